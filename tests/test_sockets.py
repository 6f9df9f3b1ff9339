from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from kvd.bench.cores import spawning_on
from kvd.client import resolve_runtime_dir
from kvd.daemon.binding import EndpointError, bind, normalize_endpoint
from kvd.daemon.reader import SocketReader
from kvd.daemon.runtime_dir import RuntimeLock, write_endpoints
from kvd.daemon_process import DaemonProcess
from kvd.endpoints import Endpoints, client_runtime_dir, default_runtime_dir, read_endpoints
from tests.daemon_helpers import kvd, zmq_io_threads


def test_runtime_dir_defaults() -> None:
    assert default_runtime_dir("0", {"RUNTIME_DIRECTORY": "/run/kvd/0:/run/other"}) == Path(
        "/run/kvd/0"
    )
    assert default_runtime_dir("2", {"XDG_RUNTIME_DIR": "/run/user/7"}) == Path("/run/user/7/kvd/2")
    assert default_runtime_dir("1", {}).name == "1"


def test_a_client_looks_where_a_daemon_of_its_gpu_would_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    xdg, system = tmp_path / "xdg", tmp_path / "run-kvd"
    env = {"XDG_RUNTIME_DIR": str(xdg), "RUNTIME_DIRECTORY": str(tmp_path / "engine-unit")}
    # None there yet: the fallback, never the client's own unit's directory.
    assert client_runtime_dir("1", env, system) == Path(f"/tmp/kvd-{os.getuid()}/1")
    (system / "1").mkdir(parents=True)
    assert client_runtime_dir("1", env, system) == system / "1"  # kvd@1.service
    (xdg / "kvd" / "1").mkdir(parents=True)
    assert client_runtime_dir("1", env, system) == xdg / "kvd" / "1"  # a kvd started by hand
    assert client_runtime_dir("0", env, system) == Path(f"/tmp/kvd-{os.getuid()}/0")

    # {gpu} in a given directory or KVD_RUNTIME_DIR is the rank's GPU.
    assert resolve_runtime_dir("/run/kvd/{gpu}", gpu="3") == Path("/run/kvd/3")
    monkeypatch.setenv("KVD_RUNTIME_DIR", str(tmp_path / "{gpu}" / "sockets"))
    assert resolve_runtime_dir(gpu="2") == tmp_path / "2" / "sockets"
    assert resolve_runtime_dir(str(system / "1"), gpu="2") == system / "1"


def test_endpoints() -> None:
    rt = Path("/run/kvd/0")
    assert normalize_endpoint("", rt, "ingest") == "ipc:///run/kvd/0/ingest.sock"
    assert normalize_endpoint("tcp://5555", rt, "events") == "tcp://127.0.0.1:5555"
    assert normalize_endpoint("tcp://:0", rt, "events") == "tcp://127.0.0.1:0"
    assert normalize_endpoint("tcp://0.0.0.0:7", rt, "events") == "tcp://0.0.0.0:7"
    assert normalize_endpoint("tcp://[::1]:7", rt, "events") == "tcp://[::1]:7"
    for spec, message in [
        ("udp://x", "must start with ipc:// or tcp://"),
        ("tcp://host:port", "is not tcp://"),
        ("ipc://", "needs a path"),
        ("ipc:///" + "x" * 120, "the limit is 107"),
    ]:
        with pytest.raises(EndpointError, match=message):
            normalize_endpoint(spec, rt, "control")


def test_endpoints_file_round_trip(short_tmp: Path) -> None:
    eps = Endpoints("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3", "ipc:///x")
    write_endpoints(short_tmp, eps)
    assert read_endpoints(short_tmp) == eps
    assert (
        read_endpoints(short_tmp / "none").ingest == f"ipc://{short_tmp / 'none' / 'ingest.sock'}"
    )
    assert "metrics" not in json.loads((short_tmp / "endpoints.json").read_text())
    with_metrics = dataclasses.replace(eps, metrics="http://127.0.0.1:9400/metrics")
    write_endpoints(short_tmp, with_metrics)
    assert read_endpoints(short_tmp) == with_metrics


