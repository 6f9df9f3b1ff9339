from __future__ import annotations

import pytest

from kvd.daemon.ledger import Ledger, LedgerError, State
from tests.test_batcher import req


def test_states_move_one_way_and_blocks_are_owned_until_published() -> None:
    ledger = Ledger()
    r = req("a", [1, 2, 3])
    ledger.accept(r)
    assert ledger.busy_blocks("c", [0, 2, 3, 4]) == [2, 3]
    with pytest.raises(LedgerError, match="ACCEPTED -> LAUNCHED"):
        ledger.advance(r, State.LAUNCHED)
    for state in (State.BATCHED, State.LAUNCHED, State.DONE):
        ledger.advance(r, state)
    assert r.launched_ns and r.done_ns
    with pytest.raises(LedgerError):
        ledger.advance(r, State.BATCHED)
    ledger.publish(r)
    assert ledger.get("a") is None
    assert ledger.busy_blocks("c", [1, 2, 3]) == []
    assert ledger.finished("a") == ("c", "", "")


def test_accept_refuses_what_validation_should_have_caught() -> None:
    ledger = Ledger()
    ledger.accept(req("a", [1]))
    with pytest.raises(LedgerError, match="already in flight"):
        ledger.accept(req("a", [2]))
    with pytest.raises(LedgerError, match="already in flight"):
        ledger.accept(req("b", [1]))


def test_requests_without_work_own_no_blocks() -> None:
    ledger = Ledger()
    r = req("a", [1])
    r.needs_work = False
    ledger.accept(r)
    assert ledger.busy_blocks("c", [1]) == []


def test_finished_memory_is_bounded() -> None:
    ledger = Ledger(remember_finished=3)
    for i in range(5):
        ledger.remember(f"r{i}", "c", "read_failed" if i % 2 else "")
    assert ledger.finished("r0") is None and ledger.finished("r1") is None
    assert ledger.finished("r3") == ("c", "read_failed", "")
    assert ledger.finished("r4").code == ""
