"""The CUDA post-process: one Triton launch rewrites the listed blocks of every tensor of a cache.

A program owns one (block, tensor) pair. It loads the whole block into registers through the
row permutation, waits at a barrier until every thread of the program holds its part, then
stores the rows in order: the block is read once and written once, in place, with coalesced
``head_dim`` rows on both sides. Blocks too large for one program's registers take two launches
through a scratch buffer instead (gather, then write back), at twice the memory traffic.

Launches go to the caller's current stream (the executor's dedicated stream). The same kernels
run on the CPU under ``TRITON_INTERPRET=1``, which is how the tests check them without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvd.kernels.plan import RowPlan

# Above this a block does not fit one program's registers (16 warps x 32 threads x ~64 regs).
MAX_TILE_BYTES = 128 * 1024
# Bound on the scratch buffer of the two-pass path; longer id lists are done in chunks.
MAX_SCRATCH_BYTES = 256 << 20

_WORDS = ((4, tl.int32), (2, tl.int16), (1, tl.uint8))


@triton.jit
def _permute_in_place(
    table_ptr,  # int64 base address of each tensor
    ids_ptr,  # int64 block ids
    perm_ptr,  # int32: new row i = old row perm[i]
    block_stride,  # words between consecutive blocks
    ROWS: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    WORD: tl.constexpr,
):
    block = tl.load(ids_ptr + tl.program_id(0))
    base = tl.load(table_ptr + tl.program_id(1)).to(tl.pointer_type(WORD))
    start = base + block * block_stride
    r = tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    mask = (r < ROWS)[:, None] & (c < ROW_WORDS)[None, :]
    src = tl.load(perm_ptr + r, mask=r < ROWS, other=0).to(tl.int64)
    tile = tl.load(start + src[:, None] * ROW_WORDS + c[None, :], mask=mask)
    # Every thread must hold its rows before any thread overwrites rows others still read.
    tl.debug_barrier()
    tl.store(start + r.to(tl.int64)[:, None] * ROW_WORDS + c[None, :], tile, mask=mask)


@triton.jit
def _gather_rows(
    table_ptr,
    ids_ptr,
    perm_ptr,
    scratch_ptr,  # (tensors * ids, ROWS, ROW_WORDS) words
    block_stride,
    n_ids,
    ROWS: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    WORD: tl.constexpr,
    TO_SCRATCH: tl.constexpr,
):
    """Rows [pid2 * BLOCK_R, ...) of one block: into scratch (permuted) or back (in order)."""
    i = tl.program_id(0)
    t = tl.program_id(1)
    block = tl.load(ids_ptr + i)
    base = tl.load(table_ptr + t).to(tl.pointer_type(WORD))
    start = base + block * block_stride
    slot = scratch_ptr.to(tl.pointer_type(WORD)) + (t * n_ids + i).to(tl.int64) * ROWS * ROW_WORDS
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    mask = (r < ROWS)[:, None] & (c < ROW_WORDS)[None, :]
    rows = r.to(tl.int64)[:, None] * ROW_WORDS + c[None, :]
    if TO_SCRATCH:
        src = tl.load(perm_ptr + r, mask=r < ROWS, other=0).to(tl.int64)
        tile = tl.load(start + src[:, None] * ROW_WORDS + c[None, :], mask=mask)
        tl.store(slot + rows, tile, mask=mask)
    else:
        tl.store(start + rows, tl.load(slot + rows, mask=mask), mask=mask)


@dataclass(frozen=True, eq=False)
class Launch:
    """Checked launch arguments of one group of tensors, reused for every request."""

    rows: list[torch.Tensor]  # kept so the address table stays valid
    table: torch.Tensor
    perm: torch.Tensor
    num_blocks: int
    rows_per_block: int
    row_words: int
    block_stride: int
    width: int
    word: object


def prepare(rows: Sequence[torch.Tensor], plan: RowPlan) -> Launch:
    """Check that the views can share one launch: same device, shape and block stride."""
    first = rows[0]
    device = first.device
    num_blocks, rows_per_block, row_elems = first.shape
    row_bytes = row_elems * first.element_size()
    stride_bytes = first.stride(0) * first.element_size()
    for view in rows:
        if view.device != device or view.shape != first.shape:
            raise ValueError("views of one launch must share their device and shape")
        contiguous_rows = view.stride()[1:] == (row_elems, 1)
        if view.stride(0) * view.element_size() != stride_bytes or not contiguous_rows:
            raise ValueError("views of one launch must share a block stride, with contiguous rows")
    if plan.rows != rows_per_block:
        raise ValueError(f"permutation has {plan.rows} rows, blocks have {rows_per_block}")
    width, word = next(w for w in _WORDS if row_bytes % w[0] == 0 and stride_bytes % w[0] == 0)
    if any(v.data_ptr() % width for v in rows):
        width, word = _WORDS[-1]
    return Launch(
        rows=list(rows),
        table=_on(device, [v.data_ptr() for v in rows]),
        perm=plan.perm_on(device),
        num_blocks=num_blocks,
        rows_per_block=rows_per_block,
        row_words=row_bytes // width,
        block_stride=stride_bytes // width,
        width=width,
        word=word,
    )


def run(launch: Launch, block_ids: Sequence[int]) -> None:
    """Rewrite ``block_ids`` of every tensor of ``launch``; asynchronous on the current stream."""
    if not block_ids:
        return
    if min(block_ids) < 0 or max(block_ids) >= launch.num_blocks:
        raise ValueError(f"block ids must be in [0, {launch.num_blocks})")
    device = launch.table.device
    n_tensors = len(launch.rows)
    rows_per_block, row_words, width = launch.rows_per_block, launch.row_words, launch.width
    block_r, block_c = triton.next_power_of_2(rows_per_block), triton.next_power_of_2(row_words)
    if block_r * block_c * width <= MAX_TILE_BYTES:
        _permute_in_place[(len(block_ids), n_tensors)](
            launch.table,
            _on(device, block_ids),
            launch.perm,
            launch.block_stride,
            ROWS=rows_per_block,
            ROW_WORDS=row_words,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            WORD=launch.word,
            num_warps=16 if block_r * block_c * width > 32 * 1024 else 8,
        )
        return
    block_bytes = rows_per_block * row_words * width
    per_chunk = max(1, MAX_SCRATCH_BYTES // (block_bytes * n_tensors))
    tile_r = max(1, min(block_r, (32 * 1024) // (block_c * width)))
    for start in range(0, len(block_ids), per_chunk):
        chunk = list(block_ids[start : start + per_chunk])
        ids = _on(device, chunk)
        scratch = torch.empty(
            n_tensors * len(chunk) * block_bytes, dtype=torch.uint8, device=device
        )
        grid = (len(chunk), n_tensors, triton.cdiv(rows_per_block, tile_r))
        for to_scratch in (True, False):
            _gather_rows[grid](
                launch.table,
                ids,
                launch.perm,
                scratch,
                launch.block_stride,
                len(chunk),
                ROWS=rows_per_block,
                ROW_WORDS=row_words,
                BLOCK_R=tile_r,
                BLOCK_C=block_c,
                WORD=launch.word,
                TO_SCRATCH=to_scratch,
                num_warps=4,
            )


def permute_blocks(rows: Sequence[torch.Tensor], block_ids: Sequence[int], plan: RowPlan) -> None:
    """Apply ``plan`` to the listed blocks of every view: ``prepare`` then ``run``."""
    run(prepare(rows, plan), block_ids)


def _on(device: torch.device, values: Sequence[int]) -> torch.Tensor:
    """An int64 tensor on ``device``; from pinned memory, so the copy does not stall the host."""
    host = torch.tensor(list(values), dtype=torch.int64)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
