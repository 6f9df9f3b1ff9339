"""The ordering logic of subscriptions, without sockets (the daemon tests cover the I/O)."""

from __future__ import annotations

import msgspec
import pytest

from kvd.protocol import UNATTACHED_TOPIC, Ready, ReplayEnd, encode_seq
from kvd.subscription import EventsLost, ReplayError, _Gap, _Ordering


def ready(n: int, epoch: int = 7) -> bytes:
    event = Ready(req_id=f"r{n}", cache_id="c", physical_block_ids=[n], epoch=epoch)
    return msgspec.msgpack.encode(event)


def end(oldest: int, newest: int, code: str = "", epoch: int = 7) -> bytes:
    reply = ReplayEnd(topic="c", oldest_seq=oldest, newest_seq=newest, epoch=epoch, code=code)
    return msgspec.msgpack.encode(reply)


def ordering(topics: list[str], from_seq: int | None) -> _Ordering:
    """An ordering that learnt the daemon's epoch (7) from the refusals topic, as every
    subscription does first."""
    order = _Ordering(topics, from_seq)
    first = order.pending.popleft()
    assert first == _Gap(UNATTACHED_TOPIC, None)
    order.replayed(first, [], end(0, 0))
    return order


def delivered(order: _Ordering) -> list[int]:
    out = [d.seq for d in order.ready]
    order.ready.clear()
    return out


def live(order: _Ordering, seq: int, topic: bytes = b"c") -> _Gap | None:
    return order.live(topic, encode_seq(seq), ready(seq))


def test_in_order_events_are_delivered() -> None:
    order = ordering(["c"], None)
    for seq in (5, 6, 7):
        assert live(order, seq) is None
    assert delivered(order) == [5, 6, 7]


def test_a_repeated_event_without_a_replay_makes_it_check_for_a_restart() -> None:
    order = ordering(["c"], None)
    live(order, 5)
    assert live(order, 5) == _Gap("c", 6)
    assert delivered(order) == [5]


def test_other_topics_with_a_shared_prefix_are_ignored() -> None:
    order = ordering(["c"], None)
    assert live(order, 1, b"c2") is None
    assert delivered(order) == []


def test_baseline_starts_after_the_newest_event() -> None:
    order = ordering(["c"], None)
    order.replayed(order.pending.popleft(), [], end(1, 41))
    assert live(order, 40) == _Gap("c", 42)  # older than the baseline: checked once ...
    assert live(order, 41) is None  # ... and not again until something is delivered
    assert live(order, 42) is None
    assert delivered(order) == [42]


def test_a_gap_asks_for_a_replay_and_the_live_event_follows_it() -> None:
    order = ordering(["c"], None)
    live(order, 1)
    gap = live(order, 4)
    assert gap == _Gap("c", 2, (4, msgspec.msgpack.decode(ready(4), type=Ready)))
    order.replayed(gap, [(2, ready(2)), (3, ready(3)), (4, ready(4)), (5, ready(5))], end(1, 5))
    assert delivered(order) == [1, 2, 3, 4, 5]
    assert live(order, 5) == _Gap("c", 6)  # the live copy of a replayed event: one check
    order.replayed(_Gap("c", 6), [], end(1, 5))
    assert live(order, 6) is None
    assert delivered(order) == [6]


def test_idle_resync_finds_a_missed_last_event() -> None:
    order = ordering(["c"], None)
    live(order, 1)
    gaps = order.resync()
    assert set(gaps) == {_Gap("c", 2), _Gap(UNATTACHED_TOPIC, 1)}
    gap = _Gap("c", 2)
    order.replayed(gap, [(2, ready(2))], end(1, 2))
    assert delivered(order) == [1, 2]


def test_lost_events_are_reported_after_the_survivors_are_queued() -> None:
    order = ordering(["c"], 1)
    with pytest.raises(EventsLost) as lost:
        order.replayed(order.pending.popleft(), [(4, ready(4)), (5, ready(5))], end(4, 5))
    assert (lost.value.first_seq, lost.value.last_seq, lost.value.restarted) == (1, 3, False)
    assert delivered(order) == [4, 5]


