"""Cache geometry: what an attached tensor's shape means, checked before any memory is opened.

Pure logic, no I/O: the registry calls ``cache_geometry`` on the ``TensorSpec``s of an Attach and
opens memory only when every tensor passes. Also the checks every path shares on what a
notification names: the block ids (``block_id_list``, ``check_block_ids``), the remote block
size (``resolve_remote_block_size``) and the pages one READ fills (``group_shape``); and what an
opened tensor must be to hold its geometry (``check_tensor``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias

from kvd.dtypes import DTypeError, itemsize
from kvd.layout.formats import (
    FormatError,
    PageSizes,
    has_heads,
    is_cross_layer,
    legacy_format,
    num_regions,
    page_bytes,
    resolve,
)
from kvd.protocol import DTypeName, KVArrangement, Layout, PageFormat, TensorSpec

if TYPE_CHECKING:  # pure logic: it only asks an array or a tensor what it is
    import numpy as np
    import numpy.typing as npt
    import torch


class GeometryError(ValueError):
    """A tensor description that cannot be a KV cache; the message names the field."""


@dataclass(frozen=True, slots=True)
class TensorGeometry:
    """The meaning of one attached tensor: ``[regions, num_blocks, *page]``, contiguous.

    ``arrangement`` and ``layout`` are the legacy description when the spec gave one.
    """

    format: PageFormat
    sizes: PageSizes
    num_blocks: int
    arrangement: KVArrangement | None = None
    layout: Layout | None = None

    @property
    def block_size(self) -> int:
        return self.sizes.block_size

    @property
    def num_heads(self) -> int:
        return self.sizes.num_heads

    @property
    def head_dim(self) -> int:
        return self.sizes.head_dim

    @property
    def itemsize(self) -> int:
        return self.sizes.itemsize

    @property
    def num_regions(self) -> int:
        """Regions of ``num_blocks`` pages: 2 for a K/V split, one per head, else 1."""
        return num_regions(self.format, self.sizes.num_heads)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block in one region: the unit a NIXL descriptor moves."""
        return page_bytes(self.format, self.sizes)

    block_bytes = page_bytes

    @property
    def block_stride(self) -> int:
        """Bytes from one block to the next inside a region (pages are packed)."""
        return self.page_bytes

    @property
    def region_stride(self) -> int:
        return self.num_blocks * self.page_bytes

    @property
    def nbytes(self) -> int:
        return self.num_regions * self.region_stride


def check_tensor(tensor: torch.Tensor, geometry: TensorGeometry, where: str = "tensor") -> None:
    """Check that ``tensor`` holds ``geometry``: its bytes, contiguous in its shape.

    Raises ``GeometryError`` naming ``where`` and each thing that is wrong.
    """
    problems = []
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes != geometry.nbytes:
        problems.append(
            f"{geometry.nbytes} bytes are needed, got {nbytes} (shape {list(tensor.shape)}, "
            f"{tensor.dtype})"
        )
    if not tensor.is_contiguous():
        packed = [1] * tensor.dim()
        for d in range(tensor.dim() - 2, -1, -1):
            packed[d] = packed[d + 1] * tensor.shape[d + 1]
        problems.append(
            f"not contiguous: strides {tuple(tensor.stride())} for shape {list(tensor.shape)}, "
            f"where contiguous means {tuple(packed)}"
        )
    if problems:
        raise GeometryError(f"{where}: {'; '.join(problems)}")


def tensor_geometry(spec: TensorSpec, where: str = "tensor") -> TensorGeometry:
    """Check that ``spec.shape`` fits its page format (or legacy description) and sizes.

    Raises ``GeometryError`` naming ``where`` and the field at fault.
    """
    if spec.page_format is not None:
        return _format_geometry(spec, where)
    if spec.layout is None or spec.kv_arrangement is None:
        raise GeometryError(f"{where}: give page_format, or layout and kv_arrangement")
    return shape_geometry(
        spec.shape,
        dtype=spec.dtype,
        layout=spec.layout,
        kv_arrangement=spec.kv_arrangement,
        block_size=spec.block_size,
        where=where,
    )


