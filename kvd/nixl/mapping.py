"""Where each block's bytes are, and which remote block lands where: pure logic, no NIXL.

A cache tensor is one or two *regions* of ``num_blocks`` equal blocks: a split tensor
``(2, num_blocks, ...)`` has a K region then a V region, every other arrangement has one region
whose blocks hold everything of that block (both K and V for blocks-first). A NIXL descriptor
moves one contiguous piece of one region.

A remote block of ``nP`` tokens and a local one of ``nD`` make a *group*
(``kvd.layout.geometry.group_shape``), and the mapping goes both ways:

- ``nP <= nD``, ``block_size_ratio`` r = nD / nP: remote blocks ``r*j .. r*j+r-1`` of a request
  land back to back in its local block ``j``: sub-block ``s`` of a local block starts
  ``s * local_block_len / r`` bytes in. The last local block of a request may be partly filled
  (fewer than r remote blocks left). The local descriptors are sub-blocks, the remote ones
  whole blocks.
- ``nP > nD``, ``chunks`` k = nP / nD: remote block ``i`` of a request lands across its local
  blocks ``k*i .. k*i+k-1``, chunk ``j`` (bytes ``[j * remote_block_len / k, ...)``) of each
  region in the ``j``-th of them. The request lists exactly k local blocks per remote block.
  The remote descriptors are chunks, the local ones whole blocks.

Either way a descriptor is as long as the smaller of the two blocks: a READ of ``n`` remote
blocks is ``n`` descriptors per region at ratio r, ``n * k`` (one per local block) at chunks k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvd.layout.geometry import (
    BlockIdError,
    BlockIds,
    TensorGeometry,
    block_id_list,
    check_block_ids,
)

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


def remote_descriptors(
    regions: Sequence[Region], device_id: int = 0, chunks: int = 1
) -> DescriptorArray:
    """One row (addr, len, device_id) per (region, block, chunk) for ``chunks`` chunks per
    block: row ``(k * num_blocks + i) * chunks + j`` is chunk ``j`` of block ``i`` of region
    ``k`` (with ``chunks`` 1, row ``k * num_blocks + i`` is the whole block)."""
    return _split_blocks(regions, chunks, device_id, "chunks", "remote")


def local_descriptors(regions: Sequence[Region], ratio: int, device_id: int = 0) -> DescriptorArray:
    """One row (addr, len, device_id) per (region, block, sub-block) for ``ratio`` sub-blocks per
    block: row ``(k * num_blocks + j) * ratio + s`` is sub-block ``s`` of block ``j`` of region
    ``k``."""
    return _split_blocks(regions, ratio, device_id, "block_size_ratio", "local")


def _split_blocks(
    regions: Sequence[Region], parts: int, device_id: int, name: str, side: str
) -> DescriptorArray:
    if parts < 1:
        raise MappingError(f"{name} must be >= 1, got {parts}")
    rows = []
    for r in regions:
        if r.block_len % parts:
            raise MappingError(
                f"{name} {parts} does not divide the {side} block length {r.block_len}"
            )
        part = r.block_len // parts
        starts = r.addr + np.arange(r.num_blocks * parts, dtype=np.int64) * part
        rows.append(_rows(starts, part, device_id))
    return np.concatenate(rows)


def _rows(starts: npt.NDArray[np.int64], length: int, device_id: int) -> DescriptorArray:
    out = np.empty((len(starts), 3), dtype=np.int64)
    out[:, 0] = starts
    out[:, 1] = length
    out[:, 2] = device_id
    return out


def local_blocks_needed(num_remote_blocks: int, ratio: int = 1, chunks: int = 1) -> int:
    """Local blocks that ``num_remote_blocks`` remote blocks fill: at ``block_size_ratio``
    ``ratio``, ``ceil(n / ratio)`` (the last may be partial); split in ``chunks``, ``n * chunks``.
    """
    return -(-num_remote_blocks // ratio) * chunks


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """The descriptor indices of one request's READ, local and remote side by side."""

    local: IndexArray
    remote: IndexArray

    @property
    def num_descriptors(self) -> int:
        return len(self.local)


def plan_read(
    remote_block_ids: BlockIds,
    local_block_ids: BlockIds,
    *,
    ratio: int = 1,
    chunks: int = 1,
    num_regions: int,
    remote_num_blocks: int,
    local_num_blocks: int,
) -> ReadPlan:
    """Map a request's remote blocks onto its local blocks, as descriptor indices.

    With ``ratio`` r (``nP <= nD``), remote block ``i`` of the request goes to sub-block
    ``i % r`` of local block ``local_block_ids[i // r]``: indices into ``local_descriptors(...,
    r)`` and ``remote_descriptors(..., chunks=1)``. With ``chunks`` k (``nP > nD``), chunk ``j``
    of remote block ``i`` goes to local block ``local_block_ids[k*i + j]``: indices into
    ``local_descriptors(..., 1)`` and ``remote_descriptors(..., chunks=k)``. At most one of the
    two may exceed 1. Every region alike. Raises ``MappingError`` when the lists do not fit:
    ids not of a ``BlockIds`` kind, wrong local count for the remote count, ids out of range,
    or repeated ids.
    """
    try:
        remote_block_ids = block_id_list(remote_block_ids, "remote_block_ids")
        local_block_ids = block_id_list(local_block_ids, "local_block_ids")
    except BlockIdError as e:
        raise MappingError(str(e)) from None
    if ratio < 1:
        raise MappingError(f"block_size_ratio must be >= 1, got {ratio}")
    if chunks < 1:
        raise MappingError(f"chunks must be >= 1, got {chunks}")
    if ratio > 1 and chunks > 1:
        raise MappingError(
            f"block_size_ratio {ratio} and chunks {chunks}: a remote block is either smaller "
            "than a local one or larger, not both"
        )
    if not remote_block_ids:
        raise MappingError("remote_block_ids: a read needs at least one block")
    needed = local_blocks_needed(len(remote_block_ids), ratio, chunks)
    if len(local_block_ids) != needed:
        how = (
            f"split in {chunks} chunks fill {chunks} local blocks each, {needed} in all"
            if chunks > 1
            else f"at block_size_ratio {ratio} fill {needed} local blocks"
        )
        raise MappingError(
            f"local_block_ids: {len(remote_block_ids)} remote blocks {how}, "
            f"got {len(local_block_ids)}"
        )
    for field, ids, limit in (
        ("remote_block_ids", remote_block_ids, remote_num_blocks),
        ("local_block_ids", local_block_ids, local_num_blocks),
    ):
        if problem := check_block_ids(ids, limit):
            raise MappingError(f"{field}: {problem}")

    region = np.arange(num_regions, dtype=np.int64)[:, None]
    local = np.asarray(local_block_ids, dtype=np.int64)
    remote = np.asarray(remote_block_ids, dtype=np.int64)
    if chunks > 1:
        # One descriptor per local block: local position p holds chunk p % k of remote p // k.
        position = np.arange(len(local), dtype=np.int64)
        local_idx = region * local_num_blocks + local
        remote_idx = (region * remote_num_blocks + remote[position // chunks]) * chunks + (
            position % chunks
        )
    else:
        position = np.arange(len(remote), dtype=np.int64)
        local_block = local[position // ratio]
        local_idx = (region * local_num_blocks + local_block) * ratio + position % ratio
        remote_idx = region * remote_num_blocks + remote
    return ReadPlan(
        local=local_idx.reshape(-1).astype(np.int32),
        remote=remote_idx.reshape(-1).astype(np.int32),
    )
