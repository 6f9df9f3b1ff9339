"""Log formats: text on a terminal, journald's priority prefixes without timestamps, JSON lines.

journald is recognised by JOURNAL_STREAM naming the device and inode of stderr; the tests point
it at a real file that stands in for the journal's stream.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.daemon.logs import clipped, setup_logging
from kvd.daemon_process import DaemonProcess

TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d")
JOURNAL_LINE = re.compile(r"^<[0-7]>[\w.]+: ")


def journal_stream(path: Path) -> str:
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}"


@pytest.fixture
def root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def log_to(path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch, journal: str | None) -> str:
    if journal is None:
        monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    else:
        monkeypatch.setenv("JOURNAL_STREAM", journal)
    with path.open("a") as stream:
        setup_logging("info", fmt, stream)  # type: ignore[arg-type]
        log = logging.getLogger("kvd.test")
        log.info("hello %s", "there")
        log.warning("careful")
        try:
            int("boom")
        except ValueError:
            log.exception("it broke")
        logging.getLogger().handlers[0].flush()
    return path.read_text()


@pytest.mark.usefixtures("root_logger")
def test_text_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = log_to(tmp_path / "log", "auto", monkeypatch, journal=None).splitlines()
    assert TIMESTAMP.match(lines[0]) and lines[0].endswith("INFO    kvd.test: hello there")
    assert "WARNING kvd.test: careful" in lines[1]


@pytest.mark.usefixtures("root_logger")
def test_journald_lines_carry_priorities_and_no_timestamps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "journal"
    path.touch()
    lines = log_to(path, "auto", monkeypatch, journal=journal_stream(path)).splitlines()
    assert lines[:3] == [
        "<6>kvd.test: hello there",
        "<4>kvd.test: careful",
        "<3>kvd.test: it broke",
    ]
    # Every traceback line is its own journal entry, at the record's priority.
    assert lines[3:] and all(line.startswith("<3>") for line in lines[3:])
    assert lines[-1] == "<3>ValueError: invalid literal for int() with base 10: 'boom'"
    assert not any(TIMESTAMP.search(line) for line in lines)


@pytest.mark.usefixtures("root_logger")
def test_journal_stream_of_another_file_is_not_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "other"
    other.touch()
    text = log_to(tmp_path / "log", "auto", monkeypatch, journal=journal_stream(other))
    assert TIMESTAMP.match(text)


@pytest.mark.usefixtures("root_logger")
def test_json_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "journal"
    path.touch()
    # Explicit json wins even under journald.
    text = log_to(path, "json", monkeypatch, journal=journal_stream(path))
    records = [json.loads(line) for line in text.splitlines()]
    assert [(r["level"], r["logger"], r["msg"]) for r in records] == [
        ("info", "kvd.test", "hello there"),
        ("warning", "kvd.test", "careful"),
        ("error", "kvd.test", "it broke"),
    ]
    assert "ValueError: invalid literal" in records[2]["exc"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", records[0]["ts"])


def run_daemon(daemon: DaemonProcess) -> list[str]:
    """Start ``daemon``, stop it with SIGTERM, and return its log lines."""
    daemon.start()
    try:
        assert daemon.stop() == 0, daemon.log_tail()
    finally:
        daemon.kill()
    return daemon.log_path.read_text().splitlines()


def test_daemon_under_journald(tmp_path: Path, short_tmp: Path) -> None:
    log_path = tmp_path / "kvd.log"
    log_path.touch()
    env = {"JOURNAL_STREAM": journal_stream(log_path)}
    lines = run_daemon(DaemonProcess(runtime_dir=short_tmp / "rt", log_path=log_path, env=env))
    assert any(line.startswith("<6>kvd.daemon.server: kvd ") for line in lines)
    assert all(JOURNAL_LINE.match(line) for line in lines), lines
    assert not any(TIMESTAMP.search(line) for line in lines)


def test_daemon_json_logs(tmp_path: Path, short_tmp: Path) -> None:
    daemon = DaemonProcess(
        "--log-format", "json", runtime_dir=short_tmp / "rt", log_path=tmp_path / "kvd.log"
    )
    records = [json.loads(line) for line in run_daemon(daemon)]
    assert {r["logger"] for r in records} >= {"kvd.daemon.server"}
    assert records[-1]["msg"] == "kvd stopped"
    assert all(set(r) >= {"ts", "level", "logger", "msg"} for r in records)


def test_a_long_message_is_clipped_and_says_so() -> None:
    assert clipped("short") == "short"
    assert clipped("x" * 1000) == "x" * 1000
    assert clipped("x" * 5000) == "x" * 1000 + "... (5000 characters)"
