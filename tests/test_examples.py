"""``examples/``: each script runs against a real kvd, as a user runs it, and exits 0."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.daemon_process import DaemonProcess

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    # A small replay buffer, so the subscriber example meets EventsLost.
    with DaemonProcess("--replay-buffer", "4") as d:
        yield d


def run_example(name: str, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_client_session(daemon: DaemonProcess) -> None:
    out = run_example("client_session.py", str(daemon.runtime_dir))
    assert "Ready(req_id='req-1'" in out
    assert "blocks [7, 3] hold the NHD layout: verified" in out


def test_client_session_finds_kvd_by_the_environment(daemon: DaemonProcess) -> None:
    out = run_example("client_session.py", env={"KVD_RUNTIME_DIR": str(daemon.runtime_dir)})
    assert "verified" in out


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="needs nixl")
def test_nixl_pair(daemon: DaemonProcess) -> None:
    out = run_example("nixl_pair.py", str(daemon.runtime_dir))
    assert "remote_engine_id='prefill-0'" in out
    assert "96 tokens x 2 layers, K and V: verified" in out
    assert "prefill-0 was told req-1 was read" in out


def test_subscriber_recovers_lost_events_with_request_status(daemon: DaemonProcess) -> None:
    out = run_example("subscriber.py", str(daemon.runtime_dir), "--requests", "10")
    assert "events lost: topic 'scheduler-" in out
    lines = out.splitlines()
    by_status = [line for line in lines if line.endswith("ready (request_status)")]
    by_event = [line for line in lines if "ready (event seq" in line]
    # kvd kept the last 4 events: those arrive as events, the 6 before from request_status.
    assert (len(by_status), len(by_event)) == (6, 4), out
    assert lines[-1] == "10 of 10 requests accounted for"
