"""The replay buffer (``EventLog``): what it holds, and that nothing in it grows."""

from __future__ import annotations

import gc
import random

import pytest

from kvd.daemon.publisher import EventLog


def test_appends_past_capacity_leave_every_structure_bounded() -> None:
    log = EventLog(capacity=1000)
    for _ in range(100_000):
        log.append("a", b"x" * 10)
    events, oldest, newest = log.since("a", 1)
    assert (len(events), oldest, newest) == (1000, 99_001, 100_000)
    assert len(log._topics) == 1
    # The order across topics (for the byte bound) once kept an entry per event ever appended.
    assert len(log._order) <= 2 * log.capacity


def test_over_several_topics_the_order_names_at_most_capacity_events_not_held() -> None:
    log = EventLog(capacity=1000)
    for i in range(100_000):
        log.append("abcd"[i % 4], b"x" * 10)
    assert log.held == 4 * log.capacity and log.nbytes == 10 * log.held
    assert len(log._order) <= log.held + log.capacity


def test_the_byte_bound_forgets_the_oldest_events_of_all_topics_first() -> None:
    log = EventLog(capacity=1000, max_bytes=100)
    for i in range(30_000):
        log.append(("a", "b", "c")[i % 3], bytes(10))
    assert log.nbytes <= 100 and log.held == 10
    assert len(log._order) <= log.held + log.capacity
    # The ten newest events of all: the last four of "c" (it had the last append), three each
    # of "a" and "b".
    held = {topic: log.since(topic, 1)[1:] for topic in "abc"}
    assert held == {"a": (9998, 10000), "b": (9998, 10000), "c": (9997, 10000)}


def test_since_returns_the_held_events_from_a_seq_with_the_range_held() -> None:
    log = EventLog(capacity=3)
    for i in range(1, 6):
        assert log.append("t", bytes([i])) == (b"t", i)
    assert log.since("t", 1) == ([(3, b"\x03"), (4, b"\x04"), (5, b"\x05")], 3, 5)
    assert log.since("t", 5) == ([(5, b"\x05")], 3, 5)
    assert log.since("t", 6) == ([], 3, 5)
    assert log.since("other", 1) == ([], 0, 0)
    assert log.last_seq("t") == 5 and log.last_seq("other") == 0


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        EventLog(capacity=0)


def test_the_order_across_topics_is_not_walked_by_the_garbage_collector() -> None:
    """Its entries live as long as their events: tracked ones made every full collection walk
    tens of thousands of them, microseconds of every notification's CPU time."""
    log = EventLog(capacity=1000)
    for i in range(2000):
        log.append("ab"[i % 2], b"x")
    gc.collect()  # a tuple of untracked items is untracked when a collection first sees it
    assert not any(gc.is_tracked(entry) for entry in log._order)


def test_with_one_topic_the_order_names_exactly_the_events_held() -> None:
    log = EventLog(capacity=100)
    for _ in range(10_000):
        log.append("a", b"x")
        assert len(log._order) == log.held


def test_what_is_held_matches_a_plain_model_under_mixed_topics_and_byte_bounds() -> None:
    """Every event held is one a plain list of all events would still hold: per topic its
    newest ``capacity``, and the oldest of all forgotten first past ``max_bytes``."""
    rng = random.Random(19)
    capacity, max_bytes = 7, 200
    log = EventLog(capacity, max_bytes)
    model: list[tuple[str, int, bytes]] = []
    seqs: dict[str, int] = {}
    for _ in range(5_000):
        topic = rng.choice("abc" if rng.random() < 0.9 else "d")
        payload = bytes(rng.randint(1, 40))
        seqs[topic] = seqs.get(topic, 0) + 1
        assert log.append(topic, payload) == (topic.encode(), seqs[topic])
        model.append((topic, seqs[topic], payload))
        if sum(1 for t, _, _ in model if t == topic) > capacity:
            model.remove(next(e for e in model if e[0] == topic))
        while sum(len(p) for _, _, p in model) > max_bytes:
            model.pop(0)
        for name in "abcd":
            assert log.since(name, 1)[0] == [(s, p) for t, s, p in model if t == name]
        assert log.held == len(model) and log.nbytes == sum(len(p) for _, _, p in model)
        assert len(log._order) <= log.held + capacity
