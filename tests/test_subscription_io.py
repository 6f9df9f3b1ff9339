"""A subscription's I/O when kvd answers replays late: live events are not held back by them.

kvd publishes events from its event loop and answers replays from a thread of its own; on a
starved core the replay answer can come seconds after the events were published. A stand-in
publisher with real ZMQ sockets (a PUB and a ROUTER, as kvd binds them) answers the baseline
replays at once and then stops answering, while it keeps publishing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvd.endpoints import Endpoints
from kvd.protocol import END_SEQ, Ready, Replay, ReplayEnd, encode_seq
from kvd.subscription import AsyncSubscription, ReplayError, Subscription

EPOCH = 11


class Publisher:
    """kvd's two event sockets; replays answered while ``answering`` is set."""

    def __init__(self, directory: Path) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.endpoints = Endpoints(
            control=f"ipc://{directory}/control.sock",
            ingest=f"ipc://{directory}/ingest.sock",
            events=f"ipc://{directory}/events.sock",
            replay=f"ipc://{directory}/replay.sock",
        )
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(self.endpoints.events)
        self.answering = threading.Event()
        self.answering.set()
        self.asked = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replays, daemon=True)
        self._thread.start()

    def _serve_replays(self) -> None:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(self.endpoints.replay)
        decoder = msgspec.msgpack.Decoder(Replay)
        while not self._stop.is_set():
            if not router.poll(20):
                continue
            peer, payload = router.recv_multipart()
            request = decoder.decode(payload)
            self.asked += 1
            if not self.answering.is_set():
                continue  # a starved kvd: the answer never comes in time
            end = ReplayEnd(topic=request.topic, oldest_seq=1, newest_seq=0, epoch=EPOCH, code="")
            router.send_multipart(
                [peer, request.topic.encode(), encode_seq(END_SEQ), msgspec.msgpack.encode(end)]
            )
        router.close()

    def publish(self, seq: int) -> None:
        event = Ready(req_id=f"r{seq}", cache_id="c", physical_block_ids=[seq], epoch=EPOCH)
        self.pub.send_multipart([b"c", encode_seq(seq), msgspec.msgpack.encode(event)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close()
        self.ctx.term()


@pytest.fixture
def publisher(tmp_path: Path) -> Iterator[Publisher]:
    p = Publisher(tmp_path)
    yield p
    p.close()


def test_a_replay_kvd_answers_late_does_not_hold_back_published_events(
    publisher: Publisher,
) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = Subscription(ctx, publisher.endpoints, ["c"], timeout=3.0, resync_interval=0.05)
    try:
        assert publisher.asked == 2  # the baseline: the refusals topic, then "c"
        publisher.answering.clear()
        # Silence past the resync interval: the subscription asks kvd whether anything is
        # newer, and that replay goes unanswered.
        assert sub.poll(0.3) is None
        assert publisher.asked == 3
        # The SUB connection may still be joining: publish until the first event gets through.
        received = None
        for _ in range(200):
            publisher.publish(1)
            received = sub.poll(0.05)
            if received is not None:
                break
        assert received is not None, "no live event delivered while a replay was unanswered"
        assert (received.topic, received.seq, received.event.req_id) == ("c", 1, "r1")
        publisher.publish(2)
        second = sub.poll(2.0)
        assert second is not None and second.seq == 2
        # The unanswered replay still counts: past its timeout the next poll says so, once.
        with pytest.raises(ReplayError, match="no replay answer"):
            for _ in range(20):
                sub.poll(0.5)
    finally:
        sub.close()
        ctx.term()


async def test_the_async_flavour_delivers_published_events_past_an_unanswered_replay(
    publisher: Publisher,
) -> None:
    ctx = zmq.asyncio.Context()
    sub = AsyncSubscription(ctx, publisher.endpoints, ["c"], timeout=3.0, resync_interval=0.05)
    try:
        publisher.publish(0)  # nobody hears it: the SUB connection is not there yet
        first = asyncio.ensure_future(sub.__anext__())
        # The baseline is answered; then silence, and the resync replay goes unanswered.
        while publisher.asked < 2:
            await asyncio.sleep(0.01)
        publisher.answering.clear()
        while publisher.asked < 3:
            await asyncio.sleep(0.01)
        for _ in range(200):
            publisher.publish(1)
            done, _ = await asyncio.wait({first}, timeout=0.05)
            if done:
                break
        received = first.result()
        assert (received.topic, received.seq, received.event.req_id) == ("c", 1, "r1")
        with pytest.raises(ReplayError, match="no replay answer"):
            for _ in range(20):
                await asyncio.wait_for(sub.__anext__(), timeout=5)
    finally:
        sub.close()
        ctx.term()
