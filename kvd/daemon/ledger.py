"""The one place a request's state lives, from acceptance to its published event.

State moves one way: accepted -> batched -> launched -> done -> published. The ledger also owns
which blocks are in flight, so a block can never be handed to two requests at once, and keeps a
bounded memory of finished requests for ``Status`` queries. A request that needs no work is
accepted and published in one step of the event loop, so only its outcome is recorded.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple


class State(enum.IntEnum):
    ACCEPTED = 0
    BATCHED = 1
    LAUNCHED = 2
    DONE = 3
    PUBLISHED = 4


@dataclass(slots=True, eq=False)
class Request:
    """An accepted ReadDone, with the resolved ratio and its arrival time (monotonic ns)."""

    req_id: str
    cache_id: str
    physical_block_ids: list[int]
    block_size_ratio: int
    remote_layout: str
    remote_engine_id: str
    received_ns: int
    state: State = State.ACCEPTED
    launched_ns: int = 0
    done_ns: int = 0
    needs_work: bool = True
    error: tuple[str, str] | None = field(default=None)
    """(code, message) when the post-process failed; set when the request reaches DONE."""


class Outcome(NamedTuple):
    """What a published request ended as, remembered for Status queries; no code = Ready."""

    cache_id: str
    code: str
    message: str


class LedgerError(RuntimeError):
    """A state transition that would break the one-way order: a bug, never bad input."""


class Ledger:
    def __init__(self, remember_finished: int = 65536) -> None:
        self._requests: dict[str, Request] = {}
        self._block_owner: dict[str, dict[int, str]] = {}
        # Plain tuples and a deque of ids, oldest first: this runs once per notification.
        self._finished: dict[str, tuple[str, str, str]] = {}
        self._finished_order: deque[str] = deque()
        self._remember = remember_finished

    def __len__(self) -> int:
        return len(self._requests)

    def get(self, req_id: str) -> Request | None:
        return self._requests.get(req_id)

    def finished(self, req_id: str) -> Outcome | None:
        outcome = self._finished.get(req_id)
        return None if outcome is None else Outcome(*outcome)

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
        """Record an accepted request; if it rewrites blocks, it owns them until published."""
        if request.req_id in self._requests:
            raise LedgerError(f"request {request.req_id!r} is already in flight")
        if request.needs_work:
            owners = self._block_owner.setdefault(request.cache_id, {})
            if not owners.keys().isdisjoint(request.physical_block_ids):
                raise LedgerError(f"blocks of {request.req_id!r} are already in flight")
            owners.update(dict.fromkeys(request.physical_block_ids, request.req_id))
        self._requests[request.req_id] = request

    def advance(self, request: Request, state: State) -> None:
        if state - request.state != 1:
            raise LedgerError(
                f"request {request.req_id!r}: {request.state.name} -> {state.name} is not allowed"
            )
        request.state = state
        if state == State.LAUNCHED:
            request.launched_ns = time.monotonic_ns()
        elif state == State.DONE:
            request.done_ns = time.monotonic_ns()

    def publish(self, request: Request, code: str = "", message: str = "") -> None:
        """Mark the request's event as sent: frees its blocks and forgets it except its outcome."""
        self.advance(request, State.PUBLISHED)
        del self._requests[request.req_id]
        if request.needs_work:
            owners = self._block_owner[request.cache_id]
            for b in request.physical_block_ids:
                del owners[b]
            if not owners:
                del self._block_owner[request.cache_id]
        self.remember(request.req_id, request.cache_id, code, message)

    def remember(self, req_id: str, cache_id: str, code: str = "", message: str = "") -> None:
        """Record how a request ended (also for notifications rejected before acceptance)."""
        finished = self._finished
        if req_id not in finished:
            self._finished_order.append(req_id)
            if len(self._finished_order) > self._remember:
                del finished[self._finished_order.popleft()]
        finished[req_id] = (cache_id, code, message)

    def requests(self) -> list[Request]:
        return list(self._requests.values())
