"""Tools that never hang: with no kvd, a stale runtime directory left by a killed one, or a kvd
that does not answer, every ``kvd`` command and ``kvd.client`` call fails at once (or after
its ``--timeout``) with one clear line, never a traceback."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvd.client import AsyncClient, Client, KvdTimeout, KvdUnavailable, ReplayError
from kvd.daemon.runtime_dir import RuntimeLock
from kvd.daemon_process import DaemonProcess
from kvd.endpoints import check_running
from tests.daemon_helpers import kvd

TOOLS = [
    ["status"],
    ["status", "--req", "r1"],
    ["tail"],
    ["tail", "--cache", "c0", "--from-seq", "1"],
    ["set", "batch-window-us", "50"],
    ["detach", "c0", "--force"],
]


@pytest.fixture(scope="module")
def stale() -> Iterator[tuple[Path, int]]:
    """A runtime directory left by a kvd killed with SIGKILL, and its pid."""
    daemon = DaemonProcess().start()
    assert daemon.proc is not None
    pid = daemon.proc.pid
    daemon.kill()
    assert (daemon.runtime_dir / "endpoints.json").exists(), "a crash leaves its files"
    yield daemon.runtime_dir, pid


@pytest.mark.parametrize("tool", TOOLS, ids=" ".join)
def test_no_daemon(tool: list[str], short_tmp: Path) -> None:
    for where, why in ((short_tmp, ""), (short_tmp / "missing", " (no such directory)")):
        done = kvd(*tool, "--runtime-dir", str(where), "--timeout", "600")
        assert done.returncode == 1
        assert done.stderr == f"kvd {tool[0]}: no kvd at {where}{why}\n"
        assert done.stdout == ""


@pytest.mark.parametrize("tool", TOOLS, ids=" ".join)
def test_stale_runtime_dir_of_a_killed_daemon(tool: list[str], stale: tuple[Path, int]) -> None:
    runtime_dir, pid = stale
    done = kvd(*tool, "--runtime-dir", str(runtime_dir), "--timeout", "600")
    assert done.returncode == 1
    assert done.stderr == f"kvd {tool[0]}: kvd (pid {pid}) is not running at {runtime_dir}\n"


def test_timeout_is_honoured_when_kvd_does_not_answer(short_tmp: Path) -> None:
    with DaemonProcess(runtime_dir=short_tmp) as daemon:
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGSTOP)  # alive, holding its lock, answering nothing
        try:
            control = f"ipc://{short_tmp}/control.sock"
            for tool in (["status"], ["set", "max-batch-blocks", "64"], ["detach", "x"]):
                done = kvd(*tool, "--runtime-dir", str(short_tmp), "--timeout", "0.5")
                assert done.returncode == 1
                assert done.stderr == f"kvd {tool[0]}: no reply from kvd at {control} in 0.5s\n"
            tail = kvd("tail", "--runtime-dir", str(short_tmp), "--timeout", "0.5")
            assert tail.returncode == 1
            replay = f"ipc://{short_tmp}/replay.sock"
            assert tail.stderr == f"kvd tail: no replay answer from {replay} in 0.5s\n"
            with Client(short_tmp, timeout=0.3) as client:
                with pytest.raises(KvdTimeout):
                    client.ping()
                with pytest.raises(ReplayError):
                    client.subscribe()
        finally:
            daemon.proc.send_signal(signal.SIGCONT)


def test_bad_timeouts_are_usage_errors(short_tmp: Path) -> None:
    done = kvd("status", "--runtime-dir", str(short_tmp), "--timeout", "0")
    assert done.returncode == 2 and "--timeout must be above 0" in done.stderr


def test_client_calls_fail_fast(short_tmp: Path, stale: tuple[Path, int]) -> None:
    runtime_dir, pid = stale
    for where, message in (
        (short_tmp, f"no kvd at {short_tmp}"),
        (runtime_dir, f"kvd (pid {pid}) is not running at {runtime_dir}"),
    ):
        # Constructing a client never fails (kvd may start later); each call does, at once.
        with Client(where, timeout=600) as client:
            for call in calls(client):
                with pytest.raises(KvdUnavailable, match=re.escape(message)):
                    call()


def calls(client: Client) -> list[Callable[[], object]]:
    return [
        client.ping,
        client.status,
        client.subscribe,
        lambda: client.read_done("r", "c0", [0], remote_layout="HND"),
        lambda: client.send_raw(b"x"),
        lambda: client.configure(batch_window_us="auto"),
        lambda: client.heartbeat("engine-a"),
    ]


async def test_async_client_calls_fail_fast(stale: tuple[Path, int]) -> None:
    runtime_dir, pid = stale
    client = AsyncClient(runtime_dir, timeout=600)
    try:
        with pytest.raises(KvdUnavailable, match=f"kvd \\(pid {pid}\\) is not running"):
            await client.ping()
        with pytest.raises(KvdUnavailable):
            client.subscribe()
        with pytest.raises(KvdUnavailable):
            await client.send_raw(b"x")
    finally:
        client.close()


def test_a_subscription_learns_that_kvd_died(short_tmp: Path) -> None:
    daemon = DaemonProcess(runtime_dir=short_tmp).start()
    try:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        with Client(short_tmp, timeout=0.5) as client, client.subscribe(["c0"]) as events:
            daemon.kill()
            with pytest.raises(KvdUnavailable, match=f"kvd \\(pid {pid}\\) is not running"):
                next(events)  # its idle resync gets no replay answer: kvd is gone
    finally:
        daemon.kill()


def test_check_by_pid_where_the_lock_cannot_be_read(short_tmp: Path) -> None:
    from kvd.endpoints import _check_pid

    with pytest.raises(KvdUnavailable, match="no kvd at"):
        _check_pid(short_tmp)
    endpoints = short_tmp / "endpoints.json"
    endpoints.write_text(json.dumps({"control": "ipc://x", "pid": os.getpid()}))
    _check_pid(short_tmp)  # a live process
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    endpoints.write_text(json.dumps({"control": "ipc://x", "pid": int(dead)}))
    with pytest.raises(KvdUnavailable, match=f"kvd \\(pid {dead}\\) is not running"):
        _check_pid(short_tmp)


def test_a_starting_kvd_waits_out_a_clients_check(short_tmp: Path) -> None:
    (short_tmp / "kvd.lock").write_text("")
    fd = os.open(short_tmp / "kvd.lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # as check_running does, for a few microseconds
    releaser = threading.Timer(0.05, lambda: os.close(fd))
    releaser.start()
    lock = RuntimeLock(short_tmp)
    lock.acquire()
    releaser.join()
    check_running(short_tmp)  # held: kvd serves it
    lock.release(remove=True)
    with pytest.raises(KvdUnavailable, match="no kvd at"):
        check_running(short_tmp)
