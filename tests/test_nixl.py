"""kvd.nixl with real NIXL agents (UCX over loopback), a real kvd daemon and real processes.

The exporter runs in a thread of this process, or (for the failing peer) in a process of its
own that the test kills; the reader sends its notifications to a ``kvd serve`` subprocess and
the test checks kvd's events and the bytes that landed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from kvd.client import Client
from kvd.daemon_process import DaemonProcess
from kvd.demo.prefill import PrefillSpec
from kvd.nixl.exporter import Exporter
from kvd.nixl.reader import HandshakeError, Reader
from kvd.protocol import (
    CacheDescription,
    Error,
    Failed,
    Handshake,
    HandshakeReply,
    Layout,
    Ready,
)
from kvd.shm import ShmCache, physical_shape
from tests.daemon_helpers import by_req, collect, subscribed
from tests.nixl_helpers import finish, kill, spawn_prefill

pytest.importorskip("nixl")

LAYERS, HEADS, HEAD_DIM = 2, 2, 8
REMOTE_BLOCKS, REMOTE_SIZE = 32, 4
LOCAL_BLOCKS = 16


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess() as d:
        yield d


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[Client]:
    with daemon.client() as c:
        yield c


class ServedExporter:
    """An Exporter of a random HND split cache, progressed by a thread of this process."""

    def __init__(
        self, endpoint: str, engine_id: str = "prefill-test", block_size: int = REMOTE_SIZE
    ) -> None:
        shape = physical_shape(
            "split",
            "HND",
            num_blocks=REMOTE_BLOCKS,
            block_size=block_size,
            num_heads=HEADS,
            head_dim=HEAD_DIM,
        )
        gen = torch.Generator().manual_seed(7)
        self.tensors = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
        self.exporter = Exporter(
            engine_id,
            self.tensors,
            layout="HND",
            kv_arrangement="split",
            block_size=block_size,
            endpoint=endpoint,
        )
        self.finished: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self.exporter.serve,
            args=(self._stop,),
            kwargs={"on_finished": self.finished.extend},
        )
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.exporter.close()


@pytest.fixture
def exporter(short_tmp: Path) -> Iterator[ServedExporter]:
    served = ServedExporter(f"ipc://{short_tmp}/prefill.sock")
    yield served
    served.close()


@pytest.fixture
def reader(client: Client) -> Iterator[Reader]:
    r = Reader("decode-test", client, read_timeout_s=5.0)
    yield r
    r.close()


def local_cache(
    client: Client,
    cache_id: str,
    block_size: int,
    layout: Layout = "NHD",
    num_blocks: int = LOCAL_BLOCKS,
) -> ShmCache:
    cache = ShmCache.create(
        num_layers=LAYERS,
        num_blocks=num_blocks,
        block_size=block_size,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        layout=layout,
    )
    for t in cache.tensors:
        t.fill_(-7.0)
    client.attach(cache_id, cache.specs)
    return cache


def expected_tokens(remote: torch.Tensor, kv: int, remote_ids: list[int]) -> torch.Tensor:
    """A request's tokens (tokens, heads, head_dim) from a remote HND split tensor."""
    blocks = remote[kv][torch.tensor(remote_ids)]  # (n, heads, size, dim)
    return blocks.transpose(1, 2).reshape(-1, HEADS, HEAD_DIM)


def local_tokens(local: torch.Tensor, kv: int, ids: list[int], layout: Layout) -> torch.Tensor:
    """A request's tokens (tokens, heads, head_dim) from a local split tensor of ``layout``."""
    blocks = local[kv][torch.tensor(ids)]
    if layout == "HND":
        blocks = blocks.transpose(1, 2)
    return blocks.reshape(-1, HEADS, HEAD_DIM)


def test_handshake_describes_the_registered_cache(exporter: ServedExporter) -> None:
    with zmq.Context() as ctx, ctx.socket(zmq.REQ) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(exporter.exporter.endpoint)
        sock.send(msgspec.msgpack.encode(Handshake(engine_id="someone")))
        assert sock.poll(5000)
        reply = msgspec.msgpack.decode(sock.recv(), type=HandshakeReply)
        assert isinstance(reply, CacheDescription)
        sock.send(b"\x93not a handshake")
        assert sock.poll(5000)
        error = msgspec.msgpack.decode(sock.recv(), type=HandshakeReply)
    assert (reply.engine_id, reply.mem_type, reply.layout, reply.kv_arrangement) == (
        "prefill-test",
        "DRAM",
        "HND",
        "split",
    )
    assert (reply.num_blocks, reply.block_size, reply.num_heads, reply.head_dim) == (
        REMOTE_BLOCKS,
        REMOTE_SIZE,
        HEADS,
        HEAD_DIM,
    )
    assert reply.dtype == "bfloat16" and reply.tp_size == 1 and reply.agent_metadata
    assert reply.page_format == "HND"  # the preset that split + HND name
    block_len = HEADS * REMOTE_SIZE * HEAD_DIM * 2
    assert [(t.base_addr, t.nbytes, t.block_len) for t in reply.tensors] == [
        (t.data_ptr(), 2 * REMOTE_BLOCKS * block_len, block_len) for t in exporter.tensors
    ]
    assert isinstance(error, Error) and error.code == "invalid_message"
    assert exporter.exporter.handshakes == 1


