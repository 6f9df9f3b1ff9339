"""Helpers for tests that run a real ``kvd serve`` process and talk to it over real sockets."""

from __future__ import annotations

import os
import secrets
import select
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec
import zmq

from kvd.client import Client, Delivery, Subscription
from kvd.protocol import Event


def zmq_io_threads(pid: int | str = "self") -> list[int]:
    """The thread ids of process ``pid``'s ZMQ I/O threads, found by name (a thread that ends
    while they are read is left out)."""
    threads = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().startswith("ZMQbg/IO"):
                threads.append(int(task.name))
        except OSError:
            pass  # the thread ended
    return threads


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def rss_mib(pid: int) -> float:
    """Process ``pid``'s resident memory now (VmRSS), MiB."""
    return _status_kib(pid, "VmRSS") / 1024


def peak_rss_mib(pid: int) -> float:
    """The most resident memory process ``pid`` had since it started or since the last
    ``reset_peak_rss`` (VmHWM), MiB: a peak no sampling can miss."""
    return _status_kib(pid, "VmHWM") / 1024


def reset_peak_rss(pid: int) -> None:
    """Start ``peak_rss_mib`` again from the resident memory now (Linux 4.0+)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def open_fds(pid: int) -> int:
    """How many descriptors process ``pid`` has open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def settle(pid: int, timeout: float = 10.0) -> None:
    """Wait until process ``pid``'s descriptors stop changing (connections closed by their
    peers take kvd a moment to close too)."""
    deadline = time.monotonic() + timeout
    last = open_fds(pid)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if (now := open_fds(pid)) == last:
            return
        last = now
    raise AssertionError(f"kvd's descriptors did not settle within {timeout}s")


def collect(sub: Subscription, count: int, timeout: float = 30.0) -> list[Delivery]:
    """The next ``count`` deliveries, polling until a deadline (never a fixed sleep)."""
    out: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(out) < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"got {len(out)} of {count} events within {timeout}s: {out}")
        delivery = sub.poll(min(remaining, 0.5))
        if delivery is not None:
            out.append(delivery)
    return out


def by_req(deliveries: Iterable[Delivery]) -> dict[str, Event]:
    events: dict[str, Event] = {}
    for d in deliveries:
        assert d.event.req_id not in events, f"two events for {d.event.req_id}"
        events[d.event.req_id] = d.event
    return events


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


def subscribed(client: Client, topics: list[str]) -> Subscription:
    """A subscription that is known to be connected: replays from 1, so nothing is missed."""
    return client.subscribe(topics, from_seq=1)


