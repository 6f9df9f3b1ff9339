"""Batching decisions with an explicit clock: grouping, the window, the block cap."""

from __future__ import annotations

import pytest

from kvd.daemon.batcher import Batch, Batcher
from kvd.daemon.ledger import Request
from kvd.daemon.window import AutoWindow

US = 1000


def req(
    req_id: str,
    blocks: list[int],
    *,
    cache: str = "c",
    remote_block_size: int = 16,
    layout: str = "HND",
    at: int = 0,
    generation: int = 0,
    remote_ranks: int = 1,
) -> Request:
    return Request(
        req_id=req_id,
        cache_id=cache,
        generation=generation,
        physical_block_ids=blocks,
        remote_format=layout,
        remote_block_size=remote_block_size,
        remote_engine_id="",
        received_ns=at,
        remote_ranks=remote_ranks,
    )


def req_ids(batches: list[Batch]) -> list[str]:
    """The requests of ``batches`` (one job, say), in order."""
    return [r.req_id for batch in batches for r in batch.requests]


def test_groups_by_cache_remote_format_block_size_and_ranks() -> None:
    b = Batcher(window_ns=100 * US, max_blocks=100)
    b.add(req("a", [1]), 0)
    b.add(req("b", [2], remote_block_size=4), 0)
    b.add(req("c", [3]), 0)
    b.add(req("d", [4], layout="NHD"), 0)
    b.add(req("e", [5], cache="other"), 0)
    b.add(req("f", [6], remote_ranks=2), 0)
    batches = b.take_due(100 * US)
    groups = {batch.key: [r.req_id for r in batch.requests] for batch in batches}
    assert groups == {
        ("c", "HND", 16, 1): ["a", "c"],
        ("c", "HND", 4, 1): ["b"],
        ("c", "NHD", 16, 1): ["d"],
        ("other", "HND", 16, 1): ["e"],
        ("c", "HND", 16, 2): ["f"],
    }
    assert [batch.block_ids() for batch in batches if batch.key == ("c", "HND", 16, 1)] == [[1, 3]]
    assert len(b) == 0


def test_window_holds_batches_until_the_oldest_request_waited_long_enough() -> None:
    b = Batcher(window_ns=100 * US, max_blocks=100)
    b.add(req("a", [1]), 10 * US)
    b.add(req("b", [2]), 90 * US)
    assert b.take_due(109 * US) == []
    assert b.next_deadline_ns() == 110 * US
    (batch,) = b.take_due(110 * US)
    assert [r.req_id for r in batch.requests] == ["a", "b"]
    assert b.next_deadline_ns() is None


def test_zero_window_launches_at_once() -> None:
    b = Batcher(window_ns=0, max_blocks=100)
    b.add(req("a", [1]), 5)
    assert [r.req_id for r in b.take_due(5)[0].requests] == ["a"]


def test_cap_closes_a_batch_and_never_splits_a_request() -> None:
    b = Batcher(window_ns=10**9, max_blocks=4)
    b.add(req("a", [1, 2]), 0)
    b.add(req("b", [3, 4, 5]), 0)  # would exceed 4: "a" is closed, "b" opens a new batch
    b.add(req("c", [6]), 0)  # "b" + "c" reach the cap exactly
    b.add(req("d", list(range(10, 20))), 0)  # larger than the cap: a batch of its own
    assert b.next_deadline_ns() == 0
    # One job each: two batches of 2 and 4 blocks would exceed the cap together.
    jobs = [b.take_due(1) for _ in range(3)]
    assert [req_ids(job) for job in jobs] == [
        ["a"],
        ["b", "c"],
        ["d"],
    ]
    assert b.take_due(2) == []


def test_a_job_takes_the_oldest_due_batches_up_to_the_cap() -> None:
    b = Batcher(window_ns=10 * US, max_blocks=4)
    for n, cache in enumerate(["c1", "c2", "c3", "c4"]):
        b.add(req(f"r{n}", [2 * n, 2 * n + 1], cache=cache), n * US)
    b.add(req("young", [9], cache="c5"), 20 * US)  # its window has not passed
    first = b.take_due(20 * US)
    assert req_ids(first) == ["r0", "r1"]
    assert b.next_deadline_ns() == 12 * US  # the rest are overdue: the next job may go now
    second = b.take_due(20 * US)
    assert req_ids(second) == ["r2", "r3"]
    assert b.take_due(20 * US) == []
    # A drain does not wait for windows, and keeps the bound.
    b.add(req("late", [10, 11, 12, 13], cache="c6"), 21 * US)
    assert req_ids(b.take_due(21 * US, draining=True)) == ["young"]
    assert req_ids(b.take_due(21 * US, draining=True)) == ["late"]
    assert len(b) == 0


