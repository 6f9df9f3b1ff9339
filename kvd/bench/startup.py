"""``kvd bench startup``: how long ``kvd serve`` takes from exec to READY, idle and under load.

A restarted kvd is what every request in flight waits for, so this is the time that matters
after a crash. Each start is a fresh ``python -m kvd serve`` on a fresh runtime directory, timed
from just before the exec to the ``READY=1`` it sends on ``NOTIFY_SOCKET`` (sd_notify: what
systemd waits for; every socket is bound, the journal recovered and the endpoints file written
before it), then stopped with SIGTERM. Load is N busy-loop processes started before a level's
starts and killed after them, standing in for the engines kvd runs beside.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvd.progress import progress_bar
from kvd.tables import format_table

READY_TIMEOUT_S = 120.0
"""A start that sends no READY within this long fails the benchmark."""
STOP_TIMEOUT_S = 20.0
_BUSY_LOOP = "while True: pass"


class StartupFailed(RuntimeError):
    """A ``kvd serve`` exited or stayed silent before READY; the message has its log."""


def time_to_ready(device: str, timeout_s: float = READY_TIMEOUT_S) -> float:
    """Seconds from exec to ``READY=1`` of one ``kvd serve --device device`` (then stopped)."""
    with tempfile.TemporaryDirectory(prefix="kvd-b-") as tmp, _notify_socket() as (notify, env):
        runtime_dir, log_path = Path(tmp) / "run", Path(tmp) / "kvd.log"
        cmd = [sys.executable, "-m", "kvd", "serve", "--runtime-dir", str(runtime_dir)]
        with open(log_path, "wb") as log:
            started = time.perf_counter()
            proc = subprocess.Popen(
                [*cmd, "--device", device],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
            )
        try:
            ready = _wait_ready(notify, proc, started + timeout_s, log_path)
        finally:
            _stop(proc)
        return ready - started


@contextlib.contextmanager
def _notify_socket() -> Iterator[tuple[socket.socket, dict[str, str]]]:
    """A datagram socket in the abstract namespace, as systemd's, and the env naming it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    name = f"kvd-bench-startup-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        sock.bind(b"\0" + name.encode())
        yield sock, {"NOTIFY_SOCKET": "@" + name}
    finally:
        sock.close()


def _wait_ready(
    notify: socket.socket, proc: subprocess.Popen[bytes], deadline: float, log_path: Path
) -> float:
    """The moment ``READY=1`` arrived; raises ``StartupFailed`` on an exit or the deadline."""
    while (remaining := deadline - time.perf_counter()) > 0:
        if proc.poll() is not None:
            raise StartupFailed(
                f"kvd serve exited with {proc.returncode} before READY:\n{_tail(log_path)}"
            )
        # A datagram wakes this at once; the short timeout only bounds noticing an exit.
        notify.settimeout(min(remaining, 0.1))
        try:
            data = notify.recv(4096)
        except TimeoutError:
            continue
        if b"READY=1" in data.split(b"\n"):
            return time.perf_counter()
    raise StartupFailed(f"kvd serve sent no READY within the timeout:\n{_tail(log_path)}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """``n`` processes spinning on a core each (a busy engine's worth of CPU) while inside."""
    procs = [subprocess.Popen([sys.executable, "-c", _BUSY_LOOP]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def run(args: argparse.Namespace) -> int:
    loads: list[int] = args.load
    quiet = args.json or args.no_progress
    samples: dict[int, list[float]] = {}
    try:
        with progress_bar(
            len(loads) * args.starts, "kvd bench startup", unit="start", quiet=quiet
        ) as bar:
            for busy in loads:
                with busy_processes(busy):
                    times = samples[busy] = []
                    for _ in range(args.starts):
                        times.append(time_to_ready(args.device, args.timeout))
                        bar.set_postfix_str(f"{busy} busy: {times[-1]:.2f} s")
                        bar.update()
    except StartupFailed as exc:
        print(f"kvd bench startup: {exc}", file=sys.stderr)
        return 1
    report: dict[str, Any] = {
        "device": args.device,
        "cpus": os.cpu_count(),
        "starts": args.starts,
        "loads": [
            {
                "busy": busy,
                "ready_s": [round(t, 4) for t in times],
                "min_s": round(min(times), 4),
                "median_s": round(statistics.median(times), 4),
                "max_s": round(max(times), 4),
            }
            for busy, times in samples.items()
        ],
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"kvd serve --device {args.device}: seconds from exec to READY=1, "
        f"{args.starts} starts per load, {report['cpus']} CPUs"
    )
    rows = [["busy processes", "min", "median", "max"]]
    rows += [
        [str(e["busy"]), f"{e['min_s']:.2f}", f"{e['median_s']:.2f}", f"{e['max_s']:.2f}"]
        for e in report["loads"]
    ]
    for line in format_table(rows, right=(0, 1, 2, 3)):
        print(line)
    return 0
