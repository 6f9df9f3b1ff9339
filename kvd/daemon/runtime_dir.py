"""The runtime directory: checked to be kvd's own, locked against a second daemon, and where the
bound addresses (``endpoints.json``) are published and cleaned up on a clean exit."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import stat
import time
from pathlib import Path

from kvd.daemon.binding import EndpointError
from kvd.endpoints import ENDPOINT_NAMES, ENDPOINTS_FILE, LOCK_FILE, Endpoints

LOCK_RETRY_S = 0.5
"""How long a starting kvd retries a lock it finds held: a client checking whether a daemon
runs (``kvd.endpoints.check_running``) holds it shared for a few microseconds."""


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
