"""Bounded under abuse: a full journal, a thousand idle peers, a stalled replay reader, a huge
Attach and a stopped subscriber, each against a real ``kvd serve`` over real sockets and real
shared memory. Every accepted notification still gets exactly one event, and kvd stays up.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from kvd.client import Client, KvdError, ShmCache, read_done_message
from kvd.daemon.attach import open_cache
from kvd.daemon.connection_guard import FD_RESERVE
from kvd.daemon.memory import Span
from kvd.daemon.registry import Owner, Registry
from kvd.daemon_process import DaemonProcess
from kvd.protocol import UNATTACHED_TOPIC, Attach, Failed, Ready, Replay, ShmRef, TensorSpec
from tests.daemon_helpers import (
    RawPeer,
    collect,
    open_fds,
    peak_rss_mib,
    reset_peak_rss,
    rss_mib,
    settle,
    wait_for,
)

UNIT = Path(__file__).parent.parent / "systemd" / "kvd@.service"

# -- a journal that cannot be written ------------------------------------------------------------

JOURNAL_ROOM = 16 << 10
"""RLIMIT_FSIZE for the daemon: the journal's segment fills up after a few requests."""


def _answer(client: Client, sub, req_id: str, blocks: list[int]) -> Ready | Failed:
    client.read_done(req_id, "full", blocks, remote_layout="HND", block_size_ratio=1)
    (delivery,) = collect(sub, 1)
    assert delivery.event.req_id == req_id, delivery.event
    return delivery.event


def test_a_journal_that_cannot_be_written_refuses_work_and_recovers(short_tmp: Path) -> None:
    cache = ShmCache.create(
        num_layers=1, num_blocks=256, block_size=8, num_heads=2, head_dim=16, layout="NHD"
    )
    blocks = list(range(256))  # about 1 KB per record: the journal is full after a dozen
    daemon = DaemonProcess(runtime_dir=short_tmp).start()
    try:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        with daemon.client() as client, client.subscribe(["full"], from_seq=1) as sub:
            client.attach("full", cache.specs)
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (JOURNAL_ROOM, hard))
            answered: list[Ready | Failed] = []
            # Each request gets its one event; the first that cannot be journaled is refused.
            while len(answered) < 200:
                event = _answer(client, sub, f"r{len(answered)}", blocks)
                answered.append(event)
                if isinstance(event, Failed):
                    break
            refused = answered[-1]
            assert isinstance(refused, Failed), f"{len(answered)} requests, none refused"
            assert refused.code == "journal_unavailable", refused
            assert "untouched" in refused.message
            assert all(isinstance(e, Ready) for e in answered[:-1])
            # Refused again while there is no room, each with one event, on any request.
            again = _answer(client, sub, "still-full", blocks)
            assert isinstance(again, Failed) and again.code == "journal_unavailable", again
            status = client.status()
            assert "cannot write" in status.journal_problem, status
            assert status.counters["journal_errors"] >= 2
            assert status.in_flight == 0

            # Room again: the refused request, sent again, is processed.
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))
            retried = _answer(client, sub, refused.req_id, blocks)
            assert isinstance(retried, Ready), retried
            assert client.status().journal_problem == ""
            ready = [e.req_id for e in answered[:-1]] + [refused.req_id]
        # What the journal holds is whole: a kvd killed now remembers every outcome.
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        second = DaemonProcess(runtime_dir=short_tmp).start()
        try:
            with second.client() as client:
                states = {r: client.request_status(r, "full").state for r in ready}
                assert set(states.values()) == {"ready"}, states
                assert client.status().counters["events_published"] == 0  # none interrupted
        finally:
            second.stop()
    finally:
        daemon.close()
        cache.close()


# -- a thousand idle peers -----------------------------------------------------------------------


def unit_nofile() -> tuple[int, int]:
    """The unit's ``LimitNOFILE=SOFT[:HARD]``, the hard limit capped at what this process has."""
    match = re.search(r"^LimitNOFILE=(\d+)(?::(\d+))?$", UNIT.read_text(), re.MULTILINE)
    assert match, "the unit sets no LimitNOFILE"
    soft = int(match[1])
    _, ours = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = min(int(match[2] or soft), ours)
    assert hard > soft + 1000, f"this machine's hard limit ({ours}) is too low for the test"
    return soft, hard


