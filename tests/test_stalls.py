"""``kvd.bench.stalls``: a process held off its cores shows as lateness, and a run with such a
stall is flagged."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from kvd.bench.stalls import verdict

WATCHED = """
import json, sys, time
from kvd.bench.stalls import StallWatch
with StallWatch() as watch:
    print("watching", flush=True)
    sys.stdin.readline()
    print(json.dumps(watch.take()), flush=True)
    time.sleep(0.1)
    print(json.dumps(watch.take()), flush=True)
"""


def test_a_process_stopped_for_half_a_second_is_seen_late_by_that_much_on_its_cores_once() -> None:
    """The stop shows in the first ``take``; the next one starts over, without it."""
    with subprocess.Popen(
        [sys.executable, "-c", WATCHED],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            assert child.stdout.readline() == "watching\n"
            child.send_signal(signal.SIGSTOP)  # off every core, as a frozen machine keeps it
            time.sleep(0.5)
            child.send_signal(signal.SIGCONT)
            time.sleep(0.2)  # the sleepers wake and record their lateness
            child.stdin.write("\n")
            child.stdin.flush()
            worst = json.loads(child.stdout.readline())
            after = json.loads(child.stdout.readline())
        finally:
            child.kill()
    assert worst and all(late >= 0.4 for late in worst.values()), worst
    assert after.keys() == worst.keys() and all(late < 0.4 for late in after.values()), after


def test_a_stall_past_the_limit_is_flagged_naming_the_core() -> None:
    assert verdict({"0": 0.02, "1": 0.05}) is None
    assert verdict({}) is None
    warning = verdict({"0": 0.02, "1": 14.6})
    assert warning is not None and "core 1 for 14.6 s" in warning
