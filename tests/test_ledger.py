"""The ledger and the verdicts on notifications: pure logic, no sockets."""

from __future__ import annotations

import gc

import pytest

from kvd.daemon.journal import Outcome
from kvd.daemon.ledger import (
    BoundedMemory,
    Ledger,
    LedgerError,
    RecentAnswers,
    State,
    outcome_bytes,
)
from kvd.daemon.routes import Rejection
from kvd.daemon.validate import InFlight, Repeat, identify
from kvd.protocol import ReadDone, ReadFailed, Reason
from tests.test_batcher import req


def outcome(req_id: str, generation: int = 0, code: str = "", cache: str = "c") -> Outcome:
    return Outcome(cache, req_id, generation, code, "", [1, 2], "")


def read_done(req_id: str, generation: int = 0, cache: str = "c") -> ReadDone:
    return ReadDone(
        req_id=req_id,
        cache_id=cache,
        remote_layout="HND",
        physical_block_ids=[1, 2],
        generation=generation,
    )


def test_states_move_one_way_and_blocks_are_owned_until_published() -> None:
    ledger = Ledger()
    r = req("a", [1, 2, 3])
    ledger.accept(r)
    assert ledger.busy_blocks("c", [0, 2, 3, 4]) == [2, 3]
    with pytest.raises(LedgerError, match="ACCEPTED -> LAUNCHED"):
        ledger.advance(r, State.LAUNCHED)
    for state in (State.BATCHED, State.LAUNCHED, State.DONE):
        ledger.advance(r, state)
    assert r.state == State.DONE
    with pytest.raises(LedgerError):
        ledger.advance(r, State.BATCHED)
    ledger.publish(r, outcome("a"))
    assert ledger.get(("c", "a")) is None
    assert ledger.busy_blocks("c", [1, 2, 3]) == []
    assert ledger.outcomes.get(("c", "a")) == outcome("a")


def test_accept_refuses_what_validation_should_have_caught() -> None:
    ledger = Ledger()
    ledger.accept(req("a", [1]))
    with pytest.raises(LedgerError, match="already in flight"):
        ledger.accept(req("a", [2]))
    with pytest.raises(LedgerError, match="already in flight"):
        ledger.accept(req("b", [1]))


def test_the_same_req_id_in_two_caches_is_two_requests() -> None:
    ledger = Ledger()
    ledger.accept(req("a", [1], cache="x"))
    ledger.accept(req("a", [1], cache="y"))
    assert ledger.in_flight() == 2
    assert ledger.find("a", "y") is not None and ledger.find("a", "z") is None


def test_outcome_memory_is_bounded_by_bytes_oldest_first() -> None:
    memory = BoundedMemory(max_bytes=3 * outcome_bytes(outcome("r0")))
    for i in range(5):
        memory.put(outcome(f"r{i}"))
    assert memory.get(("c", "r0")) is None and memory.get(("c", "r1")) is None
    assert memory.get(("c", "r4")) is not None and len(memory) == 3
    assert memory.nbytes <= memory.max_bytes
    memory.put(outcome("r2", generation=1))  # an update replaces, and counts once
    assert len(memory) == 3 and memory.get(("c", "r2")).generation == 1


def test_a_repeat_of_a_finished_notification_is_answered_from_its_outcome() -> None:
    ledger = Ledger()
    ledger.outcomes.put(outcome("a", generation=1, code="transform_failed"))
    assert identify(read_done("a", 1), ledger) == Repeat(ledger.outcomes.get(("c", "a")))
    stale = identify(read_done("a", 0), ledger)
    assert isinstance(stale, Rejection) and stale.code == Reason.STALE_GENERATION
    assert identify(read_done("a", 2), ledger) is None  # read again: new
    assert identify(read_done("a", 1, cache="other"), ledger) is None  # another cache's "a"


def test_a_repeat_while_in_flight_is_absorbed_and_a_new_generation_refused() -> None:
    ledger = Ledger()
    ledger.accept(req("a", [1], generation=3))
    assert identify(read_done("a", 3), ledger) == InFlight()
    failed = ReadFailed(req_id="a", cache_id="c", generation=3)
    assert identify(failed, ledger) == InFlight()
    racing = identify(read_done("a", 4), ledger)
    assert isinstance(racing, Rejection) and racing.code == Reason.GENERATION_IN_FLIGHT
    older = identify(read_done("a", 2), ledger)
    assert isinstance(older, Rejection) and older.code == Reason.STALE_GENERATION


def test_answers_that_touched_nothing_are_kept_for_status_bounded_by_count() -> None:
    answers = RecentAnswers(100)
    for i in range(10_000):
        answers.put("c", f"r{i}", 0)
    assert 100 <= len(answers) <= 200
    assert answers.by_req_id("r9999") == [Outcome("c", "r9999", 0, "", "", [])]
    assert answers.by_req_id("r0") == [], "the oldest are forgotten"
    answers.put("c", "r9999", 1, "block_in_flight", "busy")
    newest = answers.by_req_id("r9999")[0]
    assert (newest.generation, newest.code) == (1, "block_in_flight"), "newest first"


def test_remembering_an_answer_leaves_nothing_for_the_garbage_collector() -> None:
    """One answer is kept per notification that needed no work: objects the collector tracks
    made it run every few hundred notifications, and walk them when it did."""
    answers = RecentAnswers(100_000)
    answers.put("c", "first", 0)  # the cache's own dict of answers
    req_ids = [f"r{i}" for i in range(10_000)]
    gc.collect()
    gc.disable()
    try:
        before = gc.get_count()[0]
        for req_id in req_ids:
            answers.put("c", req_id, 0)
        assert gc.get_count()[0] - before < 10
    finally:
        gc.enable()
    assert answers.by_req_id("r5") == [Outcome("c", "r5", 0, "", "", [])]
    answers.put("d", "r5", 2, "stale_generation", "old")
    assert {(o.cache_id, o.generation) for o in answers.by_req_id("r5")} == {("c", 0), ("d", 2)}
