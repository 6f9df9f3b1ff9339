"""The vLLM connector's link to kvd (``kvd.vllm.link``), against real ``kvd serve`` processes.

The link is the connector's own thread: it attaches, listens, notices a kvd that died or was
replaced, attaches again, and gives up after the down timeout. The engine's thread only sends
and pops the link's deque; these tests drive the link the way the connector's step does.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.client import AsyncClient, Client, ShmCache, read_done_message
from kvd.cpus import CpuListError
from kvd.daemon_process import DaemonProcess
from kvd.protocol import Ready
from kvd.vllm.holding import Released
from kvd.vllm.link import (
    STATS_BUSY_S,
    STATS_QUIET_S,
    Attachment,
    GiveUp,
    KvdLink,
    Notice,
    Resend,
    State,
    io_thread_cpus,
    parse_io_cpus,
    stats_due,
)
from kvd.vllm.stats import HandoffStats
from tests.daemon_helpers import zmq_io_threads

_ids = itertools.count()


@pytest.fixture
def cache() -> Iterator[ShmCache]:
    cache = ShmCache.create(
        num_layers=1, num_blocks=8, block_size=8, num_heads=2, head_dim=16, layout="NHD"
    )
    try:
        yield cache
    finally:
        cache.close()


def start_link(
    daemon: DaemonProcess,
    cache: ShmCache,
    down_timeout_s: float = 60.0,
    stats_path: Path | None = None,
) -> KvdLink:
    cache_id = f"link-{next(_ids)}"
    link = KvdLink(
        Client(daemon.runtime_dir, timeout=5.0),
        Attachment(cache_id, cache.specs, "engine", 10.0),
        down_timeout_s=down_timeout_s,
        stats=HandoffStats(),
        stats_path=None if stats_path is None else str(stats_path),
    )
    link.start()
    return link


def next_notice(link: KvdLink, timeout: float = 30.0) -> Notice:
    """The first notice the link queues, popped as the engine's step pops them."""
    deadline = time.monotonic() + timeout
    while not link.inbox:
        if time.monotonic() > deadline:
            raise AssertionError(f"no notice within {timeout}s (link {link.state})")
        time.sleep(0.005)
    notice, _, _ = link.inbox.popleft()
    return notice