def test_take_all_ignores_the_window() -> None:
    b = Batcher(window_ns=10**9, max_blocks=100)
    b.add(req("a", [1]), 0)
    b.add(req("b", [2], remote_block_size=8), 0)
    assert b.take_due(1) == []
    assert len(b.take_all()) == 2
    assert len(b) == 0


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="window_ns"):
        Batcher(window_ns=-1, max_blocks=1)
    with pytest.raises(ValueError, match="max_blocks"):
        Batcher(window_ns=0, max_blocks=0)


def test_a_new_window_moves_the_deadlines_of_waiting_batches() -> None:
    b = Batcher(window_ns=10**9, max_blocks=100)
    b.add(req("a", [1]), 10 * US)
    assert b.take_due(20 * US) == []
    b.set_window(5 * US)  # kvd set batch-window-us 5: the waiting batch is overdue now
    assert b.next_deadline_ns() == 15 * US
    assert [r.req_id for r in b.take_due(20 * US)[0].requests] == ["a"]
    b.add(req("b", [2]), 30 * US)
    b.set_window(100 * US)
    assert b.take_due(129 * US) == [] and b.next_deadline_ns() == 130 * US


def test_a_lower_cap_makes_batches_that_reach_it_due() -> None:
    b = Batcher(window_ns=10**9, max_blocks=100)
    b.add(req("a", [1, 2, 3]), 0)
    b.add(req("b", [4], cache="other"), 0)
    b.set_max_blocks(3)
    (due,) = b.take_due(1)
    assert [r.req_id for r in due.requests] == ["a"]
    assert b.next_deadline_ns() == 10**9
    with pytest.raises(ValueError, match="max_blocks"):
        b.set_max_blocks(0)


def test_take_cache_removes_only_that_caches_batches() -> None:
    b = Batcher(window_ns=10**9, max_blocks=2)
    b.add(req("a", [1, 2]), 0)  # full
    b.add(req("b", [3]), 0)  # open
    b.add(req("c", [4], layout="NHD"), 0)
    b.add(req("d", [5], cache="other"), 0)
    taken = b.take_cache("c")
    assert sorted(req_ids(taken)) == ["a", "b", "c"]
    assert req_ids(b.take_all()) == ["d"]


def test_an_auto_window_applies_when_the_batch_opens_with_the_executor_idle() -> None:
    auto = AutoWindow()
    for n in range(16):  # jobs of 1..4 blocks costing 100 us + 10 us per block
        blocks = 1 + n % 4
        auto.job(blocks, 100 * US + blocks * 10 * US)
    b = Batcher(window_ns=auto, max_blocks=100)
    for n in range(20):  # a request every 20 us: waiting pays for about 100 - 20 us
        b.add(req(f"r{n}", [n]), n * 20 * US)
        b.take_all()
    # It waits for the next request two typical gaps (40 us), each arrival moving the deadline,
    # never past the window (80 us).
    b.add(req("idle", [100]), 400 * US)
    assert b.next_deadline_ns() == pytest.approx(440 * US, abs=2 * US)
    b.add(req("next", [102]), 430 * US)
    assert b.next_deadline_ns() == pytest.approx(470 * US, abs=2 * US)
    b.add(req("last", [103]), 460 * US)
    assert b.next_deadline_ns() == pytest.approx(480 * US, abs=2 * US)
    b.take_all()
    b.add(req("busy", [101]), 420 * US, idle=False)  # it fills while the executor works
    assert b.next_deadline_ns() == 420 * US


def test_an_auto_window_goes_once_a_closed_loop_has_sent_all_it_will() -> None:
    auto = AutoWindow()
    for n in range(16):
        blocks = 1 + n % 4
        auto.job(blocks, 100 * US + blocks * 10 * US)
    b = Batcher(window_ns=auto, max_blocks=100)
    # A closed loop of 4: four requests 5 us apart, answered together, again and again.
    now = 0
    for cycle in range(10):
        for held in range(1, 5):
            now += 5 * US
            b.add(req(f"r{cycle}.{held}", [held]), now, held=held)
        b.take_all()
        now += 300 * US
    # The first three of a cycle wait for the next; the fourth makes it all the loop sends.
    for held in range(1, 4):
        now += 5 * US
        b.add(req(f"again{held}", [held]), now, held=held)
        assert b.next_deadline_ns() is not None and b.next_deadline_ns() > now
    now += 5 * US
    b.add(req("again4", [4]), now, held=4)
    assert b.next_deadline_ns() == now
    assert req_ids(b.take_due(now)) == [
        "again1",
        "again2",
        "again3",
        "again4",
    ]
