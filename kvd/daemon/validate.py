"""What a notification is, decided before anything is touched: pure logic over the registry and
the ledger.

A ReadDone is one of: a notification kvd knows (in flight: absorbed; finished: answered with
the outcome kvd recorded), a new one to accept, or a refusal with a reason code. The identity
of a notification is (cache_id, req_id, generation); only a higher generation than the one
recorded is processed again.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.daemon.journal import Outcome
from kvd.daemon.ledger import Ledger, RemoteFormat
from kvd.daemon.registry import AttachedCache, Registry, Rewrite
from kvd.layout.formats import FormatError, resolve
from kvd.layout.geometry import (
    check_block_ids,
    group_shape,
    preview,
    resolve_remote_block_size,
)
from kvd.protocol import PROTOCOL_VERSION, ReadDone, ReadFailed, Reason


@dataclass(frozen=True, slots=True)
class Rejection:
    code: Reason
    message: str


@dataclass(frozen=True, slots=True)
class Repeat:
    """A notification kvd already answered: publish ``outcome`` again, touch nothing."""

    outcome: Outcome


@dataclass(frozen=True, slots=True)
class InFlight:
    """The same notification again while kvd still works on it: its one event answers both."""


@dataclass(frozen=True, slots=True)
class Accept:
    cache: AttachedCache
    remote_format: RemoteFormat
    remote_block_size: int
    rewrites: list[Rewrite]

    def needs_work(self, msg: ReadDone) -> bool:
        """Whether any byte of ``msg``'s blocks changes (the format pair or the coverage)."""
        ids = msg.physical_block_ids
        return bool(ids) and any(
            r.needs_work(msg.covered_sub_blocks, len(ids)) for r in self.rewrites
        )


Verdict = Accept | Rejection | Repeat | InFlight


def identify(msg: ReadDone | ReadFailed, ledger: Ledger) -> Rejection | Repeat | InFlight | None:
    """What kvd already knows of the notification's (cache, req_id, generation); None: new."""
    key = (msg.cache_id, msg.req_id)
    running = ledger.get(key)
    if running is not None:
        if msg.generation == running.generation:
            return InFlight()
        if msg.generation < running.generation:
            return _stale(msg, running.generation)
        return Rejection(
            Reason.GENERATION_IN_FLIGHT,
            f"generation: {msg.req_id!r} generation {running.generation} is still being "
            f"post-processed; its blocks were read again before its event (generation "
            f"{msg.generation}), so their contents are undefined",
        )
    outcome = ledger.outcomes.get(key)
    if outcome is not None:
        if msg.generation == outcome.generation:
            return Repeat(outcome)
        if msg.generation < outcome.generation:
            return _stale(msg, outcome.generation)
    return None


def _stale(msg: ReadDone | ReadFailed, newest: int) -> Rejection:
    return Rejection(
        Reason.STALE_GENERATION,
        f"generation: {msg.generation} is older than {newest}, the newest kvd has seen for "
        f"{msg.req_id!r}; nothing was touched",
    )


def validate_read_done(msg: ReadDone, registry: Registry, ledger: Ledger) -> Verdict:
    """The verdict on ``msg``: known, acceptable (with its resolved remote side), or refused."""
    if msg.v != PROTOCOL_VERSION:
        return Rejection(
            Reason.UNSUPPORTED_VERSION,
            f"v: protocol version {msg.v} is not supported (this kvd speaks {PROTOCOL_VERSION})",
        )
    known = identify(msg, ledger)
    if known is not None:
        return known
    cache = registry.get(msg.cache_id)
    if cache is None:
        return Rejection(Reason.UNKNOWN_CACHE, f"cache_id: {msg.cache_id!r} is not attached")
    if cache.detaching is not None:
        return Rejection(Reason.CACHE_DETACHED, cache.detaching)
    if cache.lost is not None:
        return Rejection(Reason.MEMORY_UNAVAILABLE, cache.lost)
    remote = _remote_format(msg)
    if isinstance(remote, Rejection):
        return remote
    try:
        remote_block_size = resolve_remote_block_size(
            cache.block_size, msg.block_size_ratio, msg.remote_block_size
        )
    except ValueError as exc:
        return Rejection(Reason.INVALID_RATIO, str(exc))
    try:
        rewrites = cache.rewrites(remote, remote_block_size)
    except FormatError as exc:
        code = Reason.INVALID_FORMAT if msg.remote_format is not None else Reason.INVALID_LAYOUT
        return Rejection(code, f"{exc}")
    ids = msg.physical_block_ids
    bad = check_block_ids(ids, cache.num_blocks)
    if bad is not None:
        code = (
            Reason.BLOCK_OUT_OF_RANGE if bad.fault == "out_of_range" else Reason.DUPLICATE_BLOCK_ID
        )
        return Rejection(code, f"physical_block_ids: {bad}")
    pages, remote_pages = group_shape(cache.block_size, remote_block_size)
    if len(ids) % pages:
        return Rejection(
            Reason.INVALID_RATIO,
            f"physical_block_ids: a remote block of {remote_block_size} tokens lands across "
            f"{pages} local blocks of {cache.block_size}; {len(ids)} blocks are not whole groups",
        )
    holds = len(ids) // pages * remote_pages
    if msg.covered_sub_blocks > holds:
        return Rejection(
            Reason.INVALID_MESSAGE,
            f"covered_sub_blocks: {msg.covered_sub_blocks} remote blocks cannot land in "
            f"{len(ids)} local blocks (they hold {holds})",
        )
    busy = ledger.busy_blocks(msg.cache_id, ids)
    if busy:
        return Rejection(
            Reason.BLOCK_IN_FLIGHT,
            f"physical_block_ids: blocks {preview(busy)} belong to a request still in flight",
        )
    return Accept(cache, remote, remote_block_size, rewrites)


def _remote_format(msg: ReadDone) -> RemoteFormat | Rejection:
    if msg.remote_format is not None:
        try:
            return resolve(msg.remote_format, "remote_format")
        except FormatError as exc:
            return Rejection(Reason.INVALID_FORMAT, str(exc))
    if msg.remote_layout is not None:
        return msg.remote_layout
    return Rejection(
        Reason.INVALID_FORMAT, "remote_format: give the remote page format (or remote_layout)"
    )
