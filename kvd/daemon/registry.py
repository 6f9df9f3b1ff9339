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
    postprocesses: dict[tuple[int, PageFormat], CachePostProcess] = field(default_factory=dict)
    """The post-process of the cache's tensors, one per (group, local page format)."""
    group_block_sizes: list[int] = field(default_factory=list)
    """The block size of each group (``TensorSpec.group``); ``block_size`` is group 0's."""
    lost: str | None = None
    """Why the cache's memory can no longer be touched (set once; requests then fail)."""
    detaching: str | None = None
    """Why the cache is being detached: new notifications are refused, those in flight end."""
    routes: dict[RouteKey, Route | Rejection] = field(default_factory=dict)
    """Each remote side seen, decided once (``validate.route``); at most ``ROUTES_PER_CACHE``."""
    _rewrites: dict[tuple[RemoteFormat, int, int], list[Rewrite]] = field(default_factory=dict)
    work_bytes: int = field(init=False)
    """Bytes one block id stands for across every region of its group, the largest group's
    (read at each launch)."""

    def __post_init__(self) -> None:
        if not self.group_block_sizes:
            self.group_block_sizes = [self.block_size]
        per_group = [0] * len(self.group_block_sizes)
        for (group, _), postprocess in self.postprocesses.items():
            per_group[group] += postprocess.block_bytes
        self.work_bytes = max(per_group)

    @property
    def num_groups(self) -> int:
        """Groups attached apart (``TensorSpec.group``); 1 for the usual cache."""
        return len(self.group_block_sizes)

    def rewrites(
        self, remote: RemoteFormat, remote_block_size: int, remote_ranks: int = 1
    ) -> list[Rewrite]:
        """The kernel passes of a batch from ``remote`` at ``remote_block_size`` tokens (group
        0's; ``group_remote_block_size``), landed from ``remote_ranks`` ranks
        (``ReadDone.remote_ranks``).

        Cheap and memoised (plans are built by the executor, on first use): safe on the loop.
        Raises ``FormatError`` when the remote format cannot land in a local one, ``ValueError``
        when a group's remote block size is not whole (``validate.route`` checks it first).
        """
        key = (remote, remote_block_size, remote_ranks)
        known = self._rewrites.get(key)
        if known is None:
            grouped = self.num_groups > 1
            known = [
                Rewrite(
                    postprocess,
                    _remote_for(local, remote),
                    self.group_remote_block_size(group, remote_block_size),
                    remote_ranks,
                    group if grouped else -1,
                )
                for (group, local), postprocess in self.postprocesses.items()
            ]
            for rewrite in known:  # the format pair is checked now, not on the executor
                rewrite.needs_work(0, 0)
            remember(self._rewrites, key, known)
        return known

    def group_remote_block_size(self, group: int, remote_block_size: int) -> int:
        """Group ``group``'s remote block size, in proportion to group 0's."""
        scaled, rest = divmod(remote_block_size * self.group_block_sizes[group], self.block_size)
        if rest:
            raise ValueError(
                f"remote_block_size: {remote_block_size} tokens to group 0's {self.block_size} "
                f"leaves group {group} (blocks of {self.group_block_sizes[group]}) no whole "
                "remote block size"
            )
        return scaled

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
        """Bytes of the cache's memory, each counted once (groups may view the same bytes)."""
        spans = {t.span: t.geometry.nbytes for t in self.tensors}
        return sum(spans.values())


def _group_views(
    a: tuple[Span, int, str, AttachedTensor], b: tuple[Span, int, str, AttachedTensor]
) -> bool:
    """Whether spans ``a`` and ``b`` are two groups' views of the same blocks of one cache:
    tensors of different groups over the same bytes, blocks outermost (block ``n`` of each is
    the same bytes: a cache's num_blocks agree)."""
    first, second = a[3], b[3]
    return (
        a[2] == b[2]
        and a[0] == b[0]
        and first.spec.group != second.spec.group
        and first.geometry.num_regions == 1
        and second.geometry.num_regions == 1
    )


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
        never overlap each other, so any overlap found involves ``cache``. Two of its tensors
        of different groups may view the same bytes block for block (``TensorSpec.group``): a
        block id names one group's page at a time, so no byte is rewritten twice.
        """
        # (span, tensor index in this Attach or -1, owner, tensor)
        spans = [
            (t.span, -1, other.cache_id, t)
            for other in self._caches.values()
            for t in other.tensors
        ]
        spans += [(t.span, i, cache.cache_id, t) for i, t in enumerate(cache.tensors)]
        spans.sort(key=lambda s: (s[0].backing, s[0].start))
        furthest = spans[0] if spans else None
        for entry in spans[1:]:
            assert furthest is not None
            if entry[0].overlaps(furthest[0]) and not _group_views(entry, furthest):
                ours, theirs = sorted((entry, furthest), key=lambda s: s[1], reverse=True)
                span, i, _, _ = ours
                other, _, owner, tensor = theirs
                where = "another tensor of this Attach" if theirs[1] >= 0 else f"cache {owner!r}"
                return (
                    f"tensors[{i}].memory: bytes {span.start}..{span.end} overlap "
                    f"{tensor.spec.name!r} of {where} (bytes {other.start}..{other.end}); kvd "
                    "would rewrite them twice"
                )
            if entry[0].backing != furthest[0].backing or entry[0].end > furthest[0].end:
                furthest = entry
        # The sweep compares each span with one other only: a third view of bytes two groups'
        # views cover passes it, so views of one span must be of different groups.
        same: dict[tuple[Span, int], int] = {}
        for i, t in enumerate(cache.tensors):
            j = same.setdefault((t.span, t.spec.group), i)
            if j != i:
                return (
                    f"tensors[{i}].memory: bytes {t.span.start}..{t.span.end} overlap "
                    f"{cache.tensors[j].spec.name!r} of another tensor of this Attach, of the "
                    f"same group {t.spec.group}; kvd would rewrite them twice"
                )
        return None

    def remove(self, cache_id: str) -> AttachedCache:
        cache = self._caches.pop(cache_id)
        cache.close()
        return cache
