"""Bounding peers' descriptors: kvd takes every descriptor it may, and closes connections past
``max_connections`` or stuck in the handshake, because libzmq aborts the process on EMFILE."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import resource
import socket
import struct

import zmq

from kvd.daemon.logs import RateLimitedLog
from kvd.daemon.metrics import Counter
from kvd.daemon.reader import SocketReader

log = logging.getLogger(__name__)

FD_RESERVE = 256
"""Descriptors kept for kvd's own use (attached caches take two each, the journal, the device,
a kernel compiler): peer connections get the rest of the soft limit at most."""
HANDSHAKE_S = 5.0
"""How long a connection may take to speak ZMTP before kvd closes it (half-open, raw peers)."""
_FD_LIMIT_CAP = 1 << 20  # the kernel's default nr_open: an unlimited hard limit raises to this


def raise_fd_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; returns the soft limit in force.

    libzmq aborts the whole process when accept() fails with EMFILE, so kvd takes every
    descriptor it is allowed, and ``ConnectionGuard`` keeps peers below that.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _FD_LIMIT_CAP if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, target, exc)
    return soft


_WATCHED = int(zmq.EVENT_ACCEPTED) | int(zmq.EVENT_DISCONNECTED)
_MONITOR_EVENT = struct.Struct("=HI")


class ConnectionGuard:
    """Counts the peer connections of kvd's listening sockets and closes those past ``bound``.

    A socket monitor reports each accepted connection with its descriptor; one that would pass
    the bound is shut down at once (ZMQ then closes it and reports it gone). Connections that
    never complete the ZMTP handshake are closed by ZMQ after ``HANDSHAKE_S``. So no number of
    idle or half-open peers holds more than ``bound`` descriptors for longer than that.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sockets: dict[str, zmq.Socket[bytes]],
        bound: int,
        refused: Counter,
    ) -> None:
        self.bound = bound
        self._refused = refused
        self._open: set[tuple[str, int]] = set()
        self._refused_log = RateLimitedLog(log)
        self._watched: list[tuple[zmq.Socket[bytes], zmq.Socket[bytes], SocketReader]] = []
        for name, sock in sockets.items():
            monitor = sock.get_monitor_socket(_WATCHED)
            handle = functools.partial(self._event, name)
            reader = SocketReader(loop, monitor, handle, sends=False)
            self._watched.append((sock, monitor, reader))

    def __len__(self) -> int:
        return len(self._open)

    def _event(self, name: str, frames: list[bytes]) -> None:
        event, fd = _MONITOR_EVENT.unpack(frames[0])
        if event == zmq.EVENT_DISCONNECTED:
            self._open.discard((name, fd))
        elif event == zmq.EVENT_ACCEPTED:
            if len(self._open) < self.bound:
                self._open.add((name, fd))
                return
            self._refused.value += 1
            self._refused_log.warning(
                name,
                "%s: a connection past max_connections (%d) was closed",
                name,
                self.bound,
            )
            _shut_down(fd, frames[1])

    def close(self) -> None:
        """Stop watching (before the sockets close)."""
        for sock, monitor, reader in self._watched:
            reader.close()
            sock.disable_monitor()
            monitor.close(linger=0)
        self._watched = []


def _shut_down(fd: int, endpoint: bytes) -> None:
    """Shut down the connection ZMQ accepted as ``fd``; ZMQ closes it on seeing the EOF.

    The descriptor may already be closed, or reused: only a socket whose local address is the
    listening endpoint is touched (at worst another connection past the bound).
    """
    try:
        peer = socket.socket(fileno=os.dup(fd))
    except OSError:
        return  # gone already
    try:
        local = peer.getsockname()
        address = endpoint.decode()
        if isinstance(local, str) and address != f"ipc://{local}":
            return
        if isinstance(local, tuple) and not address.endswith(f":{local[1]}"):
            return
        peer.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not a socket, or not connected any more
    finally:
        peer.close()