def _format_geometry(spec: TensorSpec, where: str) -> TensorGeometry:
    assert spec.page_format is not None
    try:
        fmt = resolve(spec.page_format, f"{where}.page_format")
    except FormatError as exc:
        raise GeometryError(str(exc)) from None
    shape = list(spec.shape)
    if any(d <= 0 for d in shape):
        raise GeometryError(f"{where}.shape: every dimension must be > 0, got {shape}")
    for field, value in (("block_size", spec.block_size), ("head_dim", spec.head_dim)):
        if value <= 0:
            raise GeometryError(f"{where}.{field}: must be > 0, got {value}")
    if has_heads(fmt) and spec.num_heads <= 0:
        raise GeometryError(f"{where}.num_heads: must be > 0 for a format with heads")
    if not has_heads(fmt) and spec.num_heads > 1:
        raise GeometryError(
            f"{where}.num_heads: {spec.num_heads} given, but the format has no H axis (MLA)"
        )
    if is_cross_layer(fmt) and spec.num_layers <= 0:
        raise GeometryError(f"{where}.num_layers: must be > 0 for a cross-layer format (axis L)")
    if not is_cross_layer(fmt) and spec.num_layers:
        raise GeometryError(
            f"{where}.num_layers: {spec.num_layers} given, but the format has no L axis (one "
            "tensor per layer)"
        )
    sizes = PageSizes(
        num_layers=max(1, spec.num_layers),
        num_heads=max(1, spec.num_heads),
        block_size=spec.block_size,
        head_dim=spec.head_dim,
        itemsize=_itemsize(spec.dtype, where),
    )
    regions = num_regions(fmt, sizes.num_heads)
    lead = 2 if fmt.regions else 1
    if len(shape) <= lead:
        raise GeometryError(
            f"{where}.shape: needs {'[regions, num_blocks' if lead == 2 else '[num_blocks'}, "
            f"*page], got {shape}"
        )
    if lead == 2 and shape[0] != regions:
        raise GeometryError(
            f"{where}.shape: regions {fmt.regions!r} needs shape[0] = {regions}, got {shape}"
        )
    page = page_bytes(fmt, sizes)
    given = math.prod(shape[lead:]) * sizes.itemsize
    if given != page:
        raise GeometryError(
            f"{where}.shape: a page of {spec.block_size} tokens x {sizes.num_heads} heads x "
            f"{sizes.head_dim} head_dim ({sizes.num_layers} layers) holds {page} bytes; shape "
            f"{shape} gives {given}"
        )
    return TensorGeometry(fmt, sizes, shape[lead - 1])


