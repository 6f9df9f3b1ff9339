"""``kvd serve`` in a subprocess, real ipc sockets, real shared-memory caches.

Each test uses its own cache ids on a daemon shared by the module, so tests stay independent.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch
import zmq

from kvd.client import AsyncClient, Client, KvdError, ShmCache, Subscription
from kvd.daemon_process import DaemonProcess
from kvd.protocol import CudaIpcRef, Failed, Ready, ShmRef, TensorSpec
from kvd.subscription import ReplayError
from tests.daemon_helpers import by_req, collect, wait_for
from tests.reference import expected_block, random_bytes, same_bytes

_ids = itertools.count()


def unique(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess("--log-level", "debug") as d:
        yield d


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Client]:
    with daemon.client() as c:
        yield c


def fill(cache: ShmCache, seed: int) -> list[torch.Tensor]:
    """Random bytes in every tensor; returns copies of what was written."""
    before = []
    for i, t in enumerate(cache.tensors):
        t.copy_(random_bytes(list(t.shape), t.dtype, seed + i))
        before.append(t.clone())
    return before


def parts(t: torch.Tensor, arrangement: str) -> list[tuple[torch.Tensor, int]]:
    """(tensor indexed by block, kv_parts) for each part the post-process rewrites."""
    if arrangement == "split":
        return [(t[0], 1), (t[1], 1)]
    return [(t, 2 if arrangement == "blocks_first" else 1)]


def check_cache(
    cache: ShmCache,
    before: list[torch.Tensor],
    rewritten: dict[int, tuple[int, str]],
    *,
    arrangement: str,
    layout: str,
    block_size: int,
    heads: int,
) -> None:
    """Every block listed in ``rewritten`` (block -> (ratio, remote layout)) holds the local
    layout; every other block is byte-identical to ``before``."""
    for now, was in zip(cache.tensors, before, strict=True):
        for (now_part, kv_parts), (was_part, _) in zip(
            parts(now, arrangement), parts(was, arrangement), strict=True
        ):
            for b in range(now_part.shape[0]):
                if b in rewritten and arrangement != "mla":
                    ratio, remote = rewritten[b]
                    want = expected_block(
                        was_part[b],
                        kv_parts=kv_parts,
                        block_size=block_size,
                        heads=heads,
                        ratio=ratio,
                        remote_layout=remote,
                        local_layout=layout,
                    )
                else:
                    want = was_part[b]
                assert same_bytes(now_part[b], want), f"block {b}"


CACHES = [
    # (arrangement, local layout, block size, heads, head dim, dtype)
    ("split", "NHD", 16, 4, 64, "bfloat16"),
    ("split", "HND", 16, 2, 8, "float8_e4m3fn"),
    ("blocks_first", "NHD", 8, 3, 16, "float16"),
    ("single", "HND", 4, 2, 5, "uint8"),
    ("mla", "NHD", 16, 1, 72, "bfloat16"),
]


def test_many_requests_across_ratios_and_layouts_verified_byte_for_byte(client: Client) -> None:
    caches = []
    try:
        plans = {}
        for n, (arrangement, layout, block_size, heads, head_dim, dtype) in enumerate(CACHES):
            cache = ShmCache.create(
                num_layers=3,
                num_blocks=40,
                block_size=block_size,
                num_heads=heads,
                head_dim=head_dim,
                dtype=dtype,
                layout=layout,
                kv_arrangement=arrangement,
            )
            caches.append(cache)
            cache_id = unique("many")
            attached = client.attach(cache_id, cache.specs)
            assert (attached.num_blocks, attached.num_tensors) == (40, 3)
            plans[cache_id] = (cache, fill(cache, 100 * n), arrangement, layout, block_size, heads)
        sub = client.subscribe(list(plans))
        sent: dict[str, tuple[str, int, str, list[int]]] = {}
        rewritten: dict[str, dict[int, tuple[int, str]]] = {cid: {} for cid in plans}
        for cache_id, (_, _, _, _, block_size, _) in plans.items():
            ratios = [r for r in (1, 2, 4, 8, 16) if block_size % r == 0]
            for i, block in enumerate(range(0, 36, 3)):
                ratio, remote = ratios[i % len(ratios)], ("HND", "NHD")[i % 2]
                req_id = unique("req")
                blocks = [block + 2, block]  # request order, not sorted
                client.read_done(
                    req_id,
                    cache_id,
                    blocks,
                    remote_layout=remote,
                    block_size_ratio=ratio,
                    remote_engine_id="prefill-1",
                )
                sent[req_id] = (cache_id, ratio, remote, blocks)
                for b in blocks:
                    rewritten[cache_id][b] = (ratio, remote)
        events = by_req(collect(sub, len(sent)))
        assert set(events) == set(sent)
        for req_id, event in events.items():
            cache_id, _, _, blocks = sent[req_id]
            assert isinstance(event, Ready), event
            assert (event.cache_id, event.physical_block_ids) == (cache_id, blocks)
            assert event.remote_engine_id == "prefill-1"
        for cache_id, (cache, before, arrangement, layout, block_size, heads) in plans.items():
            check_cache(
                cache,
                before,
                rewritten[cache_id],
                arrangement=arrangement,
                layout=layout,
                block_size=block_size,
                heads=heads,
            )
        for cache_id in plans:
            client.detach(cache_id)
        sub.close()
    finally:
        for cache in caches:
            cache.close()


@pytest.fixture
def small_cache(client: Client) -> Iterator[tuple[str, ShmCache]]:
    cache = ShmCache.create(
        num_layers=1, num_blocks=8, block_size=8, num_heads=2, head_dim=4, layout="NHD"
    )
    cache_id = unique("small")
    client.attach(cache_id, cache.specs)
    yield cache_id, cache
    cache.close()


def raw_frame(**fields: object) -> bytes:
    return msgspec.msgpack.encode(fields)


BAD_NOTIFICATIONS = [
    # (fields to send, expected code, text in the message)
    ({"cache_id": "nope"}, "unknown_cache", "'nope' is not attached"),
    ({"physical_block_ids": [8]}, "block_out_of_range", "[8] outside [0, 8)"),
    ({"physical_block_ids": [-1, 2]}, "block_out_of_range", "[-1]"),
    ({"physical_block_ids": [1, 1]}, "duplicate_block_id", "[1] listed twice"),
    ({"block_size_ratio": 3}, "invalid_ratio", "does not divide the block size 8"),
    ({"block_size_ratio": 0}, "invalid_ratio", "give block_size_ratio or remote_block_size"),
    ({"block_size_ratio": 2, "remote_block_size": 2}, "invalid_ratio", "contradicts"),
    ({"remote_layout": "XYZ"}, "invalid_layout", "remote_layout"),
    ({"physical_block_ids": ["zero"]}, "invalid_message", "$.physical_block_ids[0]"),
    ({"block_size_ratio": "2"}, "invalid_message", "$.block_size_ratio"),
    ({"remote_layout": None}, "invalid_format", "give the remote page format"),
    ({"type": "read_later"}, "invalid_message", "Invalid value 'read_later' - at `$.type`"),
    ({"v": 4}, "unsupported_version", "protocol version 4"),
    ({"v": 2}, "invalid_message", "v: a ReadDone with 0 groups and remote_ranks 0 carries v 1"),
    ({"remote_ranks": 2}, "invalid_message", "remote_ranks 2 carries v 3, not 1"),
    ({"req_id": "", "cache_id": "x"}, None, None),  # empty req_id: nobody to answer
]


@pytest.mark.parametrize(("fields", "code", "text"), BAD_NOTIFICATIONS)
def test_bad_notifications_get_failed_events_and_touch_nothing(
    client: Client,
    small_cache: tuple[str, ShmCache],
    fields: dict,
    code: str | None,
    text: str | None,
) -> None:
    cache_id, cache = small_cache
    before = fill(cache, 5)
    req_id = unique("bad")
    message = {
        "type": "read_done",
        "req_id": req_id,
        "cache_id": cache_id,
        "remote_layout": "HND",
        "physical_block_ids": [1, 2],
        "block_size_ratio": 2,
        **fields,
    }
    topic = message["cache_id"] if isinstance(message["cache_id"], str) else ""
    sub = client.subscribe([topic, cache_id] if topic != cache_id else [cache_id])
    rejected_before = client.status().rejections.get(code or "invalid_message", 0)
    client.send_raw(raw_frame(**message))
    # A good request right after proves the daemon kept serving (and orders the events).
    client.read_done(unique("good"), cache_id, [5], remote_layout="NHD", block_size_ratio=1)
    events = collect(sub, 2 if code else 1)
    if code:
        failed = events[0].event
        assert isinstance(failed, Failed) and failed.req_id == req_id
        assert failed.code == code and text in failed.message, failed
        # kvd keeps no state for a cache that is not attached.
        state = "unknown" if code == "unknown_cache" else "failed"
        assert client.request_status(req_id).state == state
    assert isinstance(events[-1].event, Ready)
    assert same_bytes(cache.tensors[0], before[0]), "a rejected request touched a block"
    wait_for(lambda: client.status().rejections.get(code or "invalid_message", 0) > rejected_before)
    sub.close()


def test_status_knows_a_request_that_needed_no_work(
    client: Client, small_cache: tuple[str, ShmCache]
) -> None:
    """Nothing is recorded as an outcome for it (a repeat is checked afresh), but Status still
    answers ``ready``: a scheduler that lost events must not take its blocks for lost."""
    cache_id, _ = small_cache
    req_id = unique("no-work")
    sub = client.subscribe([cache_id])
    client.read_done(req_id, cache_id, [3], remote_layout="NHD", block_size_ratio=1)
    (delivery,) = collect(sub, 1)
    assert isinstance(delivery.event, Ready) and delivery.event.req_id == req_id
    assert client.request_status(req_id).state == "ready"
    sub.close()


def test_an_identity_rewrite_is_answered_untouched_and_counted_apart(client: Client) -> None:
    """MLA pages are token-major: sub-pages landed back to back already sit where the local
    page wants them, at any ratio. kvd answers those Ready without touching a byte and counts
    them in ``ready_untouched``; a partly covered request still has its tail zeroed."""
    cache = ShmCache.create(
        num_layers=2, num_blocks=8, block_size=16, num_heads=1, head_dim=576,
        dtype="bfloat16", layout="NHD", kv_arrangement="mla",
    )  # fmt: skip
    try:
        cache_id = unique("mla")
        client.attach(cache_id, cache.specs)
        before = fill(cache, 5)
        counters = client.status().counters
        sub = client.subscribe([cache_id])
        identity = {"same": ([1], 1, 0), "merged": ([2, 3], 2, 0)}  # block ids, ratio, covered
        for req_id, (blocks, ratio, covered) in identity.items():
            client.read_done(
                req_id, cache_id, blocks, remote_format="mla", block_size_ratio=ratio,
                covered_sub_blocks=covered,
            )  # fmt: skip
        events = by_req(collect(sub, 2))
        assert all(isinstance(e, Ready) for e in events.values()), events
        now = client.status().counters
        assert now["ready_untouched"] - counters["ready_untouched"] == 2
        assert now["blocks_processed"] == counters["blocks_processed"]
        for tensor, was in zip(cache.tensors, before, strict=True):
            assert same_bytes(tensor, was)

        client.read_done(  # the second remote page of block 4 did not land: zeroed
            "partial", cache_id, [4], remote_format="mla", block_size_ratio=2, covered_sub_blocks=1
        )
        (delivery,) = collect(sub, 1)
        assert isinstance(delivery.event, Ready)
        final = client.status().counters
        assert final["ready_untouched"] == now["ready_untouched"]
        assert final["blocks_processed"] == now["blocks_processed"] + 1
        for tensor, was in zip(cache.tensors, before, strict=True):
            assert same_bytes(tensor[4, :8], was[4, :8]) and not tensor[4, 8:].any()
        sub.close()
        client.detach(cache_id)
    finally:
        cache.close()


def test_undecodable_and_oversized_frames(
    client: Client, small_cache: tuple[str, ShmCache]
) -> None:
    cache_id, _ = small_cache
    sub = client.subscribe([cache_id])
    start = client.status().rejections
    client.send_raw(b"\xc1\xc1 not msgpack")
    client.send_raw(msgspec.msgpack.encode([1, 2, 3]))
    big_id = unique("big")
    client.send_raw(
        raw_frame(
            type="read_done",
            req_id=big_id,
            cache_id=cache_id,
            remote_layout="NHD",
            physical_block_ids=[0],
            padding="x" * (2 << 20),
        )
    )
    (event,) = collect(sub, 1)
    assert isinstance(event.event, Failed) and event.event.req_id == big_id
    assert event.event.code == "message_too_large"
    wait_for(
        lambda: (
            client.status().rejections.get("invalid_message", 0)
            >= start.get("invalid_message", 0) + 2
        )
    )
    sub.close()


def test_in_flight_conflicts() -> None:
    """A repeat of a notification in flight is absorbed by its one event; another request for
    its blocks is refused; the first finishes."""
    # A 500 ms window keeps the first request in flight while the others are validated.
    with DaemonProcess("--batch-window-us", "500000") as d, d.client() as client:
        cache = ShmCache.create(num_layers=1, num_blocks=8, block_size=8, num_heads=2, head_dim=4)
        try:
            client.attach("conflicts", cache.specs)
            check_conflicts(client, "conflicts")
        finally:
            cache.close()


def check_conflicts(client: Client, cache_id: str) -> None:
    sub = client.subscribe([cache_id])
    first, second, third = unique("a"), unique("b"), unique("c")
    for frame in (
        raw_frame(
            type="read_done",
            req_id=first,
            cache_id=cache_id,
            remote_layout="HND",
            physical_block_ids=[1, 2, 3],
            block_size_ratio=4,
        ),
        raw_frame(
            type="read_done",
            req_id=first,
            cache_id=cache_id,
            remote_layout="HND",
            physical_block_ids=[6],
            block_size_ratio=4,
        ),
        raw_frame(
            type="read_done",
            req_id=second,
            cache_id=cache_id,
            remote_layout="HND",
            physical_block_ids=[3, 4],
            block_size_ratio=4,
        ),
        raw_frame(type="read_failed", req_id=first, cache_id=cache_id, physical_block_ids=[1]),
        raw_frame(
            type="read_failed",
            req_id=third,
            cache_id=cache_id,
            physical_block_ids=[7],
            reason="transfer state ERR",
        ),
    ):
        client.send_raw(frame)
    events = collect(sub, 3)
    assert sub.poll(1.0) is None, "a repeat got an event of its own"
    kinds = [(d.event.req_id, getattr(d.event, "code", "ready")) for d in events]
    assert kinds.count((first, "ready")) == 1
    third_event = next(d.event for d in events if d.event.req_id == third)
    assert isinstance(third_event, Failed) and third_event.code == "read_failed"
    assert third_event.message == "transfer state ERR" and third_event.invalid_block_ids == [7]
    second_event = next(d.event for d in events if d.event.req_id == second)
    assert isinstance(second_event, Failed) and second_event.code == "block_in_flight"
    assert "[3]" in second_event.message and second_event.invalid_block_ids == [3, 4]
    sub.close()


def test_attach_errors(client: Client, small_cache: tuple[str, ShmCache]) -> None:
    cache_id, cache = small_cache
    with pytest.raises(KvdError, match="cache_exists"):
        client.attach(cache_id, cache.specs)
    bad_shape = msgspec.structs.replace(cache.specs[0], shape=[2, 8, 8, 2])
    with pytest.raises(KvdError, match=r"invalid_cache: tensors\[0\].shape"):
        client.attach(unique("x"), [bad_shape])
    missing = msgspec.structs.replace(cache.specs[0], memory=ShmRef(name="kvd-no-such-cache"))
    with pytest.raises(KvdError, match=r"memory_unavailable: .*cannot open /dev/shm/kvd-no-such"):
        client.attach(unique("x"), [missing])
    too_far = msgspec.structs.replace(cache.specs[0], memory=ShmRef(name=cache.name, offset=4096))
    with pytest.raises(KvdError, match=r"memory_unavailable: .*holds"):
        client.attach(unique("x"), [too_far])
    sneaky = msgspec.structs.replace(cache.specs[0], memory=ShmRef(name="../etc/passwd"))
    with pytest.raises(KvdError, match="not a shared-memory name"):
        client.attach(unique("x"), [sneaky])
    on_gpu = msgspec.structs.replace(cache.specs[0], memory=CudaIpcRef(handle=bytes(64)))
    with pytest.raises(
        KvdError, match=r"invalid_cache: .*needs a daemon started with --device cuda"
    ):
        client.attach(unique("x"), [on_gpu])
    with pytest.raises(KvdError, match="unknown_cache"):
        client.detach(unique("never"))


def test_control_garbage_gets_an_error_reply(daemon: DaemonProcess) -> None:
    ctx = zmq.Context()
    req = ctx.socket(zmq.REQ)
    req.connect(daemon.endpoints().control)
    try:
        req.send(b"\xc1 junk")
        assert req.poll(5000)
        reply = msgspec.msgpack.decode(req.recv())
        assert reply["type"] == "error" and reply["code"] == "invalid_message"
        req.send(msgspec.msgpack.encode({"type": "ping", "v": 9}))
        assert req.poll(5000)
        assert msgspec.msgpack.decode(req.recv())["code"] == "unsupported_version"
    finally:
        req.close(linger=0)
        ctx.term()


def test_detach_is_refused_while_requests_are_in_flight() -> None:
    # A 1 s window keeps the request waiting in its batch, so "in flight" is certain.
    with DaemonProcess("--batch-window-us", "1000000") as d, d.client() as c:
        cache = ShmCache.create(num_layers=1, num_blocks=4, block_size=4, num_heads=2, head_dim=4)
        try:
            c.attach("busy", cache.specs)
            sub = c.subscribe(["busy"])
            c.read_done("r1", "busy", [1], remote_layout="HND", block_size_ratio=1)
            wait_for(lambda: c.request_status("r1").state == "batched")
            with pytest.raises(KvdError, match=r"cache_busy: .*1 requests in flight"):
                c.detach("busy")
            (event,) = collect(sub, 1)
            assert isinstance(event.event, Ready)
            c.detach("busy")
            sub.close()
        finally:
            cache.close()


def test_one_window_batches_requests_together() -> None:
    with DaemonProcess("--batch-window-us", "300000") as d, d.client() as c:
        cache = ShmCache.create(
            num_layers=2, num_blocks=16, block_size=8, num_heads=2, head_dim=8, layout="NHD"
        )
        try:
            before = fill(cache, 9)
            c.attach("w", cache.specs)
            sub = c.subscribe(["w"])
            for i in range(6):
                c.read_done(
                    f"w{i}", "w", [2 * i, 2 * i + 1], remote_layout="HND", block_size_ratio=2
                )
            events = by_req(collect(sub, 6))
            assert all(isinstance(e, Ready) for e in events.values())
            status = c.status()
            assert status.counters["batches"] == 1, "all six arrived within one 300 ms window"
            assert status.counters["blocks_processed"] == 12
            check_cache(
                cache,
                before,
                {b: (2, "HND") for b in range(12)},
                arrangement="split",
                layout="NHD",
                block_size=8,
                heads=2,
            )
            sub.close()
        finally:
            cache.close()


def test_late_subscriber_and_lossy_path_recover_by_replay(client: Client, small_cache) -> None:
    cache_id, _ = small_cache
    for i in range(5):
        client.read_done(f"{cache_id}-e{i}", cache_id, [i], remote_layout="NHD", block_size_ratio=1)
    # A subscriber that starts late gets everything from seq 1.
    late = client.subscribe([cache_id], from_seq=1)
    assert [d.seq for d in collect(late, 5)] == [1, 2, 3, 4, 5]
    late.close()


def test_subscriber_behind_a_lossy_proxy_recovers_missing_events(
    daemon: DaemonProcess, client: Client, small_cache: tuple[str, ShmCache]
) -> None:
    """A forwarder drops events 2 and 3 on the way; the subscriber replays them from kvd."""
    cache_id, _ = small_cache
    ctx = zmq.Context()
    upstream = ctx.socket(zmq.SUB)
    upstream.setsockopt(zmq.SUBSCRIBE, cache_id.encode())
    upstream.connect(daemon.endpoints().events)
    downstream = ctx.socket(zmq.PUB)
    port = downstream.bind_to_random_port("tcp://127.0.0.1")
    lossy = dataclasses.replace(daemon.endpoints(), events=f"tcp://127.0.0.1:{port}")
    try:
        with Client(endpoints=lossy) as behind:
            sub = behind.subscribe([cache_id])
            probes = 0
            while not upstream.poll(200):  # until the forwarder's own SUB is connected
                client.read_done(
                    f"{cache_id}-probe{probes}",
                    cache_id,
                    [7],
                    remote_layout="NHD",
                    block_size_ratio=1,
                )
                probes += 1
            while upstream.poll(200):
                downstream.send_multipart(upstream.recv_multipart())
            for i in range(6):
                client.read_done(
                    f"{cache_id}-p{i}", cache_id, [i], remote_layout="NHD", block_size_ratio=1
                )
            for n in range(1, 7):
                assert upstream.poll(10_000), "kvd published fewer events than expected"
                frames = upstream.recv_multipart()
                if n not in (2, 3):  # events 2 and 3 are lost on the way
                    downstream.send_multipart(frames)
            got = [d.event.req_id for d in collect(sub, probes + 6)]
            assert got[-6:] == [f"{cache_id}-p{i}" for i in range(6)]
            sub.close()
    finally:
        upstream.close(linger=0)
        downstream.close(linger=0)
        ctx.term()


def test_events_lost_beyond_the_replay_buffer() -> None:
    from kvd.client import EventsLost

    with DaemonProcess("--replay-buffer", "3") as d, d.client() as c:
        cache = ShmCache.create(num_layers=1, num_blocks=8, block_size=4, num_heads=1, head_dim=4)
        try:
            c.attach("tiny", cache.specs)
            live = c.subscribe(["tiny"])
            for i in range(6):
                c.read_done(f"t{i}", "tiny", [i], remote_layout="NHD", block_size_ratio=1)
            assert [x.seq for x in collect(live, 6)] == [1, 2, 3, 4, 5, 6]
            late = c.subscribe(["tiny"], from_seq=1)
            with pytest.raises(EventsLost) as lost:
                late.poll(5)
            assert (lost.value.first_seq, lost.value.last_seq) == (1, 3)
            assert [x.seq for x in collect(late, 3)] == [4, 5, 6]
            late.close()
            live.close()
        finally:
            cache.close()


CLIENT_SCRIPT = """
import sys, torch
from kvd.client import Client, ShmCache
runtime_dir, role = sys.argv[1], sys.argv[2]
with Client(runtime_dir) as c:
    if role == "engine":
        cache = ShmCache.create(num_layers=1, num_blocks=8, block_size=8, num_heads=2,
                                head_dim=4, layout="NHD", name=sys.argv[3])
        torch.manual_seed(0)
        cache.tensors[0].copy_(torch.randn(cache.tensors[0].shape).to(torch.bfloat16))
        c.attach("xproc", cache.specs)
        print("attached", flush=True)
        sys.stdin.readline()
        c.read_done("xp-1", "xproc", [3, 5], remote_layout="HND", block_size_ratio=2)
        c.read_done("xp-2", "xproc", [6], remote_layout="HND", block_size_ratio=4)
    else:
        with c.subscribe(["xproc"], from_seq=1) as sub:
            for _ in range(2):
                d = next(sub)
                print(d.event.req_id, type(d.event).__name__, flush=True)
