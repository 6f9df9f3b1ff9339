"""``kvd bench startup`` at a tiny size: real ``kvd serve`` starts timed to their READY."""

from __future__ import annotations

import json

import pytest

from tests.daemon_helpers import kvd


@pytest.mark.slow
def test_json_has_one_time_to_ready_per_start_and_load() -> None:
    done = kvd("bench", "startup", "--starts", "1", "--load", "0,1", "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    report = json.loads(done.stdout)
    assert report["device"] == "cpu" and report["starts"] == 1
    assert [entry["busy"] for entry in report["loads"]] == [0, 1]
    for entry in report["loads"]:
        ready, attached = entry["ready"], entry["attached"]
        assert len(ready["samples_s"]) == 1 and ready["samples_s"][0] > 0
        assert ready["min_s"] <= ready["median_s"] <= ready["max_s"]
        assert attached["samples_s"][0] > ready["samples_s"][0], "attached after READY"


def test_a_start_that_fails_is_reported_with_its_log() -> None:
    done = kvd("bench", "startup", "--starts", "1", "--load", "0", "--device", "tpu", timeout=120)
    assert done.returncode == 1
    assert "exited with 2 before READY" in done.stderr and "device: 'tpu'" in done.stderr


@pytest.mark.parametrize(
    ("flag", "value", "reason"),
    [
        ("--starts", "0", "expected 1 or more"),
        ("--load", "0,x", "expected comma-separated whole numbers"),
        ("--load", "2,-1", "expected numbers >= 0"),
    ],
)
def test_bad_arguments_are_usage_errors_naming_the_flag(flag: str, value: str, reason: str) -> None:
    done = kvd("bench", "startup", flag, value, timeout=60)
    assert done.returncode == 2
    assert f"argument {flag}: {reason}" in done.stderr
