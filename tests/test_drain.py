"""Graceful drain of a real ``kvd serve``: SIGTERM with requests in flight, a second signal, and
the drain timeout. Every request sent gets exactly one event, whatever the way out, and a
``Failed`` always means untouched: requests whose blocks may still be written when kvd leaves
are answered by the next start, from the journal, with ``Failed(interrupted)``.

The requests hold enough blocks that their post-process takes a while (most of a second on a
2-core machine, hundreds of times what the test needs), so that the daemon is still draining
when the test sends notifications or signals after SIGTERM.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvd.client import Client, ShmCache
from kvd.daemon_process import DaemonProcess
from kvd.protocol import Event, Failed, Ready
from tests.daemon_helpers import EventTap, NotifyReceiver, collect, wait_for
from tests.reference import expected_block, same_bytes

REQUESTS = 50
BLOCKS_PER_REQUEST = 16
NUM_BLOCKS = REQUESTS * BLOCKS_PER_REQUEST
MAX_BATCH_BLOCKS = 4 * BLOCKS_PER_REQUEST
LATE = 10
# 800 blocks of 1 MiB (4 layers, K and V of 64 tokens x 8 heads x 128 bf16 each).
GEOMETRY = {"num_layers": 4, "block_size": 64, "num_heads": 8, "head_dim": 128}
ROW = 128  # int16 elements of one head_dim row


def original_page(layer: int, part: int, block: int) -> torch.Tensor:
    """What ``fill`` wrote to one page: distinct rows, so any permutation changes it."""
    page = 64 * 8 * ROW
    start = (part * NUM_BLOCKS + block) * page
    rows = torch.arange(start, start + page, dtype=torch.int32).to(torch.int16).view(-1, ROW)
    rows[:, 0] = layer
    return rows.view(64, 8, ROW)


def fill(cache: ShmCache) -> None:
    """``original_page`` everywhere, a layer at a time (this also touches every page now)."""
    for layer, t in enumerate(cache.tensors):
        flat = t.view(torch.int16).view(-1)
        flat.copy_(torch.arange(flat.numel(), dtype=torch.int32).to(torch.int16))
        flat.view(-1, ROW)[:, 0] = layer


def rewritten_page(layer: int, part: int, block: int) -> torch.Tensor:
    return expected_block(
        original_page(layer, part, block).view(torch.bfloat16),
        kv_parts=1,
        block_size=64,
        heads=8,
        ratio=2,
        remote_layout="HND",
        local_layout="NHD",
    )


def check_blocks(cache: ShmCache, blocks: list[int], *, rewritten: bool) -> None:
    for layer, t in enumerate(cache.tensors):
        for part in range(2):
            for b in blocks:
                want = (
                    rewritten_page(layer, part, b) if rewritten else original_page(layer, part, b)
                )
                assert same_bytes(t[part, b], want), (layer, part, b, rewritten)


@dataclass
class Draining:
    daemon: DaemonProcess
    client: Client
    tap: EventTap
    notify: NotifyReceiver
    cache: ShmCache
    sent: dict[str, list[int]]
    runtime_dir: Path


@pytest.fixture
def draining(request: pytest.FixtureRequest, short_tmp: Path) -> Iterator[Draining]:
    """A daemon that accepted REQUESTS requests (HND into NHD, ratio 2), just sent SIGTERM and
    confirmed (STOPPING=1) to be draining most of them. Batches of four requests, one job at a
    time on the executor; the last two wait in the 1 s batch window until the drain."""
    extra: tuple[str, ...] = getattr(request, "param", ())
    notify = NotifyReceiver()
    daemon = DaemonProcess(
        *("--batch-window-us", "1000000", "--drain-timeout-s", "60"),
        *("--max-batch-blocks", str(MAX_BATCH_BLOCKS), *extra),
        env={"NOTIFY_SOCKET": notify.env_value},
        runtime_dir=short_tmp,
    )
    cache = ShmCache.create(num_blocks=NUM_BLOCKS, layout="NHD", **GEOMETRY)
    try:
        fill(cache)
        daemon.start()
        with daemon.client() as client:
            client.attach("drain", cache.specs)
            with EventTap(client, "drain") as tap:
                ready_before = client.status().counters["ready"]  # the tap's probes
                sent = {}
                for i in range(REQUESTS):
                    blocks = list(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST))
                    client.read_done(
                        f"d{i}", "drain", blocks, remote_layout="HND", block_size_ratio=2
                    )
                    sent[f"d{i}"] = blocks
                wait_for(lambda: accepted(client) - ready_before == REQUESTS)
                daemon.signal(signal.SIGTERM)
                stopping, _ = notify.wait_for("STOPPING")
                # A job or two of four requests may have finished before SIGTERM came.
                status = re.fullmatch(r"draining (\d+) requests in flight", stopping["STATUS"])
                assert status and REQUESTS // 2 <= int(status[1]) <= REQUESTS, stopping
                yield Draining(daemon, client, tap, notify, cache, sent, short_tmp)
    finally:
        daemon.kill()
        notify.close()
        cache.close()


def accepted(client: Client) -> int:
    """Requests kvd accepted so far: the ones in flight and the ones answered Ready."""
    status = client.status()
    return status.in_flight + status.counters["ready"]


def events_until_exit(d: Draining) -> tuple[dict[str, Event], int]:
    """Every event the daemon published before it exited, by req_id, and the exit code."""
    code = d.daemon.wait()
    events = d.tap.already_delivered()
    by_req = {e.req_id: e for e in events}
    assert len(by_req) == len(events), f"{len(events)} events for {len(by_req)} ids"
    return by_req, code


def send_late(d: Draining) -> list[str]:
    """Notifications sent while the daemon drains: each must get Failed(shutting_down)."""
    late = [f"late{i}" for i in range(LATE)]
    for req_id in late:
        d.client.read_done(req_id, "drain", [0], remote_layout="HND", block_size_ratio=2)
    return late


def check_the_way_out(d: Draining, events: dict[str, Event]) -> dict[str, Event]:
    """Ready means rewritten and Failed means untouched, for what the stopped daemon said; a
    new daemon on the same runtime directory answers every other request with
    Failed(interrupted). Returns the new daemon's answers."""
    for req_id, event in events.items():
        blocks = d.sent[req_id]
        if isinstance(event, Ready):
            check_blocks(d.cache, blocks, rewritten=True)
        else:
            assert event.code == "shutting_down", event
            check_blocks(d.cache, blocks, rewritten=False)
    missing = set(d.sent) - set(events)
    with DaemonProcess(runtime_dir=d.runtime_dir) as again, again.client() as client:
        with client.subscribe(["drain"], from_seq=1) as sub:
            later = {x.event.req_id: x.event for x in collect(sub, len(missing))}
            assert sub.poll(0.5) is None
        assert set(later) == missing
        for req_id, event in later.items():
            assert isinstance(event, Failed) and event.code == "interrupted", event
            assert event.invalid_block_ids == d.sent[req_id]
            assert client.request_status(req_id).code == "interrupted"
    return later


