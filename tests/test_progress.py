"""The progress helper: a bar on a terminal, nothing anywhere else."""

from __future__ import annotations

import io
import sys

import pytest

from kvd.progress import progress_bar, shows_progress
from tests.tty import run_on_tty


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_shows_only_on_a_terminal_and_not_when_quiet() -> None:
    assert shows_progress(stream=_Terminal())
    assert not shows_progress(quiet=True, stream=_Terminal())
    assert not shows_progress(stream=io.StringIO())
    closed = io.StringIO()
    closed.close()  # isatty raises ValueError
    assert not shows_progress(stream=closed)


def test_off_the_terminal_nothing_is_written(capsys: pytest.CaptureFixture[str]) -> None:
    with progress_bar(3, "quiet", unit="run") as bar:
        bar.write("a line")
        bar.update()
        bar.set_postfix_str("x")
    assert capsys.readouterr() == ("", "")


SCRIPT = """
from kvd.progress import progress_bar
with progress_bar(4, "steps", unit="run") as bar:
    for i in range(4):
        bar.write(f"step {i} done")
        bar.update()
"""


def test_on_a_terminal_a_bar_with_eta_and_lines_above_it() -> None:
    code, out = run_on_tty([sys.executable, "-c", SCRIPT])
    assert code == 0, out
    assert "steps:" in out and "run/s]" in out
    assert "<00:00" in out, "elapsed<remaining: the ETA"
    for i in range(4):
        assert f"step {i} done" in out
