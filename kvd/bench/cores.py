"""Where a benchmark's processes run, and the CPU time a process used, to the nanosecond.

kvd is meant to run on a core of its own (systemd ``CPUAffinity=``, a Kubernetes CPU manager's
exclusive cpuset). A benchmark that compares it with a baseline places both the same way: the
daemon under test (kvd, or the baseline in its place) on ``Placement.daemon``, the benchmark's
own threads on ``Placement.bench``. A child inherits the affinity of the thread that starts it,
so ``spawning_on`` sets the calling thread's for the time of a spawn: every thread the child
ever makes (ZMQ's I/O threads, kvd's executor) starts on those CPUs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvd.cpus import CpuListError, format_cpus, parse_cpus


class PlacementError(ValueError):
    """CPUs that cannot be used here; the message names them and why."""


@dataclass(frozen=True)
class Placement:
    """The daemon under test's CPUs and the benchmark's; both None: left to the scheduler."""

    daemon: frozenset[int] | None = None
    bench: frozenset[int] | None = None


def placement(spec: str, allowed: frozenset[int] | None = None) -> Placement:
    """``spec``: ``auto`` (the daemon on the last CPU this process may use, the bench on the
    others; unpinned with only one), ``none`` (unpinned), or a CPU list for the daemon (the
    bench gets the rest). Raises ``PlacementError`` for CPUs this process may not use, or a
    list that leaves the bench none."""
    allowed = allowed if allowed is not None else frozenset(os.sched_getaffinity(0))
    if spec == "none" or (spec == "auto" and len(allowed) < 2):
        return Placement()
    try:
        daemon = frozenset({max(allowed)}) if spec == "auto" else parse_cpus(spec)
    except CpuListError as exc:
        raise PlacementError(str(exc)) from None
    if not daemon <= allowed:
        raise PlacementError(
            f"CPU {format_cpus(daemon - allowed)} is not one this process may run on "
            f"(it may use {format_cpus(allowed)})"
        )
    bench = allowed - daemon
    if not bench:
        raise PlacementError(f"CPU {format_cpus(daemon)} leaves no CPU for the benchmark itself")
    return Placement(daemon, bench)


@contextlib.contextmanager
def spawning_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Processes started in this block (by this thread) run on ``cpus``; None: as this thread."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass(frozen=True)
class Stat:
    """What a ``/proc/PID/stat`` (or ``.../task/TID/stat``) line says that the benches use."""

    name: str
    ppid: int
    cpu_s: float
    """User and system CPU seconds, to the clock tick."""


def read_stat(path: str | Path) -> Stat:
    """Parse one stat file; raises ``OSError`` when the process or thread is gone, ``ValueError``
    or ``IndexError`` on a line not of the kernel's form. The name may hold spaces and
    parentheses: it is everything between the first ``(`` and the last ``)``."""
    text = Path(path).read_text()
    head, tail = text.rsplit(")", 1)
    fields = tail.split()
    ticks = int(fields[11]) + int(fields[12])
    return Stat(head.split("(", 1)[1], int(fields[1]), ticks / os.sysconf("SC_CLK_TCK"))


@dataclass(frozen=True)
class CpuReading:
    """A process's CPU time so far: per live thread in ns (``/proc/PID/task/*/schedstat``, empty
    where the kernel keeps no such figures), and all threads ever in clock ticks (``stat``)."""

    threads_ns: dict[int, int]
    ticks_s: float


def read_cpu(pid: int) -> CpuReading:
    ticks_s = read_stat(f"/proc/{pid}/stat").cpu_s
    threads_ns = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            threads_ns[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended while being read
    if not any(threads_ns.values()):
        threads_ns = {}  # no schedstat figures (a kernel without CONFIG_SCHED_INFO)
    return CpuReading(threads_ns, ticks_s)


def cpu_seconds(before: CpuReading, after: CpuReading) -> float:
    """CPU seconds used between two readings of one process, all its threads.

    To the nanosecond when every thread of ``before`` still runs (threads born since count
    whole); otherwise, or without schedstat figures, to the clock tick (10 ms at 100 Hz), which
    counts the time of threads that ended too.
    """
    if before.threads_ns and before.threads_ns.keys() <= after.threads_ns.keys():
        return (sum(after.threads_ns.values()) - sum(before.threads_ns.values())) / 1e9
    return after.ticks_s - before.ticks_s
