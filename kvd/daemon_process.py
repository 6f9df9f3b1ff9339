"""Run ``kvd serve`` as a child process and wait until it answers (benchmarks, demo, tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvd.client import Client, KvdTimeout, KvdUnavailable
from kvd.endpoints import Endpoints, read_endpoints


class DaemonError(RuntimeError):
    pass


class DaemonProcess:
    """A ``kvd serve`` child with its own runtime directory (a fresh short temp dir by default)."""

    def __init__(
        self,
        *args: str,
        runtime_dir: str | Path | None = None,
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        self.runtime_dir = Path(runtime_dir or tempfile.mkdtemp(prefix="kvd-"))
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(log_path) if log_path else self.runtime_dir / "kvd.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start ``kvd serve`` without waiting for it to answer."""
        cmd = [sys.executable, "-m", "kvd", "serve", "--runtime-dir", str(self.runtime_dir)]
        self.runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*cmd, *self.args], stdout=log, stderr=subprocess.STDOUT, env=self.env
            )
        return self.proc

    def start(self, timeout: float = 30.0) -> DaemonProcess:
        """Start ``kvd serve`` and wait until it answers a Ping."""
        self.proc = self.spawn()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DaemonError(
                    f"kvd serve exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            client = Client(self.runtime_dir, timeout=0.5)
            try:
                client.ping()
                return self
            except KvdTimeout:
                pass
            except KvdUnavailable:
                time.sleep(0.02)  # not started yet: found without waiting, so ask again soon
            finally:
                client.close()
        self.kill()
        raise DaemonError(f"kvd serve did not answer within {timeout}s:\n{self.log_tail()}")

    def endpoints(self) -> Endpoints:
        return read_endpoints(self.runtime_dir)

    def client(self, timeout: float | None = None) -> Client:
        """A client of this kvd (``Client``'s default timeouts unless ``timeout`` is given)."""
        return Client(self.runtime_dir, timeout=timeout)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 20.0) -> int:
        """Wait for the exit; returns the exit code (kills the daemon if it does not exit)."""
        if self.proc is None:
            return 0
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise DaemonError(
                f"kvd serve did not exit within {timeout}s:\n{self.log_tail()}"
            ) from None

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (graceful drain) and wait; returns the exit code."""
        self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def close(self) -> None:
        """Stop it gracefully; kill it whatever happens (a failed or slow drain included)."""
        try:
            self.stop()
        finally:
            self.kill()

    def __exit__(self, *exc: object) -> None:
        self.close()