def test_the_first_event_of_a_restarted_kvd_is_noticed_whatever_its_seq() -> None:
    order = ordering([], None)  # every topic
    live(order, 3)
    live(order, 4)
    with pytest.raises(EventsLost) as lost:
        order.live(b"c", encode_seq(9), ready(9, epoch=8))  # higher seq, other daemon
    assert lost.value.restarted
    # Everything of the new daemon, every topic from its first event:
    assert set(order.pending) == {_Gap("c", 1), _Gap(UNATTACHED_TOPIC, 1)}
    order.replayed(_Gap("c", 1), [(1, ready(1, 8)), (9, ready(9, 8))], end(1, 9, epoch=8))
    assert delivered(order) == [3, 4, 1, 9]


def test_a_new_epoch_means_kvd_restarted() -> None:
    order = ordering(["c"], None)
    order.replayed(order.pending.popleft(), [], end(1, 10, epoch=7))
    live(order, 11)
    # A new daemon's event lost on the way (an old one sent no epoch): only the seq tells.
    gap = order.live(b"c", encode_seq(1), ready(1, epoch=0))
    assert gap == _Gap("c", 12)
    with pytest.raises(EventsLost) as lost:
        order.replayed(gap, [], end(1, 1, epoch=8))
    assert lost.value.restarted and lost.value.first_seq == 12
    again = next(g for g in order.pending if g.topic == "c")
    assert again == _Gap("c", 1)
    order.replayed(again, [(1, ready(1, epoch=8))], end(1, 1, epoch=8))
    assert delivered(order) == [11, 1]


def test_replay_refusal() -> None:
    order = ordering(["c"], 1)
    with pytest.raises(ReplayError, match="invalid_message"):
        order.replayed(order.pending.popleft(), [], end(0, 0, "invalid_message"))


def test_from_seq_needs_topics() -> None:
    with pytest.raises(ValueError, match="explicit topics"):
        _Ordering([], 1)


def test_a_topic_longer_than_a_cache_id_is_refused() -> None:
    """kvd would close the connection of its subscription (max_subscription_bytes)."""
    _Ordering(["c" * 128], None)
    with pytest.raises(ValueError, match=r"topics: 'c+'\.\.\. is 129 bytes; a topic is a cache id"):
        _Ordering(["c" * 129], None)


def test_a_late_event_of_a_replaced_daemon_is_not_another_restart() -> None:
    # The SUB socket still holds events the old daemon published before it was killed; they
    # come through after the subscription learnt of the new daemon, one between each two new
    # events (fair queuing over the old and the new connection). Each is not a new restart.
    order = ordering(["c"], None)
    order.replayed(order.pending.popleft(), [], end(1, 10, epoch=7))
    live(order, 11)
    with pytest.raises(EventsLost):
        order.replayed(_Gap("c", 12), [], end(1, 1, epoch=8))
    while order.pending:  # the new daemon's events, from its first
        gap = order.pending.popleft()
        if gap.topic == "c":
            order.replayed(gap, [(1, ready(1, epoch=8))], end(1, 1, epoch=8))
        else:
            order.replayed(gap, [], end(0, 0, epoch=8))
    assert delivered(order) == [11, 1]
    assert order.live(b"c", encode_seq(12), ready(12, epoch=7)) is None  # the old daemon's
    assert not order.pending and delivered(order) == []
    assert order.live(b"c", encode_seq(2), ready(2, epoch=8)) is None
    assert delivered(order) == [2]


def test_a_live_event_during_the_first_replay_waits_for_the_events_before_it() -> None:
    # The replay from ``from_seq`` is in flight while live events are read: one published
    # meanwhile must neither jump ahead of the replayed ones nor make them look old.
    order = ordering(["c"], 1)
    first = order.pending.popleft()
    assert first == _Gap("c", 1)
    gap = live(order, 2)
    assert gap is not None and gap.from_seq == 1
    assert delivered(order) == []
    order.replayed(first, [(1, ready(1))], end(1, 1))
    order.replayed(gap, [(1, ready(1)), (2, ready(2))], end(1, 2))
    assert delivered(order) == [1, 2]