"""


def test_clients_in_other_processes(daemon: DaemonProcess, short_tmp) -> None:
    script = short_tmp / "client.py"
    script.write_text(CLIENT_SCRIPT)
    name = unique("kvd-xproc")
    rt = str(daemon.runtime_dir)
    engine = subprocess.Popen(
        [sys.executable, str(script), rt, "engine", name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert engine.stdout is not None and engine.stdin is not None
        assert engine.stdout.readline().strip() == "attached"
        with subprocess.Popen(
            [sys.executable, str(script), rt, "scheduler"], stdout=subprocess.PIPE, text=True
        ) as scheduler:
            engine.stdin.write("go\n")
            engine.stdin.flush()
            out, _ = scheduler.communicate(timeout=60)
        assert sorted(out.split("\n")[:2]) == ["xp-1 Ready", "xp-2 Ready"]
        engine.communicate(timeout=60)
        assert engine.returncode == 0
        mapped = torch.from_file(
            f"/dev/shm/{name}", shared=False, size=8 * 8 * 2 * 4 * 2 * 2, dtype=torch.uint8
        )
        tensor = mapped.view(torch.bfloat16).view(2, 8, 8, 2, 4)
        torch.manual_seed(0)
        original = torch.randn(2, 8, 8, 2, 4).to(torch.bfloat16)
        for kv in range(2):
            for block, ratio in ((3, 2), (5, 2), (6, 4)):
                want = expected_block(
                    original[kv, block],
                    kv_parts=1,
                    block_size=8,
                    heads=2,
                    ratio=ratio,
                    remote_layout="HND",
                    local_layout="NHD",
                )
                assert same_bytes(tensor[kv, block], want)
            assert same_bytes(tensor[kv, 0], original[kv, 0])
    finally:
        engine.kill()
        engine.communicate()
        subprocess.run(["rm", "-f", f"/dev/shm/{name}"], check=False)


async def test_async_client(daemon: DaemonProcess) -> None:
    client = AsyncClient(daemon.runtime_dir)
    cache = ShmCache.create(num_layers=1, num_blocks=8, block_size=8, num_heads=2, head_dim=4)
    try:
        pong = await client.ping()
        assert pong.protocol_version == 1
        cache_id = unique("async")
        await client.attach(cache_id, cache.specs)
        events = client.subscribe([cache_id], from_seq=1)
        await client.read_done("as-1", cache_id, [1, 2], remote_layout="HND", block_size_ratio=2)
        await client.read_failed("as-2", cache_id, [3], reason="peer died")
        got = [await anext(events), await anext(events)]
        # ReadFailed is answered at once, ReadDone after its post-process: any order.
        assert sorted((d.event.req_id, type(d.event).__name__) for d in got) == [
            ("as-1", "Ready"),
            ("as-2", "Failed"),
        ]
        assert (await client.request_status("as-2")).code == "read_failed"
        await client.detach(cache_id)
        events.close()
    finally:
        client.close()
        cache.close()


def test_cli_status_and_tail(daemon: DaemonProcess, client: Client, small_cache) -> None:
    cache_id, _ = small_cache
    client.read_done(f"{cache_id}-cli", cache_id, [0], remote_layout="NHD", block_size_ratio=1)
    kvd = [sys.executable, "-m", "kvd"]
    rt = ["--runtime-dir", str(daemon.runtime_dir)]
    table = subprocess.run(
        [*kvd, "status", *rt], capture_output=True, text=True, timeout=60, check=False
    )
    assert table.returncode == 0, table.stderr
    assert cache_id in table.stdout and "COUNTER" in table.stdout
    as_json = json.loads(
        subprocess.run(
            [*kvd, "status", *rt, "--json"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    )
    assert as_json["type"] == "daemon_status" and as_json["counters"]["ready"] >= 1
    one = subprocess.run(
        [*kvd, "status", *rt, "--req", f"{cache_id}-cli"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "state    ready" in one.stdout
    tail = subprocess.run(
        [*kvd, "tail", *rt, "--cache", cache_id, "--from-seq", "1", "--count", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert tail.returncode == 0, tail.stderr
    line = json.loads(tail.stdout.splitlines()[0])
    assert line["topic"] == cache_id and line["seq"] == 1 and line["type"] == "ready"
    down = subprocess.run(
        [*kvd, "status", "--runtime-dir", "/tmp/kvd-nobody-here", "--timeout", "0.5"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert down.returncode == 1
    assert down.stderr == "kvd status: no kvd at /tmp/kvd-nobody-here (no such directory)\n"


def test_polling_without_waiting_does_not_ask_kvd_each_time(
    client: Client, small_cache: tuple[str, ShmCache]
) -> None:
    """An engine polls its subscription with no wait every step: that must not cost a replay
    round trip to kvd each time (only one per resync interval of silence)."""
    cache_id, _ = small_cache
    sub = client.subscribe([cache_id])  # resyncs after 1 s of silence
    before = client.status().counters["replays"]
    for _ in range(200):
        assert sub.poll(0) is None
    asked = client.status().counters["replays"] - before
    assert asked <= 2 * (1 + 1), f"200 empty polls asked kvd {asked} times"
    client.read_done(f"{cache_id}-polled", cache_id, [1], remote_layout="NHD", block_size_ratio=1)
    (event,) = collect(sub, 1)
    assert event.event.req_id == f"{cache_id}-polled", "and events still arrive"
    sub.close()


def test_poll_without_a_wait_on_an_idle_subscription_polls_its_socket_once(
    daemon: DaemonProcess,
) -> None:
    """An engine polls its subscription with no wait on every step: that must cost one
    non-blocking socket poll, not a spin until a millisecond has passed."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = Subscription(ctx, daemon.endpoints(), [unique("idle")], resync_interval=3600)
    polls = 0
    socket_poll = sub._poller.poll

    def counted(*args: Any, **kwargs: Any) -> list[tuple[Any, int]]:
        nonlocal polls
        polls += 1
        return socket_poll(*args, **kwargs)

    sub._poller.poll = counted  # type: ignore[method-assign]
    try:
        for _ in range(100):
            assert sub.poll(0) is None
    finally:
        sub.close()
        ctx.term()
    assert polls == 100


