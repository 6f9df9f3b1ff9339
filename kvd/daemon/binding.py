"""Where kvd listens and how it binds: each socket's address, checked before anything is bound.

Endpoints default to ``ipc://`` files in the runtime directory. TCP endpoints bind loopback
unless the host is given; port 0 picks a free port, and the bound address (``LAST_ENDPOINT``)
is what clients read from ``endpoints.json``, so they never guess ports.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import zmq

# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
_IPC_PATH_MAX = 107
_TCP = re.compile(r"^tcp://(?:(?P<host>\[[^\]]+\]|[^:/\[\]]*):)?(?P<port>\d+|\*)$")


class EndpointError(ValueError):
    """A socket's address or the runtime directory kvd cannot use; the message names the setting."""


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
