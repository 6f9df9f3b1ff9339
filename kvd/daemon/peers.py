"""Who is on the other end of a message: the sending process's uid, and the connection it came
on, as the kernel knows them (ipc sockets; over TCP there is no uid)."""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

import zmq

_UCRED = struct.Struct("3i")


def _peer_credentials(fd: int) -> tuple[int, int] | None:
    """(pid, uid) of the process at the other end of the ipc socket ``fd`` when it connected
    (None over TCP, or for a descriptor that is not a socket)."""
    try:
        peer = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        pid, uid, _ = _UCRED.unpack(
            peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
    except OSError:
        return None
    finally:
        peer.close()
    # Not a Unix socket: the kernel answers zeros (pid 0 is no process).
    return (pid, uid) if pid > 0 else None


def peer_uid(frame: zmq.Frame) -> int | None:
    """The uid of the process that sent ``frame`` over an ipc socket (None over TCP)."""
    try:
        fd = int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, ValueError):
        return None
    credentials = _peer_credentials(fd)
    return credentials[1] if credentials is not None else None


def process_exists(pid: int) -> bool:
    """Whether process ``pid`` still runs: not gone, and not a zombie (killed, not yet reaped
    by its parent: its memory is already released)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state follows the command name, which is in parentheses and may hold any character.
    return stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] not in ("Z", "X")


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
    pid: int | None = None
    """The process that connected (ipc only)."""

    @classmethod
    def of(cls, frame: zmq.Frame) -> Connection | None:
        """The connection ``frame`` arrived on (received with ``copy=False``)."""
        try:
            fd = int(frame.get(zmq.SRCFD))
            st = os.fstat(fd)
        except (zmq.ZMQError, OSError, ValueError):
            return None
        credentials = _peer_credentials(fd)
        return cls(fd, (st.st_dev, st.st_ino), credentials[0] if credentials else None)

    def process_gone(self) -> bool:
        """True only when the process that connected is known and no longer exists."""
        return self.pid is not None and not process_exists(self.pid)

    def is_open(self) -> bool:
        """False once ZMQ closed it (its peer went away). Only reads the descriptor's identity."""
        try:
            st = os.fstat(self.fd)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.identity