def test_a_replay_that_timed_out_is_tried_again_at_the_next_poll(
    daemon: DaemonProcess, client: Client, small_cache: tuple[str, ShmCache]
) -> None:
    """kvd stopped while a late subscriber's replay from seq 1 waits: that replay times out
    (a poll says so once its timeout has passed; polls before it do not wait for it), and the
    next poll asks for the same events again instead of dropping the gap (nothing else would
    ask before a resync interval of silence, here an hour)."""
    cache_id, _ = small_cache
    for i in range(3):
        client.read_done(f"{cache_id}-t{i}", cache_id, [i], remote_layout="NHD", block_size_ratio=1)
    with client.subscribe([cache_id], from_seq=1) as seen:  # all 3 answered before we go on
        assert [d.seq for d in collect(seen, 3)] == [1, 2, 3]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = Subscription(
        ctx, daemon.endpoints(), [cache_id], from_seq=1, timeout=0.5, resync_interval=3600
    )
    assert daemon.proc is not None
    try:
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(ReplayError, match="no replay answer"):
                for _ in range(100):
                    assert sub.poll(0.1) is None
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        got = [sub.poll(10) for _ in range(3)]
        assert [d.seq if d else None for d in got] == [1, 2, 3]
    finally:
        sub.close()
        ctx.term()


