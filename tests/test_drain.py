"""Graceful drain of a real ``kvd serve``: SIGTERM with requests in flight, a second signal, and
the drain timeout. Every request sent gets exactly one event, whatever the way out.

The requests hold enough blocks that their post-process takes a while (most of a second on a
2-core machine, hundreds of times what the test needs), so that the daemon is still draining
when the test sends notifications or signals after SIGTERM.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from kvd.client import Client, ShmCache
from kvd.daemon_process import DaemonProcess
from kvd.protocol import Event, Failed, Ready
from tests.daemon_helpers import EventTap, NotifyReceiver, wait_for
from tests.reference import expected_block, random_bytes, same_bytes

REQUESTS = 50
BLOCKS_PER_REQUEST = 16
LATE = 10
# 800 blocks of 1 MiB (4 layers, K and V of 64 tokens x 8 heads x 128 bf16 each).
GEOMETRY = {"num_layers": 4, "block_size": 64, "num_heads": 8, "head_dim": 128}


@dataclass
class Draining:
    daemon: DaemonProcess
    client: Client
    tap: EventTap
    notify: NotifyReceiver
    cache: ShmCache
    sent: dict[str, list[int]]
    before: dict[int, torch.Tensor]
    """Layer 0, K part, of the blocks checked byte for byte (the others stay zero)."""


@pytest.fixture
def draining(request: pytest.FixtureRequest) -> Iterator[Draining]:
    """A daemon holding REQUESTS accepted requests (HND into NHD, ratio 2) in its 1 s batch
    window, just sent SIGTERM and confirmed (STOPPING=1) to be draining them."""
    extra: tuple[str, ...] = getattr(request, "param", ())
    notify = NotifyReceiver()
    daemon = DaemonProcess(
        *("--batch-window-us", "1000000", "--drain-timeout-s", "60", *extra),
        env={"NOTIFY_SOCKET": notify.env_value},
    )
    cache = ShmCache.create(num_blocks=REQUESTS * BLOCKS_PER_REQUEST, layout="NHD", **GEOMETRY)
    try:
        daemon.start()
        with daemon.client() as client:
            client.attach("drain", cache.specs)
            for t in cache.tensors:
                t.zero_()  # touch every page now, not during the drain
            layer = cache.tensors[0]
            before = {}
            for block in (0, REQUESTS * BLOCKS_PER_REQUEST - 1):
                layer[0, block] = random_bytes(list(layer.shape[2:]), layer.dtype, block)
                before[block] = layer[0, block].clone()
            with EventTap(client, "drain") as tap:
                sent = {}
                for i in range(REQUESTS):
                    blocks = list(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST))
                    client.read_done(
                        f"d{i}", "drain", blocks, remote_layout="HND", block_size_ratio=2
                    )
                    sent[f"d{i}"] = blocks
                wait_for(lambda: client.status().in_flight == REQUESTS)
                daemon.signal(signal.SIGTERM)
                stopping, _ = notify.wait_for("STOPPING")
                assert stopping["STATUS"] == f"draining {REQUESTS} requests in flight"
                yield Draining(daemon, client, tap, notify, cache, sent, before)
    finally:
        daemon.kill()
        notify.close()
        cache.close()


def events_until_exit(d: Draining, count: int) -> tuple[dict[str, Event], int]:
    """``count`` events by req_id and the exit code; fails if any req_id got two events,
    counting those that were still queued when the daemon had exited."""
    events = d.tap.events(count)
    code = d.daemon.wait()
    events += d.tap.already_delivered()
    by_req = {e.req_id: e for e in events}
    assert len(by_req) == len(events) == count, f"{len(events)} events for {len(by_req)} ids"
    return by_req, code


def send_late(d: Draining) -> list[str]:
    """Notifications sent while the daemon drains: each must get Failed(shutting_down)."""
    late = [f"late{i}" for i in range(LATE)]
    for req_id in late:
        d.client.read_done(req_id, "drain", [0], remote_layout="HND", block_size_ratio=2)
    return late


def test_sigterm_finishes_every_request_in_flight(draining: Draining) -> None:
    late = send_late(draining)
    events, code = events_until_exit(draining, REQUESTS + LATE)
    assert code == 0, draining.daemon.log_tail()
    assert set(events) == {*draining.sent, *late}
    for req_id, blocks in draining.sent.items():
        event = events[req_id]
        assert isinstance(event, Ready), event
        assert event.physical_block_ids == blocks
    for req_id in late:
        event = events[req_id]
        assert isinstance(event, Failed) and event.code == "shutting_down", event
    # Ready was sent after the rewrite: check a block of the first and of the last request.
    for block, was in draining.before.items():
        want = expected_block(
            was,
            kv_parts=1,
            block_size=GEOMETRY["block_size"],
            heads=GEOMETRY["num_heads"],
            ratio=2,
            remote_layout="HND",
            local_layout="NHD",
        )
        assert same_bytes(draining.cache.tensors[0][0, block], want)
    log = draining.daemon.log_tail(400)
    assert "kvd stopped" in log and "unfinished" not in log


def test_second_signal_forces_the_exit(draining: Draining) -> None:
    draining.daemon.signal(signal.SIGINT)
    events, code = events_until_exit(draining, REQUESTS)
    assert code == 1, "a forced exit is not a clean one"
    assert set(events) == set(draining.sent)
    failed = [e for e in events.values() if isinstance(e, Failed)]
    assert all(e.code == "shutting_down" for e in failed), failed
    assert failed, "the post-process was cut short, so its requests must fail"
    assert all(isinstance(e, Ready | Failed) for e in events.values())
    assert "second SIGINT: forcing exit" in draining.daemon.log_tail(400)


@pytest.mark.parametrize("draining", [("--drain-timeout-s", "0.001")], indirect=True)
def test_drain_timeout_fails_what_is_unfinished(draining: Draining) -> None:
    events, code = events_until_exit(draining, REQUESTS)
    assert code == 1
    assert set(events) == set(draining.sent)
    assert any(isinstance(e, Failed) and e.code == "shutting_down" for e in events.values())
    assert "drain did not finish within 0.001s" in draining.daemon.log_tail(400)