def test_connect_to_nobody_times_out(reader: Reader, short_tmp: Path) -> None:
    with pytest.raises(HandshakeError, match=r"no handshake reply within 0\.2s"):
        reader.connect(f"ipc://{short_tmp}/nobody.sock", timeout_s=0.2)


@pytest.mark.parametrize("remote_count", [8, 6])  # 6 at ratio 4: the last local block half full
def test_read_lands_blocks_and_kvd_reports_ready(
    client: Client, reader: Reader, exporter: ServedExporter, remote_count: int
) -> None:
    cache_id = f"nixl-ready-{remote_count}"
    cache = local_cache(client, cache_id, block_size=4 * REMOTE_SIZE)
    try:
        reader.add_cache(cache_id, cache.tensors, cache.specs)
        assert reader.connect(exporter.exporter.endpoint) == "prefill-test"
        remote_ids = [9, 2, 31, 0, 17, 5, 12, 30][:remote_count]
        local_ids = [11, 3]
        with subscribed(client, [cache_id]) as sub:
            reader.read("req-a", "prefill-test", cache_id, remote_ids, local_ids)
            (result,) = finish(reader, 1)
            assert result.ok, result.reason
            assert result.nbytes == remote_count * LAYERS * 2 * HEADS * REMOTE_SIZE * HEAD_DIM * 2
            (event,) = by_req(collect(sub, 1)).values()
        assert isinstance(event, Ready) and event.physical_block_ids == local_ids
        assert event.remote_engine_id == "prefill-test"
        tokens = remote_count * REMOTE_SIZE
        for layer, (local, remote) in enumerate(zip(cache.tensors, exporter.tensors, strict=True)):
            for kv in range(2):
                got = local[kv][torch.tensor(local_ids)].reshape(-1, HEADS, HEAD_DIM)[:tokens]
                want = expected_tokens(remote, kv, remote_ids)
                assert torch.equal(got, want), f"layer {layer} kv {kv}"
            others = [b for b in range(LOCAL_BLOCKS) if b not in local_ids]
            assert bool((local[:, others] == -7.0).all()), "a block outside the request changed"
        # The prefill side hears "<req_id>:<tp_size>" once the READ is done.
        deadline = time.monotonic() + 5
        while "req-a" not in exporter.finished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert exporter.finished == ["req-a"]
    finally:
        client.detach(cache_id)
        cache.close()


LARGE_REMOTE_SIZE, SMALL_LOCAL_SIZE = 64, 16


