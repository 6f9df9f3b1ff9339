"""What a start costs: a CPU ``kvd serve`` is READY before torch, numpy or Triton load, and the
commands that need none of them never import them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "numpy", "triton")

SERVE = f"""
import signal, sys
from kvd.daemon.config import Config
from kvd.daemon.server import Server

HEAVY = {HEAVY!r}

def loaded():
    return ",".join(m for m in HEAVY if m in sys.modules) or "-"

def ready(server):
    print("at READY:", loaded(), flush=True)
    server.handle_exit(signal.SIGTERM)

server = Server(Config(runtime_dir=sys.argv[1]))
server.on_ready = ready
code = server.run()
print("after exit:", loaded(), flush=True)
sys.exit(code)
"""

COMMAND = f"""
import sys
from kvd.cli import main

try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("loaded:", ",".join(m for m in {HEAVY!r} if m in sys.modules) or "-")
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_cpu_daemon_is_ready_before_torch_loads_and_loads_it_after(short_tmp: Path) -> None:
    done = _python(SERVE, str(short_tmp / "run"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "at READY: -", done.stderr
    # Loaded off the loop after READY, so the first Attach finds them (the exit waits for it).
    assert lines[1] == "after exit: torch,numpy", done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["serve", "--help"],
        ["bench", "startup", "--help"],
        ["status", "--runtime-dir", "/nonexistent/kvd"],
    ],
    ids=" ".join,
)
def test_commands_that_need_no_tensors_import_no_torch(argv: list[str]) -> None:
    done = _python(COMMAND, *argv)
    assert done.stdout.splitlines()[-1] == "loaded: -", done.stdout + done.stderr
