"""The decode-side post-process: rewrite NIXL-received blocks into the local layout, in place.

A NIXL READ writes ``ratio`` remote blocks back to back into one local block, each sub-block in
the remote layout with ``nP = block_size // ratio`` tokens (and, for blocks-first caches, each
with its own K then V part). The post-process rewrites every listed block so that it holds the
same tokens in the local layout, local token ``t = s * nP + t'`` for sub-block ``s`` and sub-block
token ``t'``. It only moves whole ``head_dim`` rows, so it is dtype-agnostic: the work happens on
raw integer views of the rows.

Every transform is a fixed permutation of the rows of one block (``row_plan``): new row ``i``
is old row ``perm[i]``. Blocks that are not listed are never read or written. The rows move in
a compiled kernel (``kvd.kernels``): C on the CPU, Triton on CUDA; plain torch ops remain as the
fallback for a build without a C compiler.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvd.geometry import LAYOUTS, check_ratio, duplicate_ids, out_of_range_ids, preview
from kvd.kernels import cpu as kernels_cpu
from kvd.kernels.plan import RowPlan

# Raw element types by width: a row of head_dim elements is moved as the widest integer type
# that divides its byte length, which keeps copies dtype-agnostic and wide.
_RAW_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))

# Blocks gathered per torch call: large enough to amortise the call, small enough that the
# scratch copy stays in the CPU's L2.
_SCRATCH_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class BlockRows:
    """One tensor seen as rows: ``rows`` is (num_blocks, rows_per_block, row_elems), raw ints.

    ``kv_parts`` is 2 when a block holds its K and then its V part (blocks-first caches).
    """

    rows: torch.Tensor
    layout: str
    block_size: int
    num_heads: int
    kv_parts: int = 1


def postprocess_blocks(
    cache: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    *,
    ratio: int,
    remote_layout: str,
    local_layout: str,
) -> None:
    """Rewrite the listed blocks of ``cache`` in place from the remote into the local layout.

    ``cache`` is the physical tensor: (num_blocks, block_size, heads, head_dim) for local NHD or
    (num_blocks, heads, block_size, head_dim) for local HND, any dtype, each block contiguous.
    ``block_ids`` are local physical block ids (ints or a 1-D integer tensor). ``ratio`` is the
    decode block size over the prefill block size and must divide the block size.

    Raises ``ValueError`` before anything is written for out-of-range, negative or duplicate ids,
    a bad ratio or an unknown layout.
    """
    if local_layout not in LAYOUTS:
        raise ValueError(f"local_layout must be one of {LAYOUTS}, got {local_layout!r}")
    if cache.dim() != 4:
        raise ValueError(f"cache must have 4 dimensions, got shape {tuple(cache.shape)}")
    if local_layout == "NHD":
        _, block_size, num_heads, _ = cache.shape
    else:
        _, num_heads, block_size, _ = cache.shape
    view = block_rows(cache, layout=local_layout, block_size=block_size, num_heads=num_heads)
    postprocess_tensors([view], block_ids, ratio=ratio, remote_layout=remote_layout)


Backend = Literal["auto", "kernel", "torch"]
"""``kernel``: the compiled CPU kernel or the Triton kernel on CUDA; ``torch``: plain torch ops
(the fallback when no kernel is available); ``auto``: the kernel when there is one."""


@dataclass(eq=False)
class Group:
    """Tensors rewritten by one kernel call: same row plan, same geometry, same device.

    The kernel's launch arguments (checked geometry, base address table) are prepared on first
    use and kept, so a cache's every request reuses them.
    """

    plan: RowPlan
    rows: list[torch.Tensor]
    _launch: object = None

    def apply(self, ids: list[int], backend: Backend = "auto") -> None:
        """Rewrite blocks ``ids`` (already checked to be in range and unique)."""
        device = self.rows[0].device
        if backend != "torch":
            if device.type == "cpu" and kernels_cpu.available():
                if self._launch is None:
                    self._launch = kernels_cpu.prepare(self.rows, self.plan)
                kernels_cpu.run(self._launch, ids)  # type: ignore[arg-type]
                return
            if device.type == "cuda":
                from kvd.kernels import gpu

                if self._launch is None:
                    self._launch = gpu.prepare(self.rows, self.plan)
                gpu.run(self._launch, ids)  # type: ignore[arg-type]
                return
            if backend == "kernel":
                raise RuntimeError(f"no post-process kernel for {device} in this build")
        for rows in self.rows:
            _permute_rows_torch(rows, ids, self.plan.perm)


def plan_groups(tensors: Sequence[BlockRows], *, ratio: int, remote_layout: str) -> list[Group]:
    """The kernel calls that rewrite every tensor under (ratio, remote_layout); [] = no work.

    Raises ``ValueError`` for a ratio that does not divide a tensor's block size or an
    unknown layout.
    """
    if remote_layout not in LAYOUTS:
        raise ValueError(f"remote_layout must be one of {LAYOUTS}, got {remote_layout!r}")
    groups: dict[tuple[object, ...], Group] = {}
    for view in tensors:
        check_ratio(view.block_size, ratio)
        plan = row_plan(
            kv_parts=view.kv_parts,
            block_size=view.block_size,
            num_heads=view.num_heads,
            ratio=ratio,
            remote_layout=remote_layout,
            local_layout=view.layout,
        )
        if plan is None:
            continue
        rows = view.rows
        key = (id(plan), rows.shape, rows.stride(0), rows.dtype, rows.device)
        groups.setdefault(key, Group(plan, [])).rows.append(rows)
    return list(groups.values())


def postprocess_tensors(
    tensors: Sequence[BlockRows],
    block_ids: Sequence[int] | torch.Tensor,
    *,
    ratio: int,
    remote_layout: str,
    backend: Backend = "auto",
) -> None:
    """Rewrite the listed blocks of every tensor of one cache (all layers, K and V).

    All tensors must share num_blocks. Validation happens for all of them before any write.
    Tensors with the same geometry are rewritten by one kernel call (one launch on CUDA).
    """
    ids = _as_id_list(block_ids)
    repeated = duplicate_ids(ids)
    if repeated:
        raise ValueError(f"block ids {preview(repeated)} listed twice")
    for view in tensors:
        bad = out_of_range_ids(ids, view.rows.shape[0])
        if bad:
            raise ValueError(f"block ids {preview(bad)} outside [0, {view.rows.shape[0]})")
    groups = plan_groups(tensors, ratio=ratio, remote_layout=remote_layout)
    if not ids:
        return
    for group in groups:
        group.apply(ids, backend)


def block_rows(
    tensor: torch.Tensor, *, layout: str, block_size: int, num_heads: int, kv_parts: int = 1
) -> BlockRows:
    """A raw row view of ``tensor`` whose dim 0 indexes blocks and whose blocks are contiguous."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if tensor.dim() < 2:
        raise ValueError(f"a cache tensor needs a block axis and a row axis, got {tensor.shape}")
    num_blocks = tensor.shape[0]
    if num_blocks and not tensor[0].is_contiguous():
        raise ValueError("each block of the cache must be contiguous in memory")
    block_bytes = tensor[0].numel() * tensor.element_size() if num_blocks else 0
    rows_per_block = kv_parts * block_size * num_heads
    if rows_per_block == 0 or block_bytes % rows_per_block:
        raise ValueError(
            f"block of {block_bytes} bytes does not split into {rows_per_block} rows "
            f"(kv_parts={kv_parts}, block_size={block_size}, num_heads={num_heads})"
        )
    row_bytes = block_bytes // rows_per_block
    width, raw_dtype = next((w, d) for w, d in _RAW_DTYPES if row_bytes % w == 0)
    elem = tensor.element_size()
    block_stride_bytes = tensor.stride(0) * elem
    if block_stride_bytes % width or (tensor.storage_offset() * elem) % width:
        width, raw_dtype = 1, torch.uint8
    raw = torch.empty(0, dtype=raw_dtype, device=tensor.device).set_(
        tensor.untyped_storage(),
        (tensor.storage_offset() * elem) // width,
        (num_blocks, rows_per_block, row_bytes // width),
        (block_stride_bytes // width, row_bytes // width, 1),
    )
    return BlockRows(raw, layout, block_size, num_heads, kv_parts)


@functools.lru_cache(maxsize=256)
def row_plan(
    *,
    kv_parts: int,
    block_size: int,
    num_heads: int,
    ratio: int,
    remote_layout: str,
    local_layout: str,
) -> RowPlan | None:
    """The row gather of one block (new row i = old row perm[i]), or None when nothing moves.

    Source rows are indexed (sub-block s, kv part, then (h, t') for HND or (t', h) for NHD);
    destination rows (kv part, then (t, h) for NHD or (h, t) for HND) with t = s * nP + t'.
    """
    check_ratio(block_size, ratio)
    sub = block_size // ratio
    if remote_layout == "HND":
        src = torch.arange(ratio * kv_parts * num_heads * sub).view(ratio, kv_parts, num_heads, sub)
        s_kv_t_h = src.permute(0, 1, 3, 2)
    else:
        src = torch.arange(ratio * kv_parts * sub * num_heads).view(ratio, kv_parts, sub, num_heads)
        s_kv_t_h = src
    # dims now (s, kv, t', h); bring kv first, then the local order.
    # NHD: (kv, s, t', h) = (kv, t, h); HND: (kv, h, s, t') = (kv, h, t).
    order = (1, 0, 2, 3) if local_layout == "NHD" else (1, 3, 0, 2)
    dest = s_kv_t_h.permute(*order)
    perm = dest.reshape(-1).contiguous()
    if torch.equal(perm, torch.arange(perm.numel())):
        return None
    return RowPlan(perm)


def _as_id_list(block_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1:
            raise ValueError(f"block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
        if block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
            raise ValueError(f"block_ids must be integers, got {block_ids.dtype}")
        return [int(b) for b in block_ids.tolist()]
    ids = list(block_ids)
    for b in ids:
        if isinstance(b, bool) or not isinstance(b, int):
            # The contract is ValueError for every bad block id, wrong type included.
            raise ValueError(f"block_ids must be integers, got {b!r}")  # noqa: TRY004
    return ids


def _permute_rows_torch(rows: torch.Tensor, ids: list[int], perm: torch.Tensor) -> None:
    """Apply ``perm`` to each listed block: gather blocks, gather rows, scatter blocks back."""
    block_bytes = rows.shape[1] * rows.shape[2] * rows.element_size()
    chunk = max(1, _SCRATCH_BYTES // max(1, block_bytes))
    perm = perm.to(rows.device)
    index = torch.tensor(ids, dtype=torch.int64, device=rows.device)
    for start in range(0, len(ids), chunk):
        part = index[start : start + chunk]
        blocks = rows.index_select(0, part)
        rows.index_copy_(0, part, blocks.index_select(1, perm))
