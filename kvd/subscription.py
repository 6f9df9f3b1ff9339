"""Event subscriptions: events in sequence order per topic, with gaps filled by replay.

A subscriber tracks the next seq it expects per topic. A live event with a higher seq means it
missed some (a reconnect, a subscriber past its high-water mark): it asks the replay socket for
the events from the first missing one and delivers them in order before the live one. Because a
lost *last* event is revealed by no later event, a subscription that hears nothing for
``resync_interval`` seconds also asks the replay socket whether anything newer exists; the same
check catches a connection that was still being set up when an event went out.

A subscription delivers every event published after it was created (or from ``from_seq``), and
also every event of ``UNATTACHED_TOPIC``: refusals of notifications whose cache is not attached
(a typo, a cache detached meanwhile), so such a request is answered where its engine listens.

Every subscription knows the daemon's epoch (asked at creation; every event carries it), so a
restarted kvd is noticed on its first event, whatever its sequence numbers; events of a daemon
already replaced, still queued when the new one is noticed, are dropped. Only when kvd's
replay buffer no longer holds missing events, or kvd restarted, is ``EventsLost`` raised, once,
after every event that survived has been queued; iteration may continue after it, with the new
daemon's events of every known topic replayed from its first.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvd.endpoints import Endpoints
from kvd.protocol import (
    CACHE_ID_MAX,
    END_SEQ,
    UNATTACHED_TOPIC,
    Event,
    Replay,
    ReplayEnd,
    decode_seq,
)

_ENCODER = msgspec.msgpack.Encoder()
_EVENT_DECODER = msgspec.msgpack.Decoder(Event)
_REPLAY_END_DECODER = msgspec.msgpack.Decoder(ReplayEnd)
# Asking from a seq no topic reaches returns no events, only the ReplayEnd: the topic's newest.
_BASELINE = 2**63
DEFAULT_RESYNC_INTERVAL = 1.0


class EventsLost(Exception):
    """Events of ``topic`` from ``first_seq`` on are gone: up to ``last_seq``, or, when kvd
    ``restarted``, every event the old daemon had not published (``last_seq`` is then -1).

    Requests whose events may be among them should be asked about with ``request_status``.
    """

    def __init__(self, topic: str, first_seq: int, last_seq: int, restarted: bool = False) -> None:
        what = "kvd restarted" if restarted else f"events {first_seq}..{last_seq} are gone"
        super().__init__(f"topic {topic!r}: {what}; events from seq {first_seq} may be lost")
        self.topic = topic
        self.first_seq = first_seq
        self.last_seq = last_seq
        self.restarted = restarted


class ReplayError(Exception):
    """kvd refused or did not answer a replay request (a subscription of a client found by its
    runtime directory raises ``KvdUnavailable`` instead when no kvd serves it any more)."""


@dataclass(frozen=True, slots=True)
class Delivery:
    topic: str
    seq: int
    event: Event


@dataclass(frozen=True, slots=True)
class _Gap:
    """A replay to do: ``topic`` from ``from_seq`` (None: only learn the topic's newest seq)."""

    topic: str
    from_seq: int | None
    live: tuple[int, Event] | None = None
    """The live (seq, event) that revealed the gap, delivered after the replay."""


class _Ordering:
    """The pure part of a subscription: what to deliver, skip, or replay first."""

    def __init__(self, topics: list[str], from_seq: int | None) -> None:
        if from_seq is not None and not topics:
            raise ValueError("from_seq needs explicit topics to replay")
        for topic in topics:
            # kvd closes the connection of a subscriber whose subscription is much longer
            # (max_subscription_bytes): ZMQ would reconnect and subscribe again, for ever.
            if len(topic.encode()) > CACHE_ID_MAX:
                raise ValueError(
                    f"topics: {topic[:32]!r}... is {len(topic.encode())} bytes; a topic is a "
                    f"cache id, at most {CACHE_ID_MAX}"
                )
        self.topics = topics
        self.expected: dict[str, int] = {}
        # Topics whose latest duplicate was already checked against a replay (see live()).
        self.checked: set[str] = set()
        self.ready: deque[Delivery] = deque()
        # The refusals topic is learnt first: its answer tells the daemon's epoch.
        self.pending: deque[_Gap] = deque([_Gap(UNATTACHED_TOPIC, None)])
        self.pending.extend(_Gap(t, from_seq) for t in topics if t != UNATTACHED_TOPIC)
        if from_seq is not None:
            # Known before the replay from it is answered: a live event read while it is in
            # flight then shows a gap, instead of becoming the first and hiding older ones.
            self.expected.update((t, from_seq) for t in topics if t != UNATTACHED_TOPIC)
        self.epoch: int | None = None
        self.replaced: set[int] = set()
        """Epochs of daemons this subscription saw replaced by a newer one."""

    def live(self, topic_b: bytes, seq_b: bytes, payload: bytes) -> _Gap | None:
        """Take one live event; returns the replay to do first when it needs one.

        Raises ``EventsLost`` when the event comes from a restarted kvd.
        """
        topic = topic_b.decode()
        if self.topics and topic not in self.topics and topic != UNATTACHED_TOPIC:
            return None  # a longer topic that shares the prefix we subscribed to
        seq = decode_seq(seq_b)
        event = _EVENT_DECODER.decode(payload)
        epoch = event.epoch
        if epoch in self.replaced:
            # Published by a daemon since replaced, and still queued on the SUB socket (read
            # in turn with the new connection's events): its EventsLost was raised already.
            return None
        if epoch and self.epoch is not None and epoch != self.epoch:
            self._restarted(topic, epoch)
        expected = self.expected.setdefault(topic, seq)
        if seq < expected:
            # Usually the live copy of an event a replay already delivered. But after a kvd
            # restart every live seq is "old" (they begin again at 1): one replay per run of
            # duplicates tells, as its ReplayEnd then carries a new epoch.
            if topic in self.checked:
                return None
            self.checked.add(topic)
            return _Gap(topic, expected)
        if seq > expected:
            return _Gap(topic, expected, (seq, event))
        self._deliver(topic, seq, event)
        return None

    def resync(self) -> list[_Gap]:
        """Replays that would reveal events missed without a later event to show the gap."""
        return [_Gap(topic, expected) for topic, expected in self.expected.items()]

    def replayed(self, gap: _Gap, frames: list[tuple[int, bytes]], end_payload: bytes) -> None:
        """Queue what a replay answer brought; raises EventsLost if some events are gone."""
        end = _REPLAY_END_DECODER.decode(end_payload)
        if end.code:
            raise ReplayError(f"{end.code}: {end.message}")
        topic = gap.topic
        if self.epoch is None:
            self.epoch = end.epoch
        elif end.epoch != self.epoch:
            self._restarted(topic, end.epoch)
        if gap.from_seq is None:
            self.expected.setdefault(topic, end.newest_seq + 1)
            return
        self.expected.setdefault(topic, gap.from_seq)
        for seq, payload in frames:
            if seq >= self.expected[topic]:
                self._deliver(topic, seq, _EVENT_DECODER.decode(payload))
        if gap.live is not None and gap.live[0] >= self.expected[topic]:
            self._deliver(topic, *gap.live)
        if end.oldest_seq > gap.from_seq:
            raise EventsLost(topic, gap.from_seq, end.oldest_seq - 1)

    def _restarted(self, topic: str, epoch: int) -> None:
        """A new daemon: replay every known topic from its first event, then say so."""
        if self.epoch:
            self.replaced.add(self.epoch)
        self.epoch = epoch
        first = self.expected.get(topic, 1)
        self.expected.setdefault(topic, 1)
        self.checked.clear()
        self.pending.clear()
        for t in self.expected:
            self.expected[t] = 1
            self.pending.append(_Gap(t, 1))
        raise EventsLost(topic, first, -1, restarted=True)

    def _deliver(self, topic: str, seq: int, event: Event) -> None:
        self.expected[topic] = seq + 1
        self.checked.discard(topic)
        self.ready.append(Delivery(topic, seq, event))


def _configure_sub(sock: zmq.Socket[Any], endpoints: Endpoints, topics: list[str]) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    for topic in [*topics, UNATTACHED_TOPIC] if topics else [""]:
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sock.connect(endpoints.events)


def _replay_request(gap: _Gap) -> bytes:
    from_seq = _BASELINE if gap.from_seq is None else gap.from_seq
    return _ENCODER.encode(Replay(topic=gap.topic, from_seq=from_seq))


def _replay_socket(ctx: Any, endpoints: Endpoints) -> Any:
    """A DEALER of its own per replay: a late answer to an abandoned one is never mistaken for
    the next one's (``ctx`` is a ``zmq.Context`` or a ``zmq.asyncio.Context``)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoints.replay)
    return sock


class _ReplayAnswer:
    """The frames of one replay answer: events, then the ReplayEnd (``end``, its payload)."""

    def __init__(self) -> None:
        self.frames: list[tuple[int, bytes]] = []
        self.end: bytes | None = None

    def take(self, message: list[bytes]) -> None:
        _, seq_b, payload = message
        seq = decode_seq(seq_b)
        if seq == END_SEQ:
            self.end = payload
        else:
            self.frames.append((seq, payload))


@dataclass(slots=True)
class _InFlight:
    """A replay asked for and not yet answered: its socket, what came so far, the daemon epoch
    it was asked of, and when it counts as unanswered (``time.monotonic()``)."""

    gap: _Gap
    sock: Any
    answer: _ReplayAnswer
    epoch: int | None
    deadline: float


class _Replays:
    _check: Callable[[], None] | None
    _endpoints: Endpoints
    _timeout_ms: int
    _inflight: _InFlight | None
    _poller: Any
    _order: _Ordering

    def _end_replay(self) -> _InFlight:
        inflight = self._inflight
        assert inflight is not None
        self._inflight = None
        self._poller.unregister(inflight.sock)
        inflight.sock.close()
        return inflight

    def _answered(self, inflight: _InFlight) -> None:
        """A replay's whole answer came: queue what it brought (may raise EventsLost)."""
        assert inflight.answer.end is not None
        self._end_replay()
        if inflight.epoch != self._order.epoch:
            # Asked of a daemon since replaced: its restart replays every topic anew.
            return
        self._order.replayed(inflight.gap, inflight.answer.frames, inflight.answer.end)

    def _no_answer(self, gap: _Gap) -> ReplayError:
        """The error for a replay that got no answer: ``KvdUnavailable`` (raised by ``check``)
        when no daemon is there any more. The gap goes back first in line, the next poll asks
        again: no other poll would (a live event that revealed it is still in it, and a resync
        waits for silence)."""
        self._order.pending.appendleft(gap)
        if self._check is not None:
            self._check()
        return ReplayError(
            f"no replay answer from {self._endpoints.replay} in {self._timeout_ms / 1000:g}s"
        )


class Subscription(_Replays, Iterator[Delivery]):
    """Synchronous subscription to ``topics`` (cache ids; every topic when empty).

    With ``from_seq`` each topic is first replayed from that seq, so a subscriber that starts
    late still sees everything kvd buffered (use 1 for "everything").
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoints: Endpoints,
        topics: Iterable[str] = (),
        *,
        from_seq: int | None = None,
        timeout: float = 10.0,
        resync_interval: float = DEFAULT_RESYNC_INTERVAL,
        check: Callable[[], None] | None = None,
    ) -> None:
        self._order = _Ordering(list(topics), from_seq)
        self._check = check
        self._ctx = ctx
        self._endpoints = endpoints
        self._timeout_ms = int(timeout * 1000)
        self._resync_ms = int(resync_interval * 1000)
        self._heard = time.monotonic()
        """When the SUB socket last brought something, or kvd was last asked (resync)."""
        self._timeout_s = timeout
        self._inflight: _InFlight | None = None
        self._sub = ctx.socket(zmq.SUB)
        _configure_sub(self._sub, endpoints, self._order.topics)
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        # Learn the daemon's epoch and each topic's newest seq now: later events are then
        # delivered even if the SUB connection is still being set up when they are published.
        # Replays from ``from_seq`` wait for the first poll, which may raise EventsLost.
        pending = self._order.pending
        try:
            while pending and pending[0].from_seq is None:
                self._replay(pending.popleft())
        except BaseException:
            self._sub.close()
            raise

    def __next__(self) -> Delivery:
        while True:
            delivery = self.poll(self._resync_ms / 1000)
            if delivery is not None:
                return delivery

    def poll(self, timeout: float) -> Delivery | None:
        """The next delivery, or None if nothing arrives within ``timeout`` seconds.

        ``poll(0)`` on an empty subscription is one non-blocking socket poll (plus, once per
        resync interval of silence, the replay that asks kvd whether anything is newer).

        One replay is in flight at a time, and live events keep coming while it is: an event
        in order is delivered at once, whatever a replay still waits for (a kvd slow to answer
        one, on a starved core, no longer holds back the events it did publish). A replay with
        no answer in ``timeout`` raises ``ReplayError`` and is asked again by the next poll.
        """
        deadline = time.monotonic() + timeout
        order = self._order
        while True:
            if order.ready:
                return order.ready.popleft()
            if self._inflight is None and order.pending:
                self._start_replay(order.pending.popleft())
                continue  # an answer may already be ready, or ``replayed`` queued events
            now = time.monotonic()
            waits = [deadline - now, self._heard + self._resync_ms / 1000 - now]
            if self._inflight is not None:
                waits.append(self._inflight.deadline - now)
            # Rounded up: a deadline a fraction of a millisecond away is still a wait.
            wait_ms = max(0, math.ceil(min(waits) * 1000))
            ready = dict(self._poller.poll(wait_ms))
            if self._sub in ready:
                self._heard = time.monotonic()
                gap = order.live(*self._sub.recv_multipart())
                if gap is not None:
                    order.pending.append(gap)
                continue
            if self._inflight is not None and self._inflight.sock in ready:
                self._take_answer()
                continue
            now = time.monotonic()
            if self._inflight is not None and now >= self._inflight.deadline:
                gap = self._end_replay().gap
                raise self._no_answer(gap)
            if now - self._heard >= self._resync_ms / 1000:
                # Silent for a resync interval: ask kvd. Not at every empty poll: a
                # subscriber may poll with no wait in a loop, and a replay is a round trip.
                self._heard = now
                order.pending.extend(order.resync())
            elif now >= deadline:
                return None

    def _start_replay(self, gap: _Gap) -> None:
        sock = _replay_socket(self._ctx, self._endpoints)
        sock.send(_replay_request(gap))
        self._inflight = _InFlight(
            gap, sock, _ReplayAnswer(), self._order.epoch, time.monotonic() + self._timeout_s
        )
        self._poller.register(sock, zmq.POLLIN)

    def _take_answer(self) -> None:
        inflight = self._inflight
        assert inflight is not None
        while inflight.answer.end is None and inflight.sock.poll(0):
            inflight.answer.take(inflight.sock.recv_multipart())
        if inflight.answer.end is not None:
            self._answered(inflight)

    def _replay(self, gap: _Gap) -> None:
        """One replay, waited for (at creation, before any live event counts)."""
        sock = _replay_socket(self._ctx, self._endpoints)
        answer = _ReplayAnswer()
        try:
            sock.send(_replay_request(gap))
            while answer.end is None:
                if not sock.poll(self._timeout_ms):
                    raise self._no_answer(gap)
                answer.take(sock.recv_multipart())
        finally:
            sock.close()
        self._order.replayed(gap, answer.frames, answer.end)

    def close(self) -> None:
        if self._inflight is not None:
            self._end_replay()
        self._sub.close()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSubscription(_Replays, AsyncIterator[Delivery]):
    """The asyncio flavour of ``Subscription`` (``async for``; may raise EventsLost and go on).

    The baseline replay of explicit topics happens on the first ``__anext__``; events published
    between construction and then are still delivered (found by the idle resync). Later replays
    are in flight one at a time while live events keep coming, as in ``Subscription``.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoints: Endpoints,
        topics: Iterable[str] = (),
        *,
        from_seq: int | None = None,
        timeout: float = 10.0,
        resync_interval: float = DEFAULT_RESYNC_INTERVAL,
        check: Callable[[], None] | None = None,
    ) -> None:
        self._order = _Ordering(list(topics), from_seq)
        self._check = check
        self._ctx = ctx
        self._endpoints = endpoints
        self._timeout_ms = int(timeout * 1000)
        self._resync_ms = int(resync_interval * 1000)
        self._timeout_s = timeout
        self._inflight = None
        self._heard = time.monotonic()
        self._sub = ctx.socket(zmq.SUB)
        _configure_sub(self._sub, endpoints, self._order.topics)
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self._sub, zmq.POLLIN)

    async def __anext__(self) -> Delivery:
        order = self._order
        # The baseline first, waited for, as ``Subscription`` does at creation.
        while order.pending and order.pending[0].from_seq is None:
            await self._replay(order.pending.popleft())
        while True:
            if order.ready:
                return order.ready.popleft()
            if self._inflight is None and order.pending:
                await self._start_replay(order.pending.popleft())
                continue
            now = time.monotonic()
            waits = [self._heard + self._resync_ms / 1000 - now]
            if self._inflight is not None:
                waits.append(self._inflight.deadline - now)
            ready = dict(await self._poller.poll(max(0, math.ceil(min(waits) * 1000))))
            if self._sub in ready:
                self._heard = time.monotonic()
                gap = order.live(*await self._sub.recv_multipart())
                if gap is not None:
                    order.pending.append(gap)
                continue
            inflight = self._inflight
            if inflight is not None and inflight.sock in ready:
                while inflight.answer.end is None and await inflight.sock.poll(0):
                    inflight.answer.take(await inflight.sock.recv_multipart())
                if inflight.answer.end is not None:
                    self._answered(inflight)
                continue
            now = time.monotonic()
            if inflight is not None and now >= inflight.deadline:
                raise self._no_answer(self._end_replay().gap)
            if now - self._heard >= self._resync_ms / 1000:
                self._heard = now
                order.pending.extend(order.resync())

    async def _start_replay(self, gap: _Gap) -> None:
        sock = _replay_socket(self._ctx, self._endpoints)
        await sock.send(_replay_request(gap))
        self._inflight = _InFlight(
            gap, sock, _ReplayAnswer(), self._order.epoch, time.monotonic() + self._timeout_s
        )
        self._poller.register(sock, zmq.POLLIN)

    async def _replay(self, gap: _Gap) -> None:
        sock = _replay_socket(self._ctx, self._endpoints)
        answer = _ReplayAnswer()
        try:
            await sock.send(_replay_request(gap))
            while answer.end is None:
                if not await sock.poll(self._timeout_ms):
                    raise self._no_answer(gap)
                answer.take(await sock.recv_multipart())
        finally:
            sock.close()
        self._order.replayed(gap, answer.frames, answer.end)

    def close(self) -> None:
        if self._inflight is not None:
            self._end_replay()
        self._sub.close()
