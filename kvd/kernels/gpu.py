"""The CUDA kernels: Triton programs that execute a plan over groups of pages, in place.

The plan arrives as a word gather index (``Plan.gather_index``): word ``i`` of a group receives
landed word ``index[i]``, or zero where it is -1. A program owns one group: it loads the words
that move into registers, waits at a barrier until every thread of the program holds its part,
then stores them: the group is read once and written once, in place, and words already in place
are neither loaded nor stored. Groups too large for one program's registers take two launches
through a scratch buffer instead (gather, then write back), at twice the memory traffic.

Page addresses come as a table, one row of ``pages_per_group`` addresses per (region, group), so
one launch covers every region of a cache that shares a plan. Launches go to the caller's
current stream (the executor's dedicated stream). The same kernels run on the CPU under
``TRITON_INTERPRET=1``, which is how the tests check them without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import triton
import triton.language as tl

from kvd.layout.planner import Plan

# Above this a group does not fit one program's registers: each word held also needs its
# int32 source index (16 warps x 32 threads x ~64 regs). Not yet tuned on a GPU.
MAX_TILE_BYTES = 64 * 1024
# Bound on the scratch buffer of the two-pass path; longer page tables are done in chunks.
MAX_SCRATCH_BYTES = 256 << 20
# Words a program of the two-pass path moves.
_TWO_PASS_TILE_BYTES = 16 * 1024

_WORDS = {4: tl.int32, 2: tl.int16, 1: tl.uint8}


@triton.jit
def _load_group(pages_ptr, index_ptr, g, i, mask, PAGE_WORDS, K: tl.constexpr, WORD: tl.constexpr):
    """The landed words group ``g``'s words ``i`` receive; ``moving`` marks those not in place."""
    src = tl.load(index_ptr + i, mask=mask, other=0)
    moving = mask & (src != i)
    tile = tl.zeros(i.shape, dtype=WORD)
    for j in tl.static_range(K):
        page = tl.load(pages_ptr + g * K + j).to(tl.pointer_type(WORD))
        here = moving & (src >= j * PAGE_WORDS) & (src < (j + 1) * PAGE_WORDS)
        tile = tl.where(here, tl.load(page + (src - j * PAGE_WORDS), mask=here, other=0), tile)
    return tile, moving


@triton.jit
def _store_group(pages_ptr, g, i, moving, tile, PAGE_WORDS, K: tl.constexpr, WORD: tl.constexpr):
    for j in tl.static_range(K):
        page = tl.load(pages_ptr + g * K + j).to(tl.pointer_type(WORD))
        here = moving & (i >= j * PAGE_WORDS) & (i < (j + 1) * PAGE_WORDS)
        tl.store(page + (i - j * PAGE_WORDS), tile, mask=here)


@triton.jit
def _apply_in_place(
    pages_ptr,  # int64 page addresses, K per group
    index_ptr,  # int32: landed word of each word of a group (-1: zero)
    GROUP_WORDS,
    PAGE_WORDS,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    WORD: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < GROUP_WORDS
    tile, moving = _load_group(pages_ptr, index_ptr, g, i, mask, PAGE_WORDS, K, WORD)
    # Every thread must hold its words before any thread overwrites words others still read.
    tl.debug_barrier()
    _store_group(pages_ptr, g, i, moving, tile, PAGE_WORDS, K, WORD)


@triton.jit
def _apply_two_pass(
    pages_ptr,
    index_ptr,
    scratch_ptr,  # (groups, GROUP_WORDS) words
    GROUP_WORDS,
    PAGE_WORDS,
    K: tl.constexpr,
    TILE: tl.constexpr,
    WORD: tl.constexpr,
    TO_SCRATCH: tl.constexpr,
):
    """Words [tile * TILE, ...) of one group: into scratch (gathered) or back to the pages."""
    g = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = i < GROUP_WORDS
    slot = scratch_ptr.to(tl.pointer_type(WORD)) + g * GROUP_WORDS
    if TO_SCRATCH:
        tile, moving = _load_group(pages_ptr, index_ptr, g, i, mask, PAGE_WORDS, K, WORD)
        tl.store(slot + i, tile, mask=moving)
    else:
        src = tl.load(index_ptr + i, mask=mask, other=0)
        moving = mask & (src != i)
        tile = tl.load(slot + i, mask=moving, other=0)
        _store_group(pages_ptr, g, i, moving, tile, PAGE_WORDS, K, WORD)


@dataclass(frozen=True, eq=False)
class Prepared:
    """A plan's launch arguments on one device, made once and reused by every request."""

    plan: Plan
    index: torch.Tensor
    width: int

    @property
    def group_words(self) -> int:
        return self.plan.group_bytes // self.width


def prepare(plan: Plan, device: torch.device, alignment: int) -> Prepared:
    """The gather index of ``plan`` on ``device``, in the widest words every page address
    (all multiples of ``alignment``) and every run allow."""
    width = min(plan.word_width(4), alignment & -alignment or 4, 4)
    index = plan.gather_index(width)
    if len(index) >= 2**31:
        raise ValueError(f"a group of {len(index)} words is too large for the CUDA kernels")
    return Prepared(plan, _on(device, index, torch.int32), width)


def apply_runs(prepared: Prepared, pages: npt.NDArray[np.int64], device: torch.device) -> None:
    """Apply the plan to every group of ``pages`` (rows of page addresses); asynchronous on
    the current stream."""
    if len(pages) == 0 or prepared.plan.is_identity:
        return
    plan, width = prepared.plan, prepared.width
    word = _WORDS[width]
    group_words, page_words = prepared.group_words, plan.page_bytes // width
    k = plan.pages_per_group
    block = triton.next_power_of_2(group_words)
    if block * width <= MAX_TILE_BYTES:
        table = _on(device, pages, torch.int64)
        _apply_in_place[(len(pages),)](
            table,
            prepared.index,
            group_words,
            page_words,
            K=k,
            BLOCK=block,
            WORD=word,
            num_warps=16 if block * width > 32 * 1024 else 8,
        )
        return
    tile = min(block, _TWO_PASS_TILE_BYTES // width)
    per_chunk = max(1, MAX_SCRATCH_BYTES // plan.group_bytes)
    for start in range(0, len(pages), per_chunk):
        chunk = pages[start : start + per_chunk]
        table = _on(device, chunk, torch.int64)
        scratch = torch.empty(len(chunk) * plan.group_bytes, dtype=torch.uint8, device=device)
        grid = (len(chunk), triton.cdiv(group_words, tile))
        for to_scratch in (True, False):
            _apply_two_pass[grid](
                table,
                prepared.index,
                scratch,
                group_words,
                page_words,
                K=k,
                TILE=tile,
                WORD=word,
                TO_SCRATCH=to_scratch,
                num_warps=4,
            )


def _on(device: torch.device, values: npt.NDArray[np.int64], dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a tensor on ``device``; from pinned memory, so the copy does not stall."""
    host = torch.from_numpy(np.array(values, dtype=np.int64).reshape(-1)).to(dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