@pytest.fixture
def large_exporter(short_tmp: Path) -> Iterator[ServedExporter]:
    served = ServedExporter(
        f"ipc://{short_tmp}/prefill64.sock", "prefill-64", block_size=LARGE_REMOTE_SIZE
    )
    yield served
    served.close()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_larger_remote_blocks_land_across_groups_of_local_blocks(
    client: Client,
    reader: Reader,
    large_exporter: ServedExporter,
    layout: Layout,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """64-token HND prefill blocks into 16-token decode blocks: each lands across 4 of them."""
    cache_id = f"nixl-64-to-16-{layout}"
    cache = local_cache(client, cache_id, block_size=SMALL_LOCAL_SIZE, layout=layout, num_blocks=32)
    sent: list[dict[str, object]] = []
    send = client.read_done

    def recording(*args: object, **kwargs: object) -> None:
        sent.append(kwargs)
        send(*args, **kwargs)

    monkeypatch.setattr(client, "read_done", recording)
    try:
        reader.add_cache(cache_id, cache.tensors, cache.specs)
        reader.connect(large_exporter.exporter.endpoint)
        remote_ids = [[30, 4, 17], [9]]
        local_ids = [[5, 12, 0, 9, 14, 2, 7, 11, 3, 15, 1, 8], [10, 4, 6, 13]]
        with subscribed(client, [cache_id]) as sub:
            for i, (r, loc) in enumerate(zip(remote_ids, local_ids, strict=True)):
                reader.read(f"req-{i}", "prefill-64", cache_id, r, loc)
            # Not whole groups: 2 remote blocks need 8 local blocks, not 7.
            ragged = [16, 17, 18, 19, 20, 21, 22]
            reader.read("ragged", "prefill-64", cache_id, [1, 2], ragged)
            results = {r.req_id: r for r in finish(reader, 3)}
            events = by_req(collect(sub, 3))
        assert "8 in all, got 7" in results["ragged"].reason
        assert isinstance(events["ragged"], Failed) and events["ragged"].code == "read_failed"
        for i, (r, loc) in enumerate(zip(remote_ids, local_ids, strict=True)):
            result, event = results[f"req-{i}"], events[f"req-{i}"]
            assert result.ok, result.reason
            assert result.nbytes == len(r) * LAYERS * 2 * HEADS * LARGE_REMOTE_SIZE * HEAD_DIM * 2
            assert isinstance(event, Ready) and event.physical_block_ids == loc
            for layer, (local, remote) in enumerate(
                zip(cache.tensors, large_exporter.tensors, strict=True)
            ):
                for kv in range(2):
                    got = local_tokens(local, kv, loc, layout)
                    want = expected_tokens(remote, kv, r)
                    assert torch.equal(got, want), f"req-{i} layer {layer} kv {kv}"
        # Blocks no successful request listed (the ragged one's included) are untouched.
        listed = {b for loc in local_ids for b in loc}
        others = [b for b in range(32) if b not in listed]
        assert all(bool((t[:, others] == -7.0).all()) for t in cache.tensors)
        # kvd was told the remote block size and the remote page format (it cannot be a ratio).
        assert [(m["remote_block_size"], m["block_size_ratio"]) for m in sent] == [(64, 0)] * 2
        assert {m["remote_format"] for m in sent} == {"HND"}
        assert {m["remote_layout"] for m in sent} == {None}
    finally:
        client.detach(cache_id)
        cache.close()


def test_block_sizes_that_do_not_divide_end_as_failed(
    client: Client, reader: Reader, large_exporter: ServedExporter
) -> None:
    cache_id = "nixl-64-to-24"
    cache = local_cache(client, cache_id, block_size=24)
    try:
        reader.add_cache(cache_id, cache.tensors, cache.specs)
        reader.connect(large_exporter.exporter.endpoint)
        with subscribed(client, [cache_id]) as sub:
            reader.read("odd", "prefill-64", cache_id, [0], [0, 1, 2])
            (result,) = finish(reader, 1)
            (event,) = by_req(collect(sub, 1)).values()
        assert "remote block_size 64 does not divide local 24, nor is it a multiple" in (
            result.reason
        )
        assert isinstance(event, Failed) and event.invalid_block_ids == [0, 1, 2]
    finally:
        client.detach(cache_id)
        cache.close()


def test_a_description_whose_page_format_contradicts_its_layout_is_refused(
    reader: Reader, exporter: ServedExporter
) -> None:
    wrong = msgspec.structs.replace(exporter.exporter.description, page_format="NHD")
    with pytest.raises(HandshakeError, match="page_format 'NHD' is not the format of"):
        reader.add_peer(wrong)
    unknown = msgspec.structs.replace(exporter.exporter.description, page_format="HNX")
    with pytest.raises(HandshakeError, match="unknown preset 'HNX'"):
        reader.add_peer(unknown)


def test_bad_requests_end_as_failed_events(
    client: Client, reader: Reader, exporter: ServedExporter
) -> None:
    cache_id = "nixl-bad"
    cache = local_cache(client, cache_id, block_size=REMOTE_SIZE)
    try:
        reader.add_cache(cache_id, cache.tensors, cache.specs)
        reader.connect(exporter.exporter.endpoint)
        with subscribed(client, [cache_id]) as sub:
            reader.read("unknown-peer", "prefill-nobody", cache_id, [0], [0])
            reader.read("too-few-local", "prefill-test", cache_id, [0, 1], [0])
            reader.read("remote-range", "prefill-test", cache_id, [REMOTE_BLOCKS], [1])
            reader.read("repeated", "prefill-test", cache_id, [3, 4], [2, 2])
            # Ids of every kind get the same checks (a tensor's once slipped past duplicates).
            repeated = torch.tensor([2, 2])
            reader.read("repeated-tensor", "prefill-test", cache_id, [3, 4], repeated)
            reader.read("float-ids", "prefill-test", cache_id, [3], torch.tensor([2.0]))
            results = {r.req_id: r for r in finish(reader, 6)}
            events = by_req(collect(sub, 6))
        assert not any(r.ok for r in results.values())
        assert "no handshake with 'prefill-nobody'" in results["unknown-peer"].reason
        assert "fill 2 local blocks, got 1" in results["too-few-local"].reason
        assert f"[{REMOTE_BLOCKS}] outside [0, {REMOTE_BLOCKS})" in results["remote-range"].reason
        assert "[2] listed twice" in results["repeated"].reason
        assert "local_block_ids: [2] listed twice" in results["repeated-tensor"].reason
        assert "local_block_ids: integers are needed" in results["float-ids"].reason
        for req_id, event in events.items():
            assert isinstance(event, Failed) and event.code == "read_failed", event
            assert event.message == results[req_id].reason
        # Nothing was read: every block still holds what it held.
        assert all(bool((t == -7.0).all()) for t in cache.tensors)
    finally:
        client.detach(cache_id)
        cache.close()


def doomed_prefill(short_tmp: Path) -> PrefillSpec:
    """The prefill peer that the tests below kill or stop."""
    return PrefillSpec(
        engine_id="prefill-doomed",
        block_size=REMOTE_SIZE,
        layout="HND",
        seed=1,
        num_blocks=REMOTE_BLOCKS,
        layers=LAYERS,
        heads=HEADS,
        head_dim=HEAD_DIM,
        endpoint=f"ipc://{short_tmp}/doomed.sock",
    )


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_peer_that_dies_or_hangs_ends_as_failed(
    client: Client, short_tmp: Path, how: str
) -> None:
    """A dead peer (SIGKILL) or one that no longer progresses (SIGSTOP): Failed, never a hang."""
    cache_id = f"nixl-peer-{how}"
    cache = local_cache(client, cache_id, block_size=2 * REMOTE_SIZE)
    proc, endpoint = spawn_prefill(doomed_prefill(short_tmp))
    reader = Reader("decode-doomed", client, read_timeout_s=2.0)
    try:
        reader.add_cache(cache_id, cache.tensors, cache.specs)
        reader.connect(endpoint)
        # One READ that works first: the peer is real and connected.
        reader.read("before", "prefill-doomed", cache_id, [0, 1], [0])
        (before,) = finish(reader, 1)
        assert before.ok, before.reason
        if how == "killed":
            kill(proc)
        else:
            os.kill(proc.pid, signal.SIGSTOP)
        with subscribed(client, [cache_id]) as sub:
            collect(sub, 1)  # the Ready of "before"
            reader.read("after", "prefill-doomed", cache_id, list(range(2, 12)), [3, 4, 5, 6, 7])
            (after,) = finish(reader, 1, timeout=20.0)
            (event,) = by_req(collect(sub, 1)).values()
        assert not after.ok
        assert isinstance(event, Failed) and event.req_id == "after"
        assert event.code == "read_failed" and event.invalid_block_ids == [3, 4, 5, 6, 7]
        assert event.message == after.reason
    finally:
        kill(proc)
        reader.close()
        client.detach(cache_id)
        cache.close()


def test_a_reader_outlives_a_peer_killed_before_its_read(
    daemon: DaemonProcess, short_tmp: Path
) -> None:
    """UCX left the failed READ's copies queued and asserted on them when the agent went,
    aborting the decode process (seen in CI). Its own process, so an abort fails only this."""
    iterations = 16
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.nixl_peer_death",
            str(daemon.runtime_dir),
            str(short_tmp),
            str(iterations),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    assert done.stdout.strip() == f"survived {iterations}"


def test_close_fails_reads_in_flight(client: Client, short_tmp: Path) -> None:
    cache_id = "nixl-close"
    cache = local_cache(client, cache_id, block_size=REMOTE_SIZE)
    proc, endpoint = spawn_prefill(doomed_prefill(short_tmp))
    reader = Reader("decode-closing", client)
    try:
        reader.add_cache(cache_id, cache.tensors, cache.specs)
        reader.connect(endpoint)
        os.kill(proc.pid, signal.SIGSTOP)  # the READ cannot finish
        with subscribed(client, [cache_id]) as sub:
            reader.read("open", "prefill-doomed", cache_id, [4, 5], [6, 7])
            assert reader.in_flight == 1
            reader.close()
            (event,) = by_req(collect(sub, 1)).values()
        assert isinstance(event, Failed) and event.invalid_block_ids == [6, 7]
        assert "reader closed" in event.message
    finally:
        kill(proc)
        reader.close()
        client.detach(cache_id)
        cache.close()
