"""Block mapping for NIXL READs (pure logic): descriptors and plans, applied to real bytes.

Each plan is executed here the way NIXL would (copy descriptor ``remote[i]`` into ``local[i]``)
on byte buffers, and the result is checked against the definition: remote blocks
``r*j .. r*j+r-1`` of a request lie back to back in its local block ``j`` (``nP <= nD``), and
chunk ``j`` of remote block ``i`` lies in local block ``k*i + j`` (``nP = k * nD``).
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvd.layout.geometry import shape_geometry
from kvd.nixl.mapping import (
    MappingError,
    Region,
    local_blocks_needed,
    local_descriptors,
    plan_read,
    remote_descriptors,
    tensor_regions,
)
from kvd.shm import physical_shape


def _geometry(arrangement, layout, *, num_blocks, block_size, heads=2, head_dim=4):
    shape = physical_shape(
        arrangement,
        layout,
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=heads,
        head_dim=head_dim,
    )
    g = shape_geometry(
        shape, dtype="bfloat16", layout=layout, kv_arrangement=arrangement, block_size=block_size
    )
    return shape, g


def _execute(plan, local_rows, remote_rows, local: torch.Tensor, remote: torch.Tensor):
    """Copy every (local, remote) descriptor pair of ``plan``, as a NIXL READ does."""
    local_mem, remote_mem = _bytes(local), _bytes(remote)
    local_base, remote_base = local.data_ptr(), remote.data_ptr()
    for li, ri in zip(plan.local, plan.remote, strict=True):
        laddr, llen, _ = local_rows[li]
        raddr, rlen, _ = remote_rows[ri]
        assert llen == rlen
        lo, ro = laddr - local_base, raddr - remote_base
        local_mem[lo : lo + llen] = remote_mem[ro : ro + rlen]


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).reshape(-1).numpy()


@pytest.mark.parametrize("arrangement", ["split", "blocks_first", "single"])
@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("remote_count", [1, 3, 8, 9])
def test_plan_places_remote_blocks_back_to_back(arrangement, ratio, remote_count):
    remote_size, remote_blocks, local_blocks = 4, 24, 10
    rshape, rg = _geometry(arrangement, "HND", num_blocks=remote_blocks, block_size=remote_size)
    lshape, lg = _geometry(
        arrangement, "NHD", num_blocks=local_blocks, block_size=remote_size * ratio
    )
    remote = torch.randn(rshape).to(torch.bfloat16)
    local = torch.zeros(lshape, dtype=torch.bfloat16)
    remote_mem, local_mem = _bytes(remote), _bytes(local)
    sentinel = 0xA5
    local_mem[:] = sentinel

    rng = random.Random(remote_count * 10 + ratio)
    remote_ids = rng.sample(range(remote_blocks), remote_count)
    local_ids = rng.sample(range(local_blocks), local_blocks_needed(remote_count, ratio))
    regions_r = tensor_regions(remote.data_ptr(), rg)
    regions_l = tensor_regions(local.data_ptr(), lg)
    assert len(regions_r) == len(regions_l) == (2 if arrangement == "split" else 1)
    plan = plan_read(
        remote_ids,
        local_ids,
        ratio=ratio,
        num_regions=len(regions_r),
        remote_num_blocks=remote_blocks,
        local_num_blocks=local_blocks,
    )
    assert plan.num_descriptors == remote_count * len(regions_r)
    _execute(
        plan,
        local_descriptors(regions_l, ratio),
        remote_descriptors(regions_r),
        local,
        remote,
    )

    # The definition, by byte ranges: region k of local block j, sub-block s holds region k of
    # remote block remote_ids[r*j + s]; everything else is untouched.
    expected = np.full_like(local_mem, sentinel)
    sub = lg.block_bytes // ratio
    assert sub == rg.block_bytes
    for k in range(len(regions_r)):
        for i, rid in enumerate(remote_ids):
            j, s = divmod(i, ratio)
            lo = k * local_blocks * lg.block_bytes + local_ids[j] * lg.block_bytes + s * sub
            ro = k * remote_blocks * rg.block_bytes + rid * rg.block_bytes
            expected[lo : lo + sub] = remote_mem[ro : ro + sub]
    assert np.array_equal(local_mem, expected)


@pytest.mark.parametrize("arrangement", ["split", "blocks_first", "single"])
@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("remote_count", [1, 3])
def test_plan_splits_a_larger_remote_block_across_local_blocks(arrangement, chunks, remote_count):
    local_size, remote_blocks, local_blocks = 4, 12, 16
    rshape, rg = _geometry(
        arrangement, "HND", num_blocks=remote_blocks, block_size=local_size * chunks
    )
    lshape, lg = _geometry(arrangement, "NHD", num_blocks=local_blocks, block_size=local_size)
    remote = torch.randn(rshape).to(torch.bfloat16)
    local = torch.zeros(lshape, dtype=torch.bfloat16)
    remote_mem, local_mem = _bytes(remote), _bytes(local)
    sentinel = 0x5A
    local_mem[:] = sentinel

    rng = random.Random(remote_count * 10 + chunks)
    remote_ids = rng.sample(range(remote_blocks), remote_count)
    local_ids = rng.sample(range(local_blocks), remote_count * chunks)
    assert local_blocks_needed(remote_count, chunks=chunks) == len(local_ids)
    regions_r = tensor_regions(remote.data_ptr(), rg)
    regions_l = tensor_regions(local.data_ptr(), lg)
    plan = plan_read(
        remote_ids,
        local_ids,
        chunks=chunks,
        num_regions=len(regions_r),
        remote_num_blocks=remote_blocks,
        local_num_blocks=local_blocks,
    )
    # One descriptor per (region, local block), each as long as a local block.
    assert plan.num_descriptors == len(local_ids) * len(regions_l)
    _execute(
        plan,
        local_descriptors(regions_l, 1),
        remote_descriptors(regions_r, chunks=chunks),
        local,
        remote,
    )

    # The definition: region k of local block local_ids[chunks*i + j] holds chunk j of region k
    # of remote block remote_ids[i]; everything else is untouched.
    expected = np.full_like(local_mem, sentinel)
    size = lg.block_bytes
    assert rg.block_bytes == chunks * size
    for k in range(len(regions_r)):
        for i, rid in enumerate(remote_ids):
            for j in range(chunks):
                lo = k * local_blocks * size + local_ids[chunks * i + j] * size
                ro = k * remote_blocks * rg.block_bytes + rid * rg.block_bytes + j * size
                expected[lo : lo + size] = remote_mem[ro : ro + size]
    assert np.array_equal(local_mem, expected)


@st.composite
def read_cases(draw):
    """A random read: regions (with gaps between them), block lengths, a ratio or chunks, ids."""
    regions = draw(st.integers(1, 3))
    small = draw(st.integers(1, 6))  # bytes of the smaller block
    factor = draw(st.integers(1, 4))
    larger_remote = draw(st.booleans())
    remote_len, local_len = (small * factor, small) if larger_remote else (small, small * factor)
    remote_num, local_num = draw(st.integers(1, 12)), draw(st.integers(factor, 24))
    fits = local_num // factor if larger_remote else local_num * factor
    count = draw(st.integers(1, min(remote_num, fits)))
    remote_ids = draw(st.permutations(range(remote_num)))[:count]
    needed = count * factor if larger_remote else -(-count // factor)
    local_ids = draw(st.permutations(range(local_num)))[:needed]
    gaps = draw(st.lists(st.integers(0, 7), min_size=2 * regions, max_size=2 * regions))
    return {
        "regions": regions,
        "remote_len": remote_len,
        "local_len": local_len,
        "remote_num": remote_num,
        "local_num": local_num,
        "ratio": 1 if larger_remote else factor,
        "chunks": factor if larger_remote else 1,
        "remote_ids": remote_ids,
        "local_ids": local_ids,
        "gaps": gaps,
    }


def _layout(num_regions, block_len, num_blocks, gaps):
    """Regions laid out one after another in a flat byte space, ``gaps`` bytes apart."""
    regions, addr = [], 0
    for gap in gaps[:num_regions]:
        addr += gap
        regions.append(Region(addr, block_len, num_blocks))
        addr += block_len * num_blocks
    return regions, addr


@given(read_cases())
def test_every_remote_byte_lands_once_and_only_in_listed_blocks(case):
    n = case["regions"]
    remote_regions, remote_size = _layout(
        n, case["remote_len"], case["remote_num"], case["gaps"][:n]
    )
    local_regions, local_size = _layout(n, case["local_len"], case["local_num"], case["gaps"][n:])
    plan = plan_read(
        case["remote_ids"],
        case["local_ids"],
        ratio=case["ratio"],
        chunks=case["chunks"],
        num_regions=n,
        remote_num_blocks=case["remote_num"],
        local_num_blocks=case["local_num"],
    )
    local_rows = local_descriptors(local_regions, case["ratio"])
    remote_rows = remote_descriptors(remote_regions, chunks=case["chunks"])
    # Each local byte records which remote byte landed in it (-1: none) and how many times.
    landed = np.full(local_size, -1, dtype=np.int64)
    writes = np.zeros(local_size, dtype=np.int64)
    for li, ri in zip(plan.local, plan.remote, strict=True):
        laddr, llen, _ = local_rows[li]
        raddr, rlen, _ = remote_rows[ri]
        assert llen == rlen
        landed[laddr : laddr + llen] = np.arange(raddr, raddr + rlen)
        writes[laddr : laddr + llen] += 1
    assert writes.max() <= 1, "a local byte written twice"

    # Every byte of every listed remote block, every region, lands exactly once.
    wanted = np.concatenate(
        [
            np.arange(r.addr + b * r.block_len, r.addr + (b + 1) * r.block_len)
            for r in remote_regions
            for b in case["remote_ids"]
        ]
    )
    got = landed[landed >= 0]
    assert np.array_equal(np.sort(got), np.sort(wanted))
    assert len(np.unique(got)) == len(got) and remote_size > 0

    # Nothing lands outside the listed local blocks, and in request order the listed local
    # blocks of a region hold its listed remote blocks back to back (a partial tail unwritten).
    inside = np.zeros(local_size, dtype=bool)
    for r in local_regions:
        stream = np.concatenate(
            [
                landed[r.addr + b * r.block_len : r.addr + (b + 1) * r.block_len]
                for b in case["local_ids"]
            ]
        )
        for b in case["local_ids"]:
            inside[r.addr + b * r.block_len : r.addr + (b + 1) * r.block_len] = True
        k = local_regions.index(r)
        source = remote_regions[k]
        want = np.concatenate(
            [
                np.arange(
                    source.addr + b * source.block_len, source.addr + (b + 1) * source.block_len
                )
                for b in case["remote_ids"]
            ]
        )
        assert np.array_equal(stream[: len(want)], want)
        assert bool((stream[len(want) :] == -1).all())
    assert bool((landed[~inside] == -1).all())


def test_partly_filled_last_block_leaves_its_tail_alone():
    # 5 remote blocks at ratio 4: local block 0 gets one sub-block, the rest of it keeps its bytes.
    rshape, rg = _geometry("single", "NHD", num_blocks=8, block_size=2)
    lshape, lg = _geometry("single", "NHD", num_blocks=4, block_size=8)
    remote = torch.arange(np.prod(rshape), dtype=torch.float32).to(torch.bfloat16).view(rshape)
    local = torch.full(lshape, -1.0, dtype=torch.bfloat16)
    plan = plan_read(
        [7, 6, 5, 4, 3], [2, 0], ratio=4, num_regions=1, remote_num_blocks=8, local_num_blocks=4
    )
    _execute(
        plan,
        local_descriptors(tensor_regions(local.data_ptr(), lg), 4),
        remote_descriptors(tensor_regions(remote.data_ptr(), rg)),
        local,
        remote,
    )
    assert torch.equal(local[2], torch.cat([remote[7], remote[6], remote[5], remote[4]]))
    assert torch.equal(local[0][:2], remote[3])
    assert bool((local[0][2:] == -1).all())
    assert bool((local[1] == -1).all()) and bool((local[3] == -1).all())


def test_descriptor_rows_follow_the_documented_order():
    _, g = _geometry("split", "HND", num_blocks=3, block_size=4)
    regions = tensor_regions(1000, g)
    assert [(r.addr, r.block_len, r.num_blocks) for r in regions] == [
        (1000, g.block_bytes, 3),
        (1000 + 3 * g.block_bytes, g.block_bytes, 3),
    ]
    rows = remote_descriptors(regions, device_id=5)
    assert rows.dtype == np.int64 and rows.shape == (6, 3)
    assert rows[4].tolist() == [1000 + 3 * g.block_bytes + g.block_bytes, g.block_bytes, 5]
    local = local_descriptors(regions, 2)
    # row (k * num_blocks + j) * ratio + s
    half = g.block_bytes // 2
    assert local[(1 * 3 + 2) * 2 + 1].tolist() == [
        1000 + 3 * g.block_bytes + 2 * g.block_bytes + half,
        half,
        0,
    ]


@pytest.mark.parametrize(
    ("remote_ids", "local_ids", "ratio", "field"),
    [
        ([], [], 1, "remote_block_ids"),
        ([0, 1, 2], [0], 2, "local_block_ids: 3 remote blocks at block_size_ratio 2 fill 2"),
        ([0, 1], [0, 1], 2, "fill 1 local blocks, got 2"),
        ([0, 16], [0, 1], 1, "remote_block_ids: [16] outside [0, 16)"),
        ([0, -1], [0, 1], 1, "remote_block_ids: [-1]"),
        ([0, 1], [0, 8], 1, "local_block_ids: [8] outside [0, 8)"),
        ([3, 3], [0, 1], 1, "remote_block_ids: [3] listed twice"),
        ([1, 2], [4, 4], 1, "local_block_ids: [4] listed twice"),
        # Ids of every kind get the same checks (a tensor's once slipped past the duplicates).
        (torch.tensor([3, 3]), [0, 1], 1, "remote_block_ids: [3] listed twice"),
        ([1, 2], np.array([4, 4]), 1, "local_block_ids: [4] listed twice"),
        (torch.tensor([0.0]), [0], 1, "remote_block_ids: integers are needed, got torch.float32"),
        ([0], np.array([[0]]), 1, "local_block_ids: one dimension is needed, got shape (1, 1)"),
        ([1], [0], 0, "block_size_ratio must be >= 1"),
    ],
)
def test_plan_rejects_lists_that_do_not_fit(remote_ids, local_ids, ratio, field):
    with pytest.raises(MappingError, match=re.escape(field)):
        plan_read(
            remote_ids,
            local_ids,
            ratio=ratio,
            num_regions=2,
            remote_num_blocks=16,
            local_num_blocks=8,
        )


@pytest.mark.parametrize(
    ("remote_ids", "local_ids", "ratio", "chunks", "field"),
    [
        (
            [0, 1],
            [0, 1, 2, 3, 4, 5, 6],
            1,
            4,
            "local_block_ids: 2 remote blocks split in 4 chunks fill 4 local blocks each, 8 in "
            "all, got 7",
        ),
        ([0], [0, 1, 2, 3, 4], 1, 4, "4 in all, got 5"),
        ([0], [0, 1], 1, 0, "chunks must be >= 1"),
        ([0], [0, 1], 2, 2, "block_size_ratio 2 and chunks 2"),
        ([16], [0, 1], 1, 2, "remote_block_ids: [16] outside [0, 16)"),
        ([0], [7, 8], 1, 2, "local_block_ids: [8] outside [0, 8)"),
        ([0], [3, 3], 1, 2, "local_block_ids: [3] listed twice"),
    ],
)
def test_plan_rejects_chunked_lists_that_do_not_fit(remote_ids, local_ids, ratio, chunks, field):
    with pytest.raises(MappingError, match=re.escape(field)):
        plan_read(
            remote_ids,
            local_ids,
            ratio=ratio,
            chunks=chunks,
            num_regions=2,
            remote_num_blocks=16,
            local_num_blocks=8,
        )


def test_remote_descriptors_in_chunks_follow_the_documented_order():
    regions = [Region(1000, 12, 3), Region(2000, 12, 3)]
    rows = remote_descriptors(regions, device_id=2, chunks=4)
    assert rows.shape == (24, 3)
    # row (k * num_blocks + i) * chunks + j: chunk j of block i of region k
    assert rows[(1 * 3 + 2) * 4 + 1].tolist() == [2000 + 2 * 12 + 3, 3, 2]
    assert np.array_equal(remote_descriptors(regions, chunks=1), remote_descriptors(regions))
    with pytest.raises(MappingError, match="chunks 5 does not divide the remote block length 12"):
        remote_descriptors(regions, chunks=5)


def test_local_descriptors_refuse_a_ratio_that_splits_a_row():
    _, g = _geometry("single", "NHD", num_blocks=2, block_size=3, heads=1, head_dim=1)
    with pytest.raises(MappingError, match="does not divide the local block length 6"):
        local_descriptors(tensor_regions(0, g), 4)


@pytest.mark.parametrize(("remote", "ratio", "local"), [(1, 4, 1), (4, 4, 1), (5, 4, 2), (9, 1, 9)])
def test_local_blocks_needed(remote, ratio, local):
    assert local_blocks_needed(remote, ratio) == local


@pytest.mark.parametrize(("remote", "chunks", "local"), [(1, 4, 4), (3, 2, 6), (2, 1, 2)])
def test_local_blocks_needed_for_larger_remote_blocks(remote, chunks, local):
    assert local_blocks_needed(remote, chunks=chunks) == local
