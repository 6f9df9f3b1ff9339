"""Exactly once, whatever a client sends: each scenario an unlucky or hostile engine can create,
against a real ``kvd serve``, real sockets and real shared memory.

The post-process is a permutation: applied twice to the same landed bytes it corrupts the cache
silently. So these tests check bytes, not only events.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from kvd.client import Client, EventsLost, KvdError, ShmCache
from kvd.daemon_process import DaemonProcess
from kvd.protocol import Failed, Ready
from tests.daemon_helpers import collect, rss_mib, wait_for
from tests.reference import expected_block, random_bytes, same_bytes

_ids = itertools.count()


def unique(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


def read_done(
    client: Client, req_id: str, cache_id: str, blocks: list[int], **extra: object
) -> None:
    """A ReadDone as raw fields: HND pages into the NHD cache at ratio 1 unless told otherwise."""
    fields = {
        "type": "read_done",
        "req_id": req_id,
        "cache_id": cache_id,
        "remote_layout": "HND",
        "physical_block_ids": blocks,
        "block_size_ratio": 1,
        **extra,
    }
    client.send_raw(msgspec.msgpack.encode(fields))


def fill(cache: ShmCache, seed: int) -> list[torch.Tensor]:
    before = []
    for i, t in enumerate(cache.tensors):
        t.copy_(random_bytes(list(t.shape), t.dtype, seed + i))
        before.append(t.clone())
    return before


def rewritten(
    was: torch.Tensor, *, ratio: int = 1, heads: int = 2, block_size: int = 8
) -> torch.Tensor:
    """One K or V page of an NHD cache after the HND -> NHD post-process of ``was``."""
    return expected_block(
        was,
        kv_parts=1,
        block_size=block_size,
        heads=heads,
        ratio=ratio,
        remote_layout="HND",
        local_layout="NHD",
    )


def small_cache() -> ShmCache:
    return ShmCache.create(
        num_layers=2, num_blocks=16, block_size=8, num_heads=2, head_dim=16, layout="NHD"
    )


def events_for(client: Client, cache_id: str, count: int, timeout: float = 30.0) -> list:
    with client.subscribe([cache_id], from_seq=1) as sub:
        return [d.event for d in collect(sub, count, timeout)]


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess("--log-level", "debug") as d:
        yield d


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Client]:
    with daemon.client() as c:
        yield c


# -- 1. a re-sent ReadDone never rewrites blocks again --------------------------------------------


def test_a_resent_read_done_repeats_its_outcome_and_rewrites_nothing(client: Client) -> None:
    cache = small_cache()
    try:
        cache_id = unique("resend")
        client.attach(cache_id, cache.specs)
        before = fill(cache, 1)
        with client.subscribe([cache_id], from_seq=1) as sub:
            read_done(client, "req-1", cache_id, [3])
            (first,) = collect(sub, 1)
            assert isinstance(first.event, Ready), first.event
            want = rewritten(before[0][0, 3])
            assert same_bytes(cache.tensors[0][0, 3], want)

            read_done(client, "req-1", cache_id, [3])  # the engine lost the event and retries
            (again,) = collect(sub, 1)
            assert isinstance(again.event, Ready), again.event
            assert again.event.physical_block_ids == [3]
            assert same_bytes(cache.tensors[0][0, 3], want), "the re-send rewrote the block"

            # The engine read the blocks again: a new generation is a new notification.
            for tensor, was in zip(cache.tensors, before, strict=True):
                tensor[:, 3].copy_(was[:, 3])
            read_done(client, "req-1", cache_id, [3], generation=1)
            (third,) = collect(sub, 1)
            assert isinstance(third.event, Ready) and third.event.generation == 1
            assert same_bytes(cache.tensors[0][0, 3], want)

            # An older generation than the last one is stale: refused, nothing touched.
            read_done(client, "req-1", cache_id, [3], generation=0)
            (stale,) = collect(sub, 1)
            assert stale.event.generation == 0
            assert same_bytes(cache.tensors[0][0, 3], want)
        assert same_bytes(cache.tensors[1], rewritten_all(before[1], {3}))
    finally:
        cache.close()


def rewritten_all(was: torch.Tensor, blocks: set[int]) -> torch.Tensor:
    """A whole split NHD tensor after the HND -> NHD post-process of ``blocks``."""
    out = was.clone()
    for part in range(2):
        for b in blocks:
            out[part, b] = rewritten(was[part, b])
    return out


# -- 9. a duplicate never looks like the original's outcome ---------------------------------------


def test_a_duplicate_in_flight_is_never_answered_as_a_failure() -> None:
    # A 1 s window holds the first notification in its batch while the duplicate arrives.
    with DaemonProcess("--batch-window-us", "1000000") as d, d.client() as client:
        cache = small_cache()
        try:
            client.attach("dup", cache.specs)
            before = fill(cache, 2)
            with client.subscribe(["dup"], from_seq=1) as sub:
                read_done(client, "req-d", "dup", [5, 6])
                read_done(client, "req-d", "dup", [5, 6])
                read_done(client, "req-d", "dup", [7])  # same id, other blocks: still a repeat
                client.read_failed("req-d", "dup", [5, 6], "late ReadFailed for the same READ")
                read_done(client, "marker", "dup", [9], remote_layout="NHD")
                events = [x.event for x in collect(sub, 2)]
                assert sub.poll(1.5) is None, "more than one event for one notification"
            by_req = {e.req_id: e for e in events}
            assert isinstance(by_req["req-d"], Ready), by_req["req-d"]
            assert by_req["req-d"].physical_block_ids == [5, 6]
            assert same_bytes(cache.tensors[0][0, 5], rewritten(before[0][0, 5]))
            assert same_bytes(cache.tensors[0][0, 7], before[0][0, 7])
        finally:
            cache.close()


# -- 4. a segment shrunk after Attach does not kill kvd -------------------------------------------


def test_a_truncated_segment_fails_its_requests_and_kvd_keeps_serving(client: Client) -> None:
    shrunk, healthy = small_cache(), small_cache()
    try:
        shrunk_id, healthy_id = unique("shrunk"), unique("healthy")
        client.attach(shrunk_id, shrunk.specs)
        client.attach(healthy_id, healthy.specs)
        before = fill(healthy, 3)
        os.truncate(shrunk.path, 0)
        read_done(client, "on-shrunk", shrunk_id, [1])
        (failed,) = events_for(client, shrunk_id, 1)
        assert isinstance(failed, Failed) and failed.code == "memory_unavailable", failed
        assert "shrank" in failed.message
        client.ping()
        read_done(client, "on-healthy", healthy_id, [2])
        (ready,) = events_for(client, healthy_id, 1)
        assert isinstance(ready, Ready)
        assert same_bytes(healthy.tensors[0][0, 2], rewritten(before[0][0, 2]))
    finally:
        shrunk.close()
        healthy.close()


# -- 5. one bad frame cannot stall a connection ---------------------------------------------------


def deeply_nested(depth: int) -> bytes:
    head = msgspec.msgpack.encode({"type": "read_done", "req_id": "deep", "cache_id": "x"})
    # Replace the map header (3 entries) by 4 and add a key whose value nests `depth` arrays.
    return b"\x84" + head[1:] + msgspec.msgpack.encode("nest") + b"\x91" * depth + b"\xc0"


def test_a_deeply_nested_frame_does_not_stall_the_connection(client: Client) -> None:
    cache = small_cache()
    try:
        cache_id = unique("nested")
        client.attach(cache_id, cache.specs)
        frame = deeply_nested(200_000)
        assert len(frame) > 200_000
        with client.subscribe([cache_id]) as sub:
            client.send_raw(frame)
            for i in range(3):  # queued behind it on the same connection
                read_done(client, f"after-{i}", cache_id, [i], remote_layout="NHD")
            events = {d.event.req_id: d.event for d in collect(sub, 4, timeout=20)}
        assert set(events) == {"deep", "after-0", "after-1", "after-2"}
        # Its routing fields were read without recursion: its engine gets an answer too.
        assert isinstance(events.pop("deep"), Failed)
        assert all(isinstance(e, Ready) for e in events.values())
        wait_for(lambda: client.status().rejections.get("invalid_message", 0) >= 1)
    finally:
        cache.close()


# -- 6. aliased memory is never rewritten twice ---------------------------------------------------


def test_two_tensors_over_the_same_bytes_are_refused(client: Client) -> None:
    cache = small_cache()
    try:
        twice = [cache.specs[0], msgspec.structs.replace(cache.specs[0], name="again")]
        with pytest.raises(KvdError) as refused:
            client.attach(unique("alias"), twice)
        assert refused.value.code == "invalid_cache"
        assert "overlap" in refused.value.message

        client.attach(unique("first"), cache.specs)
        with pytest.raises(KvdError) as second:
            client.attach(unique("second"), cache.specs)
        assert second.value.code == "invalid_cache" and "overlap" in second.value.message
    finally:
        cache.close()


# -- 10. a typo cannot hang the caller ------------------------------------------------------------


def test_a_notification_for_a_cache_nobody_attached_reaches_the_subscriber(client: Client) -> None:
    cache = small_cache()
    try:
        cache_id = unique("engine")
        client.attach(cache_id, cache.specs)
        with client.subscribe([cache_id]) as sub:
            read_done(client, "req-x", cache_id + "-typo", [1])
            (event,) = collect(sub, 1, timeout=10)
            assert isinstance(event.event, Failed) and event.event.req_id == "req-x"
            assert event.event.code == "unknown_cache"
        with pytest.raises(KvdError) as typo:
            client.read_done("req-y", "engin0", [1], remote_layout="HND", block_size_ratio=1)
        assert typo.value.code == "unknown_cache"
    finally:
        cache.close()


# -- 8. memory is bounded by bytes ----------------------------------------------------------------


def test_rejections_for_unknown_caches_keep_no_state(daemon: DaemonProcess, client: Client) -> None:
    client.ping()
    start = rss_mib(daemon.proc.pid)
    for i in range(200):
        read_done(client, f"huge-{i}", "c" * 900_000 + str(i), [1])
    wait_for(lambda: client.status().counters["ingest_messages"] >= 200, timeout=60)
    client.ping()
    grown = rss_mib(daemon.proc.pid) - start
    assert grown < 100, f"RSS grew by {grown:.0f} MiB for 200 rejected notifications"


def test_an_oversized_notification_is_answered_without_echoing_it(client: Client) -> None:
    cache = small_cache()
    try:
        cache_id = unique("oversized")
        client.attach(cache_id, cache.specs)
        read_done(client, "too-big", cache_id, list(range(6_000_000)))
        (failed,) = events_for(client, cache_id, 1, timeout=60)
        assert isinstance(failed, Failed) and failed.code == "message_too_large"
        assert len(failed.invalid_block_ids) <= 1024
    finally:
        cache.close()


def test_replays_are_bounded_and_do_not_stall_the_daemon() -> None:
    with DaemonProcess() as d, d.client(timeout=30) as client:
        # Events of about 1.3 KB each (256 block ids): 85 MB in the buffer.
        cache = ShmCache.create(
            num_layers=1, num_blocks=256, block_size=8, num_heads=1, head_dim=8, layout="NHD"
        )
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            client.attach("replayed", cache.specs)
            n = 65536
            blocks = list(range(256))
            for i in range(n):
                read_done(client, f"r{i}", "replayed", blocks, remote_layout="NHD")
            wait_for(lambda: client.status().counters["events_published"] >= n, timeout=120)
            start = rss_mib(d.proc.pid)
            readers = []
            for _ in range(4):  # replay everything to peers that never read
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 1)
                sock.connect(d.endpoints().replay)
                sock.send(
                    msgspec.msgpack.encode({"type": "replay", "topic": "replayed", "from_seq": 1})
                )
                readers.append(sock)
            client.ping()
            peak = start
            for _ in range(20):
                peak = max(peak, rss_mib(d.proc.pid))
                client.ping()
            assert peak - start < 100, f"RSS grew by {peak - start:.0f} MiB serving 4 replays"
            for sock in readers:
                sock.close()
        finally:
            ctx.term()
            cache.close()


def test_planning_a_fine_grained_geometry_is_bounded(daemon: DaemonProcess, client: Client) -> None:
    # 16 MiB in one block of one-byte rows: 16 M rows to plan if nothing bounds it.
    cache = ShmCache.create(
        num_layers=1,
        num_blocks=1,
        block_size=4096,
        num_heads=4096,
        head_dim=1,
        dtype="uint8",
        layout="NHD",
        kv_arrangement="single",
    )
    try:
        client.ping()
        start = rss_mib(daemon.proc.pid)
        cache_id = unique("fine")
        try:
            client.attach(cache_id, cache.specs)
        except KvdError as refused:
            assert refused.code == "invalid_cache"
            return
        read_done(client, "fine-1", cache_id, [0])
        (_answer,) = events_for(client, cache_id, 1, timeout=60)
        grown = rss_mib(daemon.proc.pid) - start
        assert grown < 300, f"RSS grew by {grown:.0f} MiB planning one request"
        client.ping()
    finally:
        cache.close()


# -- 7. no subscription ever loses an event silently ----------------------------------------------


def test_a_subscription_to_every_topic_learns_of_a_restart(short_tmp: Path) -> None:
    cache = small_cache()
    try:
        first = DaemonProcess(runtime_dir=short_tmp).start()
        client = first.client()
        client.attach("everything", cache.specs)
        sub = client.subscribe()  # every topic
        for i in range(5):
            read_done(client, f"old-{i}", "everything", [i], remote_layout="NHD")
        assert len(collect(sub, 5)) == 5
        assert first.stop() == 0
        second = DaemonProcess(runtime_dir=short_tmp).start()
        try:
            client.attach("everything", cache.specs)
            for i in range(2):
                read_done(client, f"new-{i}", "everything", [i], remote_layout="NHD")
            got: list[str] = []
            lost = False
            deadline = time.monotonic() + 20
            while len(got) < 2 and time.monotonic() < deadline:
                try:
                    delivery = sub.poll(0.5)
                except EventsLost:  # says the restart out loud
                    lost = True
                    continue
                if delivery is not None:
                    got.append(delivery.event.req_id)
            assert got == ["new-0", "new-1"], f"events after the restart: {got} (lost={lost})"
            assert lost, "the restart was not reported"
        finally:
            sub.close()
            client.close()
            second.stop()
    finally:
        cache.close()


# -- 2. a crash never leaves the engine guessing --------------------------------------------------

CRASH_GEOMETRY = {"num_layers": 4, "block_size": 64, "num_heads": 8, "head_dim": 128}


def fill_pattern(cache: ShmCache) -> None:
    """Distinct rows everywhere, cheaply: a permutation of them always changes the bytes."""
    for layer, t in enumerate(cache.tensors):
        rows = t.view(torch.int16).view(-1, 64)
        rows.copy_(torch.arange(rows.shape[0] * 64, dtype=torch.int32).view(-1, 64).to(torch.int16))
        rows[:, 0] = layer


def test_kill_during_a_transform_is_reported_after_restart(short_tmp: Path) -> None:
    cache = ShmCache.create(num_blocks=512, layout="NHD", **CRASH_GEOMETRY)
    try:
        fill_pattern(cache)
        original = [t.clone() for t in cache.tensors]
        first = DaemonProcess(runtime_dir=short_tmp).start()
        with first.client() as client:
            client.attach("crashy", cache.specs)
            blocks = list(range(512))
            read_done(client, "big", "crashy", blocks, block_size_ratio=2)
            wait_for(lambda: client.request_status("big").state == "launched", interval=0.001)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()

        second = DaemonProcess(runtime_dir=short_tmp).start()
        try:
            with second.client() as client:
                (event,) = events_for(client, "crashy", 1)
                assert isinstance(event, Failed) and event.code == "interrupted", event
                assert event.invalid_block_ids == blocks
                assert client.request_status("big").state == "failed"
                client.attach("crashy", cache.specs)
                partial = [t.clone() for t in cache.tensors]
                read_done(client, "big", "crashy", blocks, block_size_ratio=2)  # a re-send
                again = events_for(client, "crashy", 2)[1]
                assert isinstance(again, Failed) and again.code == "interrupted", again
                assert all(same_bytes(a, b) for a, b in zip(cache.tensors, partial, strict=True))
                # Read again (the original bytes land once more): a new generation is processed.
                for t, was in zip(cache.tensors, original, strict=True):
                    t.copy_(was)
                read_done(client, "big", "crashy", blocks, block_size_ratio=2, generation=1)
                done = events_for(client, "crashy", 3)[2]
                assert isinstance(done, Ready) and done.generation == 1
                page = cache.tensors[2][1, 300]
                want = rewritten(original[2][1, 300], ratio=2, heads=8, block_size=64)
                assert same_bytes(page, want)
        finally:
            second.stop()
    finally:
        cache.close()
