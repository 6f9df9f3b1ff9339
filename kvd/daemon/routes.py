"""Routes: how notifications from one remote side land in one attached cache.

The types the registry remembers per cache and ``validate`` decides: a ``Route`` (or the
``Rejection`` of a remote side that cannot land), keyed by the ``RouteKey`` a ReadDone states,
and its ``Rewrite`` passes. Pure data, below both the registry and validate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from kvd.daemon.ledger import RemoteFormat
from kvd.layout.geometry import remote_pages_held
from kvd.protocol import FormatRef, Layout, PageFormat, Reason

if TYPE_CHECKING:  # loaded by the first Attach (attach.py), after READY
    from kvd.kernels.postprocess import CachePostProcess

K = TypeVar("K")
V = TypeVar("V")

ROUTES_PER_CACHE = 64
"""Routes (and their kernel passes) a cache remembers: a peer that names ever new remote
formats or block sizes makes kvd decide again, not hold more."""


@dataclass(frozen=True, slots=True)
class Rejection:
    code: Reason
    message: str


RouteKey = tuple[FormatRef | None, Layout | None, int, int, int]
"""A remote side as a ReadDone states it: (remote_format, remote_layout, block_size_ratio,
remote_block_size, remote_ranks)."""


@dataclass(frozen=True, eq=False)
class Rewrite:
    """One kernel pass of a batch: the cache's tensors of one local page format, rewritten from
    the remote format (resolved for them) at the remote block size; of one group's
    (``group``), or of every group's when the cache is attached as one (-1)."""

    postprocess: CachePostProcess
    remote: PageFormat
    remote_block_size: int
    remote_ranks: int = 1
    group: int = -1

    def needs_work(self, covered: int, num_ids: int) -> bool:
        return self.postprocess.needs_work(
            self.remote, self.remote_block_size, covered, num_ids, remote_ranks=self.remote_ranks
        )

    def apply(self, requests: list[tuple[list[int], int]]) -> None:
        """Rewrite each (block ids, covered_sub_blocks) request (executor thread)."""
        self.postprocess.apply(
            requests, self.remote, self.remote_block_size, remote_ranks=self.remote_ranks
        )


@dataclass(frozen=True, slots=True, eq=False)
class Route:
    """How notifications from one remote side land in one cache: the resolved remote format
    and block size, the group shape, the kernel passes, and whether a whole read moves bytes.
    An accepted notification's verdict. It names no cache: the cache remembers it, and a
    reference back would keep a detached cache's memory until a garbage collection."""

    remote_format: RemoteFormat
    remote_block_size: int
    pages: int
    """Local blocks per group (> 1 when a remote block spans several)."""
    remote_pages: int
    """Remote blocks per group (> 1 when several land in one local block)."""
    rewrites: list[Rewrite]
    moves_bytes: bool
    """Whether the format pair moves any byte of a fully covered group."""
    remote_ranks: int = 1
    """Remote ranks whose pages landed interleaved (``ReadDone.remote_ranks``, at least 1)."""

    def needs_work(self, covered: int, num_ids: int) -> bool:
        """Whether any byte of a request of ``num_ids`` blocks changes: the format pair moves
        bytes, or ``covered`` leaves pages (partly) unwritten, which are then zeroed."""
        if not num_ids:
            return False
        # The usual request (no byte moved, covered 0) stops before the arithmetic.
        return self.moves_bytes or (
            0 < covered < remote_pages_held(num_ids, self.pages, self.remote_pages)
        )

    def any_work(self, parts: list[tuple[int, int]]) -> bool:
        """``needs_work`` for any (blocks, covered_sub_blocks) part of a request."""
        return any(self.needs_work(covered, num_ids) for num_ids, covered in parts)


def remember(memo: dict[K, V], key: K, value: V) -> V:
    """Store ``value`` in a per-cache memo, forgetting the oldest entry past the bound."""
    if len(memo) >= ROUTES_PER_CACHE:
        del memo[next(iter(memo))]
    memo[key] = value
    return value
