"""Endpoints and sockets: where kvd listens, how it binds, and reading ZMQ sockets from asyncio.

Endpoints default to ``ipc://`` files in the runtime directory. TCP endpoints bind loopback
unless the host is given; port 0 picks a free port, and the bound address (``LAST_ENDPOINT``)
is written to ``endpoints.json`` in the runtime directory so that clients never guess ports.
The metrics URL, when metrics are served, is written there too.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import functools
import json
import logging
import os
import re
import resource
import secrets
import socket
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from kvd.cpus import refused_on_a_thread
from kvd.daemon.logs import RateLimitedLog
from kvd.daemon.metrics import Counter
from kvd.endpoints import ENDPOINT_NAMES, ENDPOINTS_FILE, LOCK_FILE, Endpoints

log = logging.getLogger(__name__)

LOCK_RETRY_S = 0.5
"""How long a starting kvd retries a lock it finds held: a client checking whether a daemon
runs (``kvd.endpoints.check_running``) holds it shared for a few microseconds."""

# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
_IPC_PATH_MAX = 107
_TCP = re.compile(r"^tcp://(?:(?P<host>\[[^\]]+\]|[^:/\[\]]*):)?(?P<port>\d+|\*)$")


class EndpointError(ValueError):
    pass


def normalize_endpoint(spec: str, runtime_dir: Path, name: str) -> str:
    """The address to bind for one socket; raises ``EndpointError`` naming the socket."""
    if not spec:
        spec = f"ipc://{runtime_dir / f'{name}.sock'}"
    if spec.startswith("ipc://"):
        path = spec[len("ipc://") :]
        if not path:
            raise EndpointError(f"{name}_endpoint: ipc:// needs a path")
        if len(os.fsencode(path)) > _IPC_PATH_MAX:
            raise EndpointError(
                f"{name}_endpoint: ipc path is {len(os.fsencode(path))} bytes, the limit is "
                f"{_IPC_PATH_MAX}; use a shorter --runtime-dir"
            )
        return spec
    if spec.startswith("tcp://"):
        match = _TCP.match(spec)
        if not match:
            raise EndpointError(f"{name}_endpoint: {spec!r} is not tcp://[HOST:]PORT")
        host = match["host"] or "127.0.0.1"
        return f"tcp://{host}:{match['port']}"
    raise EndpointError(f"{name}_endpoint: {spec!r} must start with ipc:// or tcp://")


def prepare_runtime_dir(path: Path) -> None:
    """Create the runtime directory if needed (systemd creates it under a unit) and check that
    nobody else controls it.

    kvd writes its lock, its journal and its sockets there: the directory, and the one above
    it, must be real directories owned by kvd's user (or root) that no other user can write to
    (a sticky directory such as /tmp may be world-writable above). It is made 0750, so the
    engine's group can reach the sockets.
    """
    for parent in reversed(path.parents):
        if not parent.exists():
            try:
                parent.mkdir(mode=0o700)
            except FileExistsError:
                pass
            except OSError as exc:
                raise EndpointError(f"runtime_dir: cannot create {parent}: {exc.strerror}") from exc
    try:
        path.mkdir(mode=0o750)
    except FileExistsError:
        pass
    except OSError as exc:
        raise EndpointError(f"runtime_dir: cannot create {path}: {exc.strerror}") from exc
    for directory in (path, path.parent):
        problem = _untrusted_dir(directory, own=directory == path)
        if problem:
            raise EndpointError(f"runtime_dir: {directory} {problem}")


def _untrusted_dir(path: Path, *, own: bool) -> str | None:
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be inspected: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory (a symbolic link?)"
    owners = {os.geteuid()} if own else {os.geteuid(), 0}
    if st.st_uid not in owners:
        return f"belongs to uid {st.st_uid}, not to kvd's user (uid {os.geteuid()})"
    sticky = bool(st.st_mode & stat.S_ISVTX)
    if st.st_mode & stat.S_IWOTH and not (sticky and not own):
        return f"is writable by every user (mode {stat.S_IMODE(st.st_mode):o})"
    return None


class RuntimeLock:
    """An exclusive lock on the runtime directory, so two daemons never share sockets."""

    def __init__(self, runtime_dir: Path) -> None:
        self.path = runtime_dir / LOCK_FILE
        self._fd = -1

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise EndpointError(f"runtime_dir: cannot open {self.path}: {exc.strerror}") from exc
        deadline = time.monotonic() + LOCK_RETRY_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EACCES) and time.monotonic() < deadline:
                    time.sleep(0.005)
                    continue
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                if exc.errno in (errno.EAGAIN, errno.EACCES):
                    raise EndpointError(
                        f"runtime_dir: another kvd (pid {holder}) is serving {self.path.parent}"
                    ) from exc
                raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self, *, remove: bool = False) -> None:
        """Let go of the lock; ``remove`` deletes the file first (a clean exit)."""
        if self._fd >= 0:
            if remove:
                self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = -1


def write_endpoints(runtime_dir: Path, endpoints: Endpoints) -> Path:
    """Publish the bound addresses atomically for clients."""
    target = runtime_dir / ENDPOINTS_FILE
    tmp = runtime_dir / f".{ENDPOINTS_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o644)
    try:
        os.write(fd, (json.dumps(endpoints.as_dict(), indent=2) + "\n").encode())
    finally:
        os.close(fd)
    tmp.replace(target)
    return target


def remove_runtime_files(runtime_dir: Path, endpoints: Endpoints | None) -> None:
    """Remove what a clean exit leaves behind: endpoints.json and the ipc socket files (the
    journal stays: the next start reads it)."""
    (runtime_dir / ENDPOINTS_FILE).unlink(missing_ok=True)
    if endpoints is None:
        return
    for name in ENDPOINT_NAMES:
        address = getattr(endpoints, name)
        if address.startswith("ipc://"):
            Path(address[len("ipc://") :]).unlink(missing_ok=True)


def bind(sock: zmq.Socket[bytes], endpoint: str, name: str) -> str:
    """Bind ``sock``; an ipc socket file is made 0660 (kvd's user and the engine's group).

    Every socket kvd binds bounds the message a peer may send (``ZMQ_MAXMSGSIZE``), set before
    this call: the listener copies the socket's options when it is bound, so an option set
    later never reaches the connections it accepts. A socket without one is refused.
    """
    if int(sock.getsockopt(zmq.MAXMSGSIZE)) < 0:
        raise ValueError(f"{name}: a socket kvd binds needs ZMQ_MAXMSGSIZE, set before bind")
    # The socket file is created by the bind: the umask decides its mode from the start.
    previous = os.umask(0o117) if endpoint.startswith("ipc://") else None
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise EndpointError(f"{name}_endpoint: cannot bind {endpoint}: {exc}") from exc
    finally:
        if previous is not None:
            os.umask(previous)
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(bound, bytes)
    return bound.decode()


_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
# pyzmq's Python-level Socket methods cost more than the ZMQ calls they wrap (and wrap flags in
# enums); the hot paths call the compiled base class directly.
_BaseSocket: Any = next((c for c in zmq.Socket.__mro__[1:] if "send" in vars(c)), zmq.Socket)
raw_recv: Callable[..., bytes] = _BaseSocket.recv
raw_send: Callable[..., None] = _BaseSocket.send
_raw_get: Callable[..., Any] = _BaseSocket.get


class SocketReader:
    """Calls ``handle(frames)`` for each message on ``sock`` from the event loop, never blocking.

    ZMQ's FD is edge-triggered: after a wake-up the socket is read until it is empty (or the
    budget is spent, then the rest is read on the next loop iteration so other work can run),
    and ``EVENTS`` is checked again because sending on the socket can consume the edge.

    ``sends=False`` says neither ``handle`` nor ``after`` sends on this socket, so the EVENTS
    query that ended the read still holds and is not repeated.

    ``copy=False`` hands over ``zmq.Frame`` objects instead of bytes (multipart only).

    With ``multipart=False`` every frame is handed over as a message of its own: the ingest
    socket's protocol is one frame per message, and skipping the RCVMORE query per frame halves
    the cost of a read.

    A failure while handling one message is contained: logged, passed to ``on_error`` (for
    counting), and the reader goes on with the next message.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: zmq.Socket[bytes],
        handle: Callable[[list[Any]], None],
        *,
        after: Callable[[], None] | None = None,
        budget: int = 512,
        multipart: bool = True,
        sends: bool = True,
        on_error: Callable[[BaseException], None] | None = None,
        copy: bool = True,
    ) -> None:
        self._loop = loop
        self._sock = sock
        self._handle = handle
        self._after = after
        self._budget = budget
        self._multipart = multipart
        self._sends = sends
        self._on_error = on_error
        self._error_log = RateLimitedLog(log)
        self._recv: Callable[[], list[Any]] = (
            functools.partial(sock.recv_multipart, _NOBLOCK, copy=copy)
            if multipart
            else lambda: [raw_recv(sock, _NOBLOCK)]
        )
        self._fd = int(_raw_get(sock, zmq.FD))
        self._scheduled = False
        self._closed = False
        loop.add_reader(self._fd, self._ready)
        self._schedule()  # messages may have arrived before the reader was added

    def flush(self) -> None:
        """Handle every message already queued on the socket now (before the socket closes)."""
        while not self._closed and int(_raw_get(self._sock, _EVENTS)) & _POLLIN:
            self._ready()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self._fd)

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._ready)

    def poke(self) -> None:
        """Read again if messages wait: call after sending on this socket outside ``handle``.

        A send processes ZMQ's pending commands, which can consume the FD's edge while a message
        is queued; without this check the loop would not wake for it until the next one arrived.
        """
        if not self._closed and int(_raw_get(self._sock, _EVENTS)) & _POLLIN:
            self._schedule()

    def _ready(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        sock = self._sock
        handle = self._handle
        # A wake-up nearly always means one message: receive it, then ask EVENTS whether more
        # wait, since ending on zmq.Again costs more than the query. In a burst, receiving until
        # zmq.Again is cheaper than a query per message.
        recv = self._recv
        try:
            frames = recv()
            try:
                handle(frames)
            except Exception as exc:  # noqa: BLE001 (contained: one message, not the reader)
                self._failed(exc)
            if int(_raw_get(sock, _EVENTS)) & _POLLIN:
                for _ in range(self._budget - 1):
                    frames = recv()
                    try:
                        handle(frames)
                    except Exception as exc:  # noqa: BLE001 (as above)
                        self._failed(exc)
                self._schedule()  # budget spent: continue after other callbacks had a turn
        except zmq.Again:
            pass
        if self._after is not None:
            try:
                self._after()
            except Exception as exc:  # noqa: BLE001 (as above)
                self._failed(exc)
        if self._sends:
            self.poke()  # the handler replied on this socket, which can consume the edge

    def _failed(self, exc: BaseException) -> None:
        """One message's handling raised: log it, count it, and keep reading."""
        self._error_log.warning(
            type(exc).__name__, "handling a message failed: %s: %.500s", type(exc).__name__, exc
        )
        log.debug("the failure", exc_info=exc)
        if self._on_error is not None:
            self._on_error(exc)


_UCRED = struct.Struct("3i")


def peer_uid(frame: zmq.Frame) -> int | None:
    """The uid of the process that sent ``frame`` over an ipc socket (None over TCP)."""
    try:
        fd = frame.get(zmq.SRCFD)
        peer = socket.socket(fileno=os.dup(fd))
    except (zmq.ZMQError, OSError):
        return None
    try:
        uid: int
        _, uid, _ = _UCRED.unpack(
            peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
    except OSError:
        return None
    finally:
        peer.close()
    return uid


def is_operator(frame: zmq.Frame) -> tuple[bool, int | None]:
    """Whether ``frame`` came from kvd's own user or root over an ipc socket, and the uid."""
    uid = peer_uid(frame)
    return uid is not None and uid in (0, os.geteuid()), uid


@dataclass(frozen=True, slots=True)
class Connection:
    """One peer's connection to a ZMQ socket, as the kernel knows it: ZMQ's file descriptor of
    it and that socket's identity (device, inode), which a later connection or file given the
    same descriptor number does not share."""

    fd: int
    identity: tuple[int, int]

    @classmethod
    def of(cls, frame: zmq.Frame) -> Connection | None:
        """The connection ``frame`` arrived on (received with ``copy=False``)."""
        try:
            fd = int(frame.get(zmq.SRCFD))
            st = os.fstat(fd)
        except (zmq.ZMQError, OSError, ValueError):
            return None
        return cls(fd, (st.st_dev, st.st_ino))

    def is_open(self) -> bool:
        """False once ZMQ closed it (its peer went away). Only reads the descriptor's identity."""
        try:
            st = os.fstat(self.fd)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.identity


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


def yield_io_threads(ctx: zmq.Context[zmq.Socket[bytes]]) -> bool:
    """Make ``ctx``'s I/O threads SCHED_BATCH: a thread woken by a send or a receive waits for
    the event loop to block instead of preempting it on a CPU they share, then moves every
    message queued meanwhile. Before the context's first socket (its threads start there).

    False, with a warning, where this process may not take that policy (a seccomp filter):
    libzmq aborts the process when its thread cannot, so it is tried on a thread of ours first.
    """
    refused = refused_on_a_thread(
        lambda: os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    )
    if refused is not None:
        log.warning(
            "dedicated_cpus: cannot make ZMQ's I/O threads SCHED_BATCH (%s); they keep the "
            "default policy",
            refused.strerror,
        )
        return False
    ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
    return True


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
