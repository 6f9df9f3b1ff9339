"""``kvd.bench.cores``: CPU lists, where a benchmark puts the daemon under test, and a
process's CPU time read from /proc, checked against real processes and threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.bench.cores import (
    Placement,
    PlacementError,
    cpu_seconds,
    placement,
    read_cpu,
    read_stat,
    spawning_on,
)
from kvd.cpus import CpuListError, format_cpus, parse_cpus
from kvd.daemon_process import DaemonProcess
from tests.daemon_helpers import kvd

ALLOWED = frozenset(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs to place apart")


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("1", {1}), ("2-3", {2, 3}), ("0,2-3", {0, 2, 3}), ("3, 1", {1, 3}), ("4-4", {4})],
)
def test_cpu_lists_read_as_taskset_writes_them(text: str, cpus: set[int]) -> None:
    assert parse_cpus(text) == cpus
    assert parse_cpus(format_cpus(frozenset(cpus))) == cpus


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "-1", "1,,2"])
def test_what_is_not_a_cpu_list_is_refused(text: str) -> None:
    with pytest.raises(CpuListError):
        parse_cpus(text)
    with pytest.raises(PlacementError):
        placement(text, frozenset({0, 1}))


def test_auto_gives_the_daemon_the_last_cpu_and_the_bench_the_rest() -> None:
    assert placement("auto", frozenset({0, 1, 2})) == Placement(frozenset({2}), frozenset({0, 1}))
    assert placement("auto", frozenset({3})) == Placement(), "one CPU: nothing to place apart"
    assert placement("none", frozenset({0, 1})) == Placement()
    assert placement("0", frozenset({0, 1})) == Placement(frozenset({0}), frozenset({1}))


def test_cpus_that_cannot_be_used_name_themselves() -> None:
    with pytest.raises(PlacementError, match="CPU 4-5 is not one this process may run on"):
        placement("3-5", frozenset({0, 1, 2, 3}))
    with pytest.raises(PlacementError, match="leaves no CPU for the benchmark"):
        placement("0-1", frozenset({0, 1}))


@two_cpus
def test_every_thread_of_a_daemon_started_in_the_block_runs_on_its_cpu() -> None:
    cpu = max(ALLOWED)
    daemon = DaemonProcess()
    with spawning_on(frozenset({cpu})):
        daemon.start()
    try:
        assert os.sched_getaffinity(0) == ALLOWED, "the caller's own affinity is given back"
        assert daemon.proc is not None
        tasks = list(Path(f"/proc/{daemon.proc.pid}/task").iterdir())
        assert len(tasks) > 2, "kvd's loop, executor and ZMQ's I/O threads"
        for task in tasks:
            assert os.sched_getaffinity(int(task.name)) == {cpu}, task.name
    finally:
        daemon.close()


# A child that burns CPU on a thread of its own when told, then lets that thread end.
_BURNER = """
import sys, threading, time
go = threading.Event()
def burn():
    go.wait()
    start = time.thread_time()
    while time.thread_time() - start < 0.3:
        pass
thread = threading.Thread(target=burn)
thread.start()
print("ready", flush=True)
sys.stdin.readline()
go.set()
thread.join()
print("done", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def burner() -> Iterator[subprocess.Popen[str]]:
    """``_BURNER`` running, its burner thread waiting: write a line to start it."""
    with subprocess.Popen(
        [sys.executable, "-c", _BURNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout is not None
        assert child.stdout.readline() == "ready\n"
        try:
            yield child
        finally:
            child.kill()


def test_cpu_time_counts_a_thread_that_ended_between_the_readings(
    burner: subprocess.Popen[str],
) -> None:
    """The precise per-thread sum loses a thread that ended; the reading then falls back to
    the process's own count (ticks), which keeps it: 0.3 s burned, not a negative figure."""
    assert burner.stdin is not None and burner.stdout is not None
    before = read_cpu(burner.pid)
    assert len(before.threads_ns) in (0, 2), "the main thread and the burner"
    burner.stdin.write("\n")
    burner.stdin.flush()
    assert burner.stdout.readline() == "done\n"
    after = read_cpu(burner.pid)
    # Units, not speed: the 0.3 s the thread burned, give or take ticks and start-up.
    assert 0.25 <= cpu_seconds(before, after) <= 1.0


def test_cpu_time_of_live_threads_is_read_to_the_nanosecond(
    burner: subprocess.Popen[str],
) -> None:
    before = read_cpu(burner.pid)
    if not before.threads_ns:
        pytest.skip("this kernel keeps no per-thread schedstat figures")
    after = read_cpu(burner.pid)
    used = cpu_seconds(before, after)
    assert 0 <= used < 0.01, "two readings of an idle process: nothing, not a tick"
    assert used == (sum(after.threads_ns.values()) - sum(before.threads_ns.values())) / 1e9


def test_a_stat_line_names_its_process_whatever_the_name_holds() -> None:
    """A process may name itself with spaces and parentheses (``prctl``); the fields after
    the name are read from its last ``)``."""
    script = "import ctypes, time; ctypes.CDLL(None).prctl(15, b'a (b) c', 0, 0, 0); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        path = Path(f"/proc/{child.pid}/stat")
        for _ in range(200):
            if read_stat(path).name == "a (b) c":
                break
            time.sleep(0.05)
        stat = read_stat(path)
        assert (stat.name, stat.ppid) == ("a (b) c", os.getpid())
        assert stat.cpu_s >= 0
    finally:
        child.kill()
        child.wait()
    with pytest.raises(OSError):
        read_stat(path)


@pytest.mark.slow
@two_cpus
def test_the_pipeline_bench_says_where_its_processes_ran() -> None:
    tiny = ("bench", "pipeline", "--rounds", "1", "--messages", "300", "--latency-samples", "30")
    done = kvd(*tiny, "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["daemon_cpus"] == str(max(ALLOWED))
    assert parse_cpus(report["bench_cpus"]) == ALLOWED - {max(ALLOWED)}
    done = kvd(*tiny, "--json", "--daemon-cpus", "none", timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["daemon_cpus"] is None


def test_a_daemon_cpu_the_bench_may_not_use_is_a_usage_error() -> None:
    done = kvd("bench", "pipeline", "--daemon-cpus", str(max(ALLOWED) + 1), timeout=60)
    assert done.returncode == 2
    assert "--daemon-cpus: CPU" in done.stderr and "not one this process may run on" in done.stderr
