"""Attached KV caches: the only references kvd holds to engine memory, by cache id.

Registration only: ``attach.py`` opens an Attach's memory off the event loop; ``add`` makes the
cache visible on the loop, atomically with respect to ingest, after checking that none of its
bytes is already reachable through another attached tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvd.daemon.ledger import RemoteFormat
from kvd.daemon.memory import AttachError, SharedSegment, Span
from kvd.daemon.peers import Connection
from kvd.daemon.routes import Rejection, Rewrite, Route, RouteKey, remember
from kvd.layout.formats import has_heads, legacy_remote_format
from kvd.layout.geometry import TensorGeometry
from kvd.protocol import PageFormat, Reason, TensorSpec

if TYPE_CHECKING:  # loaded by the first Attach (attach.py), after READY
    import torch

    from kvd.kernels.postprocess import CachePostProcess


@dataclass(slots=True)
class AttachedTensor:
    spec: TensorSpec
    geometry: TensorGeometry
    tensor: torch.Tensor
    """The engine's tensor in its physical shape and dtype."""
    span: Span


@dataclass(frozen=True, slots=True)
class Owner:
    """Who attached a cache: the control connection's routing id, the engine's id, and the
    connection itself (None when it cannot be told, e.g. a frame without a descriptor)."""

    routing_id: bytes
    engine_id: str
    connection: Connection | None = None


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
    postprocesses: dict[PageFormat, CachePostProcess] = field(default_factory=dict)
    """The post-process of the cache's tensors, one per local page format."""
    lost: str | None = None
    """Why the cache's memory can no longer be touched (set once; requests then fail)."""
    detaching: str | None = None
    """Why the cache is being detached: new notifications are refused, those in flight end."""
    routes: dict[RouteKey, Route | Rejection] = field(default_factory=dict)
    """Each remote side seen, decided once (``validate.route``); at most ``ROUTES_PER_CACHE``."""
    _rewrites: dict[tuple[RemoteFormat, int, int], list[Rewrite]] = field(default_factory=dict)
    work_bytes: int = field(init=False)
    """Bytes one block id stands for across every region of the cache (read at each launch)."""

    def __post_init__(self) -> None:
        self.work_bytes = sum(p.block_bytes for p in self.postprocesses.values())

    def rewrites(
        self, remote: RemoteFormat, remote_block_size: int, remote_ranks: int = 1
    ) -> list[Rewrite]:
        """The kernel passes of a batch from ``remote`` at ``remote_block_size`` tokens, landed
        from ``remote_ranks`` ranks (``ReadDone.remote_ranks``).

        Cheap and memoised (plans are built by the executor, on first use): safe on the loop.
        Raises ``FormatError`` when the remote format cannot land in a local one.
        """
        key = (remote, remote_block_size, remote_ranks)
        known = self._rewrites.get(key)
        if known is None:
            known = [
                Rewrite(postprocess, _remote_for(local, remote), remote_block_size, remote_ranks)
                for local, postprocess in self.postprocesses.items()
            ]
            for rewrite in known:  # the format pair is checked now, not on the executor
                rewrite.needs_work(0, 0)
            remember(self._rewrites, key, known)
        return known

    def memory_problem(self) -> str | None:
        """Why the cache's memory cannot be touched now (a segment shrank, or has holes), or
        None."""
        for segment, end in self.segments:
            problem = segment.unusable(end)
            if problem:
                return problem
        return None

    def close(self) -> None:
        for segment, _ in self.segments:
            segment.close()

    @property
    def nbytes(self) -> int:
        return sum(t.geometry.nbytes for t in self.tensors)


def _remote_for(local: PageFormat, remote: RemoteFormat) -> PageFormat:
    """The remote page format of ``local``'s tensors: given, or the legacy order applied."""
    if isinstance(remote, PageFormat):
        return remote
    if not has_heads(local):
        return local  # an MLA latent has no head/token order to swap
    return legacy_remote_format(local, remote)


class Registry:
    def __init__(self, device: str) -> None:
        self.device = device
        """The daemon's device, ``'cpu'`` or ``'cuda:N'`` (``server.parse_device``)."""
        self._caches: dict[str, AttachedCache] = {}
        self.get: Callable[[str], AttachedCache | None] = self._caches.get
        """The attached cache of an id, or None (the dict's own method: a hot path)."""

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
        """Why some byte of ``cache`` is reachable twice (within it or through another cache).

        O(n log n) in the tensors attached, this one's included: spans sorted by backing and
        start, each checked against the one before it that reaches furthest. Attached caches
        never overlap each other, so any overlap found involves ``cache``.
        """
        # (span, tensor index in this Attach or -1, owner, name)
        spans = [
            (t.span, -1, other.cache_id, t.spec.name)
            for other in self._caches.values()
            for t in other.tensors
        ]
        spans += [(t.span, i, cache.cache_id, t.spec.name) for i, t in enumerate(cache.tensors)]
        spans.sort(key=lambda s: (s[0].backing, s[0].start))
        furthest = spans[0] if spans else None
        for entry in spans[1:]:
            assert furthest is not None
            if entry[0].overlaps(furthest[0]):
                ours, theirs = sorted((entry, furthest), key=lambda s: s[1], reverse=True)
                span, i, _, _ = ours
                other, _, owner, name = theirs
                where = "another tensor of this Attach" if theirs[1] >= 0 else f"cache {owner!r}"
                return (
                    f"tensors[{i}].memory: bytes {span.start}..{span.end} overlap {name!r} of "
                    f"{where} (bytes {other.start}..{other.end}); kvd would rewrite them twice"
                )
            if entry[0].backing != furthest[0].backing or entry[0].end > furthest[0].end:
                furthest = entry
        return None

    def remove(self, cache_id: str) -> AttachedCache:
        cache = self._caches.pop(cache_id)
        cache.close()
        return cache
