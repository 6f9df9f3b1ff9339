"""Who is on the other end of a message: the sending process's uid, and the connection it came
on, as the kernel knows them (ipc sockets; over TCP there is no uid)."""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

import zmq

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
