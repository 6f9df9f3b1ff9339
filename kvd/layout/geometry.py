"""Cache geometry: what an attached tensor's shape means, checked before any memory is opened.

Pure logic, no I/O: the registry calls ``tensor_geometry`` on each ``TensorSpec`` of an Attach
and opens memory only when every tensor of the cache passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvd.dtypes import ITEMSIZE
from kvd.protocol import DTypeName, KVArrangement, Layout, TensorSpec

LAYOUTS: tuple[Layout, ...] = ("NHD", "HND")


class GeometryError(ValueError):
    """A tensor description that cannot be a KV cache; the message names the field."""


@dataclass(frozen=True, slots=True)
class TensorGeometry:
    """The meaning of one attached tensor's physical shape.

    ``num_heads`` is 1 for MLA. ``kv_parts`` is how many of K and V one block of the tensor
    holds (2 for blocks_first, else 1); a split tensor is two such tensors side by side.
    """

    arrangement: KVArrangement
    layout: Layout
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    itemsize: int

    @property
    def kv_parts(self) -> int:
        return 2 if self.arrangement == "blocks_first" else 1

    @property
    def row_bytes(self) -> int:
        """One head_dim row: the unit the post-process moves."""
        return self.head_dim * self.itemsize

    @property
    def rows_per_block(self) -> int:
        return self.kv_parts * self.block_size * self.num_heads

    @property
    def block_bytes(self) -> int:
        return self.rows_per_block * self.row_bytes

    @property
    def nbytes(self) -> int:
        halves = 2 if self.arrangement == "split" else 1
        return halves * self.num_blocks * self.block_bytes


def tensor_geometry(spec: TensorSpec, where: str = "tensor") -> TensorGeometry:
    """Check that ``spec.shape`` fits its arrangement, layout and block size.

    Raises ``GeometryError`` naming ``where`` and the field at fault.
    """
    if spec.layout is None or spec.kv_arrangement is None:
        raise GeometryError(f"{where}: give layout and kv_arrangement")
    return shape_geometry(
        spec.shape,
        dtype=spec.dtype,
        layout=spec.layout,
        kv_arrangement=spec.kv_arrangement,
        block_size=spec.block_size,
        where=where,
    )


def shape_geometry(
    shape: Sequence[int],
    *,
    dtype: DTypeName,
    layout: Layout,
    kv_arrangement: KVArrangement,
    block_size: int,
    where: str = "tensor",
) -> TensorGeometry:
    """``tensor_geometry`` for a shape and its description given field by field."""
    spec = _Fields(list(shape), dtype, layout, kv_arrangement, block_size)
    shape = spec.shape
    if any(d <= 0 for d in shape):
        raise GeometryError(f"{where}.shape: every dimension must be > 0, got {shape}")
    if spec.block_size <= 0:
        raise GeometryError(f"{where}.block_size: must be > 0, got {spec.block_size}")

    expected_dims = {"split": 5, "blocks_first": 5, "single": 4, "mla": 3}[spec.kv_arrangement]
    if len(shape) != expected_dims:
        raise GeometryError(
            f"{where}.shape: kv_arrangement {spec.kv_arrangement!r} needs {expected_dims} "
            f"dimensions ({_shape_hint(spec.kv_arrangement, spec.layout)}), got {shape}"
        )

    if spec.kv_arrangement == "mla":
        num_blocks, tokens, head_dim = shape
        num_heads = 1
    else:
        if spec.kv_arrangement == "split":
            kv, num_blocks, *block = shape
        elif spec.kv_arrangement == "blocks_first":
            num_blocks, kv, *block = shape
        else:
            kv = 2
            num_blocks, *block = shape
        if kv != 2:
            raise GeometryError(
                f"{where}.shape: kv_arrangement {spec.kv_arrangement!r} needs a K/V axis of 2 "
                f"({_shape_hint(spec.kv_arrangement, spec.layout)}), got {shape}"
            )
        if spec.layout == "NHD":
            tokens, num_heads, head_dim = block
        else:
            num_heads, tokens, head_dim = block

    if tokens != spec.block_size:
        raise GeometryError(
            f"{where}.block_size: {spec.block_size} does not match the token axis of shape "
            f"{shape} ({_shape_hint(spec.kv_arrangement, spec.layout)})"
        )
    return TensorGeometry(
        arrangement=spec.kv_arrangement,
        layout=spec.layout,
        num_blocks=num_blocks,
        block_size=spec.block_size,
        num_heads=num_heads,
        head_dim=head_dim,
        itemsize=ITEMSIZE[spec.dtype],
    )


@dataclass(frozen=True, slots=True)
class _Fields:
    shape: list[int]
    dtype: DTypeName
    layout: Layout
    kv_arrangement: KVArrangement
    block_size: int


def cache_geometry(specs: Sequence[TensorSpec]) -> list[TensorGeometry]:
    """Check every tensor of one cache; all must agree on num_blocks and block_size."""
    if not specs:
        raise GeometryError("tensors: a cache needs at least one tensor")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise GeometryError(f"tensors: names must be unique, repeated: {dup}")
    geometries = [tensor_geometry(s, f"tensors[{i}]") for i, s in enumerate(specs)]
    first = geometries[0]
    for i, g in enumerate(geometries[1:], start=1):
        if g.num_blocks != first.num_blocks:
            raise GeometryError(
                f"tensors[{i}].shape: num_blocks {g.num_blocks} differs from tensors[0] "
                f"({first.num_blocks}); block ids index every tensor of a cache"
            )
        if g.block_size != first.block_size:
            raise GeometryError(
                f"tensors[{i}].block_size: {g.block_size} differs from tensors[0] "
                f"({first.block_size})"
            )
    return geometries


def resolve_ratio(block_size: int, block_size_ratio: int, remote_block_size: int) -> int:
    """The block_size_ratio a notification asks for, checked against the local block size.

    Either value may be 0 ("not given"); at least one must be given, and both must agree.
    Raises ``ValueError`` with the reason.
    """
    if not remote_block_size and block_size_ratio >= 1 and block_size % block_size_ratio == 0:
        return block_size_ratio
    if block_size_ratio < 0:
        raise ValueError(f"block_size_ratio must be >= 1, got {block_size_ratio}")
    if remote_block_size < 0:
        raise ValueError(f"remote_block_size must be >= 1, got {remote_block_size}")
    if remote_block_size:
        if block_size % remote_block_size:
            raise ValueError(
                f"remote_block_size {remote_block_size} does not divide the local block size "
                f"{block_size}"
            )
        derived = block_size // remote_block_size
        if block_size_ratio and block_size_ratio != derived:
            raise ValueError(
                f"block_size_ratio {block_size_ratio} contradicts remote_block_size "
                f"{remote_block_size} (local block size {block_size} gives {derived})"
            )
        return derived
    if not block_size_ratio:
        raise ValueError("give block_size_ratio or remote_block_size (both are 0)")
    check_ratio(block_size, block_size_ratio)
    return block_size_ratio


def check_ratio(block_size: int, ratio: int) -> None:
    if ratio < 1:
        raise ValueError(f"block_size_ratio must be >= 1, got {ratio}")
    if block_size % ratio:
        raise ValueError(f"block_size_ratio {ratio} does not divide the block size {block_size}")


def out_of_range_ids(block_ids: Sequence[int], num_blocks: int) -> list[int]:
    """The ids outside [0, num_blocks), in the order given."""
    if not block_ids or (min(block_ids) >= 0 and max(block_ids) < num_blocks):
        return []
    return [b for b in block_ids if b < 0 or b >= num_blocks]


def duplicate_ids(block_ids: Sequence[int]) -> list[int]:
    """Every repeat of an id already seen, in the order given."""
    if len(set(block_ids)) == len(block_ids):
        return []
    seen: set[int] = set()
    repeats = []
    for b in block_ids:
        if b in seen:
            repeats.append(b)
        seen.add(b)
    return repeats


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
