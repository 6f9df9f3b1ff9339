"""A decode process whose prefill peer is killed just before a READ must outlive its reader.

``python -m tests.nixl_peer_death RUNTIME_DIR TMP_DIR ITERATIONS`` (``tests/test_nixl.py`` runs
it in its own process, so an abort inside UCX fails that test instead of ending the session).
Each iteration: a prefill peer with blocks large enough that the READ's copies queue inside UCX,
one READ that lands, SIGKILL of the peer, a READ of every block (which fails), then the reader
is closed and destroyed. Prints ``survived N`` at the end.
"""

from __future__ import annotations

import gc
import sys

from kvd.client import Client
from kvd.demo.prefill import PrefillSpec
from kvd.nixl.reader import Reader
from kvd.shm import ShmCache
from tests.nixl_helpers import finish, kill, spawn_prefill

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 8, 128, 16, 64  # 16 MiB per READ


def one_death(client: Client, tmp_dir: str, i: int) -> None:
    proc, endpoint = spawn_prefill(
        PrefillSpec(
            engine_id="prefill-killed",
            block_size=BLOCK_SIZE,
            layout="HND",
            seed=1,
            num_blocks=NUM_BLOCKS,
            layers=LAYERS,
            heads=HEADS,
            head_dim=HEAD_DIM,
            endpoint=f"ipc://{tmp_dir}/killed-{i}.sock",
        )
    )
    cache = ShmCache.create(
        num_layers=LAYERS,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
    )
    cache_id = f"peer-death-{i}"
    client.attach(cache_id, cache.specs)
    reader = Reader("decode-survivor", client, read_timeout_s=5.0)
    try:
        reader.add_cache(cache_id, cache.tensors, cache.specs)
        reader.connect(endpoint)
        reader.read("before", "prefill-killed", cache_id, [0], [0])
        (before,) = finish(reader, 1)
        assert before.ok, before.reason
        kill(proc)
        every = list(range(NUM_BLOCKS))
        reader.read("after", "prefill-killed", cache_id, every, every)
        (after,) = finish(reader, 1)
        assert not after.ok and after.reason.startswith("NIXL"), after
    finally:
        kill(proc)
        reader.close()
        del reader
        gc.collect()  # the NIXL agent goes now, not at some later collection
        client.detach(cache_id)
        cache.close()


def main(argv: list[str]) -> int:
    runtime_dir, tmp_dir, iterations = argv[0], argv[1], int(argv[2])
    with Client(runtime_dir) as client:
        for i in range(iterations):
            one_death(client, tmp_dir, i)
    print(f"survived {iterations}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
