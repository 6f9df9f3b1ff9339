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
from kvd.daemon.ledger import Ledger
from kvd.daemon.registry import AttachedCache, Registry
from kvd.geometry import duplicate_ids, out_of_range_ids, preview, resolve_ratio
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
    remote_format: str
    remote_block_size: int


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
    if cache.lost is not None:
        return Rejection(Reason.MEMORY_UNAVAILABLE, cache.lost)
    if msg.remote_layout is None:
        return Rejection(Reason.INVALID_LAYOUT, "remote_layout: must be given")
    ratio = msg.block_size_ratio
    if msg.remote_block_size or ratio < 1 or cache.block_size % ratio:
        try:
            ratio = resolve_ratio(cache.block_size, msg.block_size_ratio, msg.remote_block_size)
        except ValueError as exc:
            return Rejection(Reason.INVALID_RATIO, str(exc))
    ids = msg.physical_block_ids
    # Cheap checks first; the helpers name the offending ids only when one fails.
    if ids and (min(ids) < 0 or max(ids) >= cache.num_blocks):
        return Rejection(
            Reason.BLOCK_OUT_OF_RANGE,
            f"physical_block_ids: {preview(out_of_range_ids(ids, cache.num_blocks))} outside "
            f"[0, {cache.num_blocks})",
        )
    if len(set(ids)) != len(ids):
        return Rejection(
            Reason.DUPLICATE_BLOCK_ID,
            f"physical_block_ids: {preview(duplicate_ids(ids))} listed twice",
        )
    busy = ledger.busy_blocks(msg.cache_id, ids)
    if busy:
        return Rejection(
            Reason.BLOCK_IN_FLIGHT,
            f"physical_block_ids: blocks {preview(busy)} belong to a request still in flight",
        )
    return Accept(cache, msg.remote_layout, cache.block_size // ratio)
