"""The CPU kernels: the compiled plan executor (``_runs.c``) and a plain-torch fallback.

Both execute a ``kvd.layout.planner.Plan`` over groups of pages. The C code trusts its
arguments: callers form every page address from block ids checked against their region
(``kvd.kernels.postprocess`` does). A page that faults (its shared-memory file was truncated)
ends the call with ``MemoryFault`` instead of the process.
"""

from __future__ import annotations

import functools
from types import ModuleType

import numpy as np
import numpy.typing as npt
import torch

from kvd.kernels.faults import MemoryFault
from kvd.layout.planner import ZERO, Plan, Runs

_runs: ModuleType | None
try:
    import kvd.kernels._runs as _runs  # noqa: PLR0402 (this form type-checks the stub)
except ImportError:  # built without a C compiler: the torch fallback runs the plans
    _runs = None

# Starting a thread costs tens of microseconds: worth it only for a large job.
THREADED_BYTES = 4 << 20

# Groups gathered per torch call: large enough to amortise the call, small enough that the
# copies stay in the CPU's L2.
_TORCH_CHUNK_BYTES = 1 << 20

_TORCH_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def available() -> bool:
    return _runs is not None


def page_table(
    bases: npt.NDArray[np.int64], strides: npt.NDArray[np.int64], groups: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """Page addresses, one row per (region, group): region ``i``'s block ``b`` is at
    ``bases[i] + b * strides[i]``; ``groups`` is (n_groups, pages_per_group) block ids."""
    table = bases[:, None, None] + groups[None, :, :] * strides[:, None, None]
    return np.ascontiguousarray(table.reshape(-1, groups.shape[1]))


def apply_runs(
    pages: npt.NDArray[np.int64], plan: Plan, threads: int = 0, prefetch: int | None = None
) -> None:
    """Apply ``plan`` in place to every group of ``pages`` (rows of page addresses).

    Threads (``threads`` 0: as many as torch uses) only when the job is large; ``prefetch``
    (runs ahead) defaults to ``prefetch_distance(plan)``. Raises ``MemoryFault`` when a page
    faults; the pages of other groups may then be rewritten or not.
    """
    if _runs is None:
        raise RuntimeError("kvd's CPU kernel is not built (no C compiler at install time)")
    if pages.dtype != np.int64 or pages.ndim != 2 or pages.shape[1] != plan.pages_per_group:
        raise ValueError(f"pages must be int64 rows of {plan.pages_per_group} page addresses")
    pages = np.ascontiguousarray(pages)
    # `_moves` holds the moves array for the call: its cache entry may be evicted meanwhile.
    moves, num_moves, write_back, num_write_back, distance, _moves = _plan_arguments(plan)
    if not threads:
        big = len(pages) * plan.group_bytes >= THREADED_BYTES
        threads = torch.get_num_threads() if big else 1
    fault = _runs.apply_runs(
        pages.ctypes.data,
        len(pages),
        plan.pages_per_group,
        plan.page_bytes,
        moves,
        num_moves,
        write_back,
        num_write_back,
        distance if prefetch is None else prefetch,
        threads,
    )
    if fault is not None:
        raise MemoryFault(*fault)


@functools.lru_cache(maxsize=256)
def _plan_arguments(plan: Plan) -> tuple[int, int, int, int, int, Runs]:
    """The kernel's arguments from ``plan``, made once per plan (numpy's ``ctypes`` and
    ``mean`` cost microseconds a call): moves and write-back (address, rows), prefetch; and
    the array of moves, which the entry keeps alive as long as it hands out its address."""
    moves, write_back = gather_order(plan), plan.write_back
    return (
        moves.ctypes.data,
        len(moves),
        write_back.ctypes.data,
        len(write_back),
        prefetch_distance(plan),
        moves,
    )


def gather_order(plan: Plan) -> Runs:
    """``plan.moves`` in the order the C kernel gathers them: by destination (the plan's
    order), or by source (landed page, offset; zero-fills first) when that reads fewer
    interleaved streams than it writes.

    The gather reads the landed pages from memory and writes a scratch copy of the group that
    stays in cache; one side is read or written in order, the other is scattered over as many
    interleaved streams as the transpose has rows. The hardware prefetchers follow a few
    streams (HND -> NHD in destination order reads 8, one per head) but not dozens (NHD -> HND
    reads 64, one per token, 2 KiB apart, and every line waits on memory): the scattered side
    should be the one with fewer streams. ``kvd bench kernels`` on a shared 2-core EPYC, medians
    of 5 to 10 runs alternating builds: NHD -> HND r=1 bf16 1.57-1.63x a plain copy in
    destination order, 1.08-1.38x in source order; HND -> NHD r=1, whose source order writes
    64 streams, 1.00x in destination order and 1.16x in source order.
    """
    moves = plan.moves
    loads = moves[:, 1] != ZERO
    source = np.where(loads, moves[:, 1] * plan.page_bytes + moves[:, 2], -1)
    by_source = np.argsort(source, kind="stable")
    reads = _interleave(source[loads], moves[loads, 3])
    writes = _interleave(moves[by_source, 0], moves[by_source, 3])
    if reads <= writes:
        return moves
    ordered = np.ascontiguousarray(moves[by_source])
    ordered.setflags(write=False)
    return ordered


def _interleave(starts: Runs, lengths: Runs) -> float:
    """How many streams runs visited in this order interleave on one side: the median
    distance, in runs, from a run to the one that continues it (starts where it ends); 0 when
    none continues another."""
    ends = starts + lengths
    by_end = np.argsort(ends, kind="stable")
    at = np.minimum(np.searchsorted(ends[by_end], starts), len(ends) - 1)
    continues = ends[by_end][at] == starts
    if not continues.any():
        return 0.0
    previous = by_end[at[continues]]
    return float(np.median(np.abs(np.flatnonzero(continues) - previous)))


def apply_runs_torch(region: torch.Tensor, groups: npt.NDArray[np.int64], plan: Plan) -> None:
    """``apply_runs`` with plain torch ops, for one region seen as ``(num_blocks, page_bytes)``
    uint8 pages: each chunk of groups is gathered (a copy), permuted, and scattered back."""
    if len(groups) == 0 or plan.is_identity:
        return
    block_stride = region.stride(0)
    offset = region.storage_offset()
    width = plan.word_width()
    while block_stride % width or offset % width:
        width //= 2
    words = torch.empty(0, dtype=_TORCH_WORDS[width], device=region.device).set_(
        region.untyped_storage(),
        offset // width,
        (region.shape[0], plan.page_bytes // width),
        (block_stride // width, 1),
    )
    group_words = plan.group_bytes // width
    index = torch.from_numpy(np.asarray(plan.gather_index(width)).copy()).to(region.device)
    index[index < 0] = group_words  # a zero column appended to each gathered group
    per_chunk = max(1, _TORCH_CHUNK_BYTES // plan.group_bytes)
    ids_all = torch.from_numpy(np.ascontiguousarray(groups, dtype=np.int64)).to(region.device)
    for start in range(0, len(groups), per_chunk):
        ids = ids_all[start : start + per_chunk].reshape(-1)
        n = len(ids) // plan.pages_per_group
        landed = words.index_select(0, ids).reshape(n, group_words)
        padded = torch.cat([landed, landed.new_zeros(n, 1)], dim=1)
        out = padded[:, index].reshape(len(ids), -1)
        words.index_copy_(0, ids, out)


def prefetch_distance(plan: Plan) -> int:
    """How many runs ahead the C kernel prefetches sources: about 2 KiB ahead, and none for
    runs so short that they read the pages densely anyway (measured on x86)."""
    moves = plan.moves
    if not len(moves):
        return 0
    mean = int(moves[:, 3].mean())
    return 0 if mean < 64 else max(1, min(32, 2048 // mean))
