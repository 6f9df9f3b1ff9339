"""NIXL test helpers shared by ``tests/test_nixl.py`` and the processes it runs: the demo's
prefill process as a peer, and polling a reader until its READs end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import msgspec

from kvd.demo.prefill import PrefillSpec
from kvd.nixl.reader import Reader, ReadResult


def spawn_prefill(spec: PrefillSpec) -> tuple[subprocess.Popen[str], str]:
    """The demo's prefill process (its own NIXL agent), once it has bound its handshake socket;
    returns it and that socket's endpoint."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvd.demo.prefill", msgspec.json.encode(spec).decode()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the prefill process exited before it was ready"
    return proc, json.loads(line)["ready"]["endpoint"]


def kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)  # SIGKILL ends a SIGSTOPped process too
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def finish(reader: Reader, count: int, timeout: float = 20.0) -> list[ReadResult]:
    """Poll ``reader`` until ``count`` reads have ended."""
    results: list[ReadResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < count:
        assert time.monotonic() < deadline, f"{len(results)} of {count} reads ended"
        results += reader.poll()
        time.sleep(0.0005)
    return results
