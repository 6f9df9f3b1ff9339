"""``CachePostProcess`` on the CPU (C kernel and torch fallback), byte for byte against the
independent reference in tests/reference.py: every preset pair of interest, every ratio in both
directions, fp8/bf16/fp32, partly covered requests; unlisted blocks unchanged."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.kernels import cpu
from kvd.kernels.postprocess import CachePostProcess, region_views
from kvd.layout.formats import PRESETS, FormatError
from kvd.layout.geometry import GeometryError
from kvd.layout.planner import PlanError
from kvd.protocol import PageFormat
from tests.kernel_cases import check_cache, make_cache
from tests.reference import same_bytes
from tests.strategies import Case, cases

BACKENDS = ["kernel", "torch"] if cpu.available() else ["torch"]
DTYPES = ["float8_e4m3fn", "bfloat16", "float32"]

PAIRS = [(name, name) for name in PRESETS] + [
    ("HND", "NHD"),
    ("NHD", "HND"),
    ("blocks_first_HND", "blocks_first_NHD"),
    ("blocks_first_NHD", "blocks_first_HND"),
    ("single_HND", "single_NHD"),
    ("LBHNC", "LBNHC"),
    ("LBNHC", "LBHNC"),
    ("BLHNC", "BLNHC"),
    ("BHLNC", "BLHNC"),
]
BLOCK_SIZE = 8
# Every remote block size that divides the local one or is a multiple of it (up to 4x).
REMOTE_BLOCK_SIZES = [1, 2, 4, 8, 16, 32]
NUM_BLOCKS = 20


def requests_for(rng: random.Random, remote_block_size: int) -> list[tuple[list[int], int]]:
    """A few requests over distinct random blocks, some partly covered where that exists."""
    pages = max(1, remote_block_size // BLOCK_SIZE)
    remote_pages = max(1, BLOCK_SIZE // remote_block_size)
    free = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    requests = []
    for _ in range(3):
        count = pages * rng.randint(1, 2)
        if len(free) < count:
            break
        ids, free = free[:count], free[count:]
        holds = count // pages * remote_pages
        covered = rng.choice([0, holds, rng.randint(1, holds)])
        requests.append((ids, covered))
    return requests


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("remote_block_size", REMOTE_BLOCK_SIZES)
@pytest.mark.parametrize(("remote", "local"), PAIRS)
def test_preset_pairs_match_the_reference(remote, local, remote_block_size, dtype, backend) -> None:
    rng = random.Random(f"{remote}{local}{remote_block_size}{dtype}")
    cache = make_cache(
        local, dtype=dtype, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, seed=rng.randrange(99)
    )
    requests = requests_for(rng, remote_block_size)
    cache.postprocess(backend).apply(requests, remote, remote_block_size)
    check_cache(cache, requests, remote, remote_block_size)


@settings(max_examples=60)
@given(cases(max_chunk=2, max_ratio=3), st.sampled_from(BACKENDS), st.randoms())
def test_random_formats_match_the_reference(case: Case, backend: str, rng) -> None:
    """Any valid pair of formats through the kernels (the planner is checked more widely in
    test_planner.py)."""
    dtype = {1: "uint8", 2: "bfloat16", 4: "float32"}[case.itemsize]
    cache = make_cache(
        case.local,
        dtype=dtype,  # type: ignore[arg-type]
        block_size=case.block_size,
        num_blocks=8 * case.pages_per_group,
        heads=case.sizes["H"],
        head_dim=case.sizes["C"],
        layers=case.sizes["L"],
        seed=rng.randrange(99),
    )
    ids = rng.sample(range(8 * case.pages_per_group), 4 * case.pages_per_group)
    requests = [(ids, 0)]
    if case.covered:  # one partly covered page, after full ones
        requests = [(ids, (len(ids) - 1) * case.remote_pages + case.covered)]
    cache.postprocess(backend).apply(requests, case.remote, case.remote_block_size)
    check_cache(cache, requests, case.remote, case.remote_block_size)


@pytest.mark.parametrize("backend", BACKENDS)
def test_covered_follows_vllm(backend) -> None:
    """covered_sub_blocks counts remote pages from the request's first block: the page where it
    ends keeps its covered tokens and zeroes the rest; later pages are zeroed whole."""
    cache = make_cache("HND", dtype="bfloat16", block_size=8, num_blocks=10, tensors=1)
    requests = [([4, 1, 7, 2], 5)]  # ratio 4: block 4 full, block 1 one sub-page, 7 and 2 zeros
    cache.postprocess(backend).apply(requests, "NHD", 2)
    check_cache(cache, requests, "NHD", 2)
    raw = cache.tensors[0].view(torch.uint8).reshape(2, 10, -1)
    assert not raw[:, [7, 2]].any()
    # Block 1, local HND: tokens 2.. of every head are zeros.
    page = raw[:, 1].reshape(2, 3, 8, 4 * 2)
    assert not page[:, :, 2:].any() and page[:, :, :2].any()


def test_identical_formats_need_no_work_but_uncovered_pages_do() -> None:
    cache = make_cache("NHD", dtype="bfloat16", block_size=8, num_blocks=10)
    post = cache.postprocess()
    assert not post.needs_work("NHD", 2)
    assert not post.needs_work("NHD", 16)
    assert post.needs_work("HND", 2)
    assert post.needs_work("NHD", 2, covered=3)  # number of ids unknown: assume a tail
    assert post.needs_work("NHD", 2, covered=3, num_ids=1)
    assert not post.needs_work("NHD", 2, covered=4, num_ids=1)
    assert not post.needs_work(PRESETS["NHD"], 8)
    post.apply([([3, 5], 0)], "NHD", 2)
    assert all(same_bytes(t, b) for t, b in zip(cache.tensors, cache.before, strict=True))


def test_a_cross_layer_page_is_one_region() -> None:
    cache = make_cache("BLHNC", dtype="bfloat16", block_size=8, num_blocks=6, layers=3)
    post = cache.postprocess()
    assert post.block_bytes == 2 * 3 * 3 * 8 * 2 * 4 * 2  # two tensors, L H N (K|V) C
    requests = [([5, 0], 0)]
    post.apply(requests, "BLHNC", 4)
    check_cache(cache, requests, "BLHNC", 4)


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        ([([0, 20], 0)], r"\[20\] outside \[0, 20\)"),
        ([([-1], 0)], r"\[-1\] outside \[0, 20\)"),
        ([([1, 2], 0), ([3, 1], 0)], r"\[1\] listed twice"),
        ([([1, 2], 9)], r"requests\[0\]: covered_sub_blocks 9 is not in \[0, 8\]"),
        ([([1, 2], -1)], r"covered_sub_blocks -1"),
    ],
)
def test_bad_requests_raise_before_any_write(requests, message) -> None:
    cache = make_cache("NHD", dtype="float16", block_size=8, num_blocks=20)
    with pytest.raises(ValueError, match=message):
        cache.postprocess().apply(requests, "HND", 2)
    assert all(same_bytes(t, b) for t, b in zip(cache.tensors, cache.before, strict=True))


ID_KINDS = [list, tuple, np.array, torch.tensor]


@pytest.mark.parametrize("kind", ID_KINDS)
def test_block_ids_of_every_kind_are_checked_alike(kind) -> None:
    """A tensor of ids once dodged the duplicate check (a set of tensors never repeats) and the
    kernel rewrote the block twice."""
    cache = make_cache("NHD", dtype="float16", block_size=8, num_blocks=20)
    with pytest.raises(ValueError, match=r"\[1\] listed twice"):
        cache.postprocess().apply([(kind([1, 1]), 0)], "HND", 2)
    with pytest.raises(ValueError, match=r"\[20\] outside \[0, 20\)"):
        cache.postprocess().apply([(kind([3, 20]), 0)], "HND", 2)
    assert all(same_bytes(t, b) for t, b in zip(cache.tensors, cache.before, strict=True))
    requests = [([5, 2], 0)]
    cache.postprocess().apply([(kind(ids), covered) for ids, covered in requests], "HND", 2)
    check_cache(cache, requests, "HND", 2)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (torch.tensor([1.0, 2.0]), r"physical_block_ids: integers are needed, got torch\.float32"),
        (np.array([1, 2], dtype=np.float64), r"physical_block_ids: integers .* got float64"),
        (torch.tensor([True, False]), r"physical_block_ids: integers .* got torch\.bool"),
        (
            torch.tensor([[1], [2]]),
            r"physical_block_ids: one dimension is needed, got shape \(2, 1\)",
        ),
        (np.array(3), r"physical_block_ids: one dimension is needed, got shape \(\)"),
        ([1, 2.0], r"physical_block_ids\[1\]: an integer is needed, got float"),
        ([1, True], r"physical_block_ids\[1\]: an integer is needed, got bool"),
        ({1, 2}, r"physical_block_ids: a list, tuple, numpy array or torch tensor .* got set"),
    ],
)
def test_malformed_block_ids_name_the_field(ids, message) -> None:
    cache = make_cache("NHD", dtype="float16", block_size=8, num_blocks=20)
    with pytest.raises(ValueError, match=r"requests\[1\]\." + message):
        cache.postprocess().apply([([0], 0), (ids, 0)], "HND", 2)
    assert all(same_bytes(t, b) for t, b in zip(cache.tensors, cache.before, strict=True))


def test_region_views_say_what_is_wrong_with_a_tensor() -> None:
    cache = make_cache("single_NHD", dtype="float16", block_size=8, num_blocks=4, tensors=1)
    tensor, geometry = cache.tensors[0], cache.geometry
    shuffled = tensor.view(4, -1).t().contiguous().t()  # same bytes, column-major
    with pytest.raises(GeometryError, match=r"not contiguous: strides \(1, 4\) for shape \[4, "):
        region_views(shuffled, geometry)
    with pytest.raises(GeometryError, match=f"{geometry.nbytes} bytes are needed, got "):
        region_views(tensor[:2], geometry)


def test_remote_pages_larger_than_local_ones_need_whole_groups() -> None:
    cache = make_cache("NHD", dtype="float16", block_size=8, num_blocks=20)
    with pytest.raises(ValueError, match=r"requests\[1\]: 3 block ids do not fill whole groups"):
        cache.postprocess().apply([([0, 1], 0), ([2, 3, 4], 0)], "HND", 16)
    with pytest.raises(ValueError, match="neither divides"):
        cache.postprocess().apply([([0], 0)], "HND", 12)
    assert all(same_bytes(t, b) for t, b in zip(cache.tensors, cache.before, strict=True))


def test_formats_that_hold_other_elements_are_refused() -> None:
    cache = make_cache("NHD", dtype="float16", block_size=8, num_blocks=4)
    with pytest.raises(FormatError, match="regions"):
        cache.postprocess().apply([([0], 0)], "blocks_first_NHD", 8)
    with pytest.raises(FormatError, match="unknown preset"):
        cache.postprocess().needs_work("nhd", 8)
    with pytest.raises(FormatError, match=r"remote_format\.k: axis 'H' appears twice"):
        cache.postprocess().apply([([0], 0)], PageFormat(k=("H", "H", "C"), regions="kv"), 8)


def test_plans_too_large_are_refused() -> None:
    cache = make_cache(
        PageFormat(k=("C", "N")),
        dtype="uint8",
        block_size=2048,
        num_blocks=1,
        heads=1,
        head_dim=2049,
        tensors=1,
    )
    with pytest.raises(PlanError, match="MAX_PLAN_UNITS"):
        cache.postprocess().apply([([0], 0)], PageFormat(k=("N", "C")), 2048)


def test_empty_requests_are_a_no_op() -> None:
    cache = make_cache("NHD", dtype="float16", block_size=8, num_blocks=3)
    cache.postprocess().apply([], "HND", 2)
    cache.postprocess().apply([([], 0)], "HND", 2)
    assert all(same_bytes(t, b) for t, b in zip(cache.tensors, cache.before, strict=True))


def test_regions_must_agree() -> None:
    a = make_cache("NHD", dtype="float16", block_size=8, num_blocks=3)
    b = make_cache("NHD", dtype="float16", block_size=8, num_blocks=4)
    with pytest.raises(ValueError, match=r"regions\[4\]: 4 blocks"):
        CachePostProcess(a.regions() + b.regions())
    c = make_cache("NHD", dtype="float16", block_size=4, num_blocks=3)
    with pytest.raises(ValueError, match=r"regions\[4\]: block size 4"):
        CachePostProcess(a.regions() + c.regions())
    with pytest.raises(ValueError, match="at least one region"):
        CachePostProcess([])


def test_mixed_formats_in_one_cache() -> None:
    """Regions of several formats each get their own plan; one remote format must fit them all
    (the daemon keeps one post-process per local format)."""
    split = make_cache("NHD", dtype="bfloat16", block_size=8, num_blocks=6)
    v_apart = PageFormat(k=("N", "H", "C"), v=("H", "N", "C"), regions="kv")
    other = make_cache(v_apart, dtype="bfloat16", block_size=8, num_blocks=6)
    post = CachePostProcess(split.regions() + other.regions())
    requests = [([1, 4], 0)]
    post.apply(requests, "HND", 4)
    check_cache(split, requests, "HND", 4)
    check_cache(other, requests, "HND", 4)
    flat = make_cache("blocks_first_NHD", dtype="bfloat16", block_size=8, num_blocks=6)
    mixed = CachePostProcess(split.regions() + flat.regions())
    with pytest.raises(FormatError, match="regions"):
        mixed.needs_work("NHD", 8)
    snapshot = split.tensors[0].clone()
    with pytest.raises(FormatError):
        mixed.apply([([1], 0)], "HND", 4)
    assert same_bytes(split.tensors[0], snapshot)


def test_k_and_v_halves_that_move_alike_take_one_kernel_call(monkeypatch) -> None:
    """A split cache's K and V pages share a plan for HND -> NHD: every layer's K and V half is
    rewritten by one call (on CUDA one launch: each launch costs tens of microseconds of the
    small-batch latency), while halves that move differently still get a call each."""
    calls = []

    def counted(table, plan):  # the real kernel, counted
        calls.append(len(table))
        return real(table, plan)

    real = cpu.apply_runs
    monkeypatch.setattr(cpu, "apply_runs", counted)
    split = make_cache("NHD", dtype="bfloat16", block_size=8, num_blocks=6, layers=3)
    requests = [([1, 4], 0)]
    post = CachePostProcess(split.regions(), backend="c")
    post.apply(requests, "HND", 8)
    check_cache(split, requests, "HND", 8)
    assert len(calls) == 1, calls
    v_apart = PageFormat(k=("N", "H", "C"), v=("H", "N", "C"), regions="kv")
    other = make_cache(v_apart, dtype="bfloat16", block_size=8, num_blocks=6)
    crossed = PageFormat(k=("H", "N", "C"), v=("N", "H", "C"), regions="kv")
    calls.clear()
    CachePostProcess(other.regions(), backend="c").apply(requests, crossed, 8)
    check_cache(other, requests, crossed, 8)
    assert len(calls) == 2, calls