def test_sigterm_finishes_every_request_in_flight(draining: Draining) -> None:
    late = send_late(draining)
    events = {e.req_id: e for e in draining.tap.events(REQUESTS + LATE)}
    code = draining.daemon.wait()
    assert code == 0, draining.daemon.log_tail()
    assert set(events) == {*draining.sent, *late}
    for req_id, blocks in draining.sent.items():
        event = events[req_id]
        assert isinstance(event, Ready), event
        assert event.physical_block_ids == blocks
    for req_id in late:
        event = events[req_id]
        assert isinstance(event, Failed) and event.code == "shutting_down", event
    check_blocks(draining.cache, draining.sent["d0"] + draining.sent["d49"], rewritten=True)
    log = draining.daemon.log_tail(400)
    assert "kvd stopped" in log and "still being rewritten" not in log
    # A clean exit leaves no sockets, endpoints or lock behind; the journal stays.
    left = sorted(p.name for p in draining.runtime_dir.iterdir() if p.name != "kvd.log")
    assert left and all(name.startswith("journal.") for name in left), left


def test_second_signal_forces_the_exit(draining: Draining) -> None:
    draining.daemon.signal(signal.SIGINT)
    events, code = events_until_exit(draining)
    assert code == 1, "a forced exit is not a clean one"
    assert "second SIGINT: forcing exit" in draining.daemon.log_tail(400)
    assert any(isinstance(e, Failed) for e in events.values()), "nothing was cut short"
    interrupted = check_the_way_out(draining, events)
    assert interrupted, "the batch being rewritten at the exit must be reported interrupted"
    # A job holds at most --max-batch-blocks blocks, and the CPU executor runs one at a time:
    # whatever waited behind it was cut short untouched, not left half-written to the journal.
    assert len(interrupted) <= MAX_BATCH_BLOCKS // BLOCKS_PER_REQUEST, sorted(interrupted)


@pytest.mark.parametrize("draining", [("--drain-timeout-s", "0.001")], indirect=True)
def test_drain_timeout_answers_untouched_requests_and_leaves_the_rest_to_the_journal(
    draining: Draining,
) -> None:
    events, code = events_until_exit(draining)
    assert code == 1
    assert any(isinstance(e, Failed) and e.code == "shutting_down" for e in events.values())
    assert "drain did not finish within 0.001s" in draining.daemon.log_tail(400)
    check_the_way_out(draining, events)