@contextlib.contextmanager
def nofile(soft: int, hard: int) -> Iterator[None]:
    """This process's RLIMIT_NOFILE while a daemon is spawned (it inherits it)."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_a_thousand_idle_peers_cannot_exhaust_kvds_descriptors(short_tmp: Path) -> None:
    soft, hard = unit_nofile()
    bound = soft  # connections kvd keeps, all sockets together
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # for this test's own peers
    with nofile(soft, hard):
        daemon = DaemonProcess(
            runtime_dir=short_tmp, env={"KVD_MAX_CONNECTIONS": str(bound)}
        ).start()
    peers: list[socket.socket] = []
    try:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        control = daemon.endpoints().control.removeprefix("ipc://")
        with daemon.client() as client:
            client.ping()  # the client's connection is one of the bound
            # Raw connections that never speak ZMTP: idle or half-open peers.
            for _ in range(bound + 200):
                peers.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
                peers[-1].connect(control)
            client.ping()
            assert daemon.proc.poll() is None, daemon.log_tail()
            refused = lambda: client.status().counters["connections_refused"]  # noqa: E731
            wait_for(lambda: refused() >= 200, timeout=30)
            assert open_fds(pid) < hard
            # Idle peers over the bound are closed: kvd's descriptors stay bounded.
            wait_for(lambda: open_fds(pid) <= bound + FD_RESERVE, timeout=30)
            for peer in peers:
                peer.close()
            peers.clear()
            wait_for(lambda: client.status().counters["connections_refused"] == refused())
            client.ping()
        assert daemon.stop() == 0, daemon.log_tail()
    finally:
        for peer in peers:
            peer.close()
        daemon.close()


# -- replay peers that do not read ---------------------------------------------------------------


def test_replay_peers_that_do_not_read_delay_no_one(short_tmp: Path) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    stalled: list[zmq.Socket[bytes]] = []
    try:
        with DaemonProcess(runtime_dir=short_tmp) as daemon, daemon.client() as client:
            # Refusals of a cache nobody attached, each naming 1,024 blocks (about 4 KB): far
            # more than a peer's queue and socket buffers take.
            n = 3000
            message = read_done_message("r", "nobody", range(1024), remote_layout="HND")
            for _ in range(n):
                client.send_raw(message)
            wait_for(lambda: client.status().counters["events_published"] >= n, timeout=60)
            request = msgspec.msgpack.encode(Replay(topic=UNATTACHED_TOPIC, from_seq=1))
            for _ in range(3):  # on main, each held the one replay thread for 5 s
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 1)
                sock.setsockopt(zmq.RCVBUF, 4096)
                sock.connect(daemon.endpoints().replay)
                sock.send(request)
                stalled.append(sock)
            # A new subscription replays to learn the epoch and where its topics stand: on main
            # its first poll raised ReplayError after 10 s; now the replays are answered in turn.
            with client.subscribe(["honest"], from_seq=1) as sub:
                # Its replay from seq 1 is answered (no ReplayError, within its 10 s timeout).
                deadline = time.monotonic() + 10
                while sub._inflight is not None or sub._order.pending:
                    assert sub.poll(0.1) is None
                    assert time.monotonic() < deadline, "the honest replay was not answered"
            # Peers that leave are forgotten; the rest is counted when given up on.
            for sock in stalled:
                sock.close()
            stalled.clear()
            wait_for(lambda: client.status().counters["replays_abandoned"] == 3, timeout=30)
            assert client.status().counters["replays"] >= 1
    finally:
        for sock in stalled:
            sock.close()
        ctx.term()


# -- an oversized replay request ----------------------------------------------------------------

HUGE_FRAME = 128 << 20


def test_an_oversized_replay_request_closes_its_connection_unread(short_tmp: Path) -> None:
    """On main the replay socket's limit was set after the socket was bound, which ZMQ ignores:
    a 128 MiB frame was read whole (kvd's RSS peak +256 MiB) to be answered invalid_message."""
    cache = ShmCache.create(
        num_layers=1, num_blocks=8, block_size=8, num_heads=2, head_dim=16, layout="NHD"
    )
    try:
        with DaemonProcess(runtime_dir=short_tmp) as daemon, daemon.client() as client:
            assert daemon.proc is not None
            pid = daemon.proc.pid
            client.attach("honest", cache.specs)  # torch and the kernels load with it
            sub = client.subscribe(["honest"], from_seq=1)
            reset_peak_rss(pid)
            before = rss_mib(pid)
            peer = RawPeer(daemon.endpoints().replay, "DEALER")
            try:
                peer.send(b"\x82" + bytes(HUGE_FRAME))  # the start of a msgpack map, then junk
                assert peer.closed_by_kvd(), "kvd read the frame and kept the connection"
            finally:
                peer.close()
            grown = peak_rss_mib(pid) - before
            assert grown < 16, f"kvd's RSS peaked {grown:.0f} MiB above where it was"
            # Honest subscribers are served: events, and replays.
            client.read_done("after", "honest", [1], remote_layout="NHD", block_size_ratio=1)
            (delivery,) = collect(sub, 1)
            assert isinstance(delivery.event, Ready), delivery.event
            with client.subscribe(["honest"], from_seq=1) as again:
                (replayed,) = collect(again, 1)
                assert replayed.event.req_id == "after"
            sub.close()
    finally:
        cache.close()


# -- a sparse segment ---------------------------------------------------------------------------

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2


def allocated(fd: int) -> int:
    """Bytes of the file behind ``fd`` that /dev/shm has allocated (RAM)."""
    return os.fstat(fd).st_blocks * 512


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free the file's pages in [offset, offset + length): reading them gives zeros again."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    flags = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
    if libc.fallocate(fd, flags, offset, length):
        raise OSError(ctypes.get_errno(), "fallocate(PUNCH_HOLE)")


def test_kvd_allocates_no_shared_memory_the_engine_did_not(short_tmp: Path) -> None:
    """On main kvd faulted in every page of an attached segment for writing: a 64 MiB segment
    the engine never wrote (a sparse file) went from 0 to 64 MiB allocated, RAM the engine never
    reserved. Now a segment with holes is refused at Attach, and one given holes after Attach
    fails its requests untouched."""
    size, num_blocks = 64 << 20, 4096  # K and V pages of 8 KiB: 16 tokens, 4 heads of 64
    name = f"kvd-sparse-{os.getpid()}"
    spec = TensorSpec(
        name="layer.0",
        shape=[2, num_blocks, 16, 4, 64],
        dtype="bfloat16",
        layout="NHD",
        kv_arrangement="split",
        block_size=16,
        memory=ShmRef(name=name),
    )
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        with DaemonProcess(runtime_dir=short_tmp) as daemon, daemon.client() as client:
            refused = rf"memory_unavailable: tensors\[0\]\.memory: /dev/shm/{name} is sparse"
            with pytest.raises(KvdError, match=rf"{refused}: 0 of its {size} bytes are allocated"):
                client.attach("sparse", [spec])
            assert allocated(fd) == 0
            os.pwrite(fd, b"\1" * (size // 2), 0)  # the engine wrote half of it
            with pytest.raises(KvdError, match=rf"{refused}: {size // 2} of its {size} bytes"):
                client.attach("sparse", [spec])
            assert allocated(fd) == size // 2
            assert client.status().caches == []

            os.posix_fallocate(fd, 0, size)  # reserved whole: attached
            client.attach("whole", [spec])
            sub = client.subscribe(["whole"], from_seq=1)
            punch_hole(fd, 0, 1 << 20)  # the engine frees the K pages of blocks 0..127
            client.read_done("holes", "whole", [1, 2], remote_layout="HND", block_size_ratio=1)
            (delivery,) = collect(sub, 1)
            failed = delivery.event
            assert isinstance(failed, Failed) and failed.code == "memory_unavailable", failed
            assert f"/dev/shm/{name} is sparse: {size - (1 << 20)} of" in failed.message
            assert "after Attach: its blocks were not touched" in failed.message
            assert allocated(fd) == size - (1 << 20), "kvd allocated the hole's pages"
            sub.close()
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm/{name}")


# -- a huge Attach -------------------------------------------------------------------------------


def test_the_alias_check_of_a_large_attach_is_n_log_n(monkeypatch: pytest.MonkeyPatch) -> None:
    """On main every tensor was compared with every other: 2,000 tensors took 1,999,000
    comparisons on the event loop (7,900 held it for 3.5 to 4.7 s)."""
    cache = ShmCache.create(
        num_layers=2000, num_blocks=4, block_size=8, num_heads=1, head_dim=8, layout="NHD"
    )
    comparisons = 0
    compare = Span.overlaps

    def counted(self: Span, other: Span) -> bool:
        nonlocal comparisons
        comparisons += 1
        return compare(self, other)

    monkeypatch.setattr(Span, "overlaps", counted)
    registry = Registry(torch.device("cpu"))
    owner = Owner(b"", "")
    try:
        big = open_cache(Attach(cache_id="big", tensors=cache.specs), registry.device, owner)
        registry.add(big)
        n = len(big.tensors)
        assert n == 2000
        assert comparisons <= n * math.ceil(math.log2(n)), comparisons
        # An alias is still found: within the Attach, and of an attached cache.
        aliased = [*cache.specs, msgspec.structs.replace(cache.specs[1234], name="alias")]
        again = open_cache(Attach(cache_id="again", tensors=aliased), registry.device, owner)
        try:
            problem = registry.overlap(again)
            assert problem is not None and "of cache 'big'" in problem, problem
            registry.remove("big")
            problem = registry.overlap(again)
            assert problem is not None and "tensors[2000]" in problem, problem
            assert "of another tensor of this Attach" in problem, problem
        finally:
            again.close()
    finally:
        for attached in registry.caches():
            attached.close()
        cache.close()


# -- a stopped subscriber ------------------------------------------------------------------------

SUBSCRIBER = """
import sys, zmq
sock = zmq.Context().socket(zmq.SUB)
sock.setsockopt(zmq.SUBSCRIBE, b"")
sock.connect(sys.argv[1])
sock.recv_multipart()
print("subscribed", flush=True)
while True:
    sock.recv_multipart()
"""


def test_a_stopped_subscriber_costs_kvd_at_most_its_queue(short_tmp: Path) -> None:
    queue_mib = 1
    env = {
        "KVD_PEER_QUEUE_BYTES": str(queue_mib << 20),
        "KVD_REPLAY_BUFFER_BYTES": str(1 << 20),  # the replay buffer holds little of them
    }
    cache = ShmCache.create(
        num_layers=1, num_blocks=8192, block_size=1, num_heads=1, head_dim=8, layout="NHD"
    )
    subscriber = None
    try:
        with DaemonProcess(runtime_dir=short_tmp, env=env) as daemon, daemon.client() as client:
            assert daemon.proc is not None
            client.attach("flood", cache.specs)
            subscriber = subprocess.Popen(
                [sys.executable, "-c", SUBSCRIBER, daemon.endpoints().events],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert subscriber.stdout is not None
            probes = 0
            while not select.select([subscriber.stdout], [], [], 0.1)[0]:
                client.read_done(f"probe{probes}", "flood", [0], remote_layout="NHD")
                probes += 1
            assert subscriber.stdout.readline() == "subscribed\n"
            subscriber.send_signal(signal.SIGSTOP)
            published = client.status().counters["events_published"]
            before = rss_mib(daemon.proc.pid)
            # 10,000 events of about 24 KB (8,192 block ids, no work: Ready at once).
            # Sent in steps that kvd has answered before the next: only the events queue grows.
            n = 10_000
            message = read_done_message("big", "flood", range(8192), remote_layout="NHD")
            for step in range(100, n + 1, 100):
                for _ in range(100):
                    client.send_raw(message)
                wait_for(
                    lambda want=published + step: (
                        client.status().counters["events_published"] >= want
                    )
                )
            grown = rss_mib(daemon.proc.pid) - before
            # On main +35 MiB (+4 MiB with a subscriber that reads): the socket's queue was a
            # million messages; now it is what fits in peer_queue_bytes.
            assert grown < 4 * queue_mib + 16, f"kvd grew by {grown:.0f} MiB"
    finally:
        if subscriber is not None:
            subscriber.kill()
            subscriber.wait()
            assert subscriber.stdout is not None
            subscriber.stdout.close()
        cache.close()


# -- engines that restart ------------------------------------------------------------------------

RESTARTING_ENGINE = """
import os, signal, sys
from kvd.client import Client
from kvd.protocol import ShmRef, TensorSpec

runtime_dir, name, n = sys.argv[1:4]
shape = [2, 32, 16, 4, 64]
fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.posix_fallocate(fd, 0, 2 * 32 * 16 * 4 * 64 * 2)
spec = TensorSpec(name="layer.0", shape=shape, dtype="bfloat16", layout="NHD",
                  kv_arrangement="split", block_size=16, memory=ShmRef(name=name))
client = Client(runtime_dir)
client.attach("e0", [spec], engine_id="engine-a")
os.unlink(f"/dev/shm/{name}")  # kvd holds it open: the engine, killed, leaves no file behind
for req_id, blocks in ((f"full-{n}", range(16)), (f"wait-{n}", [20])):
    client.read_done(req_id, "e0", list(blocks), remote_layout="HND", block_size_ratio=1)
print("sent", flush=True)
signal.pause()
"""


@pytest.mark.slow
def test_a_hundred_engine_restarts_leave_kvds_descriptors_where_they_were(
    short_tmp: Path, tmp_path: Path
) -> None:
    """Each engine is SIGKILLed with a request launched and one waiting in the batch window; the
    next, with the same engine_id, takes its cache over, and the last one's lease runs out.

    On main the executor's thread held on to its last job, and with it the mapping of a cache
    detached since: one descriptor more, and the segment's pages kept, after the last left."""
    script = tmp_path / "engine.py"
    script.write_text(RESTARTING_ENGINE)
    restarts = 100
    windowed = ("--batch-window-us", "1000000", "--max-batch-blocks", "16")
    with (
        DaemonProcess(*windowed, "--engine-lease-s", "2", runtime_dir=short_tmp) as daemon,
        daemon.client() as client,
        ShmCache.create(num_layers=1, num_blocks=4, block_size=16, num_heads=1, head_dim=8) as c,
    ):
        assert daemon.proc is not None
        pid = daemon.proc.pid
        client.attach("warm-up", c.specs)  # kvd's torch and kernels load with its first Attach
        client.detach("warm-up")
        sub = client.subscribe(["e0"], from_seq=1)
        assert sub.poll(0.1) is None
        settle(pid)  # the subscription's replays closed their connections
        before = open_fds(pid)
        for n in range(restarts):
            name = f"kvd-restart-{os.getpid()}-{n}"
            engine = subprocess.Popen(
                [sys.executable, str(script), str(daemon.runtime_dir), name, str(n)],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert engine.stdout is not None
                assert engine.stdout.readline() == "sent\n", f"engine {n} failed"
                wait_for(lambda n=n: client.request_status(f"wait-{n}", "e0").state != "unknown")
            finally:
                engine.kill()
                engine.wait()
                if engine.stdout is not None:
                    engine.stdout.close()
                Path(f"/dev/shm/{name}").unlink(missing_ok=True)
        wait_for(lambda: not client.status().caches, timeout=30)  # the last one's lease ran out
        events = collect(sub, 2 * restarts)
        assert len({d.event.req_id for d in events}) == 2 * restarts, "one event per request"
        assert sub.poll(0.2) is None
        # Every cache and connection of the engines is gone: kvd holds what it held before.
        with contextlib.suppress(AssertionError):
            wait_for(lambda: open_fds(pid) == before, timeout=10)
        assert open_fds(pid) == before, f"{open_fds(pid)} descriptors open, {before} before"
        sub.close()