def test_a_socket_without_a_message_size_limit_is_not_bound(short_tmp: Path) -> None:
    """A listener copies the socket's options when it is bound: a limit set afterwards never
    reaches a peer's connection (the replay socket's, on main)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(ValueError, match="replay: a socket kvd binds needs ZMQ_MAXMSGSIZE"):
            bind(sock, f"ipc://{short_tmp}/replay.sock", "replay")
        sock.setsockopt(zmq.MAXMSGSIZE, 1024)
        assert bind(sock, f"ipc://{short_tmp}/replay.sock", "replay").endswith("replay.sock")
    finally:
        sock.close(linger=0)
        ctx.term()


def test_runtime_lock_excludes_a_second_daemon(short_tmp: Path) -> None:
    first = RuntimeLock(short_tmp)
    first.acquire()
    try:
        with pytest.raises(EndpointError, match=r"another kvd \(pid \d+\) is serving"):
            RuntimeLock(short_tmp).acquire()
    finally:
        first.release()
    again = RuntimeLock(short_tmp)
    again.acquire()
    again.release()


async def _wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


MakePair = Callable[[int, int], tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]


@pytest.fixture
def pair() -> Iterator[MakePair]:
    """Makes (bound, connected) sockets over inproc; closes them and the context afterwards."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    made: list[zmq.Socket[bytes]] = []

    def make(bound_kind: int, peer_kind: int) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        bound, peer = ctx.socket(bound_kind), ctx.socket(peer_kind)
        endpoint = f"inproc://pair-{len(made)}"
        bound.bind(endpoint)
        peer.connect(endpoint)
        made.extend((bound, peer))
        return bound, peer

    yield make
    for sock in made:
        sock.close(0)
    ctx.term()


async def test_reader_reads_bursts_and_single_messages(pair: MakePair) -> None:
    pull, push = pair(zmq.PULL, zmq.PUSH)
    got: list[bytes] = []
    bursts = []
    reader = SocketReader(
        asyncio.get_running_loop(),
        pull,
        got.extend,
        after=lambda: bursts.append(len(got)),
        budget=8,
        multipart=False,
        sends=False,
    )
    try:
        for i in range(50):
            push.send(b"%d" % i)
        await _wait_for(lambda: len(got) == 50)
        push.send(b"last")
        await _wait_for(lambda: len(got) == 51)
        assert got == [b"%d" % i for i in range(50)] + [b"last"]
        assert bursts, "after() runs once per read"
    finally:
        reader.close()


async def test_poke_reads_a_message_whose_edge_a_send_consumed(pair: MakePair) -> None:
    """A reply sent outside the reader (as attach replies are) must not strand a request."""
    router, dealer = pair(zmq.ROUTER, zmq.DEALER)
    got: list[list[bytes]] = []
    reader = SocketReader(asyncio.get_running_loop(), router, got.append)
    try:
        dealer.send(b"one")
        await _wait_for(lambda: len(got) == 1)
        dealer.send(b"two")
        time.sleep(0.05)  # it arrives while the loop is busy, before the reply below
        router.send_multipart([got[0][0], b"reply"])
        reader.poke()
        await _wait_for(lambda: len(got) == 2)
        assert [frames[-1] for frames in got] == [b"one", b"two"]
        assert dealer.recv() == b"reply"
    finally:
        reader.close()


@pytest.mark.parametrize("dedicated", [True, False])
def test_dedicated_cpus_make_zmqs_io_threads_yield_to_the_event_loop(
    short_tmp: Path, dedicated: bool
) -> None:
    """``dedicated_cpus``: kvd's ZMQ I/O threads run SCHED_BATCH (no wake-up preemption of
    the loop on a CPU they share); without it they keep the default policy. Started on one CPU
    of several, as the setting wants, kvd does not warn; it serves either way."""
    cpus = sorted(os.sched_getaffinity(0))
    daemon = DaemonProcess(
        "--dedicated-cpus", str(dedicated).lower(), runtime_dir=short_tmp / "kvd"
    )
    with spawning_on(frozenset(cpus[-1:])):
        daemon.start()
    try:
        assert daemon.proc is not None
        policies = [os.sched_getscheduler(t) for t in zmq_io_threads(daemon.proc.pid)]
        assert policies, "ZMQ's I/O threads, by name"
        wanted = os.SCHED_BATCH if dedicated else os.SCHED_OTHER
        assert policies == [wanted] * len(policies)
        with daemon.client() as client:
            status = client.status()
        assert (status.cpus, status.dedicated_cpus) == (cpus[-1:], dedicated)
        shown = kvd("status", "--runtime-dir", str(daemon.runtime_dir)).stdout
        assert (
            f"cpus {cpus[-1]}, dedicated" in shown if dedicated else f"cpus {cpus[-1]}\n" in shown
        )
        if len(cpus) > 1:
            assert "dedicated_cpus is set, but" not in daemon.log_path.read_text()
    finally:
        daemon.close()


def test_dedicated_cpus_on_every_cpu_of_the_machine_is_warned_about(short_tmp: Path) -> None:
    if len(os.sched_getaffinity(0)) != os.cpu_count():
        pytest.skip("this process may not use every CPU of the machine")
    daemon = DaemonProcess("--dedicated-cpus", "true", runtime_dir=short_tmp / "kvd").start()
    try:
        assert "dedicated_cpus is set, but kvd may run on every CPU" in daemon.log_path.read_text()
    finally:
        daemon.close()
