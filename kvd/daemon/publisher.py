"""Completion events: sequence numbers, the replay buffer, the PUB socket and the replay thread.

Frames are (topic, seq, payload): topic is the cache id in UTF-8, seq an 8-byte big-endian
count per topic starting at 1, payload a msgpack ``Ready`` or ``Failed`` carrying the daemon's
epoch. A subscriber that sees a gap asks the replay socket for the events from the first missing
seq; the answer ends with an ``END_SEQ`` frame carrying a ``ReplayEnd`` that says what the
buffer still held.

Replays are served by a thread of their own, so a replay of the whole buffer never stalls the
event loop; the buffer is bounded by events per topic and by bytes in all, and a replay goes out
through a bounded queue per peer, so a peer that does not read cannot make kvd hold more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import islice

import msgspec
import zmq

from kvd.daemon.metrics import Counter
from kvd.daemon.sockets import raw_send
from kvd.protocol import END_SEQ, Event, Reason, Replay, ReplayEnd, encode_seq

log = logging.getLogger(__name__)

# Plain ints: pyzmq's flag enums cost more than the send itself on this hot path.
_MORE = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)

REPLAY_QUEUE = 1024
"""Frames queued per replaying peer before kvd waits for it to read."""
REPLAY_STALL_S = 5.0
"""How long a replay waits for a peer that stopped reading before giving up on it."""


@dataclass(slots=True)
class _Topic:
    frame: bytes
    next_seq: int
    payloads: deque[bytes]
    """The newest events of the topic, oldest first: seqs ``next_seq - len(payloads)`` on."""


class EventLog:
    """Per-topic sequence numbers and the recent encoded events of each topic.

    Holds at most ``capacity`` events per topic and ``max_bytes`` of payloads in all (the
    oldest events of all go first). Nothing else grows: the order of events across topics,
    kept for that eviction, is compacted whenever it names ``capacity`` events more than are
    held. Appends come from the event loop, reads from the replay thread: a lock guards both,
    held only to copy references.
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
        self._order: deque[tuple[str, int]] = deque()
        """(topic, seq) of events in the order they were appended, oldest first; some may
        already be gone (dropped by their topic's capacity) until the next compaction. By
        name: a tuple of a str and an int is not tracked by the garbage collector, and a
        full collection would otherwise walk every one of them."""
        self._lock = threading.Lock()

    def append(self, topic: str, payload: bytes) -> tuple[bytes, int]:
        """Record one event; returns (topic frame, seq)."""
        with self._lock:
            entry = self._topics.get(topic)
            if entry is None:
                entry = _Topic(topic.encode(), 1, deque())
                self._topics[topic] = entry
            seq = entry.next_seq
            entry.next_seq = seq + 1
            payloads = entry.payloads
            payloads.append(payload)
            self._order.append((topic, seq))
            self.nbytes += len(payload)
            if len(payloads) > self.capacity:
                self.nbytes -= len(payloads.popleft())
            else:
                self.held += 1
            while self.nbytes > self.max_bytes and self._order:
                self._evict_oldest()
            if len(self._order) > self.held + self.capacity:
                self._order = deque(e for e in self._order if self._held(*e))
            return entry.frame, seq

    def _evict_oldest(self) -> None:
        topic, seq = self._order.popleft()
        # Per-topic order is global order, so the oldest event overall is its topic's oldest,
        # unless the per-topic capacity already dropped it.
        if self._held(topic, seq):
            self.nbytes -= len(self._topics[topic].payloads.popleft())
            self.held -= 1

    def _held(self, topic: str, seq: int) -> bool:
        """Whether event ``seq`` of ``topic`` is still held (a topic holds its newest seqs)."""
        entry = self._topics[topic]
        return seq >= entry.next_seq - len(entry.payloads)

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

    The socket belongs to the thread from ``start`` on. Each answer is the buffered events
    from the requested seq, then a ``ReplayEnd``; a peer that stops reading for
    ``REPLAY_STALL_S`` or goes away is given up on (its subscription asks again).
    """

    def __init__(
        self, sock: zmq.Socket[bytes], events: EventLog, epoch: int, answered: Counter
    ) -> None:
        self._sock = sock
        sock.setsockopt(zmq.SNDHWM, REPLAY_QUEUE)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._log = events
        self._epoch = epoch
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Replay)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvd-replay", daemon=True)
        self.answered = answered
        self.abandoned = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        sock = self._sock
        while not self._stopping.is_set():
            if not sock.poll(100, zmq.POLLIN):
                continue
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            try:
                self._answer(frames)
            # One bad request must not end the thread that serves every replay.
            except Exception:
                log.exception("replay request failed")

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        envelope, body = frames[:-1], frames[-1]
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
                message=str(exc)[:1000],
            )
            self._send([*envelope, b"", encode_seq(END_SEQ), self._encoder.encode(end)])
            return
        events, oldest, newest = self._log.since(request.topic, request.from_seq)
        topic = request.topic.encode()
        for seq, payload in events:
            if not self._send([*envelope, topic, encode_seq(seq), payload]):
                self.abandoned += 1
                return
        end = ReplayEnd(
            topic=request.topic, oldest_seq=oldest, newest_seq=newest, epoch=self._epoch
        )
        if self._send([*envelope, topic, encode_seq(END_SEQ), self._encoder.encode(end)]):
            self.answered.value += 1

    def _send(self, frames: list[bytes]) -> bool:
        """Send one answer frame set; False when the peer is gone or stopped reading."""
        deadline = time.monotonic() + REPLAY_STALL_S
        while True:
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK)
                return True
            except zmq.Again:
                # The peer's queue is full (or it is still connecting): wait for it to read.
                if time.monotonic() > deadline or self._stopping.is_set():
                    log.warning("replay peer stopped reading; its replay is abandoned")
                    return False
                time.sleep(0.001)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    return False  # the peer disconnected
                raise
