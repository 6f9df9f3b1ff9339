"""Where a daemon's sockets are: the runtime directory and ``endpoints.json``.

Shared by the daemon, which writes the file after binding, and by clients, which read it, so
that nobody guesses ports. Endpoints default to ``ipc://`` files in the runtime directory.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

ENDPOINT_NAMES = ("control", "ingest", "events", "replay")
ENDPOINTS_FILE = "endpoints.json"
LOCK_FILE = "kvd.lock"


@dataclass(frozen=True, slots=True)
class Endpoints:
    control: str
    ingest: str
    events: str
    replay: str
    metrics: str = ""
    """The URL of the Prometheus endpoint, empty when metrics are off."""

    def as_dict(self) -> dict[str, str]:
        return {name: value for name, value in asdict(self).items() if value}


def default_runtime_dir(gpu: str, environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    # systemd may list several directories separated by ':'; ours is the first.
    if env.get("RUNTIME_DIRECTORY"):
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "kvd" / gpu
    return Path(f"/tmp/kvd-{os.getuid()}") / gpu


def read_endpoints(runtime_dir: str | Path) -> Endpoints:
    """The endpoints a daemon serving ``runtime_dir`` bound (falls back to the ipc defaults)."""
    runtime_dir = Path(runtime_dir)
    try:
        data = json.loads((runtime_dir / ENDPOINTS_FILE).read_text())
        bound = {name: str(data[name]) for name in ENDPOINT_NAMES}
        return Endpoints(**bound, metrics=str(data.get("metrics", "")))
    except (OSError, KeyError, TypeError, ValueError):
        return Endpoints(
            **{name: f"ipc://{runtime_dir / f'{name}.sock'}" for name in ENDPOINT_NAMES}
        )


def daemon_alive(runtime_dir: str | Path) -> bool:
    """Whether a kvd holds ``runtime_dir`` now: its lock file is locked (no round trip).

    A daemon holds an exclusive ``flock`` on ``kvd.lock`` while it runs; the lock dies with it,
    however it ends.
    """
    path = Path(runtime_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False
