"""The compiled CPU kernel (``_rowperm.c``): bounds checks, then one call for many tensors.

The C code trusts its arguments, so this wrapper is where safety lives: every tensor must be on
the CPU with contiguous blocks, and every block id must be in range before an address is formed.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from kvd.kernels.plan import RowPlan

_rowperm: ModuleType | None
try:
    import kvd.kernels._rowperm as _rowperm  # noqa: PLR0402 (this form type-checks the stub)
except ImportError:  # built without a C compiler: kvd.postprocess uses its torch path
    _rowperm = None


_THREADED_BYTES = 4 << 20


def available() -> bool:
    return _rowperm is not None


@dataclass(frozen=True, eq=False)
class Launch:
    """Checked arguments of one kernel call, reused for every request of a cache."""

    rows: list[torch.Tensor]  # kept so the addresses below stay valid
    bases: array.array[int]
    runs: torch.Tensor
    num_blocks: int
    block_stride: int
    row_bytes: int
    rows_per_block: int
    bytes_per_id: int


def prepare(rows: Sequence[torch.Tensor], plan: RowPlan) -> Launch:
    """Check that the views can share one call; the C code relies on every check here.

    Each view is (num_blocks, rows, row_elems) raw rows, on the CPU, with contiguous blocks;
    all share their geometry (rows per block, row bytes and block stride).
    """
    if _rowperm is None:
        raise RuntimeError("kvd's CPU kernel is not built (no C compiler at install time)")
    first = rows[0]
    num_blocks, rows_per_block, row_elems = first.shape
    elem = first.element_size()
    block_stride = first.stride(0) * elem
    for view in rows:
        if view.device.type != "cpu":
            raise ValueError(f"the CPU kernel needs CPU tensors, got {view.device}")
        if view.shape != first.shape or view.stride(0) * view.element_size() != block_stride:
            raise ValueError("views of one kernel call must share their geometry")
        if view.element_size() != elem or view.stride()[1:] != (row_elems, 1):
            raise ValueError("each block must be contiguous rows")
    if plan.rows != rows_per_block:
        raise ValueError(f"permutation has {plan.rows} rows, blocks have {rows_per_block}")
    return Launch(
        rows=list(rows),
        bases=array.array("q", [v.data_ptr() for v in rows]),
        runs=plan.runs,
        num_blocks=num_blocks,
        block_stride=block_stride,
        row_bytes=row_elems * elem,
        rows_per_block=rows_per_block,
        bytes_per_id=len(rows) * rows_per_block * row_elems * elem,
    )


def run(launch: Launch, block_ids: Sequence[int], threads: int = 0) -> None:
    """Rewrite ``block_ids`` of every view of ``launch`` (GIL released while rows move)."""
    assert _rowperm is not None  # prepare() checked
    if not block_ids:
        return
    if min(block_ids) < 0 or max(block_ids) >= launch.num_blocks:
        raise ValueError(f"block ids must be in [0, {launch.num_blocks})")
    if not threads:
        # Starting a thread costs tens of microseconds: worth it only for a large job.
        big = launch.bytes_per_id * len(block_ids) >= _THREADED_BYTES
        threads = torch.get_num_threads() if big else 1
    ids = array.array("q", block_ids)
    bases_address, n_bases = launch.bases.buffer_info()
    ids_address, n_ids = ids.buffer_info()
    _rowperm.permute_blocks(
        bases_address,
        n_bases,
        ids_address,
        n_ids,
        launch.runs.data_ptr(),
        launch.runs.shape[0],
        launch.block_stride,
        launch.row_bytes,
        launch.rows_per_block,
        threads,
    )


def permute_blocks(
    rows: Sequence[torch.Tensor], block_ids: Sequence[int], plan: RowPlan, threads: int = 0
) -> None:
    """Apply ``plan`` to the listed blocks of every view: ``prepare`` then ``run``."""
    run(prepare(rows, plan), block_ids, threads)