class NotifyReceiver:
    """A stand-in for systemd's notify socket: an AF_UNIX datagram socket that records the
    ``KEY=VALUE`` messages it receives and the pid that sent each (SO_PASSCRED).

    With ``path`` it binds a file; without, a name in the abstract namespace. ``env_value`` is
    what to put in ``NOTIFY_SOCKET``.
    """

    _UCRED = struct.Struct("3i")

    def __init__(self, path: Path | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        if path is None:
            name = f"kvd-test-{os.getpid()}-{secrets.token_hex(4)}"
            self.sock.bind(b"\0" + name.encode())
            self.env_value = "@" + name
        else:
            self.sock.bind(str(path))
            self.env_value = str(path)
        self.messages: list[tuple[dict[str, str], int]] = []

    def receive(self, timeout: float) -> tuple[dict[str, str], int] | None:
        """The next message (fields, sender pid), or None if none came within ``timeout``."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return None
        data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(self._UCRED.size))
        pid = 0
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = self._UCRED.unpack(payload[: self._UCRED.size])[0]
        fields = dict(line.split("=", 1) for line in data.decode().splitlines())
        self.messages.append((fields, pid))
        return fields, pid

    def wait_for(
        self, key: str, timeout: float = 30.0, containing: str = ""
    ) -> tuple[dict[str, str], int]:
        """Receive until a message sets ``key`` (to a value containing ``containing``)."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            got = self.receive(remaining)
            if got is not None and key in got[0] and containing in got[0][key]:
                return got
        raise AssertionError(f"no {key}=...{containing} within {timeout}s; got {self.messages}")

    def close(self) -> None:
        self.sock.close()


class EventTap:
    """A bare SUB socket on kvd's events topic ``cache_id``: no replay and no resync, so it
    sees exactly what kvd published, and keeps working after kvd exits.

    It is known to be connected when created: Ready events of probe notifications (no work:
    NHD into an NHD cache) are sent until one arrives. Probe events are left out of results.
    """

    PROBE = "tap-probe-"

    def __init__(self, client: Client, cache_id: str) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, cache_id.encode())
        self._sock.connect(client.endpoints.events)
        self._decoder = msgspec.msgpack.Decoder(Event)
        probes = 0
        while not self._sock.poll(100):
            client.read_done(
                f"{self.PROBE}{probes}", cache_id, [0], remote_layout="NHD", block_size_ratio=1
            )
            probes += 1

    def _next(self, timeout: float) -> Event | None:
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            if not self._sock.poll(int(remaining * 1000) + 1):
                return None
            _, _, payload = self._sock.recv_multipart()
            event = self._decoder.decode(payload)
            if not event.req_id.startswith(self.PROBE):
                return event
        return None

    def events(self, count: int, timeout: float = 30.0) -> list[Event]:
        """The next ``count`` events, polling until a deadline."""
        deadline = time.monotonic() + timeout
        out: list[Event] = []
        while len(out) < count:
            event = self._next(deadline - time.monotonic())
            if event is None:
                raise AssertionError(f"got {len(out)} of {count} events within {timeout}s")
            out.append(event)
        return out

    def already_delivered(self) -> list[Event]:
        """Events still queued on the socket (after kvd exited, nothing more can come)."""
        out = []
        while (event := self._next(0.05)) is not None:
            out.append(event)
        return out

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()

    def __enter__(self) -> EventTap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def kvd(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``kvd ARGS`` as a user types it (in ``env``, else this process's environment), its
    output captured. The subprocess timeout is far above any tool's own: a tool that waited for
    ever fails the test instead of hanging it."""
    return subprocess.run(
        [sys.executable, "-m", "kvd", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


class RawPeer:
    """A ZMTP 3.0 peer (NULL mechanism) on an ipc:// socket of kvd, written by hand: it sends
    what libzmq's own sockets never would (a frame of any size, a subscription to any topic)
    and sees at once when kvd closes its connection."""

    _GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)

    def __init__(self, endpoint: str, socket_type: str, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(endpoint.removeprefix("ipc://"))
        self.sock.sendall(self._GREETING)
        greeting = b""
        while len(greeting) < len(self._GREETING):
            chunk = self.sock.recv(len(self._GREETING) - len(greeting))
            if not chunk:
                raise ConnectionError("kvd closed the connection during the greeting")
            greeting += chunk
        kind = socket_type.encode()
        ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", len(kind)) + kind
        self.sock.sendall(self._frame(ready, command=True))

    @staticmethod
    def _frame(body: bytes, *, more: bool = False, command: bool = False) -> bytes:
        flags = (1 if more else 0) | (4 if command else 0)
        if len(body) < 256:
            return bytes([flags, len(body)]) + body
        return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body

    def send(self, *frames: bytes) -> bool:
        """Send one message; False when kvd closed the connection while it was being sent."""
        try:
            for i, body in enumerate(frames):
                self.sock.sendall(self._frame(body, more=i < len(frames) - 1))
        except OSError:  # EPIPE or ECONNRESET: kvd stopped reading and closed it
            return False
        return True

    def closed_by_kvd(self, timeout: float = 10.0) -> bool:
        """Whether kvd closes the connection within ``timeout`` (whatever it sends first is
        read and dropped)."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            self.sock.settimeout(remaining)
            try:
                if not self.sock.recv(1 << 16):
                    return True
            except TimeoutError:
                return False
            except OSError:
                return True  # reset
        return False

    def close(self) -> None:
        self.sock.close()
