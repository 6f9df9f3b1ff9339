"""What a notification is, decided before anything is touched: pure logic over the registry and
the ledger.

A ReadDone is one of: a notification kvd knows (in flight: absorbed; finished: answered with
the outcome kvd recorded), a new one to accept (its ``Route``), or a refusal with a reason
code. The identity of a notification is (cache_id, req_id, generation); only a higher
generation than the one recorded is processed again.

A route (whether work is needed, the group shape, the kernel passes) is decided here, once per
(cache, remote format, remote block size) as the notification states them, and remembered on
the cache: every later notification on it costs one lookup plus the checks of its own block
ids and generation.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.daemon.journal import Outcome
from kvd.daemon.ledger import Ledger, RemoteFormat
from kvd.daemon.registry import AttachedCache, Registry
from kvd.daemon.routes import Rejection, Route, remember
from kvd.layout.formats import FormatError, resolve
from kvd.layout.geometry import (
    BlockIdFault,
    check_block_ids,
    group_problem,
    group_shape,
    preview,
    resolve_remote_block_size,
)
from kvd.protocol import (
    CUDA_IPC_HANDLE_BYTES,
    GROUPS_VERSION,
    PROTOCOL_VERSION,
    RANKS_VERSION,
    ReadDone,
    ReadFailed,
    Reason,
    read_done_version,
)

_BLOCK_ID_REASONS: dict[BlockIdFault, Reason] = {
    "out_of_range": Reason.BLOCK_OUT_OF_RANGE,
    "duplicate": Reason.DUPLICATE_BLOCK_ID,
    "malformed": Reason.INVALID_MESSAGE,
}


@dataclass(frozen=True, slots=True)
class Repeat:
    """A notification kvd already answered: publish ``outcome`` again, touch nothing."""

    outcome: Outcome


@dataclass(frozen=True, slots=True)
class InFlight:
    """The same notification again while kvd still works on it: its one event answers both."""


IN_FLIGHT = InFlight()

Verdict = Route | Rejection | Repeat | InFlight


def identify(msg: ReadDone | ReadFailed, ledger: Ledger) -> Rejection | Repeat | InFlight | None:
    """What kvd already knows of the notification's (cache, req_id, generation); None: new."""
    key = (msg.cache_id, msg.req_id)
    running = ledger.get(key)
    if running is not None:
        if msg.generation == running.generation:
            return IN_FLIGHT
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


def parts(msg: ReadDone) -> list[tuple[int, int]]:
    """(blocks, covered_sub_blocks) of each KV cache group ``msg`` names (one without
    ``groups``)."""
    if not msg.groups:
        return [(len(msg.physical_block_ids), msg.covered_sub_blocks)]
    return [(g.num_blocks, g.covered_sub_blocks) for g in msg.groups]


def validate_read_done(msg: ReadDone, registry: Registry, ledger: Ledger) -> Verdict:
    """The verdict on ``msg``: known, acceptable (its route), or refused."""
    if msg.v not in (PROTOCOL_VERSION, GROUPS_VERSION, RANKS_VERSION):
        return Rejection(
            Reason.UNSUPPORTED_VERSION,
            f"v: protocol version {msg.v} is not supported (this kvd speaks "
            f"{PROTOCOL_VERSION}, {GROUPS_VERSION} for a ReadDone with groups, and "
            f"{RANKS_VERSION} for one with remote_ranks)",
        )
    broken_groups = _groups_problem(msg)
    if broken_groups is not None:
        return Rejection(Reason.INVALID_MESSAGE, broken_groups)
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
    if cache.num_groups > 1 and len(msg.groups) != cache.num_groups:
        return Rejection(
            Reason.INVALID_MESSAGE,
            f"groups: cache {msg.cache_id!r} is attached in {cache.num_groups} groups of their "
            f"own block sizes; a ReadDone lists each of them (it lists {len(msg.groups)})",
        )
    if msg.cuda_event:
        problem = _marker_problem(msg.cuda_event, cache)
        if problem is not None:
            return Rejection(Reason.INVALID_MESSAGE, problem)
    key = (
        msg.remote_format,
        msg.remote_layout,
        msg.block_size_ratio,
        msg.remote_block_size,
        msg.remote_ranks,
    )
    found = cache.routes.get(key)
    if found is None:
        found = remember(cache.routes, key, route(cache, msg))
    if isinstance(found, Rejection):
        return found
    ids = msg.physical_block_ids
    bad = check_block_ids(ids, cache.num_blocks)
    if bad is not None:
        return Rejection(_BLOCK_ID_REASONS[bad.fault], f"physical_block_ids: {bad}")
    # One local block per group and all of it covered (the common case) always fits.
    if found.pages > 1 or msg.covered_sub_blocks or msg.groups:
        for i, (num_ids, covered) in enumerate(parts(msg)):
            broken = group_problem(num_ids, covered, found.pages, found.remote_pages)
            if broken is not None:
                field, why = broken
                whole = field == "physical_block_ids"
                code = Reason.INVALID_RATIO if whole else Reason.INVALID_MESSAGE
                if msg.groups:
                    return Rejection(code, f"groups[{i}].{'num_blocks' if whole else field}: {why}")
                return Rejection(code, f"{field}: {why}")
    busy = ledger.busy_blocks(msg.cache_id, ids)
    if busy:
        return Rejection(
            Reason.BLOCK_IN_FLIGHT,
            f"physical_block_ids: blocks {preview(busy)} belong to a request still in flight",
        )
    return found


