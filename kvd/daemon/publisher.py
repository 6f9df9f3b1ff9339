"""Completion events: sequence numbers, the replay buffer, the PUB socket and the replay thread.

Frames are (topic, seq, payload): topic is the cache id in UTF-8, seq an 8-byte big-endian
count per topic starting at 1, payload a msgpack ``Ready`` or ``Failed`` carrying the daemon's
epoch. A subscriber that sees a gap asks the replay socket for the events from the first missing
seq; the answer ends with an ``END_SEQ`` frame carrying a ``ReplayEnd`` that says what the
buffer still held.

Replays are served by a thread of their own, so a replay of the whole buffer never stalls the
event loop; the buffer is bounded by events per topic and by bytes in all, and a replay goes out
through a bounded queue per peer, so a peer that does not read cannot make kvd hold more. The
thread serves every peer in turn, never waiting on one: a stalled peer delays nobody.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import islice

import msgspec
import zmq

from kvd.daemon.logs import clipped
from kvd.daemon.metrics import Counter
from kvd.daemon.zmq_io import raw_send
from kvd.protocol import END_SEQ, Event, Reason, Replay, ReplayEnd, encode_seq

log = logging.getLogger(__name__)

# Plain ints: pyzmq's flag enums cost more than the send itself on this hot path.
_MORE = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)

EVENT_OVERHEAD = 4 << 10
"""What an event adds to the block ids it echoes from its notification (fields, a message)."""


def peer_queue(queue_bytes: int, max_message_bytes: int) -> int:
    """Messages of the largest event that fit in ``queue_bytes``: a ZMQ queue is counted in
    messages, so this bounds it by bytes."""
    return max(1, queue_bytes // (max_message_bytes + EVENT_OVERHEAD))


REPLAY_STALL_S = 5.0
"""How long a replay waits for a peer that stopped reading before giving up on it."""
REPLAY_ANSWERS = 1024
"""Replay answers in progress at once, all peers together."""
REPLAY_ANSWERS_PER_PEER = 4
"""Replay answers in progress for one peer: one peer's requests cannot crowd out others'."""
REPLAY_RETRY_MS = 2
"""While no peer took a message, how often their queues are looked at again."""


@dataclass(slots=True)
class _Topic:
    name: str
    frame: bytes
    next_seq: int
    payloads: deque[bytes]
    """The newest events of the topic, oldest first: seqs ``next_seq - len(payloads)`` on."""
    dropped: int = 0
    """How many of the topic's first entries in ``EventLog._order`` name events its capacity
    already dropped."""


class EventLog:
    """Per-topic sequence numbers and the recent encoded events of each topic.

    Holds at most ``capacity`` events per topic and ``max_bytes`` of payloads in all (the
    oldest events of all go first). Nothing else grows: the order of events across topics,
    kept for that eviction, names at most ``capacity`` events more than are held (with one
    topic, none). Appends come from the event loop, reads from the replay thread: a lock
    guards both, held only to copy references.
    """

    def __init__(self, capacity: int, max_bytes: int = 256 << 20) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.held = 0
        """Events held, all topics together."""
        self._topics: dict[str, _Topic] = {}
        self._order: deque[str] = deque()
        """The topic of each event in the order they were appended, oldest first: a topic's
        entries are its events in seq order, of which the first ``_Topic.dropped`` are gone.
        Each entry is the topic's one name object: an event adds no object of its own, so
        nothing here makes the garbage collector run or walk more."""
        self._lock = threading.Lock()

    def append(self, topic: str, payload: bytes) -> tuple[bytes, int]:
        """Record one event; returns (topic frame, seq)."""
        with self._lock:
            entry = self._topics.get(topic)
            if entry is None:
                entry = _Topic(topic, topic.encode(), 1, deque())
                self._topics[topic] = entry
            seq = entry.next_seq
            entry.next_seq = seq + 1
            payloads = entry.payloads
            payloads.append(payload)
            order = self._order
            order.append(entry.name)
            self.nbytes += len(payload)
            if len(payloads) > self.capacity:
                self.nbytes -= len(payloads.popleft())
                # The event dropped was the topic's oldest: when the order starts with it (one
                # topic, or this one's turn), it leaves the order too.
                if not entry.dropped and order[0] is entry.name:
                    order.popleft()
                else:
                    entry.dropped += 1
            else:
                self.held += 1
            while self.nbytes > self.max_bytes and order:
                self._evict_oldest()
            if len(order) > self.held + self.capacity:
                self._compact()
            return entry.frame, seq

    def _evict_oldest(self) -> None:
        # Per-topic order is global order, so the oldest event overall is its topic's oldest,
        # unless the per-topic capacity already dropped it.
        entry = self._topics[self._order.popleft()]
        if entry.dropped:
            entry.dropped -= 1
        else:
            self.nbytes -= len(entry.payloads.popleft())
            self.held -= 1

    def _compact(self) -> None:
        """Drop the order's entries of events already gone (a topic's first ``dropped``)."""
        gone = {name: t.dropped for name, t in self._topics.items() if t.dropped}
        kept: deque[str] = deque()
        for name in self._order:
            left = gone.get(name)
            if left:
                gone[name] = left - 1
            else:
                kept.append(name)
        for entry in self._topics.values():
            entry.dropped = 0
        self._order = kept

    def since(self, topic: str, from_seq: int) -> tuple[list[tuple[int, bytes]], int, int]:
        """Buffered events of ``topic`` with seq >= from_seq, and the (oldest, newest) held."""
        with self._lock:
            entry = self._topics.get(topic)
            if entry is None or not entry.payloads:
                return [], 0, 0
            payloads = entry.payloads
            newest = entry.next_seq - 1
            oldest = newest - len(payloads) + 1
            if from_seq > newest:
                return [], oldest, newest
            skip = max(0, from_seq - oldest)
            seqs = range(oldest + skip, newest + 1)
            events = list(zip(seqs, islice(payloads, skip, None), strict=True))
        return events, oldest, newest

    def last_seq(self, topic: str) -> int:
        with self._lock:
            entry = self._topics.get(topic)
            return entry.next_seq - 1 if entry else 0


class Publisher:
    """Publishes events on a PUB socket; ``ReplayServer`` answers replays from its log."""

    def __init__(
        self, pub: zmq.Socket[bytes], log_capacity: int, epoch: int, log_bytes: int = 256 << 20
    ) -> None:
        self._pub = pub
        self.epoch = epoch
        self._encoder = msgspec.msgpack.Encoder()
        self.log = EventLog(log_capacity, log_bytes)

    def publish(self, topic: str, event: Event) -> int:
        payload = self._encoder.encode(event)
        frame, seq = self.log.append(topic, payload)
        # PUB never blocks: a subscriber past its high-water mark misses events and replays.
        pub = self._pub
        raw_send(pub, frame, _MORE)
        raw_send(pub, encode_seq(seq), _MORE)
        raw_send(pub, payload, _LAST)
        return seq


class ReplayServer:
    """Answers ``Replay`` requests on a ROUTER socket from a thread of its own.

    The socket belongs to the thread from ``start`` on; its queue per peer and its largest
    request are set before it is bound (``Server.startup``). Each answer is the buffered events
    from the requested seq, then a ``ReplayEnd``. Answers in progress are served in turn, each
    as far as its peer's queue takes it, so a peer that does not read delays nobody: it is
    given up on after ``REPLAY_STALL_S`` without progress, and forgotten as soon as it
    disconnects. At most ``REPLAY_ANSWERS`` answers are in progress, and
    ``REPLAY_ANSWERS_PER_PEER`` for one peer; a request past that is dropped and counted (its
    subscription asks again).
    """

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        events: EventLog,
        epoch: int,
        answered: Counter,
        *,
        abandoned: Counter,
        dropped: Counter,
    ) -> None:
        self._sock = sock
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone peer is an error, not a silent drop
        self._log = events
        self._epoch = epoch
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Replay)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvd-replay", daemon=True)
        self._answers: deque[_Answer] = deque()
        self._per_peer: dict[bytes, int] = {}
        # Counted by this thread, their only writer.
        self.answered = answered
        self.abandoned = abandoned
        """Answers given up on: the peer stopped reading, or left."""
        self.dropped = dropped
        """Requests dropped because too many answers were in progress."""

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        sock = self._sock
        wait_ms = 100
        while not self._stopping.is_set():
            if sock.poll(wait_ms, zmq.POLLIN):
                self._take_requests()
            progressed = self._serve()
            # Idle: wake for requests. Peers that did not read: look at their queues soon.
            wait_ms = 0 if progressed else (REPLAY_RETRY_MS if self._answers else 100)

    def _take_requests(self) -> None:
        for _ in range(REPLAY_ANSWERS):  # a budget, so answers in progress get their turn
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._start(frames)
            # One bad request must not end the thread that serves every replay.
            except Exception:
                log.exception("replay request failed")

    def _start(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        envelope, body = frames[:-1], frames[-1]
        peer = envelope[0]
        if (
            len(self._answers) >= REPLAY_ANSWERS
            or self._per_peer.get(peer, 0) >= REPLAY_ANSWERS_PER_PEER
        ):
            self.dropped.value += 1
            log.warning("too many replays in progress: a request is dropped")
            return
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        try:
            request = self._decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            log.warning("undecodable replay request: %s", exc)
            end = ReplayEnd(
                topic="",
                oldest_seq=0,
                newest_seq=0,
                epoch=self._epoch,
                code=Reason.INVALID_MESSAGE,
                message=clipped(str(exc)),
            )
            self._answers.append(_Answer(envelope, b"", [], self._encoder.encode(end)))
            return
        events, oldest, newest = self._log.since(request.topic, request.from_seq)
        end = ReplayEnd(
            topic=request.topic, oldest_seq=oldest, newest_seq=newest, epoch=self._epoch
        )
        answer = _Answer(envelope, request.topic.encode(), events, self._encoder.encode(end))
        self._answers.append(answer)

    def _serve(self) -> bool:
        """Send each answer in progress as far as its peer takes it; True if any frame went."""
        progressed = False
        now = time.monotonic()
        for _ in range(len(self._answers)):
            answer = self._answers.popleft()
            try:
                sent = self._send(answer)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                self._forget(answer)  # the peer disconnected
                self.abandoned.value += 1
                continue
            if sent:
                progressed = True
                answer.stalled_since = now
            elif now - answer.stalled_since > REPLAY_STALL_S:
                self._forget(answer)
                self.abandoned.value += 1
                log.warning("replay peer stopped reading; its replay is abandoned")
                continue
            if not answer.done:
                self._answers.append(answer)
                continue
            self._forget(answer)
            if answer.topic:
                self.answered.value += 1
        return progressed

    def _forget(self, answer: _Answer) -> None:
        peer = answer.envelope[0]
        left = self._per_peer[peer] - 1
        if left:
            self._per_peer[peer] = left
        else:
            del self._per_peer[peer]

    def _send(self, answer: _Answer) -> int:
        """Send what the peer's queue takes now; returns how many messages went."""
        sock, envelope, topic = self._sock, answer.envelope, answer.topic
        sent = 0
        try:
            while answer.next < len(answer.events):
                seq, payload = answer.events[answer.next]
                sock.send_multipart([*envelope, topic, encode_seq(seq), payload], zmq.NOBLOCK)
                answer.next += 1
                sent += 1
            sock.send_multipart([*envelope, topic, encode_seq(END_SEQ), answer.end], zmq.NOBLOCK)
            answer.done = True
            sent += 1
        except zmq.Again:
            pass  # the peer's queue is full (or it is still connecting): its turn comes again
        return sent


@dataclass(slots=True)
class _Answer:
    """A replay in progress: the events still to send to one peer, then its ``ReplayEnd``."""

    envelope: list[bytes]
    topic: bytes
    events: list[tuple[int, bytes]]
    end: bytes
    next: int = 0
    done: bool = False
    stalled_since: float = field(default_factory=time.monotonic)
