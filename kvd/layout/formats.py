"""Page formats as data: where element (K or V, layer, head, token, channel) of one block sits.

A ``PageFormat`` (the wire type, ``kvd.protocol``) orders the logical axes of a page, outermost
first: the ``outer`` axes, then the K part in ``k`` order, then the V part in ``v`` order. This
module names the common formats (``PRESETS``), checks a format, derives its properties, and
says where each element lands (``element_offset``, the definition the planner and the tests
are held to). Pure logic: no torch, no I/O.

Within one part the axes are row-major in their order; the parts of a page interleave under the
outer axes: element ``(part p, coords)`` of a page with ``m`` parts of ``S`` elements each sits
at ``flat(outer coords) * m * S + p * S + flat(part coords)``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

from kvd.protocol import Axis, FormatRef, KVArrangement, Layout, PageFormat

AXES: tuple[Axis, ...] = ("L", "H", "N", "C")

KV = Literal["k", "v"]
"""A K or V part; for a ``regions="kv"`` format, also which of its two regions."""


class FormatError(ValueError):
    """A page format that cannot describe a KV page; the message names the field."""


PRESETS: dict[str, PageFormat] = {
    # Today's split caches: a [2, num_blocks, ...] tensor, K pages then V pages.
    "NHD": PageFormat(k=("N", "H", "C"), regions="kv"),
    "HND": PageFormat(k=("H", "N", "C"), regions="kv"),
    # FlashInfer's [num_blocks, 2, ...]: each page its K part, then its V part.
    "blocks_first_NHD": PageFormat(k=("N", "H", "C"), v=("N", "H", "C")),
    "blocks_first_HND": PageFormat(k=("H", "N", "C"), v=("H", "N", "C")),
    # A K-only or V-only tensor.
    "single_NHD": PageFormat(k=("N", "H", "C")),
    "single_HND": PageFormat(k=("H", "N", "C")),
    "mla": PageFormat(k=("N", "C")),
    # vLLM's CPU attention, ISA "vec" (cpu_attn.py, cpu_attn_reshape_and_cache): the tensor is
    # [num_blocks, num_kv_heads, block_size, 2 * head_size] but per head K is stored transposed,
    # [head_size][block_size], followed by V as [block_size][head_size].
    "cpu_attn_vec": PageFormat(outer=("H",), k=("C", "N"), v=("N", "C")),
    # vLLM 0.32's KVCacheLayout (v1/kv_cache_layout.py): logical [L, B, H, N, content] permuted,
    # where content is K and V packed, head_size + head_size_v elements (kv_cache_interface.py
    # AttentionSpec.state_content_size_bytes; flashinfer.py splits it with split(head_size,
    # dim=-1)). So each (head, token) holds its K channels then its V channels. A layout with L
    # outside B is a per-layer tensor; B outermost makes one page hold every layer. kvd assumes
    # head_size_v == head_size.
    "LBHNC": PageFormat(outer=("H", "N"), k=("C",), v=("C",)),
    "LBNHC": PageFormat(outer=("N", "H"), k=("C",), v=("C",)),
    "LHBNC": PageFormat(outer=("N",), regions="head", k=("C",), v=("C",)),
    "BLHNC": PageFormat(outer=("L", "H", "N"), k=("C",), v=("C",)),
    "BLNHC": PageFormat(outer=("L", "N", "H"), k=("C",), v=("C",)),
    "BHLNC": PageFormat(outer=("H", "L", "N"), k=("C",), v=("C",)),
}

LAYOUTS: tuple[Layout, ...] = ("NHD", "HND")
KV_ARRANGEMENTS: tuple[KVArrangement, ...] = ("split", "blocks_first", "single", "mla")

_LEGACY: dict[tuple[KVArrangement, Layout], str] = {
    ("split", "NHD"): "NHD",
    ("split", "HND"): "HND",
    ("blocks_first", "NHD"): "blocks_first_NHD",
    ("blocks_first", "HND"): "blocks_first_HND",
    ("single", "NHD"): "single_NHD",
    ("single", "HND"): "single_HND",
    ("mla", "NHD"): "mla",
    ("mla", "HND"): "mla",
}


def check_layout(layout: Layout, where: str = "layout") -> Layout:
    """``layout`` when it is NHD or HND, else ``FormatError`` naming ``where`` (a description
    built in Python, not decoded, is not checked against ``Layout``)."""
    if layout not in LAYOUTS:
        raise FormatError(f"{where}: unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    return layout


def legacy_preset(kv_arrangement: KVArrangement, layout: Layout, where: str = "") -> str:
    """The name of the preset a legacy (``kv_arrangement``, ``layout``) description stands for.

    Raises ``FormatError`` naming the unknown field (under ``where``, e.g. ``tensors[0]``).
    """
    prefix = f"{where}." if where else ""
    if kv_arrangement not in KV_ARRANGEMENTS:
        raise FormatError(
            f"{prefix}kv_arrangement: unknown kv_arrangement {kv_arrangement!r}; known: "
            f"{', '.join(KV_ARRANGEMENTS)}"
        )
    return _LEGACY[(kv_arrangement, check_layout(layout, f"{prefix}layout"))]


def legacy_format(kv_arrangement: KVArrangement, layout: Layout, where: str = "") -> PageFormat:
    """The preset a legacy (``kv_arrangement``, ``layout``) description stands for; raises as
    ``legacy_preset``."""
    return PRESETS[legacy_preset(kv_arrangement, layout, where)]


def resolve(ref: FormatRef, where: str = "page_format") -> PageFormat:
    """The checked format ``ref`` names: a preset name or a ``PageFormat``.

    Raises ``FormatError`` naming ``where`` and the field at fault.
    """
    if isinstance(ref, str):
        preset = PRESETS.get(ref)
        if preset is None:
            raise FormatError(f"{where}: unknown preset {ref!r}; known: {', '.join(PRESETS)}")
        return preset
    problem = _problem(ref)
    if problem is not None:
        field, message = problem
        raise FormatError(f"{where}{field}: {message}")
    return ref


@functools.lru_cache(maxsize=256)
def _problem(fmt: PageFormat) -> tuple[str, str] | None:
    """(".field", what is wrong) for a format that cannot describe a page, else None."""
    if fmt.regions not in ("", "kv", "head"):
        return ".regions", f"must be '', 'kv' or 'head', got {fmt.regions!r}"
    tuples = {"outer": fmt.outer, "k": fmt.k, "v": fmt.v}
    for name, axes in tuples.items():
        for i, axis in enumerate(axes):
            if axis not in AXES:
                return f".{name}", f"unknown axis {axis!r} (axes are L, H, N, C)"
            if axis in axes[:i]:
                return f".{name}", f"axis {axis!r} appears twice"
    if not fmt.k:
        return ".k", "must name the axes of the K part (or of the page's only part)"
    if fmt.regions == "kv" and fmt.outer:
        return ".outer", "a page of regions 'kv' holds one part: outer must be empty"
    used: set[Axis] = set(fmt.outer) | set(fmt.k) | set(fmt.v)
    want: set[Axis] = {"N", "C"}
    if "L" in used:
        want.add("L")
    if fmt.regions == "head":
        if "H" in used:
            field = next(n for n, axes in tuples.items() if "H" in axes)
            return f".{field}", "axis 'H' cannot be in a page of regions 'head' (a region per head)"
    elif "H" in used or fmt.v or fmt.regions == "kv":
        want.add("H")  # only a one-part page of regions '' (MLA) may leave H out
    parts = ("k", "v") if fmt.v else ("k",)
    for name in parts:
        axes = fmt.k if name == "k" else fmt.v
        if fmt.regions != "kv":
            for axis in axes:
                if axis in fmt.outer:
                    return f".{name}", f"axis {axis!r} appears twice (also in outer)"
            axes = fmt.outer + axes
        missing = sorted(want - set(axes), key=AXES.index)
        if missing:
            return f".{name}", f"axes {missing} missing (every part holds {_names(want)})"
    return None


def _names(axes: set[Axis]) -> str:
    return ", ".join(a for a in AXES if a in axes)


@dataclass(frozen=True, slots=True)
class PageSizes:
    """The logical sizes of a page's axes, and the bytes of one element.

    ``num_layers`` counts only for a cross-layer format, ``num_heads`` only for one with heads
    (in the page, or as regions).
    """

    num_layers: int
    num_heads: int
    block_size: int
    head_dim: int
    itemsize: int

    def of(self, axis: Axis, block_size: int | None = None) -> int:
        """The size of ``axis``; ``block_size`` overrides N (a page of another block size)."""
        if axis == "N":
            return self.block_size if block_size is None else block_size
        return {"L": self.num_layers, "H": self.num_heads, "C": self.head_dim}[axis]


class PageLayout(NamedTuple):
    """One region's page, ready for offset arithmetic: outer axes, then each part's order."""

    outer: tuple[Axis, ...]
    parts: tuple[tuple[Axis, ...], ...]


def page_layout(fmt: PageFormat, kv: KV = "k") -> PageLayout:
    """The page of the ``kv`` region of a ``regions="kv"`` format, or of any region otherwise."""
    if fmt.regions == "kv":
        return PageLayout((), (fmt.v if kv == "v" and fmt.v else fmt.k,))
    return PageLayout(fmt.outer, (fmt.k, fmt.v) if fmt.v else (fmt.k,))


def axes(fmt: PageFormat) -> frozenset[Axis]:
    """The logical axes one page holds (not counting K/V)."""
    return frozenset(fmt.outer) | frozenset(fmt.k) | frozenset(fmt.v)


def parts(fmt: PageFormat) -> int:
    """How many of K and V one page holds: 2 for K-then-V pages, else 1."""
    return 2 if fmt.v and fmt.regions != "kv" else 1


def is_cross_layer(fmt: PageFormat) -> bool:
    """One page holds every layer of its block."""
    return "L" in axes(fmt)


def has_heads(fmt: PageFormat) -> bool:
    """The format has KV heads: in its pages, or as its regions. False for MLA."""
    return fmt.regions == "head" or "H" in axes(fmt)


def head_slices_are_pages(fmt: PageFormat) -> bool:
    """Whether the bytes of any run of consecutive heads of a page are one contiguous range that
    is itself a page of ``fmt`` with that many heads: H is the outermost axis of the page (of
    each region's page for ``regions="kv"``), and no layer axis interleaves outside it.

    A READ that moves a byte range of a page per TP rank (vLLM's heterogeneous TP) lands pages
    of ``fmt`` only then.
    """
    if fmt.regions == "head" or "L" in axes(fmt):
        return False
    if fmt.outer:
        return fmt.outer[0] == "H"
    if fmt.v and fmt.regions != "kv":
        return False  # K of every head, then V of every head
    return fmt.k[0] == "H" and (not fmt.v or fmt.v[0] == "H")


def num_regions(fmt: PageFormat, num_heads: int) -> int:
    """How many regions of ``num_blocks`` pages a tensor of ``fmt`` holds."""
    return {"": 1, "kv": 2, "head": num_heads}[fmt.regions]


def page_elements(fmt: PageFormat, sizes: PageSizes, block_size: int | None = None) -> int:
    """Elements of one page (of ``block_size`` tokens, by default ``sizes.block_size``)."""
    return parts(fmt) * math.prod(sizes.of(a, block_size) for a in axes(fmt))


def page_bytes(fmt: PageFormat, sizes: PageSizes, block_size: int | None = None) -> int:
    """Bytes of one page (of ``block_size`` tokens, by default ``sizes.block_size``)."""
    return page_elements(fmt, sizes, block_size) * sizes.itemsize


def element_offset(
    fmt: PageFormat,
    sizes: PageSizes,
    *,
    kv: KV,
    layer: int = 0,
    head: int = 0,
    token: int,
    channel: int,
) -> tuple[int, int]:
    """(region, element offset inside the page) of one element, from the format's definition.

    ``kv`` is the part ("k" or "v"); a one-part page holds its part whatever ``kv`` says.
    """
    region = {"": 0, "kv": 0 if kv == "k" else 1, "head": head}[fmt.regions]
    layout = page_layout(fmt, kv)
    part = 1 if kv == "v" and len(layout.parts) == 2 else 0
    coords: dict[Axis, int] = {"L": layer, "H": head, "N": token, "C": channel}

    def flat(order: tuple[Axis, ...]) -> int:
        index = 0
        for axis in order:
            index = index * sizes.of(axis) + coords[axis]
        return index

    part_size = math.prod(sizes.of(a) for a in layout.parts[part])
    return region, (flat(layout.outer) * len(layout.parts) + part) * part_size + flat(
        layout.parts[part]
    )


def heads_tokens_order(fmt: PageFormat) -> Layout:
    """Whether H comes before N ("HND") or after ("NHD") in ``fmt``.

    Raises ``FormatError`` when the format has no H axis in its pages, or H and N are not
    ordered alike everywhere (in different tuples, or one way in K and the other in V).
    """
    if "H" not in axes(fmt):
        raise FormatError("the format has no H axis in its pages: it has no NHD/HND order")
    orders = set()
    for axes_ in (fmt.outer, fmt.k, fmt.v):
        has_h, has_n = "H" in axes_, "N" in axes_
        if has_h != has_n:
            raise FormatError(f"H and N sit in different parts of {fmt}: no NHD/HND order")
        if has_h:
            orders.add("HND" if axes_.index("H") < axes_.index("N") else "NHD")
    if len(orders) != 1:
        raise FormatError(f"K and V order H and N differently in {fmt}: no NHD/HND order")
    return "HND" if orders == {"HND"} else "NHD"


def legacy_remote_format(
    local: PageFormat, remote_layout: Layout, where: str = "remote_layout"
) -> PageFormat:
    """The remote format a legacy ``remote_layout`` means: ``local`` with the remote's H/N order.

    Raises ``FormatError`` for a layout other than NHD and HND (naming ``where``), or when
    ``local`` has no H axis in its pages or no defined H/N order.
    """
    check_layout(remote_layout, where)
    if heads_tokens_order(local) == remote_layout:
        return local
    swap: dict[Axis, Axis] = {"H": "N", "N": "H", "L": "L", "C": "C"}
    return PageFormat(
        k=tuple(swap[a] for a in local.k),
        v=tuple(swap[a] for a in local.v),
        outer=tuple(swap[a] for a in local.outer),
        regions=local.regions,
    )