def shape_geometry(
    shape: Sequence[int],
    *,
    dtype: DTypeName,
    layout: Layout,
    kv_arrangement: KVArrangement,
    block_size: int,
    where: str = "tensor",
) -> TensorGeometry:
    """The geometry of a legacy description: sizes read from the shape."""
    try:
        fmt = legacy_format(kv_arrangement, layout, where)
    except FormatError as exc:
        raise GeometryError(str(exc)) from None
    shape = list(shape)
    if any(d <= 0 for d in shape):
        raise GeometryError(f"{where}.shape: every dimension must be > 0, got {shape}")
    if block_size <= 0:
        raise GeometryError(f"{where}.block_size: must be > 0, got {block_size}")

    expected_dims = {"split": 5, "blocks_first": 5, "single": 4, "mla": 3}[kv_arrangement]
    if len(shape) != expected_dims:
        raise GeometryError(
            f"{where}.shape: kv_arrangement {kv_arrangement!r} needs {expected_dims} "
            f"dimensions ({_shape_hint(kv_arrangement, layout)}), got {shape}"
        )
    if kv_arrangement == "mla":
        num_blocks, tokens, head_dim = shape
        num_heads = 1
    else:
        if kv_arrangement == "split":
            kv, num_blocks, *block = shape
        elif kv_arrangement == "blocks_first":
            num_blocks, kv, *block = shape
        else:
            kv = 2
            num_blocks, *block = shape
        if kv != 2:
            raise GeometryError(
                f"{where}.shape: kv_arrangement {kv_arrangement!r} needs a K/V axis of 2 "
                f"({_shape_hint(kv_arrangement, layout)}), got {shape}"
            )
        if layout == "NHD":
            tokens, num_heads, head_dim = block
        else:
            num_heads, tokens, head_dim = block
    if tokens != block_size:
        raise GeometryError(
            f"{where}.block_size: {block_size} does not match the token axis of shape "
            f"{shape} ({_shape_hint(kv_arrangement, layout)})"
        )
    sizes = PageSizes(
        num_layers=1,
        num_heads=num_heads,
        block_size=block_size,
        head_dim=head_dim,
        itemsize=_itemsize(dtype, where),
    )
    return TensorGeometry(fmt, sizes, num_blocks, kv_arrangement, layout)


def _itemsize(dtype: DTypeName, where: str) -> int:
    try:
        return itemsize(dtype, f"{where}.dtype")
    except DTypeError as exc:
        raise GeometryError(str(exc)) from None


def cache_geometry(specs: Sequence[TensorSpec]) -> list[TensorGeometry]:
    """Check every tensor of one cache: all agree on num_blocks, those of one group on the
    block size, and the groups are numbered from 0 with none skipped."""
    if not specs:
        raise GeometryError("tensors: a cache needs at least one tensor")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise GeometryError(f"tensors: names must be unique, repeated: {dup}")
    geometries = [tensor_geometry(s, f"tensors[{i}]") for i, s in enumerate(specs)]
    first = geometries[0]
    block_sizes: dict[int, tuple[int, int]] = {}  # group -> (block size, first tensor)
    for i, (spec, g) in enumerate(zip(specs, geometries, strict=True)):
        if spec.group >= len(specs):
            raise GeometryError(
                f"tensors[{i}].group: {spec.group}; groups are numbered from 0 with none "
                f"skipped, and each has a tensor ({len(specs)} here)"
            )
        if g.num_blocks != first.num_blocks:
            raise GeometryError(
                f"tensors[{i}].shape: num_blocks {g.num_blocks} differs from tensors[0] "
                f"({first.num_blocks}); block ids index every tensor of a cache"
            )
        known = block_sizes.setdefault(spec.group, (g.block_size, i))
        if g.block_size != known[0]:
            raise GeometryError(
                f"tensors[{i}].block_size: {g.block_size} differs from tensors[{known[1]}] "
                f"({known[0]}) of the same group {spec.group}"
            )
    missing = sorted(set(range(max(block_sizes) + 1)) - set(block_sizes))
    if missing:
        raise GeometryError(
            f"tensors: groups are numbered from 0 with none skipped; no tensor has group "
            f"{', '.join(map(str, missing))}"
        )
    return geometries


def group_block_sizes(
    specs: Sequence[TensorSpec], geometries: Sequence[TensorGeometry]
) -> list[int]:
    """The block size of each group of a checked cache (``cache_geometry``), in group order."""
    sizes = dict(zip((s.group for s in specs), (g.block_size for g in geometries), strict=True))
    return [sizes[group] for group in range(len(sizes))]


