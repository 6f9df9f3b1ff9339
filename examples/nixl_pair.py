"""Both ends of a NIXL transfer in one script, with a running kvd doing the decode side's rewrite.

    python examples/nixl_pair.py [RUNTIME_DIR]

RUNTIME_DIR is the running kvd's (default: $KVD_RUNTIME_DIR, else where ``kvd serve`` puts
it). A prefill engine exports a 2-layer HND cache with 16-token blocks (``kvd.nixl.Exporter``,
progressed by a thread); a decode engine with 64-token NHD blocks attaches its shared-memory
cache to kvd, shakes hands with the exporter and READs one request's six prefill blocks into
two local blocks (``kvd.nixl.Reader``, UCX over loopback), which tells kvd when they landed.
On kvd's Ready the script checks every token of both layers, K and V, against the prefill
cache, checks that the prefill side heard the READ notification, and exits 0.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time

import torch

from kvd.client import Client
from kvd.nixl import Exporter, Reader, ReadResult
from kvd.protocol import Ready
from kvd.shm import ShmCache, physical_shape

LAYERS, HEADS, HEAD_DIM = 2, 4, 64
PREFILL_BLOCKS, PREFILL_BLOCK_SIZE = 32, 16
DECODE_BLOCKS, DECODE_BLOCK_SIZE = 16, 64


def prefill_cache() -> list[torch.Tensor]:
    """What a prefill engine computed: per layer [2, blocks, heads, 16 tokens, head_dim] (HND)."""
    shape = physical_shape(
        "split",
        "HND",
        num_blocks=PREFILL_BLOCKS,
        block_size=PREFILL_BLOCK_SIZE,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
    )
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]


def main(runtime_dir: str | None) -> int:
    with tempfile.TemporaryDirectory(prefix="kvd-nixl-pair-") as workdir:
        return pair(runtime_dir, workdir)


def pair(runtime_dir: str | None, workdir: str) -> int:
    cache_id = f"decode-{os.getpid()}"

    # Prefill side: register the cache with NIXL and answer handshakes on a ZMQ socket; a thread
    # polls its NIXL worker (without RDMA, a READ only moves while the exporter is polled).
    prefill = prefill_cache()
    exporter = Exporter(
        "prefill-0",
        prefill,
        layout="HND",
        kv_arrangement="split",
        block_size=PREFILL_BLOCK_SIZE,
        endpoint=f"ipc://{workdir}/prefill.sock",  # tcp://0.0.0.0:5600 across machines
    )
    finished: list[str] = []
    stop = threading.Event()
    serving = threading.Thread(
        target=exporter.serve, args=(stop,), kwargs={"on_finished": finished.extend}
    )
    serving.start()

    # Decode side: a cache attached to kvd and registered with NIXL by the reader.
    decode = ShmCache.create(
        num_layers=LAYERS,
        num_blocks=DECODE_BLOCKS,
        block_size=DECODE_BLOCK_SIZE,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        layout="NHD",
    )
    kvd = Client(runtime_dir)
    reader = Reader("decode-0", kvd)
    try:
        kvd.attach(cache_id, decode.specs)
        reader.add_cache(cache_id, decode.tensors, decode.specs)
        peer = reader.connect(exporter.endpoint)  # -> "prefill-0"; the ratio is 64 / 16 = 4

        # Six prefill blocks fill local block 3 (4 of them) and half of local block 10.
        remote_ids, local_ids = [4, 9, 2, 7, 11, 5], [3, 10]
        with kvd.subscribe([cache_id]) as events:
            reader.read("req-1", peer, cache_id, remote_ids, local_ids)
            results: list[ReadResult] = []
            deadline = time.monotonic() + 30
            while not results and time.monotonic() < deadline:
                results = reader.poll()  # READ done -> the reader sends kvd the ReadDone
                time.sleep(0.0002)
            if not results or not results[0].ok:
                print(f"the READ did not finish: {results}", file=sys.stderr)
                return 1
            print(f"READ of req-1 done: {results[0].nbytes} bytes")
            delivery = events.poll(10.0)
        if delivery is None or not isinstance(delivery.event, Ready):
            print(f"expected a Ready for req-1, got {delivery}", file=sys.stderr)
            return 1
        print(f"kvd: {delivery.event}")

        # Every token of the request, K and V of each layer, in the decode cache's NHD order.
        tokens = len(remote_ids) * PREFILL_BLOCK_SIZE
        for layer, (local, remote) in enumerate(zip(decode.tensors, prefill, strict=True)):
            for kv in range(2):
                got = local[kv, local_ids].reshape(-1, HEADS, HEAD_DIM)[:tokens]
                want = remote[kv, remote_ids].transpose(1, 2).reshape(-1, HEADS, HEAD_DIM)
                if not torch.equal(got, want):
                    print(f"layer {layer} kv {kv}: the tokens differ", file=sys.stderr)
                    return 1
        print(f"{tokens} tokens x {LAYERS} layers, K and V: verified")

        # The prefill side hears "<req_id>:<tp_size>" once the READ is done: it may free blocks.
        deadline = time.monotonic() + 10
        while "req-1" not in finished and time.monotonic() < deadline:
            time.sleep(0.01)
        if finished != ["req-1"]:
            print(f"the prefill side heard {finished}", file=sys.stderr)
            return 1
        print("prefill-0 was told req-1 was read")
        return 0
    finally:
        reader.close()
        stop.set()
        serving.join()
        exporter.close()
        try:
            kvd.detach(cache_id)
        finally:
            kvd.close()
            decode.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
