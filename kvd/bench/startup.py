"""``kvd bench startup``: how long ``kvd serve`` takes from exec to READY, idle and under load.

A restarted kvd is what every request in flight waits for, so this is the time that matters
after a crash. Each start is a fresh ``python -m kvd serve`` on a fresh runtime directory, timed
from just before the exec to the ``READY=1`` it sends on ``NOTIFY_SOCKET`` (sd_notify: what
systemd waits for; every socket is bound, the journal recovered and the endpoints file written
before it), and on a CPU daemon on to the reply to a first Attach (a tiny shared-memory cache,
sent at READY): what an engine attaching at once waits for, torch's import included, since kvd
loads it after READY. Then the daemon is stopped with SIGTERM. Load is N busy-loop processes
started before a level's starts and killed after them, standing in for the engines kvd runs
beside.
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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Start:
    """One start, in seconds from the exec."""

    ready_s: float
    attached_s: float | None
    """When the first Attach was answered; None on a CUDA daemon (no shared memory there)."""


def time_start(device: str, timeout_s: float = READY_TIMEOUT_S) -> Start:
    """Time one ``kvd serve --device device`` to READY and to its first Attach (then stop it)."""
    from kvd.client import Client, KvdError, KvdTimeout, KvdUnavailable
    from kvd.shm import ShmCache

    cache = ShmCache.create(num_layers=1, num_blocks=4, block_size=4, num_heads=1, head_dim=4)
    with (
        tempfile.TemporaryDirectory(prefix="kvd-b-") as tmp,
        _notify_socket() as (notify, env),
        contextlib.closing(cache),
    ):
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
            deadline = started + timeout_s
            ready = _wait_ready(notify, proc, deadline, log_path)
            attached = None
            if device == "cpu":
                with Client(runtime_dir, timeout=max(deadline - time.perf_counter(), 0.1)) as c:
                    try:
                        c.attach("bench-startup", cache.specs)
                    except (KvdError, KvdTimeout, KvdUnavailable) as exc:
                        raise StartupFailed(f"first Attach: {exc}\n{_tail(log_path)}") from exc
                attached = time.perf_counter() - started
        finally:
            _stop(proc)
        return Start(ready - started, attached)


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
    samples: dict[int, list[Start]] = {}
    try:
        with progress_bar(
            len(loads) * args.starts, "kvd bench startup", unit="start", quiet=quiet
        ) as bar:
            for busy in loads:
                with busy_processes(busy):
                    times = samples[busy] = []
                    for _ in range(args.starts):
                        times.append(time_start(args.device, args.timeout))
                        bar.set_postfix_str(f"{busy} busy: READY at {times[-1].ready_s:.2f} s")
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
                "ready": _spread([s.ready_s for s in starts]),
                "attached": _spread([s.attached_s for s in starts if s.attached_s is not None]),
            }
            for busy, starts in samples.items()
        ],
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"kvd serve --device {args.device}: seconds from exec to READY=1 and to the first "
        f"Attach answered (min / median / max), {args.starts} starts per load, "
        f"{report['cpus']} CPUs"
    )
    rows = [["busy processes", "READY", "first Attach"]]
    rows += [[str(e["busy"]), _cell(e["ready"]), _cell(e["attached"])] for e in report["loads"]]
    for line in format_table(rows, right=(0,)):
        print(line)
    return 0


def _spread(times: list[float]) -> dict[str, Any]:
    """The samples and their min, median and max (empty when there are none)."""
    if not times:
        return {}
    return {
        "samples_s": [round(t, 4) for t in times],
        "min_s": round(min(times), 4),
        "median_s": round(statistics.median(times), 4),
        "max_s": round(max(times), 4),
    }


def _cell(spread: dict[str, Any]) -> str:
    if not spread:
        return "-"
    return f"{spread['min_s']:.2f} / {spread['median_s']:.2f} / {spread['max_s']:.2f}"
