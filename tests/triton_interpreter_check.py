"""Runs kvd's Triton kernels under the Triton interpreter (CPU) against the reference.

Run by tests/test_kernels.py in a subprocess with TRITON_INTERPRET=1: the variable must be set
before the kernels are defined, and must not leak into tests that use a real GPU.
Prints one line per case and exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import random
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from kvd.kernels import gpu  # noqa: E402
from kvd.postprocess import block_rows, row_plan  # noqa: E402
from tests.reference import expected_block, random_bytes, same_bytes  # noqa: E402


def check(seed: int, *, big: bool) -> str:
    rng = random.Random(seed)
    ratio = rng.choice([1, 2, 4, 8])
    block_size = ratio * rng.choice([1, 2])
    heads = rng.randint(1, 3)
    head_dim = rng.choice([3, 8, 16, 5])
    dtype = rng.choice([torch.bfloat16, torch.float8_e4m3fn, torch.uint8, torch.float32])
    remote, local = rng.choice(["NHD", "HND"]), rng.choice(["NHD", "HND"])
    kv_parts = rng.choice([1, 2])
    num_blocks = rng.randint(2, 6)
    block = [block_size, heads, head_dim] if local == "NHD" else [heads, block_size, head_dim]
    shape = [num_blocks, 2, *block] if kv_parts == 2 else [num_blocks, *block]
    tensors = [random_bytes(shape, dtype, seed * 7 + i) for i in range(rng.randint(1, 3))]
    before = [t.clone() for t in tensors]
    views = [
        block_rows(t, layout=local, block_size=block_size, num_heads=heads, kv_parts=kv_parts)
        for t in tensors
    ]
    plan = row_plan(
        kv_parts=kv_parts,
        block_size=block_size,
        num_heads=heads,
        ratio=ratio,
        remote_layout=remote,
        local_layout=local,
    )
    ids = rng.sample(range(num_blocks), rng.randint(1, num_blocks))
    case = f"seed={seed} {remote}->{local} r={ratio} kv_parts={kv_parts} {dtype} big={big}"
    if plan is None:
        return f"{case}: nothing to do"
    saved = gpu.MAX_TILE_BYTES
    gpu.MAX_TILE_BYTES = 0 if big else saved  # force the two-pass path
    try:
        gpu.permute_blocks([v.rows for v in views], ids, plan)
    finally:
        gpu.MAX_TILE_BYTES = saved
    for now, was in zip(tensors, before, strict=True):
        for b in range(num_blocks):
            want = was[b]
            if b in ids:
                want = expected_block(
                    was[b],
                    kv_parts=kv_parts,
                    block_size=block_size,
                    heads=heads,
                    ratio=ratio,
                    remote_layout=remote,
                    local_layout=local,
                )
            if not same_bytes(now[b], want):
                raise SystemExit(f"{case}: block {b} differs")
    return f"{case}: ok"


if __name__ == "__main__":
    cases = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    for seed in range(cases):
        print(check(seed, big=seed % 3 == 2), flush=True)
