"""Log output: readable lines on a terminal, no duplicate timestamps under journald, or JSON."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import TextIO

from kvd.daemon.config import LogFormat, LogLevel

_TEXT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
# journald stamps every line itself and maps the <N> prefix to a priority.
_JOURNAL = "<%(syslog_priority)d>%(name)s: %(message)s"
_PRIORITY = {
    logging.DEBUG: 7,
    logging.INFO: 6,
    logging.WARNING: 4,
    logging.ERROR: 3,
    logging.CRITICAL: 2,
}


def under_journald(stream: TextIO = sys.stderr) -> bool:
    """True when ``stream`` is the journal stream systemd connected (JOURNAL_STREAM=dev:ino)."""
    expected = os.environ.get("JOURNAL_STREAM")
    if not expected:
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError):
        return False
    return expected == f"{st.st_dev}:{st.st_ino}"


class _JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        priority = _PRIORITY.get(record.levelno, 6)
        record.syslog_priority = priority
        # journald makes an entry of every line: each line of a traceback needs the prefix too.
        return super().format(record).replace("\n", f"\n<{priority}>")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (RFC 3339, UTC), level, logger, msg, and exc if any."""

    def format(self, record: logging.LogRecord) -> str:
        created = time.gmtime(record.created)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", created) + f".{int(record.msecs):03d}Z"
        out = {
            "ts": stamp,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(
    level: LogLevel = "info", fmt: LogFormat = "auto", stream: TextIO = sys.stderr
) -> None:
    handler = logging.StreamHandler(stream)
    formatter: logging.Formatter
    if fmt == "json":
        formatter = JsonFormatter()
    elif fmt == "auto" and under_journald(stream):
        formatter = _JournalFormatter(_JOURNAL)
    else:
        formatter = logging.Formatter(_TEXT)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # NIXL and others log through the root logger at INFO; keep them at warnings unless debugging.
    if level != "debug":
        logging.getLogger("nixl").setLevel(logging.WARNING)


class RateLimitedLog:
    """At most one line per key per ``interval`` seconds, with a count of what was held back."""

    def __init__(self, logger: logging.Logger, interval: float = 1.0) -> None:
        self._logger = logger
        self._interval = interval
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, key: str, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self._interval) < self._interval:
            self._held[key] = self._held.get(key, 0) + 1
            return
        held = self._held.pop(key, 0)
        self._last[key] = now
        suffix = f" (+{held} similar in the last {self._interval:g}s)" if held else ""
        self._logger.warning(fmt + suffix, *args)


MESSAGE_CHARS = 1000
"""The most of one message kvd logs or answers with (an Error, a Failed): a message that quotes
what a peer sent (a shape, a name) is cut here, so its size is kvd's bound, not the peer's."""


def clipped(message: str, limit: int = MESSAGE_CHARS) -> str:
    """``message``, cut to ``limit`` characters and saying so."""
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... ({len(message)} characters)"
