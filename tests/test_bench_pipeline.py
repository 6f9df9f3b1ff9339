"""``kvd bench pipeline`` at a tiny size: a bar on a terminal, one JSON object under --json."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.tty import run_on_tty

TINY = ["bench", "pipeline", "--rounds", "1", "--messages", "300", "--latency-samples", "30"]


@pytest.mark.slow
def test_bar_on_a_terminal_then_the_table() -> None:
    code, out = run_on_tty([sys.executable, "-m", "kvd", *TINY])
    assert code == 0, out
    assert "kvd bench pipeline:" in out and "run/s]" in out, "a tqdm bar"
    assert "round 1/1 kvd" in out, "each run's figures above the bar"
    assert "throughput (msg/s)" in out and "meets targets:" in out


@pytest.mark.slow
def test_json_is_quiet() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvd", *TINY, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    report = json.loads(done.stdout)
    assert report["figures"]["kvd"]["throughput"] > 0 and report["rounds"] == 1
