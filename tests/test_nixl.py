"""kvd.nixl with real NIXL agents (UCX over loopback), a real kvd daemon and real processes.

The exporter runs in a thread of this process, or (for the failing peer) in a process of its
own that the test kills; the reader sends its notifications to a ``kvd serve`` subprocess and
the test checks kvd's events and the bytes that landed.
"""

from __future__ import annotations

import json
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
from kvd.nixl.exporter import Exporter
from kvd.nixl.reader import HandshakeError, Reader, ReadResult
from kvd.protocol import CacheDescription, Error, Failed, Handshake, HandshakeReply, Ready
from kvd.shm import ShmCache, physical_shape
from tests.daemon_helpers import by_req, collect, subscribed

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

    def __init__(self, endpoint: str, engine_id: str = "prefill-test") -> None:
        shape = physical_shape(
            "split",
            "HND",
            num_blocks=REMOTE_BLOCKS,
            block_size=REMOTE_SIZE,
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
            block_size=REMOTE_SIZE,
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


def local_cache(client: Client, cache_id: str, block_size: int) -> ShmCache:
    cache = ShmCache.create(
        num_layers=LAYERS,
        num_blocks=LOCAL_BLOCKS,
        block_size=block_size,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        layout="NHD",
    )
    for t in cache.tensors:
        t.fill_(-7.0)
    client.attach(cache_id, cache.specs)
    return cache


def finish(reader: Reader, count: int, timeout: float = 20.0) -> list[ReadResult]:
    """Poll ``reader`` until ``count`` reads have ended."""
    results: list[ReadResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < count:
        assert time.monotonic() < deadline, f"{len(results)} of {count} reads ended"
        results += reader.poll()
        time.sleep(0.0005)
    return results


def expected_tokens(remote: torch.Tensor, kv: int, remote_ids: list[int]) -> torch.Tensor:
    """A request's tokens (tokens, heads, head_dim) from a remote HND split tensor."""
    blocks = remote[kv][torch.tensor(remote_ids)]  # (n, heads, size, dim)
    return blocks.transpose(1, 2).reshape(-1, HEADS, HEAD_DIM)


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
            results = {r.req_id: r for r in finish(reader, 4)}
            events = by_req(collect(sub, 4))
        assert not any(r.ok for r in results.values())
        assert "no handshake with 'prefill-nobody'" in results["unknown-peer"].reason
        assert "fill 2 local blocks, got 1" in results["too-few-local"].reason
        assert f"[{REMOTE_BLOCKS}] outside [0, {REMOTE_BLOCKS})" in results["remote-range"].reason
        assert "[2] listed twice" in results["repeated"].reason
        for req_id, event in events.items():
            assert isinstance(event, Failed) and event.code == "read_failed", event
            assert event.message == results[req_id].reason
        # Nothing was read: every block still holds what it held.
        assert all(bool((t == -7.0).all()) for t in cache.tensors)
    finally:
        client.detach(cache_id)
        cache.close()


def spawn_prefill(short_tmp: Path) -> tuple[subprocess.Popen[str], str]:
    """The demo's prefill process (its own NIXL agent), once it has bound its handshake socket."""
    spec = {
        "engine_id": "prefill-doomed",
        "block_size": REMOTE_SIZE,
        "layout": "HND",
        "seed": 1,
        "num_blocks": REMOTE_BLOCKS,
        "layers": LAYERS,
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "endpoint": f"ipc://{short_tmp}/doomed.sock",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvd.demo.prefill", json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the prefill process exited before it was ready"
    return proc, json.loads(line)["ready"]["endpoint"]


def kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)  # SIGKILL ends a SIGSTOPped process too
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_peer_that_dies_or_hangs_ends_as_failed(
    client: Client, short_tmp: Path, how: str
) -> None:
    """A dead peer (SIGKILL) or one that no longer progresses (SIGSTOP): Failed, never a hang."""
    cache_id = f"nixl-peer-{how}"
    cache = local_cache(client, cache_id, block_size=2 * REMOTE_SIZE)
    proc, endpoint = spawn_prefill(short_tmp)
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


def test_close_fails_reads_in_flight(client: Client, short_tmp: Path) -> None:
    cache_id = "nixl-close"
    cache = local_cache(client, cache_id, block_size=REMOTE_SIZE)
    proc, endpoint = spawn_prefill(short_tmp)
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
