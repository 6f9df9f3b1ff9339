"""A client session with a running kvd: attach a cache, subscribe, send a ReadDone, wait, detach.

    python examples/client_session.py [RUNTIME_DIR]

RUNTIME_DIR is the running kvd's (default: $KVD_RUNTIME_DIR, else where ``kvd serve`` puts
it). The script plays a decode engine whose NIXL READs of request ``req-1`` have landed: two
64-token NHD blocks, each filled by four 16-token HND blocks of the prefill side, back to back.
kvd rewrites them; the script checks the result and exits 0.
"""

from __future__ import annotations

import os
import sys

import torch

from kvd.client import Client
from kvd.protocol import Ready
from kvd.shm import ShmCache

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 2, 16, 64, 8, 128
PREFILL_BLOCK_SIZE = 16
RATIO = BLOCK_SIZE // PREFILL_BLOCK_SIZE


def main(runtime_dir: str | None) -> int:
    cache_id = f"session-{os.getpid()}"
    # A KV cache in shared memory (/dev/shm) that kvd maps too: per layer [2, blocks, 64, 8, 128].
    cache = ShmCache.create(
        num_layers=LAYERS,
        num_blocks=BLOCKS,
        block_size=BLOCK_SIZE,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        layout="NHD",
    )
    with cache, Client(runtime_dir) as kvd:
        kvd.attach(cache_id, cache.specs)
        try:
            # Subscribe before sending: the subscription sees every event published after it.
            with kvd.subscribe([cache_id]) as events:
                # What NIXL would have landed in local blocks 7 and 3: per block, four prefill
                # pages of (heads, 16 tokens, head_dim), back to back.
                block_ids = [7, 3]
                landed = {}
                for layer, tensor in enumerate(cache.tensors):
                    for kv in range(2):
                        for block in block_ids:
                            pages = torch.randn(RATIO, HEADS, PREFILL_BLOCK_SIZE, HEAD_DIM)
                            landed[layer, kv, block] = pages.to(tensor.dtype)
                            tensor[kv, block].view(-1).copy_(landed[layer, kv, block].view(-1))

                kvd.read_done(
                    "req-1",
                    cache_id,
                    block_ids,
                    remote_layout="HND",
                    remote_block_size=PREFILL_BLOCK_SIZE,
                )
                delivery = events.poll(10.0)  # seconds
            if delivery is None or not isinstance(delivery.event, Ready):
                print(f"expected a Ready for req-1, got {delivery}", file=sys.stderr)
                return 1
            print(f"seq {delivery.seq}: {delivery.event}")

            # Token s*16 + t of a block is token t of the block's prefill page s, in NHD order.
            for (layer, kv, block), pages in landed.items():
                want = pages.permute(0, 2, 1, 3).reshape(BLOCK_SIZE, HEADS, HEAD_DIM)
                if not torch.equal(cache.tensors[layer][kv, block], want):
                    print(f"layer {layer} kv {kv} block {block}: wrong bytes", file=sys.stderr)
                    return 1
            print(f"blocks {block_ids} hold the NHD layout: verified")
        finally:
            kvd.detach(cache_id)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