def wait_state(link: KvdLink, state: State, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while link.state is not state:
        if time.monotonic() > deadline:
            raise AssertionError(f"link is {link.state}, not {state}, after {timeout}s")
        time.sleep(0.005)


def send(link: KvdLink, req_id: str) -> None:
    frame = read_done_message(
        req_id, link.attachment.cache_id, [1, 2], remote_layout="HND", block_size_ratio=1
    )
    assert link.send(frame)


def test_a_read_done_is_answered_through_the_deque(cache: ShmCache) -> None:
    with DaemonProcess() as daemon:
        link = start_link(daemon, cache)
        try:
            send(link, "r1")
            event = next_notice(link)
            assert isinstance(event, Ready) and event.req_id == "r1"
        finally:
            link.close()


def test_a_replaced_kvd_is_attached_again_and_held_requests_go_again(cache: ShmCache) -> None:
    first = DaemonProcess().start()
    link = start_link(first, cache)
    second: DaemonProcess | None = None
    try:
        first.kill()
        wait_state(link, State.DOWN)
        second = DaemonProcess(runtime_dir=first.runtime_dir).start()
        notice = next_notice(link)
        assert isinstance(notice, Resend), notice
        wait_state(link, State.UP)
        # Attached again: the new kvd knows the cache and answers for it.
        send(link, "after-restart")
        event = next_notice(link)
        assert isinstance(event, Ready) and event.req_id == "after-restart"
    finally:
        link.close()
        first.close()
        if second is not None:
            second.close()


def test_a_kvd_gone_past_the_down_timeout_fails_what_is_held(cache: ShmCache) -> None:
    daemon = DaemonProcess().start()
    link = start_link(daemon, cache, down_timeout_s=0.2)
    try:
        daemon.kill()
        notice = next_notice(link)
        assert isinstance(notice, GiveUp), notice
        assert link.state is State.GONE
    finally:
        link.close()
        daemon.close()


def test_closing_the_link_detaches_its_cache_at_once(cache: ShmCache) -> None:
    """A worker's shutdown detaches its cache: kvd releases its mapping then, not when the
    engine's lease (30 s) ends under whatever runs next."""
    with DaemonProcess() as daemon:
        link = start_link(daemon, cache)
        cache_id = link.attachment.cache_id
        with Client(daemon.runtime_dir, timeout=5.0) as client:
            assert cache_id in {c.cache_id for c in client.status().caches}
            link.close()
            assert cache_id not in {c.cache_id for c in client.status().caches}


def test_stats_stay_bounded_however_long_the_run(cache: ShmCache) -> None:
    stats = HandoffStats()
    for _ in range(30_000):
        stats.step(1e-5, 1, Released(latencies_s=[1e-3], answered_s=[5e-4]), [1])
    stats.absorb()
    report = stats.report()
    assert report["requests"] == 30_000
    assert report["handoff"]["count"] == 30_000
    assert len(report["handoff"]["recent_s"]) <= 10_000
    assert len(report["ready_latency"]["recent_s"]) <= 10_000
    assert len(report["answer_latency"]["recent_s"]) <= 10_000
    assert report["steps_to_release"] == {"1": 30_000}


def test_the_stats_file_waits_while_the_engine_hands_off() -> None:
    """Each write holds the GIL the engine's step then waits for: while requests flow the file
    is rewritten every ``STATS_BUSY_S`` at most (ten times a second before, a late token for
    every running request each time), and once the engine is quiet."""
    changed = 100.0
    assert not stats_due(changed + 0.1, changed_at=changed, written_at=changed - 1.0)
    assert not stats_due(changed + 0.001, changed_at=changed, written_at=changed - 0.2)
    assert stats_due(changed + STATS_QUIET_S, changed_at=changed, written_at=changed - 1.0)
    assert stats_due(changed + 0.001, changed_at=changed, written_at=changed - STATS_BUSY_S)


def test_the_stats_file_holds_every_answer_once_the_engine_is_quiet(
    cache: ShmCache, tmp_path: Path
) -> None:
    """Read while the link rewrites it, the file is always whole JSON; once the engine stops
    handing off it holds every request, without waiting for the link to close."""
    path = tmp_path / "stats.json"
    with DaemonProcess() as daemon:
        link = start_link(daemon, cache, stats_path=path)
        try:
            for i in range(20):
                send(link, f"s{i}")
                assert isinstance(next_notice(link), Ready)
                link.stats.step(1e-5, 1, Released(latencies_s=[1e-3], answered_s=[5e-4]), [1])
                if path.exists():
                    json.loads(path.read_text())  # never half a file
            deadline = time.monotonic() + 30
            while not (path.exists() and json.loads(path.read_text())["requests"] == 20):
                assert time.monotonic() < deadline, "the stats never caught up with the engine"
                time.sleep(0.01)
        finally:
            link.close()
    assert json.loads(path.read_text())["requests"] == 20


def io_thread_cpus_now() -> dict[int, str]:
    """This process's ZMQ I/O threads: thread id -> the CPUs it may run on."""
    threads = {}
    for tid in zmq_io_threads():
        try:
            status = Path(f"/proc/self/task/{tid}/status").read_text()
        except OSError:
            continue  # the thread ended
        threads[tid] = status.split("Cpus_allowed_list:")[1].split()[0]
    return threads


def test_a_client_runs_its_io_thread_on_the_cpus_it_is_given() -> None:
    cpu = max(os.sched_getaffinity(0))
    before = io_thread_cpus_now()
    with DaemonProcess() as daemon, Client(daemon.runtime_dir, io_cpus=frozenset({cpu})) as client:
        client.ping()
        started = {t: cpus for t, cpus in io_thread_cpus_now().items() if t not in before}
    assert list(started.values()) == [str(cpu)]


async def test_an_async_client_runs_its_io_thread_on_the_cpus_it_is_given() -> None:
    cpu = min(os.sched_getaffinity(0))
    before = io_thread_cpus_now()
    with DaemonProcess() as daemon:
        client = AsyncClient(daemon.runtime_dir, io_cpus=frozenset({cpu}))
        try:
            await client.ping()
            started = {t: cpus for t, cpus in io_thread_cpus_now().items() if t not in before}
        finally:
            client.close()
    assert list(started.values()) == [str(cpu)]


@pytest.mark.parametrize("cpus", [{1000}, {1024}, set()])
def test_cpus_this_process_may_not_use_are_an_error_not_an_abort(cpus: set[int]) -> None:
    """libzmq aborts the process at the client's first socket when it cannot place its thread
    there (CPU 1000, on a machine without it), or places it anywhere (no CPUs)."""
    if cpus & os.sched_getaffinity(0):
        pytest.skip(f"this machine has CPU {cpus}")
    with pytest.raises(ValueError, match="io_cpus: this process may not run on CPUs"):
        Client("/nonexistent", io_cpus=frozenset(cpus))


ENGINE = frozenset({1})


@pytest.mark.parametrize(
    ("setting", "kvd_cpus", "placed", "note"),
    [
        ("kvd", [0], {0}, "on kvd's CPUs 0, apart from the engine thread's (1)"),
        ("kvd", [0, 1], None, "on the engine thread's CPUs 1: kvd's (0-1) are not apart"),
        ("kvd", [], None, "CPUs 1: this kvd does not say which CPUs it runs on"),
        ("engine", [0], None, "on the engine thread's CPUs 1 (kvd_io_cpus = engine)"),
        ("2-3", [0], {2, 3}, "on CPUs 2-3 (kvd_io_cpus), the engine thread on 1"),
    ],
)
def test_the_io_thread_goes_to_kvds_cpus_only_when_they_are_apart_from_the_engines(
    setting: str, kvd_cpus: list[int], placed: set[int] | None, note: str
) -> None:
    cpus, why = io_thread_cpus(parse_io_cpus(setting), kvd_cpus, ENGINE)
    assert cpus == (frozenset(placed) if placed is not None else None)
    assert note in why


@pytest.mark.parametrize("setting", ["", "seven", "3-1", "kvd,0"])
def test_a_bad_kvd_io_cpus_is_refused_naming_it(setting: str) -> None:
    with pytest.raises(CpuListError, match=r"kvd_io_cpus: .*; or kvd, or engine"):
        parse_io_cpus(setting)
