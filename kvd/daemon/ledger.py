"""The one place a request's state lives, from acceptance to its published event.

A request is identified by its key (cache_id, req_id) and its generation. State moves one way:
accepted -> batched -> launched -> done -> published. The ledger owns which blocks are in flight,
so a block is never handed to two requests at once, and remembers the outcome of every request
whose blocks kvd touched (launched), so a repeated notification is answered from memory and
never rewrites them again; the journal (``journal.py``) keeps the same outcomes across restarts.

Nothing here grows with the traffic: requests in flight each own at least one block of their
cache (a request without blocks needs no work and never enters), so there are at most as many
as the attached caches have blocks; the outcomes are bounded by bytes, and the answers that
touched nothing, kept for Status only, by count.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from kvd.daemon.journal import Key, Launch, Outcome
from kvd.protocol import Layout, PageFormat

RemoteFormat = PageFormat | Layout
"""What a notification says of the remote pages: a page format, or a legacy NHD/HND order
that means the local format with that order of heads and tokens."""


class State(enum.IntEnum):
    ACCEPTED = 0
    BATCHED = 1
    LAUNCHED = 2
    DONE = 3
    PUBLISHED = 4


class Request(msgspec.Struct, kw_only=True, eq=False, gc=False):
    """An accepted ReadDone, resolved: the remote format and block size, arrival time (ns).

    A Struct, not a dataclass: one is made per notification with work, six times faster. Not
    tracked by the garbage collector: nothing it holds refers back to it.
    """

    req_id: str
    cache_id: str
    generation: int
    physical_block_ids: list[int]
    remote_format: RemoteFormat
    remote_block_size: int
    remote_engine_id: str
    received_ns: int
    remote_ranks: int = 1
    """Remote ranks whose pages landed interleaved (``ReadDone.remote_ranks``, at least 1)."""
    covered_sub_blocks: int = 0
    groups: list[tuple[int, int]] | None = None
    """(blocks, covered_sub_blocks) of each KV cache group, splitting ``physical_block_ids`` in
    order (a hybrid model's ReadDone); None: one group, covered by ``covered_sub_blocks``."""
    cuda_event: bytes = b""
    """The engine's marker (``ReadDone.cuda_event``): kvd's stream waits on it before writing."""
    state: State = State.ACCEPTED
    error: tuple[str, str] | None = None
    """(code, message) when the post-process failed; set when the request reaches DONE."""

    @property
    def key(self) -> Key:
        return (self.cache_id, self.req_id)

    def parts(self) -> list[tuple[list[int], int]]:
        """(block ids, covered_sub_blocks) of each KV cache group: what the kernels rewrite."""
        ids = self.physical_block_ids
        if self.groups is None:
            return [(ids, self.covered_sub_blocks)]
        parts, start = [], 0
        for blocks, covered in self.groups:
            parts.append((ids[start : start + blocks], covered))
            start += blocks
        return parts

    def launch_record(self) -> Launch:
        return Launch(
            self.cache_id,
            self.req_id,
            self.generation,
            self.physical_block_ids,
            self.remote_engine_id,
        )


class LedgerError(RuntimeError):
    """A state transition that would break the one-way order: a bug, never bad input."""


def outcome_bytes(outcome: Outcome) -> int:
    """What remembering ``outcome`` costs, roughly (the dict entry and the Python objects)."""
    return (
        200
        + len(outcome.cache_id)
        + 2 * len(outcome.req_id)
        + len(outcome.message)
        + 40 * len(outcome.block_ids)
    )


class BoundedMemory:
    """Outcomes by key, oldest forgotten first once ``max_bytes`` is exceeded."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[Key, Outcome] = OrderedDict()
        # The dict's own method: one lookup per notification, without a Python call around it.
        self.get: Callable[[Key], Outcome | None] = self._entries.get

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, outcome: Outcome) -> None:
        key = (outcome.cache_id, outcome.req_id)
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= outcome_bytes(old)
        self._entries[key] = outcome
        self.nbytes += outcome_bytes(outcome)
        while self.nbytes > self.max_bytes and len(self._entries) > 1:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= outcome_bytes(evicted)

    def by_req_id(self, req_id: str) -> list[Outcome]:
        """Every remembered outcome of ``req_id``, in any cache (for Status; not a hot path)."""
        return [o for (_, r), o in self._entries.items() if r == req_id]

    def values(self) -> list[Outcome]:
        return list(self._entries.values())


class _Answer(msgspec.Struct, gc=False):
    """What kvd answered: code empty for Ready. Not tracked by the garbage collector: one is
    kept per notification, and tracked ones would make it run and walk them."""

    generation: int
    code: str
    message: str


class RecentAnswers:
    """Answers that touched nothing, for Status only: between ``count`` and twice that many of
    the latest are kept. Storing one is two dict lookups and a write, and allocates nothing the
    garbage collector tracks: when the newer of two generations of answers fills up, the older
    is dropped whole, so no entry is ever evicted one at a time."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.count = count
        self._newer: dict[str, dict[str, _Answer]] = {}
        """By cache_id, then req_id: no (cache_id, req_id) tuple per answer."""
        self._older: dict[str, dict[str, _Answer]] = {}
        self._newer_count = 0
        self._older_count = 0

    def __len__(self) -> int:
        return self._newer_count + self._older_count

    def put(
        self, cache_id: str, req_id: str, generation: int, code: str = "", message: str = ""
    ) -> None:
        """Remember an answer: code empty for Ready."""
        answers = self._newer.get(cache_id)
        if answers is None:
            answers = self._newer[cache_id] = {}
        size = len(answers)
        answers[req_id] = _Answer(generation, code, message)
        self._newer_count += len(answers) - size
        if self._newer_count >= self.count:
            self._older, self._newer = self._newer, {}
            self._older_count, self._newer_count = self._newer_count, 0

    def by_req_id(self, req_id: str) -> list[Outcome]:
        """Every remembered answer of ``req_id``, newest first (for Status; not a hot path)."""
        return [
            Outcome(cache_id, req_id, answer.generation, answer.code, answer.message, [])
            for generation in (self._newer, self._older)
            for cache_id, answers in generation.items()
            if (answer := answers.get(req_id)) is not None
        ]


class Ledger:
    def __init__(self, outcome_bytes: int = 64 << 20, untouched_count: int = 16384) -> None:
        self._requests: dict[Key, Request] = {}
        self.get: Callable[[Key], Request | None] = self._requests.get
        """The request in flight under ``key``, or None (the dict's own method: a hot path)."""
        self._block_owner: dict[str, dict[int, Key]] = {}
        self.outcomes = BoundedMemory(outcome_bytes)
        """Requests whose blocks kvd touched: never rewritten again under the same generation."""
        self.untouched = RecentAnswers(untouched_count)
        """Recent answers that touched nothing (refusals, requests that needed no work), for
        Status only: a repeat of one is checked afresh."""

    def __len__(self) -> int:
        return len(self._requests)

    def find(self, req_id: str, cache_id: str = "") -> Request | None:
        """A request in flight by req_id (in ``cache_id`` when given)."""
        if cache_id:
            return self._requests.get((cache_id, req_id))
        return next((r for r in self._requests.values() if r.req_id == req_id), None)

    def in_flight(self, cache_id: str | None = None) -> int:
        if cache_id is None:
            return len(self._requests)
        return sum(1 for r in self._requests.values() if r.cache_id == cache_id)

    def busy_blocks(self, cache_id: str, block_ids: list[int]) -> list[int]:
        """Those of ``block_ids`` that a request in flight will rewrite."""
        owners = self._block_owner.get(cache_id)
        if not owners or owners.keys().isdisjoint(block_ids):
            return []
        return [b for b in block_ids if b in owners]

    def accept(self, request: Request) -> None:
        """Record an accepted request; it owns its blocks until published."""
        if request.key in self._requests:
            raise LedgerError(f"request {request.key!r} is already in flight")
        owners = self._block_owner.setdefault(request.cache_id, {})
        if not owners.keys().isdisjoint(request.physical_block_ids):
            raise LedgerError(f"blocks of {request.key!r} are already in flight")
        owners.update(dict.fromkeys(request.physical_block_ids, request.key))
        self._requests[request.key] = request

    def advance(self, request: Request, state: State) -> None:
        if state - request.state != 1:
            raise LedgerError(
                f"request {request.key!r}: {request.state.name} -> {state.name} is not allowed"
            )
        request.state = state

    def publish(self, request: Request, outcome: Outcome | None) -> None:
        """Mark the request's event as sent: frees its blocks and forgets it, except the
        ``outcome`` of a request whose blocks were touched."""
        request.state = State.PUBLISHED
        del self._requests[request.key]
        owners = self._block_owner[request.cache_id]
        for b in request.physical_block_ids:
            del owners[b]
        if not owners:
            del self._block_owner[request.cache_id]
        if outcome is not None:
            self.outcomes.put(outcome)

    def requests(self) -> list[Request]:
        return list(self._requests.values())

    def launched(self) -> list[Request]:
        return [r for r in self._requests.values() if r.state >= State.LAUNCHED]
