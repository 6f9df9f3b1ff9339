"""Helpers for tests that run a real ``kvd serve`` process and talk to it over real sockets."""

from __future__ import annotations

import os
import secrets
import select
import socket
import struct
import time
from collections.abc import Iterable
from pathlib import Path

from kvd.client import Client, Delivery, Subscription
from kvd.protocol import Event


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

    def wait_for(self, key: str, timeout: float = 30.0) -> tuple[dict[str, str], int]:
        """Receive until a message that sets ``key`` arrives; returns that message."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            got = self.receive(remaining)
            if got is not None and key in got[0]:
                return got
        raise AssertionError(f"no {key}= within {timeout}s; got {self.messages}")

    def close(self) -> None:
        self.sock.close()
