"""Attached KV caches: the only references kvd holds to engine memory, by cache id.

Registration only: ``attach.py`` opens an Attach's memory off the event loop; ``add`` makes the
cache visible on the loop, atomically with respect to ingest, after checking that none of its
bytes is already reachable through another attached tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvd.daemon.memory import AttachError, SharedSegment, Span
from kvd.geometry import TensorGeometry
from kvd.postprocess import BlockRows, Group, plan_groups
from kvd.protocol import Reason, TensorSpec


@dataclass(slots=True)
class AttachedTensor:
    spec: TensorSpec
    geometry: TensorGeometry
    tensor: torch.Tensor
    """The engine's tensor in its physical shape and dtype."""
    span: Span


@dataclass(frozen=True, slots=True)
class Owner:
    """Who attached a cache: the control connection's routing id, and the engine's id."""

    routing_id: bytes
    engine_id: str


@dataclass(slots=True)
class AttachedCache:
    cache_id: str
    tensors: list[AttachedTensor]
    num_blocks: int
    block_size: int
    device: torch.device
    owner: Owner
    segments: list[tuple[SharedSegment, int]] = field(default_factory=list)
    """Each shared-memory segment and the end of the bytes the cache uses in it."""
    views: list[BlockRows] = field(default_factory=list)
    """What the post-process works on: raw row views, two per split tensor, none for MLA."""
    lost: str | None = None
    """Why the cache's memory can no longer be touched (set once; requests then fail)."""
    _groups: dict[tuple[int, str], list[Group]] = field(default_factory=dict)

    def groups(self, ratio: int, remote_layout: str) -> list[Group]:
        """The kernel calls a request under (ratio, remote_layout) needs; [] = no work.

        Memoised per cache, so requests reuse the prepared launches.
        """
        key = (ratio, remote_layout)
        known = self._groups.get(key)
        if known is None:
            known = self._groups[key] = plan_groups(
                self.views, ratio=ratio, remote_layout=remote_layout
            )
        return known

    def needs_work(self, ratio: int, remote_layout: str) -> bool:
        return bool(self.groups(ratio, remote_layout))

    def memory_problem(self) -> str | None:
        """Why the cache's memory cannot be touched now (a segment shrank), or None."""
        for segment, end in self.segments:
            problem = segment.shrank(end)
            if problem:
                return problem
        return None

    def close(self) -> None:
        for segment, _ in self.segments:
            segment.close()

    @property
    def nbytes(self) -> int:
        return sum(t.geometry.nbytes for t in self.tensors)

    @property
    def work_bytes(self) -> int:
        """Bytes of one block id across every view the post-process rewrites."""
        return sum(v.rows.shape[1] * v.rows.shape[2] * v.rows.element_size() for v in self.views)


class Registry:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._caches: dict[str, AttachedCache] = {}

    def get(self, cache_id: str) -> AttachedCache | None:
        return self._caches.get(cache_id)

    def __contains__(self, cache_id: str) -> bool:
        return cache_id in self._caches

    def __len__(self) -> int:
        return len(self._caches)

    def caches(self) -> list[AttachedCache]:
        return list(self._caches.values())

    def add(self, cache: AttachedCache) -> None:
        """Register ``cache``; refuses a known id and memory that another tensor reaches."""
        if cache.cache_id in self._caches:
            raise AttachError(Reason.CACHE_EXISTS, f"cache {cache.cache_id!r} is already attached")
        problem = self.overlap(cache)
        if problem:
            raise AttachError(Reason.INVALID_CACHE, problem)
        self._caches[cache.cache_id] = cache

    def overlap(self, cache: AttachedCache) -> str | None:
        """Why some byte of ``cache`` is reachable twice (within it or through another cache)."""
        seen: list[tuple[str, str, Span]] = [
            (other.cache_id, t.spec.name, t.span)
            for other in self._caches.values()
            for t in other.tensors
        ]
        for i, t in enumerate(cache.tensors):
            for owner, name, span in seen:
                if t.span.overlaps(span):
                    where = (
                        "another tensor of this Attach"
                        if owner == cache.cache_id
                        else (f"cache {owner!r}")
                    )
                    return (
                        f"tensors[{i}].memory: bytes {t.span.start}..{t.span.end} overlap "
                        f"{name!r} of {where} (bytes {span.start}..{span.end}); kvd would "
                        "rewrite them twice"
                    )
            seen.append((cache.cache_id, t.spec.name, t.span))
        return None

    def remove(self, cache_id: str) -> AttachedCache:
        cache = self._caches.pop(cache_id)
        cache.close()
        return cache
