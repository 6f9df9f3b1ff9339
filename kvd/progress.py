"""Progress bars for long commands (``kvd demo``, ``kvd bench ...``, ``kvd tune``).

One rule for all of them: a tqdm bar with an ETA on stderr when stderr is a terminal, and
nothing at all otherwise (``--json``, ``--no-progress``, a pipe, a log file, CI). Lines a
command wants to show while it runs go through ``ProgressBar.write`` so they print above the bar
instead of through it, and are dropped with the bar.

Usage::

    add_progress_flag(parser)  # --no-progress, when the parser is built
    ...
    quiet = args.json or args.no_progress
    with progress_bar(len(cases), "kvd demo", unit="case", quiet=quiet) as bar:
        for case in cases:
            ...
            bar.write(f"{case}: ok")
            bar.update()

Never update a bar inside a timed loop: update it between measurements.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Protocol, TextIO


class _Tqdm(Protocol):
    """What this module uses of a ``tqdm.tqdm`` bar."""

    def update(self, n: float = 1) -> object: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...

    def close(self) -> None: ...


class ProgressBar:
    """A tqdm bar plus ``write``, which prints above the bar (tqdm.write) or not at all."""

    def __init__(self, bar: _Tqdm, enabled: bool) -> None:
        self._bar, self.enabled = bar, enabled

    def update(self, n: float = 1) -> None:
        self._bar.update(n)

    def set_postfix_str(self, s: str = "") -> None:
        self._bar.set_postfix_str(s)

    def write(self, line: str) -> None:
        """Show ``line`` above the bar; dropped when the bar is off."""
        if self.enabled:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shows_progress(quiet: bool = False, stream: TextIO | None = None) -> bool:
    """Whether a bar would be shown: not ``quiet`` and ``stream`` (stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return not quiet and stream.isatty()
    except ValueError:  # a closed stream
        return False


def progress_bar(
    total: float | None, desc: str, *, unit: str = "it", quiet: bool = False
) -> ProgressBar:
    """A bar counting ``total`` ``unit``s on stderr with rate and ETA.

    It is a no-op (nothing is printed, ``write`` included) when ``quiet`` or stderr is not a
    terminal. ``total`` None shows a counter without an ETA.
    """
    from tqdm import tqdm

    enabled = shows_progress(quiet)
    bar: _Tqdm = tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        disable=not enabled,
        dynamic_ncols=True,
        leave=False,  # the command's own report follows; a finished bar would only repeat it
        smoothing=0.1,
    )
    return ProgressBar(bar, enabled)


class _TakesArguments(Protocol):
    """An ``argparse`` parser or argument group."""

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action: ...


def add_progress_flag(parser: _TakesArguments, *aliases: str) -> None:
    """``--no-progress`` (and ``aliases``): no bar even on a terminal; sets ``no_progress``."""
    parser.add_argument(
        "--no-progress",
        *aliases,
        dest="no_progress",
        action="store_true",
        help="no progress bar on stderr (it only shows on a terminal, and never with --json)",
    )
