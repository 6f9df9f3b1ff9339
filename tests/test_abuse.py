"""Bounded under abuse: a full journal, a thousand idle peers, a stalled replay reader, a huge
Attach and a stopped subscriber, each against a real ``kvd serve`` over real sockets and real
shared memory. Every accepted notification still gets exactly one event, and kvd stays up.
"""

from __future__ import annotations

import resource
import signal
from pathlib import Path

from kvd.client import Client, ShmCache
from kvd.daemon_process import DaemonProcess
from kvd.protocol import Failed, Ready
from tests.daemon_helpers import collect

# -- a journal that cannot be written ------------------------------------------------------------

JOURNAL_ROOM = 16 << 10
"""RLIMIT_FSIZE for the daemon: the journal's segment fills up after a few requests."""


def _answer(client: Client, sub, req_id: str, blocks: list[int]) -> Ready | Failed:
    client.read_done(req_id, "full", blocks, remote_layout="HND", block_size_ratio=1)
    (delivery,) = collect(sub, 1)
    assert delivery.event.req_id == req_id, delivery.event
    return delivery.event


def test_a_journal_that_cannot_be_written_refuses_work_and_recovers(short_tmp: Path) -> None:
    cache = ShmCache.create(
        num_layers=1, num_blocks=256, block_size=8, num_heads=2, head_dim=16, layout="NHD"
    )
    blocks = list(range(256))  # about 1 KB per record: the journal is full after a dozen
    daemon = DaemonProcess(runtime_dir=short_tmp).start()
    try:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        with daemon.client() as client, client.subscribe(["full"], from_seq=1) as sub:
            client.attach("full", cache.specs)
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (JOURNAL_ROOM, hard))
            answered: list[Ready | Failed] = []
            # Each request gets its one event; the first that cannot be journaled is refused.
            while len(answered) < 200:
                event = _answer(client, sub, f"r{len(answered)}", blocks)
                answered.append(event)
                if isinstance(event, Failed):
                    break
            refused = answered[-1]
            assert isinstance(refused, Failed), f"{len(answered)} requests, none refused"
            assert refused.code == "journal_unavailable", refused
            assert "untouched" in refused.message
            assert all(isinstance(e, Ready) for e in answered[:-1])
            # Refused again while there is no room, each with one event, on any request.
            again = _answer(client, sub, "still-full", blocks)
            assert isinstance(again, Failed) and again.code == "journal_unavailable", again
            status = client.status()
            assert "cannot write" in status.journal_problem, status
            assert status.counters["journal_errors"] >= 2
            assert status.in_flight == 0

            # Room again: the refused request, sent again, is processed.
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))
            retried = _answer(client, sub, refused.req_id, blocks)
            assert isinstance(retried, Ready), retried
            assert client.status().journal_problem == ""
            ready = [e.req_id for e in answered[:-1]] + [refused.req_id]
        # What the journal holds is whole: a kvd killed now remembers every outcome.
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        second = DaemonProcess(runtime_dir=short_tmp).start()
        try:
            with second.client() as client:
                states = {r: client.request_status(r, "full").state for r in ready}
                assert set(states.values()) == {"ready"}, states
                assert client.status().counters["events_published"] == 0  # none interrupted
        finally:
            second.stop()
    finally:
        daemon.close()
        cache.close()