def group_views(cache: ShmCache, block_size: int, head_dim: int) -> tuple[torch.Tensor, TensorSpec]:
    """A second group's view of ``cache``'s one tensor (blocks first, NHD, 2 heads): its pages
    the same bytes, holding ``block_size`` tokens of ``head_dim``."""
    spec = cache.specs[0]
    shape = [spec.shape[0], 2, block_size, spec.shape[3], head_dim]
    view = cache.tensors[0].view(shape)
    return view, msgspec.structs.replace(
        spec, name="group.1", shape=shape, block_size=block_size, group=1
    )


def test_groups_of_their_own_block_sizes_rewrite_each_block_in_its_group_alone(
    client: Client,
) -> None:
    """A hybrid model whose groups hold different tokens per page (a sliding-window layer of
    head_dim 4 in blocks of 8, a full layer of head_dim 8 in blocks of 4) attaches both views
    of one memory (``TensorSpec.group``). A ReadDone's first group's blocks are rewritten as
    blocks of 8 tokens, its second's as blocks of 4, each as a one-group cache of that shape
    rewrites them; no other block changes."""
    shape = {"num_layers": 1, "num_blocks": 8, "num_heads": 2, "kv_arrangement": "blocks_first"}
    hybrid = ShmCache.create(block_size=8, head_dim=4, **shape)  # type: ignore[arg-type]
    twins = [
        ShmCache.create(block_size=8, head_dim=4, **shape),  # type: ignore[arg-type]
        ShmCache.create(block_size=4, head_dim=8, **shape),  # type: ignore[arg-type]
    ]
    try:
        _, second = group_views(hybrid, 4, 8)
        before = fill(hybrid, 21)[0]
        for twin in twins:
            twin.tensors[0].view(-1).copy_(before.view(-1))
        ids = {"hybrid": unique("groups"), "twin0": unique("twin"), "twin1": unique("twin")}
        client.attach(ids["hybrid"], [*hybrid.specs, second])
        client.attach(ids["twin0"], twins[0].specs)
        client.attach(ids["twin1"], twins[1].specs)
        (info,) = [c for c in client.status().caches if c.cache_id == ids["hybrid"]]
        assert info.block_size == 8 and info.group_block_sizes == [8, 4], info
        assert info.nbytes == before.numel() * before.element_size(), "bytes counted twice"
        sub = client.subscribe(list(ids.values()))
        common = {"remote_layout": "HND", "block_size_ratio": 2}
        client.read_done("r", ids["hybrid"], [6, 1, 3, 5], groups=[(2, 4), (2, 3)], **common)
        client.read_done("g0", ids["twin0"], [6, 1], covered_sub_blocks=4, **common)
        client.read_done("g1", ids["twin1"], [3, 5], covered_sub_blocks=3, **common)
        events = by_req(collect(sub, 3))
        assert all(isinstance(e, Ready) for e in events.values()), events
        now = hybrid.tensors[0]
        for block in range(8):
            want = twins[0] if block in (6, 1) else twins[1] if block in (3, 5) else None
            expected = before[block] if want is None else want.tensors[0][block]
            assert same_bytes(now[block].flatten(), expected.flatten()), f"block {block}"
        for block in (6, 1, 3, 5):
            assert not same_bytes(now[block], before[block]), f"block {block} was not rewritten"
        for cache_id in ids.values():
            client.detach(cache_id)
        sub.close()
    finally:
        for cache in (hybrid, *twins):
            cache.close()


