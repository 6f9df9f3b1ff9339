"""Hypothesis strategies: random valid page-format pairs with small sizes and block sizes."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from kvd.protocol import PageFormat


@dataclass(frozen=True)
class Case:
    """One random post-process: two formats of the same elements, sizes, block sizes."""

    remote: PageFormat
    local: PageFormat
    sizes: dict[str, int]  # L, H, C
    block_size: int  # nD
    remote_block_size: int  # nP
    itemsize: int
    covered: int  # remote pages landed in the group (0: all)
    kv: str  # which region of a regions="kv" format

    @property
    def pages_per_group(self) -> int:
        return max(1, self.remote_block_size // self.block_size)

    @property
    def remote_pages(self) -> int:
        return max(1, self.block_size // self.remote_block_size)


@st.composite
def formats(draw: st.DrawFn, regions: str, axes: tuple[str, ...], two_parts: bool) -> PageFormat:
    """A random format over ``axes``: any order, any split between outer and the parts."""
    order = tuple(draw(st.permutations(axes)))
    if regions == "kv":
        v = tuple(draw(st.permutations(axes))) if draw(st.booleans()) else ()
        return PageFormat(k=order, v=v, regions="kv")
    n_outer = draw(st.integers(0, len(axes) - 1))
    outer, inner = order[:n_outer], order[n_outer:]
    if not two_parts:
        return PageFormat(outer=outer, k=inner, regions=regions)
    k = tuple(draw(st.permutations(inner)))
    v = tuple(draw(st.permutations(inner)))
    return PageFormat(outer=outer, k=k, v=v, regions=regions)


@st.composite
def cases(draw: st.DrawFn, max_chunk: int = 3, max_ratio: int = 4) -> Case:
    regions = draw(st.sampled_from(["", "kv", "head"]))
    cross_layer = draw(st.booleans())
    mla = regions == "" and draw(st.integers(0, 4)) == 0
    two_parts = regions != "kv" and not mla and draw(st.booleans())
    axes = (
        ("N", "C")
        + (("H",) if regions != "head" and not mla else ())
        + (("L",) if cross_layer else ())
    )
    remote = draw(formats(regions, axes, two_parts))
    local = draw(formats(regions, axes, two_parts))
    chunk = draw(st.integers(1, max_chunk))
    ratio = draw(st.integers(1, max_ratio))
    if draw(st.booleans()):
        block_size, remote_block_size = chunk * ratio, chunk
    else:
        block_size, remote_block_size = chunk, chunk * ratio
    covered = 0
    if remote_block_size < block_size and draw(st.booleans()):
        covered = draw(st.integers(1, ratio - 1))
    return Case(
        remote=remote,
        local=local,
        sizes={
            "L": draw(st.integers(1, 3)) if cross_layer else 1,
            "H": draw(st.integers(1, 3)),
            "C": draw(st.integers(1, 4)),
        },
        block_size=block_size,
        remote_block_size=remote_block_size,
        itemsize=draw(st.sampled_from([1, 2, 4])),
        covered=covered,
        kv=draw(st.sampled_from(["k", "v"])),
    )
