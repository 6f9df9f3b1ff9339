"""The planner against the independent reference (tests/reference.py), on random formats."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.layout import planner
from kvd.layout.formats import PRESETS, FormatError, PageSizes, resolve
from kvd.layout.planner import MAX_PLAN_UNITS, PlanError, needs_work, plan
from kvd.protocol import PageFormat
from tests.reference import execute_runs, expected_group
from tests.strategies import Case, cases


def sizes_of(case: Case) -> PageSizes:
    return PageSizes(
        num_layers=case.sizes["L"],
        num_heads=case.sizes["H"],
        block_size=case.block_size,
        head_dim=case.sizes["C"],
        itemsize=case.itemsize,
    )


def plan_of(case: Case) -> planner.Plan:
    return plan(
        resolve(case.remote),
        resolve(case.local),
        sizes_of(case),
        case.remote_block_size,
        covered=case.covered,
        kv=case.kv,  # type: ignore[arg-type]
    )


@given(cases(), st.randoms(use_true_random=False))
def test_plan_matches_the_reference(case: Case, rng) -> None:
    p = plan_of(case)
    landed = np.frombuffer(rng.randbytes(p.group_bytes), dtype=np.uint8).copy()
    want = expected_group(
        landed,
        remote=case.remote,
        local=case.local,
        sizes=case.sizes,
        remote_block_size=case.remote_block_size,
        block_size=case.block_size,
        itemsize=case.itemsize,
        covered=case.covered,
        kv=case.kv,
    )
    assert p.pages_per_group == case.pages_per_group
    assert np.array_equal(execute_runs(p.runs, landed, p.page_bytes), want)


@given(cases())
def test_runs_tile_the_group_and_read_each_byte_at_most_once(case: Case) -> None:
    p = plan_of(case)
    dst, page, offset, nbytes = p.runs.T
    assert (nbytes > 0).all()
    assert dst[0] == 0 and (dst[1:] == dst[:-1] + nbytes[:-1]).all(), "sorted, no gap, no overlap"
    assert dst[-1] + nbytes[-1] == p.group_bytes
    assert (dst // p.page_bytes == (dst + nbytes - 1) // p.page_bytes).all(), "dst straddles"
    reads = page >= 0
    assert (page < p.pages_per_group).all()
    assert (offset[reads] + nbytes[reads] <= p.page_bytes).all(), "src straddles a page"
    touched = np.zeros(p.group_bytes, dtype=int)
    for pg, off, n in zip(page[reads], offset[reads], nbytes[reads], strict=True):
        touched[pg * p.page_bytes + off : pg * p.page_bytes + off + n] += 1
    assert touched.max() <= 1
    if case.covered:
        # Remote pages past the covered ones are never read.
        first_unread = case.covered * p.group_bytes // case.remote_pages
        assert not touched[first_unread:].any()
    else:
        assert (touched == 1).all()
    # Merged: no two neighbours could be one run.
    if len(p.runs) > 1:
        contiguous_src = (page[1:] == page[:-1]) & (offset[1:] == offset[:-1] + nbytes[:-1])
        same_kind = (page[1:] < 0) == (page[:-1] < 0)
        zero_pair = (page[1:] < 0) & (page[:-1] < 0)
        mergeable = (dst[1:] % p.page_bytes != 0) & same_kind & (zero_pair | contiguous_src)
        assert not mergeable.any()


@given(cases())
def test_needs_work_agrees_with_the_plan(case: Case) -> None:
    p = plan_of(case)
    cheap = needs_work(
        resolve(case.remote),
        resolve(case.local),
        sizes_of(case),
        case.remote_block_size,
        covered=case.covered,
        kv=case.kv,  # type: ignore[arg-type]
    )
    assert cheap == (not p.is_identity)


@given(cases())
def test_moves_and_write_back_cover_what_changes(case: Case) -> None:
    p = plan_of(case)
    changed = np.zeros(p.group_bytes, dtype=bool)
    for dst, _, _, n in p.moves.tolist():
        changed[dst : dst + n] = True
    written = np.zeros(p.group_bytes, dtype=bool)
    for off, n in p.write_back.tolist():
        assert off // p.page_bytes == (off + n - 1) // p.page_bytes
        written[off : off + n] = True
    assert np.array_equal(changed, written)
    assert p.is_identity == (len(p.moves) == 0)


S = PageSizes(num_layers=2, num_heads=8, block_size=64, head_dim=128, itemsize=2)


def test_plans_move_the_largest_pieces() -> None:
    """Row-sized runs where C is innermost; whole head sub-pages for HND merges; no per-byte
    work for identical formats."""
    hnd, nhd = PRESETS["HND"], PRESETS["NHD"]
    assert len(plan(hnd, nhd, S, 64).runs) == 64 * 8
    merge = plan(hnd, hnd, S, 16)
    assert len(merge.runs) == 8 * 4 and set(merge.runs[:, 3]) == {16 * 128 * 2}
    assert plan(nhd, nhd, S, 16).is_identity
    assert plan(nhd, nhd, S, 256).is_identity
    assert plan(nhd, nhd, S, 256).pages_per_group == 4
    assert not needs_work(nhd, nhd, S, 16) and needs_work(hnd, hnd, S, 16)
    vec = plan(PRESETS["cpu_attn_vec"], PRESETS["cpu_attn_vec"], S, 32)
    # K is [C][N]: one run per (head, channel, sub-page); V [N][C]: one per (head, sub-page).
    assert len(vec.runs) <= 8 * (128 * 2 + 2) + 8


def test_planning_is_memoised() -> None:
    hnd, nhd = PRESETS["HND"], PRESETS["NHD"]
    assert plan(hnd, nhd, S, 16) is plan(hnd, nhd, S, 16)
    assert plan(hnd, nhd, S, 16, covered=4) is plan(hnd, nhd, S, 16), "covered = r means all"


def test_partly_covered_groups_zero_the_tail() -> None:
    p = plan(PRESETS["HND"], PRESETS["NHD"], S, 16, covered=1)
    zero = p.runs[p.runs[:, 1] < 0]
    # NHD: tokens 16.. are the last 3/4 of the page, one zero run.
    assert zero.tolist() == [[S.num_heads * 16 * 128 * 2, -1, 0, 3 * 8 * 16 * 128 * 2]]
    assert needs_work(PRESETS["NHD"], PRESETS["NHD"], S, 16, covered=1)


def test_plans_are_bounded() -> None:
    huge = PageSizes(num_layers=1, num_heads=1, block_size=1 << 12, head_dim=1 << 12, itemsize=1)
    transposed = PageFormat(k=("C", "N"))
    with pytest.raises(PlanError, match="MAX_PLAN_UNITS"):
        plan(PageFormat(k=("N", "C")), transposed, huge, 1 << 12)
    assert MAX_PLAN_UNITS < (1 << 24)


@pytest.mark.parametrize(
    ("remote", "local", "message"),
    [
        (PRESETS["HND"], PRESETS["blocks_first_HND"], "regions 'kv' differ"),
        (PRESETS["single_HND"], PRESETS["blocks_first_HND"], "hold 1 of K and V"),
        (PRESETS["BLHNC"], PRESETS["LBHNC"], "axes"),
        (PRESETS["mla"], PRESETS["single_NHD"], "axes"),
    ],
)
def test_formats_must_hold_the_same_elements(remote, local, message) -> None:
    with pytest.raises(FormatError, match=message):
        plan(remote, local, S, 64)
    with pytest.raises(FormatError, match=message):
        needs_work(remote, local, S, 64)


def test_block_sizes_must_divide() -> None:
    with pytest.raises(ValueError, match="neither divides"):
        plan(PRESETS["HND"], PRESETS["NHD"], S, 48)
    with pytest.raises(ValueError, match=r"covered must be in \[0, 4\]"):
        plan(PRESETS["HND"], PRESETS["NHD"], S, 16, covered=5)
    with pytest.raises(ValueError, match=r"covered must be in \[0, 1\]"):
        plan(PRESETS["HND"], PRESETS["NHD"], S, 128, covered=2)


@pytest.mark.parametrize(
    ("remote", "local", "kv"),
    [
        ("HND", "NHD", "k"),
        ("HND", "HND", "v"),
        ("cpu_attn_vec", "cpu_attn_vec", "k"),
        ("LBHNC", "LBNHC", "k"),
        ("blocks_first_HND", "blocks_first_NHD", "k"),
    ],
)
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("k", [2, 4])
def test_ranks_interleaved_pieces_rewrite_as_their_pages_back_to_back(
    remote: str, local: str, kv: str, ranks: int, k: int
) -> None:
    """With ``remote_ranks`` R, the j-th local page of a group holds piece j of each of R rank
    pages side by side: the plan rewrites it as the plain plan rewrites the R pages back to
    back (with heads outermost, one page of every head)."""
    sizes = PageSizes(num_layers=1, num_heads=4, block_size=8, head_dim=4, itemsize=2)
    remote_fmt, local_fmt = PRESETS[remote], PRESETS[local]
    ranked = plan(remote_fmt, local_fmt, sizes, 8 * k, kv=kv, remote_ranks=ranks)  # type: ignore[arg-type]
    plain = plan(remote_fmt, local_fmt, sizes, 8 * k, kv=kv)  # type: ignore[arg-type]
    pages = np.random.default_rng(10 * ranks + k).integers(0, 256, plain.group_bytes, np.uint8)
    landed = pages.reshape(ranks, k, -1).transpose(1, 0, 2).reshape(-1)
    assert not np.array_equal(landed, pages)
    want = execute_runs(plain.runs, pages, plain.page_bytes)
    assert np.array_equal(execute_runs(ranked.runs, landed, ranked.page_bytes), want)
    assert needs_work(remote_fmt, local_fmt, sizes, 8 * k, remote_ranks=ranks)


def test_ranks_pages_land_whole_at_remote_blocks_no_larger() -> None:
    sizes = PageSizes(num_layers=1, num_heads=4, block_size=32, head_dim=4, itemsize=2)
    hnd, nhd = PRESETS["HND"], PRESETS["NHD"]
    for n_p in (8, 32):
        assert plan(hnd, nhd, sizes, n_p, remote_ranks=2).same_moves(plan(hnd, nhd, sizes, n_p))
    assert not needs_work(hnd, hnd, sizes, 32, remote_ranks=4)


@pytest.mark.parametrize(
    ("remote", "ranks", "message"),
    [
        ("NHD", 2, "heads outermost in the remote format, which has N outermost"),
        ("BLHNC", 2, "which has L outermost"),
        ("HND", 3, "3 ranks do not share the page's 4 heads evenly"),
        ("HND", 8, "8 ranks do not share"),
    ],
)
def test_ranks_pages_that_are_not_one_page_are_refused(remote: str, ranks: int, message: str):
    sizes = PageSizes(num_layers=2, num_heads=4, block_size=8, head_dim=4, itemsize=2)
    local = PRESETS["BLHNC" if remote == "BLHNC" else "HND"]
    for call in (plan, needs_work):
        with pytest.raises(FormatError, match=f"remote_ranks: .*{message}"):
            call(PRESETS[remote], local, sizes, 16, remote_ranks=ranks)
    with pytest.raises(ValueError, match="remote_ranks must be >= 1"):
        plan(PRESETS["HND"], PRESETS["HND"], sizes, 16, remote_ranks=0)
