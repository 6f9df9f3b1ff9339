"""An independent, obviously-correct statement of the post-process, for tests only.

It follows the definition of a page format (``kvd.protocol.PageFormat``'s docstring) element by
element with explicit loops, and DESIGN.md's landing rule (remote pages back to back, or one
remote page across several local pages), sharing no code with ``kvd.layout``:

- a page holds its ``outer`` axes, then its parts (K then V; one part when ``v`` is empty or
  for a ``regions="kv"`` format, whose V region is ordered by ``v`` when given, else ``k``),
  each row-major in its own order;
- group token ``t`` sits in local page ``t // nD`` at token ``t % nD``, and came from remote
  page ``t // nP`` at token ``t % nP``; the landed group is the remote pages back to back;
- tokens of remote pages at or past ``covered`` are zeros in the result.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvd.protocol import PageFormat


def region_page(fmt: PageFormat, kv: str) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """(outer axes, the order of each part) of the pages of region ``kv`` ("k" or "v")."""
    if fmt.regions == "kv":
        return (), [fmt.v if kv == "v" and fmt.v else fmt.k]
    return tuple(fmt.outer), [tuple(fmt.k)] + ([tuple(fmt.v)] if fmt.v else [])


def element_index(
    outer: tuple[str, ...],
    parts: list[tuple[str, ...]],
    size: dict[str, int],
    part: int,
    coords: dict[str, int],
) -> int:
    """Where (part, coords) sits in one page, in elements."""
    outer_index = 0
    for axis in outer:
        outer_index = outer_index * size[axis] + coords[axis]
    inner_index = 0
    for axis in parts[part]:
        inner_index = inner_index * size[axis] + coords[axis]
    part_elements = 1
    for axis in parts[part]:
        part_elements *= size[axis]
    return (outer_index * len(parts) + part) * part_elements + inner_index


def expected_group(
    landed: np.ndarray,
    *,
    remote: PageFormat,
    local: PageFormat,
    sizes: dict[str, int],
    remote_block_size: int,
    block_size: int,
    itemsize: int,
    covered: int = 0,
    kv: str = "k",
) -> np.ndarray:
    """The bytes one group of local pages must hold after the post-process.

    ``landed`` is the group's bytes as the READ left them (local pages end to end); ``sizes``
    gives L, H and C (N comes from the block sizes).
    """
    r_outer, r_parts = region_page(remote, kv)
    l_outer, l_parts = region_page(local, kv)
    axes = sorted(set(l_outer) | set(l_parts[0]))
    group_tokens = max(block_size, remote_block_size)
    local_size = {**sizes, "N": block_size}
    remote_size = {**sizes, "N": remote_block_size}
    local_page = len(l_parts) * math.prod(local_size[a] for a in axes)
    remote_page = len(r_parts) * math.prod(remote_size[a] for a in axes)
    out = np.full_like(landed, 0xAA)  # a byte no element was given stays visible
    others = [a for a in axes if a != "N"]
    # Every (coords, group token) at once: the index arithmetic is the same, elementwise.
    grid = np.meshgrid(
        *(np.arange(sizes[a]) for a in others), np.arange(group_tokens), indexing="ij"
    )
    coords = dict(zip(others, grid[:-1], strict=True))
    t = grid[-1]
    byte = np.arange(itemsize)
    for part in range(len(l_parts)):
        dst = (t // block_size) * local_page + element_index(
            l_outer, l_parts, local_size, part, {**coords, "N": t % block_size}
        )
        src = (t // remote_block_size) * remote_page + element_index(
            r_outer, r_parts, remote_size, part, {**coords, "N": t % remote_block_size}
        )
        dst_bytes = dst[..., None] * itemsize + byte
        src_bytes = src[..., None] * itemsize + byte
        values = landed[src_bytes]
        if covered:
            values = np.where((t // remote_block_size >= covered)[..., None], 0, values)
        out[dst_bytes] = values
    return out


def execute_runs(runs: np.ndarray, landed: np.ndarray, page_bytes: int) -> np.ndarray:
    """A plan's runs applied to one landed group, one run at a time (the tests' executor)."""
    out = landed.copy()
    for dst, page, offset, nbytes in runs.tolist():
        if page < 0:
            out[dst : dst + nbytes] = 0
        else:
            start = page * page_bytes + offset
            out[dst : dst + nbytes] = landed[start : start + nbytes]
    return out


def legacy_format(arrangement: str, layout: str) -> PageFormat:
    """The page of one region of a legacy tensor, spelled out here (not from kvd's presets)."""
    order = ("N", "H", "C") if layout == "NHD" else ("H", "N", "C")
    if arrangement == "blocks_first":
        return PageFormat(k=order, v=order)
    if arrangement == "mla":
        return PageFormat(k=("N", "C"))
    return PageFormat(k=order)  # one region of a split tensor, or a single one


def expected_block(
    block: torch.Tensor,
    *,
    kv_parts: int,
    block_size: int,
    heads: int,
    ratio: int,
    remote_layout: str,
    local_layout: str,
) -> torch.Tensor:
    """What one received legacy block (NHD/HND, one part or K then V) must hold afterwards."""
    arrangement = "blocks_first" if kv_parts == 2 else "single"
    raw = block.contiguous().view(torch.uint8).reshape(-1).numpy()
    itemsize = block.element_size()
    head_dim = raw.size // itemsize // (kv_parts * block_size * heads)
    out = expected_group(
        raw,
        remote=legacy_format(arrangement, remote_layout),
        local=legacy_format(arrangement, local_layout),
        sizes={"L": 1, "H": heads, "C": head_dim},
        remote_block_size=block_size // ratio,
        block_size=block_size,
        itemsize=itemsize,
    )
    return torch.from_numpy(out).view(block.dtype).view(block.shape)


def random_bytes(shape: list[int] | tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` with random bytes (any bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(*shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