def resolve_remote_block_size(
    block_size: int, block_size_ratio: int, remote_block_size: int
) -> int:
    """The remote block size nP a notification means, checked against the local ``block_size``.

    Either value may be 0 ("not given"); at least one must be given, and both must agree.
    ``block_size_ratio`` (nD / nP) can only state nP <= nD; ``remote_block_size`` may be any
    size that divides or is a multiple of the local one. Raises ``ValueError`` naming the field.
    """
    if block_size_ratio < 0:
        raise ValueError(f"block_size_ratio: must be >= 1, got {block_size_ratio}")
    if remote_block_size < 0:
        raise ValueError(f"remote_block_size: must be >= 1, got {remote_block_size}")
    if block_size_ratio and block_size % block_size_ratio:
        raise ValueError(
            f"block_size_ratio: {block_size_ratio} does not divide the block size {block_size}"
        )
    if not remote_block_size:
        if not block_size_ratio:
            raise ValueError("give block_size_ratio or remote_block_size (both are 0)")
        return block_size // block_size_ratio
    if block_size % remote_block_size and remote_block_size % block_size:
        raise ValueError(
            f"remote_block_size: {remote_block_size} does not divide the local block size "
            f"{block_size}, nor is it a multiple of it"
        )
    if block_size_ratio and block_size_ratio * remote_block_size != block_size:
        raise ValueError(
            f"block_size_ratio: {block_size_ratio} contradicts remote_block_size "
            f"{remote_block_size} (local block size {block_size})"
        )
    return remote_block_size


BlockIdFault = Literal["out_of_range", "duplicate", "malformed"]

BlockIds: TypeAlias = "Sequence[int] | npt.NDArray[np.integer] | torch.Tensor"
"""Block ids as a caller may give them: a list or tuple of integers, or a 1-D integer numpy
array or torch tensor (on any device)."""


def group_shape(block_size: int, remote_block_size: int) -> tuple[int, int]:
    """(local pages per group, remote pages per group) for local ``nD`` and remote ``nP``.

    Raises ``ValueError`` unless one block size divides the other.
    """
    if block_size < 1 or remote_block_size < 1:
        raise ValueError(f"block sizes must be >= 1, got {remote_block_size} -> {block_size}")
    if block_size % remote_block_size == 0:
        return 1, block_size // remote_block_size
    if remote_block_size % block_size == 0:
        return remote_block_size // block_size, 1
    raise ValueError(
        f"remote block size {remote_block_size} and local block size {block_size}: "
        "neither divides the other"
    )


def remote_pages_held(num_ids: int, pages: int, remote_pages: int) -> int:
    """The remote pages ``num_ids`` local blocks hold, in groups of ``group_shape``'s ``pages``
    local and ``remote_pages`` remote pages (a partial group holds none)."""
    return num_ids // pages * remote_pages


class BlockIdError(ValueError):
    """Block ids that cannot be rewritten; ``fault`` says why, the message names them."""

    def __init__(self, fault: BlockIdFault, message: str) -> None:
        super().__init__(message)
        self.fault: BlockIdFault = fault


def block_id_list(block_ids: BlockIds, where: str = "physical_block_ids") -> list[int]:
    """``block_ids`` of any accepted kind as a list of Python ints, for ``check_block_ids``.

    Every kind goes through here, so every kind gets the same checks after: a tensor's ids,
    left as 0-d tensors, would hash apart and slip past the duplicate check. Raises
    ``BlockIdError`` (``malformed``) naming ``where`` for another kind, a dtype that is not an
    integer one, or more than one dimension.
    """
    if type(block_ids) is list and set(map(type, block_ids)) == {int}:
        return block_ids  # the common case (decoded from the wire): nothing to convert
    # An array or a tensor exists only once its library is loaded: ask, never import (a CPU
    # daemon is READY before numpy and torch load).
    np_, torch_ = sys.modules.get("numpy"), sys.modules.get("torch")
    if isinstance(block_ids, list | tuple):
        integers = (int, np_.integer) if np_ is not None else (int,)
        for i, b in enumerate(block_ids):
            if isinstance(b, bool) or not isinstance(b, integers):
                raise BlockIdError(
                    "malformed", f"{where}[{i}]: an integer is needed, got {type(b).__name__}"
                )
        return [int(b) for b in block_ids]
    if np_ is not None and isinstance(block_ids, np_.ndarray):
        integral = block_ids.dtype.kind in "iu"
    elif torch_ is not None and isinstance(block_ids, torch_.Tensor):
        integral = not (
            block_ids.is_floating_point()
            or block_ids.is_complex()
            or block_ids.dtype == torch_.bool
        )
    else:
        raise BlockIdError(
            "malformed",
            f"{where}: a list, tuple, numpy array or torch tensor of integers is needed, got "
            f"{type(block_ids).__name__}",
        )
    if not integral:
        raise BlockIdError("malformed", f"{where}: integers are needed, got {block_ids.dtype}")
    if block_ids.ndim != 1:
        raise BlockIdError(
            "malformed", f"{where}: one dimension is needed, got shape {tuple(block_ids.shape)}"
        )
    ids: list[int] = block_ids.tolist()
    return ids


