"""sd_notify against real AF_UNIX datagram sockets, in-process and from a real ``kvd serve``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.client import ShmCache
from kvd.daemon.sdnotify import Notifier, notify_address
from kvd.daemon.timers import Every
from kvd.daemon_process import DaemonProcess
from tests.daemon_helpers import NotifyReceiver


@pytest.fixture(params=["path", "abstract"])
def receiver(request: pytest.FixtureRequest, short_tmp: Path) -> Iterator[NotifyReceiver]:
    r = NotifyReceiver(short_tmp / "notify" if request.param == "path" else None)
    yield r
    r.close()


def test_without_notify_socket_nothing_is_sent() -> None:
    notifier = Notifier.from_env({})
    assert not notifier.enabled
    assert notifier.watchdog_interval_s is None
    assert not notifier.ready("up")
    assert not notifier.watchdog()


def test_from_env_reads_and_removes_the_variables() -> None:
    env = {"NOTIFY_SOCKET": "@kvd-x", "WATCHDOG_USEC": "3000000", "OTHER": "kept"}
    notifier = Notifier.from_env(env)
    assert notifier.address == b"\0kvd-x"
    assert notifier.watchdog_interval_s == 1.5
    assert env == {"OTHER": "kept"}, "children must not inherit systemd's notify variables"


@pytest.mark.parametrize(
    ("pid", "watchdog"),
    [("", True), (str(os.getpid()), True), (str(os.getpid() + 1), False), ("x", False)],
)
def test_watchdog_only_for_the_named_process(pid: str, watchdog: bool) -> None:
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1000000"}
    if pid:
        env["WATCHDOG_PID"] = pid
    assert (Notifier.from_env(env).watchdog_interval_s == 0.5) is watchdog


def test_addresses() -> None:
    assert notify_address("/run/systemd/notify") == b"/run/systemd/notify"
    assert notify_address("@name") == b"\0name"
    assert notify_address("vsock:2:1234") is None
    assert not Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled


def test_messages_reach_the_socket(receiver: NotifyReceiver) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": receiver.env_value})
    assert notifier.ready("serving\n2 caches")
    assert notifier.watchdog()
    assert notifier.stopping("draining")
    got = [receiver.receive(5.0) for _ in range(3)]
    assert [m for m, _ in filter(None, got)] == [
        {"READY": "1", "STATUS": "serving 2 caches"},
        {"WATCHDOG": "1"},
        {"STOPPING": "1", "STATUS": "draining"},
    ]
    assert all(pid == os.getpid() for _, pid in filter(None, got))
    notifier.close()


def test_a_vanished_manager_is_not_an_error(short_tmp: Path) -> None:
    path = short_tmp / "gone"
    receiver = NotifyReceiver(path)
    receiver.close()
    path.unlink()
    notifier = Notifier.from_env({"NOTIFY_SOCKET": str(path)})
    assert not notifier.status("anyone?")
    notifier.close()


async def test_every_repeats_on_the_loop() -> None:
    loop = asyncio.get_running_loop()
    calls: list[int] = []
    three = asyncio.Event()

    def tick() -> None:
        assert asyncio.get_running_loop() is loop
        calls.append(1)
        if len(calls) == 3:
            three.set()

    every = Every(loop, 0.001, tick)
    await asyncio.wait_for(three.wait(), 10)
    every.cancel()


def test_daemon_notifies_ready_watchdog_and_stopping(receiver: NotifyReceiver) -> None:
    daemon = DaemonProcess(
        "--metrics-addr",
        "127.0.0.1:0",
        env={"NOTIFY_SOCKET": receiver.env_value, "WATCHDOG_USEC": "200000"},
    )
    proc = daemon.spawn()
    try:
        ready, pid = receiver.wait_for("READY")
        assert pid == proc.pid, "NotifyAccess=main: the main process must send"
        assert ready["STATUS"].startswith("serving 0 caches")
        # READY=1 comes after every socket is bound: the files and the listener exist now.
        endpoints = json.loads((daemon.runtime_dir / "endpoints.json").read_text())
        for name in ("control", "ingest", "events", "replay"):
            assert Path(endpoints[name].removeprefix("ipc://")).exists(), name
        host, port = endpoints["metrics"].removeprefix("http://").split("/")[0].split(":")
        socket.create_connection((host, int(port)), timeout=5).close()
        for _ in range(2):
            receiver.wait_for("WATCHDOG")
        cache = ShmCache.create(num_layers=1, num_blocks=4, block_size=4, num_heads=1, head_dim=4)
        with cache, daemon.client() as client:
            assert client.ping().pid == proc.pid
            client.attach("c", cache.specs)
            # STATUS follows the daemon's state (refreshed every few seconds).
            receiver.wait_for("STATUS", containing="serving 1 cache, 0 requests in flight")
            client.detach("c")
        daemon.signal(signal.SIGTERM)
        stopping, _ = receiver.wait_for("STOPPING")
        assert stopping["STATUS"] == "draining 0 requests in flight"
        assert daemon.wait() == 0
    finally:
        daemon.kill()