def test_group_views_that_could_rewrite_a_byte_twice_are_refused(client: Client) -> None:
    """Views of one memory are taken only as different groups' views of the same blocks; a
    ReadDone to a cache of several groups lists each, and every group's remote block size must
    be whole."""
    cache = ShmCache.create(
        num_layers=2,
        num_blocks=8,
        block_size=8,
        num_heads=2,
        head_dim=4,
        kv_arrangement="blocks_first",
    )
    try:
        _, second = group_views(cache, 4, 8)
        first = cache.specs[0]
        refused = {
            "same group": ([first, msgspec.structs.replace(second, group=0)], "block_size"),
            "a group past the tensors": (
                [first, msgspec.structs.replace(second, group=2)],
                r"tensors\[1\].group: 2; .* none skipped",
            ),
            "a group skipped": (
                [
                    first,
                    msgspec.structs.replace(second, group=2),
                    cache.specs[1],
                ],
                "no tensor has group 1",
            ),
            "part of the blocks": (
                [
                    first,
                    msgspec.structs.replace(
                        second,
                        shape=[4, *second.shape[1:]],
                        memory=ShmRef(name=cache.name, offset=512),
                    ),
                ],
                "num_blocks",
            ),
            "a group of two sizes": (
                [
                    first,
                    second,
                    msgspec.structs.replace(
                        second, name="group.1b", block_size=8, shape=[8, 2, 8, 2, 4]
                    ),
                ],
                "group 1",
            ),
        }
        for case, (specs, says) in refused.items():
            with pytest.raises(KvdError, match=says) as err:
                client.attach(unique("views"), specs)
            assert err.value.code == "invalid_cache", case
        # One block apart: block n of the second view is block n + 1 of the first.
        shifted = msgspec.structs.replace(second, memory=ShmRef(name=cache.name, offset=256))
        again = msgspec.structs.replace(first, name="again")  # the same group twice
        for view, says in ((shifted, "overlap"), (again, "overlap 'layer.0' of another tensor")):
            with pytest.raises(KvdError, match=says):
                client.attach(unique("views"), [first, view])
        # Two views of group 1 over the bytes group 0's view also covers.
        twice = [first, second, msgspec.structs.replace(second, name="group.1 again")]
        with pytest.raises(KvdError, match="of the same group 1; kvd would rewrite them twice"):
            client.attach(unique("views"), twice)
        cache_id = unique("views")
        client.attach(cache_id, [first, second])
        sub = client.subscribe([cache_id])
        client.read_done("one", cache_id, [1, 2], block_size_ratio=2, remote_layout="HND")
        client.read_done(
            "odd",
            cache_id,
            [1, 2],
            groups=[(1, 0), (1, 0)],
            remote_block_size=1,
            remote_layout="HND",
        )
        events = by_req(collect(sub, 2))
        assert all(isinstance(e, Failed) for e in events.values()), events
        assert events["one"].code == "invalid_message", events
        assert "lists each of them" in events["one"].message
        assert events["odd"].code == "invalid_ratio", events
        assert "group 1" in events["odd"].message
        client.detach(cache_id)
        sub.close()
    finally:
        cache.close()