def check_block_ids(block_ids: Sequence[int], num_blocks: int) -> BlockIdError | None:
    """Why ``block_ids`` cannot index a cache of ``num_blocks`` blocks, or None.

    The one check of the block ids a request names (the kernels, the daemon's validation and
    the NIXL read planner all use it): every id in ``[0, num_blocks)``, none listed twice.
    ``block_ids`` are Python ints (``block_id_list`` makes them so from any accepted kind). The
    common case (all fine) costs a sort and a set: sorting a list of small ints compares them
    natively, so it finds both ends sooner than ``min`` and ``max`` do when the ids come in
    runs, as an engine allocates them (16 ids in order: 1.6x faster; 256 in random order: 1.2x
    slower).
    """
    if not block_ids:
        return None
    ordered = sorted(block_ids)
    if ordered[0] < 0 or ordered[-1] >= num_blocks:
        bad = [b for b in block_ids if b < 0 or b >= num_blocks]
        return BlockIdError("out_of_range", f"{preview(bad)} outside [0, {num_blocks})")
    if len(set(block_ids)) != len(block_ids):
        seen: set[int] = set()
        repeats = []
        for b in block_ids:
            if b in seen:
                repeats.append(b)
            seen.add(b)
        return BlockIdError("duplicate", f"{preview(repeats)} listed twice")
    return None


def preview(ids: Sequence[int], limit: int = 8) -> str:
    """A short rendering of an id list for error messages."""
    shown = ", ".join(str(b) for b in ids[:limit])
    more = f" (+{len(ids) - limit} more)" if len(ids) > limit else ""
    return f"[{shown}]{more}"


def _shape_hint(arrangement: KVArrangement, layout: Layout) -> str:
    block = (
        "block_size, num_heads, head_dim" if layout == "NHD" else "num_heads, block_size, head_dim"
    )
    return {
        "split": f"[2, num_blocks, {block}]",
        "blocks_first": f"[num_blocks, 2, {block}]",
        "single": f"[num_blocks, {block}]",
        "mla": "[num_blocks, block_size, head_dim]",
    }[arrangement]


def group_problem(
    num_ids: int, covered: int, pages: int, remote_pages: int
) -> tuple[Literal["physical_block_ids", "covered_sub_blocks"], str] | None:
    """The group rule of one request, given its ``group_shape``: its ``num_ids`` local blocks
    are whole groups of ``pages``, and ``covered`` (0: all) counts at most the remote pages
    they hold. (field at fault, why) when it is broken, else None."""
    if num_ids % pages:
        return "physical_block_ids", (
            f"{num_ids} block ids do not fill whole groups of {pages} (a remote block lands "
            f"across {pages} local blocks)"
        )
    holds = remote_pages_held(num_ids, pages, remote_pages)
    if covered < 0 or covered > holds:
        return "covered_sub_blocks", (
            f"{covered} is not in [0, {holds}] (the remote blocks {num_ids} local blocks hold)"
        )
    return None
