"""The compiled CPU kernel (``_rowperm.c``): bounds checks, then one call for many tensors.

The C code trusts its arguments, so this wrapper is where safety lives: every tensor must be on
the CPU with contiguous blocks, and every block id must be in range before an address is formed.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from kvd.kernels.plan import RowPlan

_rowperm: ModuleType | None
try:
    import kvd.kernels._rowperm as _rowperm  # noqa: PLR0402 (this form type-checks the stub)
except ImportError:  # built without a C compiler: kvd.postprocess uses its torch path
    _rowperm = None


def available() -> bool:
    return _rowperm is not None


def permute_blocks(
    rows: Sequence[torch.Tensor], block_ids: Sequence[int], plan: RowPlan, threads: int = 0
) -> None:
    """Apply ``plan`` to the listed blocks of every (num_blocks, rows, row_elems) raw view.

    All views must share their geometry (rows per block, row bytes and block stride).
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
    if any(b < 0 or b >= num_blocks for b in block_ids):
        raise ValueError(f"block ids must be in [0, {num_blocks})")
    # Kept alive by these locals for the duration of the call, which reads them by address.
    bases = torch.tensor([v.data_ptr() for v in rows], dtype=torch.int64)
    ids = torch.tensor(list(block_ids), dtype=torch.int64)
    runs = plan.runs
    _rowperm.permute_blocks(
        bases.data_ptr(),
        bases.numel(),
        ids.data_ptr(),
        ids.numel(),
        runs.data_ptr(),
        runs.shape[0],
        block_stride,
        row_elems * elem,
        rows_per_block,
        threads or torch.get_num_threads(),
    )
