"""Completion events: sequence numbers, the replay buffer, and the PUB and replay sockets.

Frames are (topic, seq, payload): topic is the cache id in UTF-8, seq an 8-byte big-endian
count per topic starting at 1, payload a msgpack ``Ready`` or ``Failed``. A subscriber that sees
a gap asks the replay socket for the events from the first missing seq; the answer ends with an
``END_SEQ`` frame carrying a ``ReplayEnd`` that says what the buffer still held.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

from kvd.daemon.sockets import raw_send
from kvd.protocol import END_SEQ, Event, Reason, Replay, ReplayEnd, encode_seq

log = logging.getLogger(__name__)

# Plain ints: pyzmq's flag enums cost more than the send itself on this hot path.
_MORE = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)


@dataclass(slots=True)
class _Topic:
    frame: bytes
    next_seq: int
    events: deque[tuple[int, bytes]]


class EventLog:
    """Per-topic sequence numbers and the last ``capacity`` encoded events of each topic."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._topics: dict[str, _Topic] = {}

    def append(self, topic: str, payload: bytes) -> tuple[bytes, int]:
        """Record one event; returns (topic frame, seq)."""
        entry = self._topics.get(topic)
        if entry is None:
            entry = _Topic(topic.encode(), 1, deque(maxlen=self.capacity))
            self._topics[topic] = entry
        seq = entry.next_seq
        entry.next_seq += 1
        entry.events.append((seq, payload))
        return entry.frame, seq

    def since(self, topic: str, from_seq: int) -> tuple[list[tuple[int, bytes]], int, int]:
        """Buffered events of ``topic`` with seq >= from_seq, and the (oldest, newest) held."""
        entry = self._topics.get(topic)
        if entry is None or not entry.events:
            return [], 0, 0
        oldest, newest = entry.events[0][0], entry.events[-1][0]
        if from_seq > newest:
            return [], oldest, newest
        skip = max(0, from_seq - oldest)
        events = list(entry.events)[skip:]
        return events, oldest, newest

    def last_seq(self, topic: str) -> int:
        entry = self._topics.get(topic)
        return entry.next_seq - 1 if entry else 0


class Publisher:
    """Publishes events on a PUB socket and answers replay requests on a ROUTER socket."""

    def __init__(self, pub: zmq.Socket[bytes], log_capacity: int, epoch: int = 0) -> None:
        self._pub = pub
        self.epoch = epoch
        self._encoder = msgspec.msgpack.Encoder()
        self._replay_decoder = msgspec.msgpack.Decoder(Replay)
        self.log = EventLog(log_capacity)

    def publish(self, topic: str, event: Event) -> int:
        payload = self._encoder.encode(event)
        frame, seq = self.log.append(topic, payload)
        # PUB never blocks: a subscriber past its high-water mark misses events and replays.
        pub = self._pub
        raw_send(pub, frame, _MORE)
        raw_send(pub, encode_seq(seq), _MORE)
        raw_send(pub, payload, _LAST)
        return seq

    def answer_replay(self, router: zmq.Socket[bytes], frames: list[bytes]) -> None:
        """Answer one replay request received on ``router`` (frames include the identity)."""
        identity, envelope, body = frames[0], frames[1:-1], frames[-1]
        try:
            request = self._replay_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("undecodable replay request: %s", exc)
            end = ReplayEnd(
                topic="",
                oldest_seq=0,
                newest_seq=0,
                epoch=self.epoch,
                code=Reason.INVALID_MESSAGE,
                message=str(exc),
            )
            router.send_multipart(
                [identity, *envelope, b"", encode_seq(END_SEQ), self._encoder.encode(end)]
            )
            return
        events, oldest, newest = self.log.since(request.topic, request.from_seq)
        topic = request.topic.encode()
        for seq, payload in events:
            router.send_multipart([identity, *envelope, topic, encode_seq(seq), payload])
        end = ReplayEnd(topic=request.topic, oldest_seq=oldest, newest_seq=newest, epoch=self.epoch)
        router.send_multipart(
            [identity, *envelope, topic, encode_seq(END_SEQ), self._encoder.encode(end)]
        )
