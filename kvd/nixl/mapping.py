"""Where each block's bytes are, and which remote block lands where: pure logic, no NIXL.

A cache tensor is one or two *regions* of ``num_blocks`` equal blocks: a split tensor
``(2, num_blocks, ...)`` has a K region then a V region, every other arrangement has one region
whose blocks hold everything of that block (both K and V for blocks-first). A NIXL descriptor
moves one block of one region, so a READ of ``n`` remote blocks is ``n`` descriptors per region.

For ``block_size_ratio`` r, remote blocks ``r*j .. r*j+r-1`` of a request land back to back in its
local block ``j``: sub-block ``s`` of a local block starts ``s * local_block_len / r`` bytes in.
The last local block of a request may be partly filled (fewer than r remote blocks left).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvd.layout.geometry import TensorGeometry, check_block_ids

IndexArray = npt.NDArray[np.int32]
DescriptorArray = npt.NDArray[np.int64]
"""Rows of (address, length, device id), the form ``nixl_agent.prep_xfer_dlist`` takes."""


class MappingError(ValueError):
    """A request whose block lists cannot be read; the message names the field."""


@dataclass(frozen=True, slots=True)
class Region:
    """``num_blocks`` blocks of ``block_len`` bytes each, starting at ``addr``."""

    addr: int
    block_len: int
    num_blocks: int


def tensor_regions(base_addr: int, geometry: TensorGeometry) -> list[Region]:
    """The regions of one tensor that starts at ``base_addr`` (2 for a split tensor, one per
    head for a format with head regions, else 1)."""
    return [
        Region(base_addr + i * geometry.region_stride, geometry.page_bytes, geometry.num_blocks)
        for i in range(geometry.num_regions)
    ]


def remote_descriptors(regions: Sequence[Region], device_id: int = 0) -> DescriptorArray:
    """One row (addr, len, device_id) per (region, block): row ``k * num_blocks + i`` is block
    ``i`` of region ``k``."""
    rows = [
        _rows(
            r.addr + np.arange(r.num_blocks, dtype=np.int64) * r.block_len, r.block_len, device_id
        )
        for r in regions
    ]
    return np.concatenate(rows)


def local_descriptors(regions: Sequence[Region], ratio: int, device_id: int = 0) -> DescriptorArray:
    """One row (addr, len, device_id) per (region, block, sub-block) for ``ratio`` sub-blocks per
    block: row ``(k * num_blocks + j) * ratio + s`` is sub-block ``s`` of block ``j`` of region
    ``k``."""
    rows = []
    for r in regions:
        if r.block_len % ratio:
            raise MappingError(
                f"block_size_ratio {ratio} does not divide the local block length {r.block_len}"
            )
        sub = r.block_len // ratio
        starts = r.addr + np.arange(r.num_blocks * ratio, dtype=np.int64) * sub
        rows.append(_rows(starts, sub, device_id))
    return np.concatenate(rows)


def _rows(starts: npt.NDArray[np.int64], length: int, device_id: int) -> DescriptorArray:
    out = np.empty((len(starts), 3), dtype=np.int64)
    out[:, 0] = starts
    out[:, 1] = length
    out[:, 2] = device_id
    return out


def local_blocks_needed(num_remote_blocks: int, ratio: int) -> int:
    """Local blocks that ``num_remote_blocks`` remote blocks fill (the last may be partial)."""
    return -(-num_remote_blocks // ratio)


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """The descriptor indices of one request's READ, local and remote side by side."""

    local: IndexArray
    remote: IndexArray

    @property
    def num_descriptors(self) -> int:
        return len(self.local)


def plan_read(
    remote_block_ids: Sequence[int],
    local_block_ids: Sequence[int],
    *,
    ratio: int,
    num_regions: int,
    remote_num_blocks: int,
    local_num_blocks: int,
) -> ReadPlan:
    """Map a request's remote blocks onto its local blocks, as descriptor indices.

    Remote block ``i`` of the request goes to sub-block ``i % ratio`` of local block
    ``local_block_ids[i // ratio]``, in every region. Raises ``MappingError`` when the lists do
    not fit: wrong local count for the remote count, ids out of range, or repeated ids.
    """
    if ratio < 1:
        raise MappingError(f"block_size_ratio must be >= 1, got {ratio}")
    if not remote_block_ids:
        raise MappingError("remote_block_ids: a read needs at least one block")
    needed = local_blocks_needed(len(remote_block_ids), ratio)
    if len(local_block_ids) != needed:
        raise MappingError(
            f"local_block_ids: {len(remote_block_ids)} remote blocks at block_size_ratio "
            f"{ratio} fill {needed} local blocks, got {len(local_block_ids)}"
        )
    for field, ids, limit in (
        ("remote_block_ids", remote_block_ids, remote_num_blocks),
        ("local_block_ids", local_block_ids, local_num_blocks),
    ):
        if problem := check_block_ids(ids, limit):
            raise MappingError(f"{field}: {problem}")

    remote = np.asarray(remote_block_ids, dtype=np.int64)
    position = np.arange(len(remote), dtype=np.int64)
    local_block = np.asarray(local_block_ids, dtype=np.int64)[position // ratio]
    region = np.arange(num_regions, dtype=np.int64)[:, None]
    local_idx = (region * local_num_blocks + local_block) * ratio + position % ratio
    remote_idx = region * remote_num_blocks + remote
    return ReadPlan(
        local=local_idx.reshape(-1).astype(np.int32),
        remote=remote_idx.reshape(-1).astype(np.int32),
    )
