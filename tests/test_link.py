"""The vLLM connector's link to kvd (``kvd.vllm.link``), against real ``kvd serve`` processes.

The link is the connector's own thread: it attaches, listens, notices a kvd that died or was
replaced, attaches again, and gives up after the down timeout. The engine's thread only sends
and pops the link's deque; these tests drive the link the way the connector's step does.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest

from kvd.client import Client, ShmCache, read_done_message
from kvd.daemon_process import DaemonProcess
from kvd.protocol import Ready
from kvd.vllm.link import Attachment, GiveUp, KvdLink, Notice, Resend, State
from kvd.vllm.stats import HandoffStats

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


def start_link(daemon: DaemonProcess, cache: ShmCache, down_timeout_s: float = 60.0) -> KvdLink:
    cache_id = f"link-{next(_ids)}"
    link = KvdLink(
        Client(daemon.runtime_dir, timeout=5.0),
        Attachment(cache_id, cache.specs, "engine", 10.0),
        down_timeout_s=down_timeout_s,
        stats=HandoffStats(),
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
    notice, _ = link.inbox.popleft()
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


def test_stats_stay_bounded_however_long_the_run(cache: ShmCache) -> None:
    stats = HandoffStats()
    for _ in range(30_000):
        stats.step(1e-5, 1, 0, [1e-3], [1])
    stats.absorb()
    report = stats.report()
    assert report["requests"] == 30_000
    assert report["handoff"]["count"] == 30_000
    assert len(report["handoff"]["recent_s"]) <= 10_000
    assert len(report["ready_latency"]["recent_s"]) <= 10_000
    assert report["steps_to_release"] == {"1": 30_000}
