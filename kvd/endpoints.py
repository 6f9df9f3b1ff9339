"""Where a daemon's sockets are: the runtime directory and ``endpoints.json``; and whether a
daemon serves it at all.

Shared by the daemon, which writes the file after binding, and by clients, which read it, so
that nobody guesses ports. Endpoints default to ``ipc://`` files in the runtime directory.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

ENDPOINT_NAMES = ("control", "ingest", "events", "replay")
ENDPOINTS_FILE = "endpoints.json"
LOCK_FILE = "kvd.lock"
"""A serving kvd holds an exclusive ``flock`` on it and has written its pid in it."""


class KvdUnavailable(ConnectionError):
    """No kvd serves the runtime directory, or it cannot be reached; the message says which."""


@dataclass(frozen=True, slots=True)
class Endpoints:
    control: str
    ingest: str
    events: str
    replay: str
    metrics: str = ""
    """The URL of the Prometheus endpoint, empty when metrics are off."""
    pid: int = 0
    """The daemon's process id (0 when not known)."""

    def as_dict(self) -> dict[str, str | int]:
        return {name: value for name, value in asdict(self).items() if value}


SYSTEM_RUNTIME_DIR = Path("/run/kvd")
"""Where ``kvd@<gpu>.service`` keeps its runtime directories (``RuntimeDirectory=kvd/%i``)."""


def default_runtime_dir(gpu: str, environ: Mapping[str, str] | None = None) -> Path:
    """The runtime directory ``kvd serve --gpu GPU`` uses when none is given."""
    env = os.environ if environ is None else environ
    # systemd may list several directories separated by ':'; ours is the first.
    if env.get("RUNTIME_DIRECTORY"):
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "kvd" / gpu
    return Path(f"/tmp/kvd-{os.getuid()}") / gpu


def client_runtime_dir(
    gpu: str, environ: Mapping[str, str] | None = None, system_dir: Path = SYSTEM_RUNTIME_DIR
) -> Path:
    """The runtime directory a client of GPU ``gpu``'s kvd looks in when none is given: the
    first that exists of ``$XDG_RUNTIME_DIR/kvd/GPU`` (a kvd started by hand), ``/run/kvd/GPU``
    (``kvd@GPU.service``) and ``/tmp/kvd-UID/GPU``; the last when none does.

    Not ``$RUNTIME_DIRECTORY``: in a client's environment that is its own unit's directory.
    """
    env = os.environ if environ is None else environ
    fallback = default_runtime_dir(gpu, {})  # kvd serve's own, with no directory in its env
    candidates = [system_dir / gpu, fallback]
    if env.get("XDG_RUNTIME_DIR"):
        candidates.insert(0, Path(env["XDG_RUNTIME_DIR"]) / "kvd" / gpu)
    return next((path for path in candidates if path.is_dir()), fallback)


def read_endpoints(runtime_dir: str | Path) -> Endpoints:
    """The endpoints a daemon serving ``runtime_dir`` bound (falls back to the ipc defaults)."""
    runtime_dir = Path(runtime_dir)
    try:
        data = json.loads((runtime_dir / ENDPOINTS_FILE).read_text())
        control, ingest, events, replay = (str(data[name]) for name in ENDPOINT_NAMES)
        metrics, pid = str(data.get("metrics", "")), int(data.get("pid", 0))
    except (OSError, KeyError, TypeError, ValueError):
        control, ingest, events, replay = (
            f"ipc://{runtime_dir / f'{name}.sock'}" for name in ENDPOINT_NAMES
        )
        metrics, pid = "", 0
    return Endpoints(control, ingest, events, replay, metrics, pid)


def check_running(runtime_dir: str | Path) -> None:
    """Raise ``KvdUnavailable`` when no kvd serves ``runtime_dir``; cheap (a few system calls),
    so clients ask before they connect and after a wait timed out.

    A serving kvd holds ``kvd.lock`` locked. A clean exit removes it, with ``endpoints.json``
    and the sockets; a crashed kvd leaves it unlocked, with its pid in it. Where the lock cannot
    be opened (it is kvd's user's own), the pid in ``endpoints.json`` tells instead. Says
    nothing when a daemon may be there: only a reply proves one is.
    """
    runtime_dir = Path(runtime_dir)
    try:
        fd = os.open(runtime_dir / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if not runtime_dir.is_dir():
            raise KvdUnavailable(f"no kvd at {runtime_dir} (no such directory)") from None
        raise KvdUnavailable(f"no kvd at {runtime_dir}") from None
    except PermissionError:
        _check_pid(runtime_dir)
        return
    except OSError as exc:
        raise KvdUnavailable(f"cannot reach kvd at {runtime_dir}: {exc.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return  # held: a daemon serves the directory
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
    finally:
        os.close(fd)
    if pid.isdigit():
        raise KvdUnavailable(f"kvd (pid {pid}) is not running at {runtime_dir}")
    raise KvdUnavailable(f"no kvd at {runtime_dir}")


def daemon_alive(runtime_dir: str | Path) -> bool:
    """``check_running`` as a yes or no, for a caller that polls (the vLLM connector)."""
    try:
        check_running(runtime_dir)
    except KvdUnavailable:
        return False
    return True


def _check_pid(runtime_dir: Path) -> None:
    """``check_running`` for a client that may not open the lock: by the pid kvd published."""
    try:
        data = json.loads((runtime_dir / ENDPOINTS_FILE).read_text())
    except FileNotFoundError:
        raise KvdUnavailable(f"no kvd at {runtime_dir}") from None
    except PermissionError:
        raise KvdUnavailable(
            f"cannot reach kvd at {runtime_dir}: permission denied (kvd's sockets are for its "
            "user and group)"
        ) from None
    except (OSError, ValueError):
        return
    pid = data.get("pid") if isinstance(data, dict) else None
    if not isinstance(pid, int) or pid <= 0:
        return
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise KvdUnavailable(f"kvd (pid {pid}) is not running at {runtime_dir}") from None
    except PermissionError:
        pass  # a process of another user: kvd's, most likely