def _groups_problem(msg: ReadDone) -> str | None:
    """Why ``msg``'s ``v``, ``groups`` and ``remote_ranks`` disagree, or its ``groups`` do not
    split its ``physical_block_ids``; None when they agree."""
    want = read_done_version(groups=bool(msg.groups), remote_ranks=msg.remote_ranks)
    if msg.v != want:
        return (
            f"v: a ReadDone with {len(msg.groups)} groups and remote_ranks {msg.remote_ranks} "
            f"carries v {want}, not {msg.v}"
        )
    if not msg.groups:
        return None
    if msg.covered_sub_blocks:
        return "covered_sub_blocks: with groups, each group's coverage is its own (give 0 here)"
    listed = sum(g.num_blocks for g in msg.groups)
    if listed != len(msg.physical_block_ids):
        return (
            f"groups: they count {listed} blocks, physical_block_ids lists "
            f"{len(msg.physical_block_ids)}"
        )
    return None


def _marker_problem(handle: bytes, cache: AttachedCache) -> str | None:
    """Why kvd cannot wait on the engine's marker ``handle`` before writing ``cache``, or None."""
    if cache.device.type != "cuda":
        return (
            f"cuda_event: cache {cache.cache_id!r} is in host memory ({cache.device}); a CUDA "
            "event orders only a kvd on the GPU"
        )
    if len(handle) != CUDA_IPC_HANDLE_BYTES:
        return (
            f"cuda_event: must be a {CUDA_IPC_HANDLE_BYTES}-byte cudaIpcEventHandle_t, got "
            f"{len(handle)} bytes"
        )
    return None


def route(cache: AttachedCache, msg: ReadDone) -> Route | Rejection:
    """Decide the route of ``msg``'s remote side into ``cache`` (what ``validate_read_done``
    remembers per ``RouteKey``): the remote format and block size resolved and checked against
    the cache's formats, or why they cannot land in it."""
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
        for group in range(1, cache.num_groups):
            cache.group_remote_block_size(group, remote_block_size)
    except ValueError as exc:
        return Rejection(Reason.INVALID_RATIO, str(exc))
    remote_ranks = max(msg.remote_ranks, 1)  # 0: not given, one rank
    try:
        rewrites = cache.rewrites(remote, remote_block_size, remote_ranks)
        moves_bytes = any(r.needs_work(0, 0) for r in rewrites)
    except FormatError as exc:
        code = Reason.INVALID_FORMAT if msg.remote_format is not None else Reason.INVALID_LAYOUT
        return Rejection(code, f"{exc}")
    pages, remote_pages = group_shape(cache.block_size, remote_block_size)
    return Route(
        remote,
        remote_block_size,
        pages,
        remote_pages,
        rewrites,
        moves_bytes,
        remote_ranks,
    )


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
