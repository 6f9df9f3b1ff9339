"""Runs kvd's Triton kernels under the Triton interpreter (CPU) against the reference.

Run by tests/test_kernels.py in a subprocess with TRITON_INTERPRET=1: the variable must be set
before the kernels are defined, and must not leak into tests that use a real GPU. The
interpreter stands in for a device: each case's ``CachePostProcess`` is switched to the Triton
backend on CPU memory, launching through a ``Lane`` whose CUDA calls are ``HostCuda``'s (the
block-id ring, region tables and scratch as in service, in host memory).
Prints one line per case and exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os
import random
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from kvd.kernels import device, gpu  # noqa: E402
from tests.fake_cuda import HostCuda  # noqa: E402
from tests.kernel_cases import check_cache, make_cache  # noqa: E402

# A small ring, so that long requests wrap around it and are split across launches.
LANE = device.Lane(torch.device("cpu"), api=HostCuda())
LANE.ids = device.IdRing(LANE, slots=3, slot_ids=4)

CASES = [
    # (remote, local, local block size, remote block size, dtype)
    ("HND", "NHD", 4, 4, "bfloat16"),
    ("HND", "NHD", 8, 2, "float8_e4m3fn"),
    ("HND", "HND", 8, 4, "float32"),
    ("NHD", "HND", 4, 16, "bfloat16"),
    ("HND", "NHD", 2, 8, "float32"),
    ("cpu_attn_vec", "cpu_attn_vec", 8, 4, "bfloat16"),
    ("cpu_attn_vec", "cpu_attn_vec", 8, 2, "float32"),
    ("cpu_attn_vec", "cpu_attn_vec", 4, 8, "bfloat16"),
    ("blocks_first_HND", "blocks_first_NHD", 8, 4, "bfloat16"),
    ("LBHNC", "LBNHC", 4, 2, "float8_e4m3fn"),
    ("LBHNC", "LBHNC", 4, 16, "bfloat16"),
    ("BLHNC", "BLNHC", 4, 2, "bfloat16"),
    ("BHLNC", "BHLNC", 8, 2, "float32"),
    ("LHBNC", "LHBNC", 8, 4, "bfloat16"),
    ("single_HND", "single_NHD", 4, 1, "float32"),
]


# The benchmark's page: 64 tokens x 8 heads x 128 head_dim bf16 (128 KiB, 512 head vectors).
BENCH_PAGE = ("HND", "NHD", 64, 64, "bfloat16")


def check(
    n: int,
    case: tuple[str, str, int, int, str],
    *,
    two_pass: bool,
    partial: bool,
    tile_bytes: int | None = None,
    components: bool = True,
    heads: int = 3,
    head_dim: int = 4,
) -> str:
    remote, local, nD, nP, dtype = case
    rng = random.Random(n)
    cache = make_cache(
        local, dtype=dtype, block_size=nD, num_blocks=12, seed=n, heads=heads, head_dim=head_dim
    )
    pages_per_group = max(1, nP // nD)
    remote_pages = max(1, nD // nP)
    ids = rng.sample(range(12), 2 * pages_per_group)
    covered = remote_pages + 1 if partial else 0  # the second page partly covered
    requests = [(ids, covered)]
    name = (
        f"{remote}->{local} {nP}->{nD} {dtype} pages={pages_per_group} covered={covered} "
        f"two_pass={two_pass}" + (f" tile={tile_bytes}" if tile_bytes else "")
    )
    saved = gpu.TILE_BYTES, gpu.WHOLE_UNIT_BYTES
    gpu.TILE_BYTES = 0 if two_pass else tile_bytes or saved[0]
    if tile_bytes and components:  # the whole-components path, whatever the unit's size
        gpu.WHOLE_UNIT_BYTES = 0
    post = cache.postprocess(lane=LANE)
    post.backend = "triton"  # the interpreter runs Triton on CPU memory
    try:
        post.apply(requests, remote, nP)
    finally:
        gpu.TILE_BYTES, gpu.WHOLE_UNIT_BYTES = saved
    paths = {
        launch.prepared.in_place
        for launches in post._launches.values()
        for launch in launches
        if launch.prepared is not None
    }
    if paths - {not two_pass}:  # none when the pair needs no kernel (only zeroes)
        raise SystemExit(f"{name}: ran in_place={paths}, expected {not two_pass}")
    by_members = {
        launch.prepared.members is not None
        for launches in post._launches.values()
        for launch in launches
        if launch.prepared is not None and launch.prepared.in_place
    }
    if tile_bytes and components and by_members != {True}:
        raise SystemExit(f"{name}: not moved by whole components")
    tiles = {
        launch.prepared.tile_bytes
        for launches in post._launches.values()
        for launch in launches
        if launch.prepared is not None and launch.prepared.in_place
    }
    if tile_bytes and tiles != {tile_bytes}:
        raise SystemExit(f"{name}: prepared for tiles {tiles}, not {tile_bytes}")
    try:
        check_cache(cache, requests, remote, nP)
    except AssertionError as exc:
        raise SystemExit(f"{name}: {exc}") from None
    return f"{name}: ok"


def check_replays(n: int, case: tuple[str, str, int, int, str]) -> str:
    """Warm-up captures launches of 1 to ``GRAPH_GROUPS`` groups (here: the calls a graph
    would hold, run at each replay); requests of those sizes replay them, larger ones launch
    directly, and every block ends as the reference says."""
    remote, local, nD, nP, dtype = case
    api = HostCuda()
    lane = device.Lane(torch.device("cpu"), api=api)
    cache = make_cache(local, dtype=dtype, block_size=nD, num_blocks=16, seed=n)
    post = cache.postprocess(lane=lane)
    post.backend = "triton"
    post.warm_up(remote, nP)
    captured = len(api.noted("capture"))
    if captured != 1 + gpu.GRAPH_GROUPS:  # the trial on scratch pages, then the cache's
        raise SystemExit(f"replays {case}: {captured} captures, not 1 + {gpu.GRAPH_GROUPS}")
    free = random.Random(n).sample(range(16), 16)
    requests = []
    for size in (1, 2, 3, 4, 5):
        requests.append((free[:size], 0))
        free = free[size:]
    for request in requests:
        uploads = len(api.noted("copy_async"))
        post.apply([request], remote, nP)
        copies = len(api.noted("copy_async")) - uploads
        if copies != 1:  # one copy of the ids per launch, by either path
            raise SystemExit(f"replays {case}: {copies} id copies for {len(request[0])} blocks")
    replays = [
        r for launches in post._launches.values() for la in launches for r in la.replays.values()
    ]
    used = sorted(r.n for r in replays if r._done is not None)
    if used != list(range(1, gpu.GRAPH_GROUPS + 1)):
        raise SystemExit(f"replays {case}: replayed {used} group counts, captured {len(replays)}")
    try:
        check_cache(cache, requests, remote, nP)
    except AssertionError as exc:
        raise SystemExit(f"replays {case}: {exc}") from None
    return f"replays {remote}->{local} {nP}->{nD} {dtype} sizes 1-5: ok"


if __name__ == "__main__":
    n = 0
    for case in CASES:
        partials = (False, True) if case[2] > case[3] else (False,)
        for two_pass in (False, True):
            for partial in partials:
                print(check(n, case, two_pass=two_pass, partial=partial), flush=True)
                n += 1
    print(check(n, BENCH_PAGE, two_pass=False, partial=False, heads=8, head_dim=128), flush=True)
    # Whole components in tiny tiles: packed into many programs (2 -> 8), in slices (32 -> 8).
    for case in (("HND", "NHD", 8, 2, "bfloat16"), ("HND", "HND", 8, 32, "float32")):
        n += 1
        print(check(n, case, two_pass=False, partial=False, tile_bytes=32), flush=True)
    # Every tile size ``tune`` measures, on the benchmark's page (slices of 128, 64, 32 bytes).
    for tile in gpu.TILE_CHOICES:
        n += 1
        print(
            check(
                n,
                BENCH_PAGE,
                two_pass=False,
                partial=False,
                tile_bytes=tile,
                components=False,
                heads=8,
                head_dim=128,
            ),
            flush=True,
        )
    for case in (("HND", "NHD", 4, 4, "bfloat16"), ("NHD", "HND", 8, 2, "float32")):
        n += 1
        print(check_replays(n, case), flush=True)
    sys.exit(0)