def test_a_hybrid_request_rewrites_each_group_with_its_own_coverage(client: Client) -> None:
    """A ReadDone with ``groups`` (a sliding-window and a full-attention group of one request)
    leaves the blocks as two single-group ReadDones do on a twin cache: each group merged at
    ratio 2 and zeroed past its own coverage, one Ready for the request. The same ids as one
    group, covered as the second group, would zero the first group's last block too."""
    caches = [
        ShmCache.create(
            num_layers=1, num_blocks=8, block_size=8, num_heads=2, head_dim=4, layout="NHD"
        )
        for _ in range(2)
    ]
    try:
        ids = {"a": unique("hybrid"), "b": unique("twin")}
        for cache_id, cache in zip(ids.values(), caches, strict=True):
            client.attach(cache_id, cache.specs)
            fill(cache, 11)
        sub = client.subscribe(list(ids.values()))
        common = {"remote_layout": "HND", "block_size_ratio": 2}
        # Group 0 (sliding window): blocks 6, 1, all 4 sub-blocks landed; group 1: 3, 5, 2 of 4.
        client.read_done("r", ids["a"], [6, 1, 3, 5], groups=[(2, 4), (2, 2)], **common)
        client.read_done("g0", ids["b"], [6, 1], covered_sub_blocks=4, **common)
        client.read_done("g1", ids["b"], [3, 5], covered_sub_blocks=2, **common)
        events = by_req(collect(sub, 3))
        assert all(isinstance(e, Ready) for e in events.values()), events
        assert events["r"].physical_block_ids == [6, 1, 3, 5]
        assert same_bytes(caches[0].tensors[0], caches[1].tensors[0])
        assert caches[0].tensors[0][:, 1].any(), "group 0's last block was zeroed"
        for cache_id in ids.values():
            client.detach(cache_id)
        sub.close()
    finally:
        for cache in caches:
            cache.close()
