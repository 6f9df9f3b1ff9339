"""The launch journal: what kvd started rewriting and how each rewrite ended, kept across crashes.

Before a batch is launched, a ``Launch`` record per request goes to the journal; before a
launched request's event is published, its ``Outcome`` does. The files live in the runtime
directory (tmpfs): a write survives a crash of the process without an fsync. A starting kvd
reads them back: a launch without an outcome was cut short by a crash, a kill or a forced exit,
so its blocks may be partly rewritten; the daemon answers it with ``Failed(interrupted)``. The
outcomes tell it which (cache, request, generation) it must never rewrite again.

The journal is two segment files at most; when the newer one outgrows half of ``max_bytes`` a
fresh one starts (carrying the launches still running) and the older one is deleted, so the
journal, and the outcomes it remembers, are bounded by bytes. A record cut short by a crash in
the middle of a write is the last of its file and is ignored: its launch had not started.

A write can fail (ENOSPC on a full tmpfs, EFBIG past ``RLIMIT_FSIZE``): the bytes of a record cut
short are cut off again, so the next record follows a whole one; ``problem`` says why until a
write succeeds. Outcomes that could not be written are kept (as many as requests were running)
and go first in the next write, so the journal recovers by itself once there is room.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

log = logging.getLogger(__name__)

_NAME = re.compile(r"^journal\.(\d{1,12})$")
_LENGTH = struct.Struct("<I")


class Launch(msgspec.Struct, array_like=True, gc=False, tag="L"):
    cache_id: str
    req_id: str
    generation: int
    block_ids: list[int]
    remote_engine_id: str = ""


class Outcome(msgspec.Struct, array_like=True, gc=False, tag="O"):
    """How a launched request ended; ``code`` is empty for Ready."""

    cache_id: str
    req_id: str
    generation: int
    code: str
    message: str
    block_ids: list[int]
    remote_engine_id: str = ""


Record = Launch | Outcome
Key = tuple[str, str]
"""(cache_id, req_id): what a notification is, with its generation beside it."""


class JournalError(RuntimeError):
    """The journal cannot be opened or written; the message names the file."""


@dataclass
class Recovered:
    """What the journal held at start: outcomes in the order they were recorded, and the
    launches that never got one (in launch order)."""

    outcomes: dict[Key, Outcome] = field(default_factory=dict)
    interrupted: list[Launch] = field(default_factory=list)
    torn: int = 0
    """Records cut short by a crash (at most one per file)."""


class Journal:
    def __init__(self, directory: Path, max_bytes: int) -> None:
        if max_bytes < 4096:
            raise ValueError(f"max_bytes must be >= 4096, got {max_bytes}")
        self.directory = directory
        self.max_bytes = max_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._fd = -1
        self._segment = 0
        self._size = 0
        self._unrecorded: list[Outcome] = []
        """Outcomes whose write failed: written ahead of the next record."""
        self.problem: str | None = None
        """Why the last write failed; None once one succeeded."""

    # -- start ---------------------------------------------------------------------------------

    def recover(self) -> Recovered:
        """Read every segment, oldest first. Call once, before ``open``."""
        decoder = msgspec.msgpack.Decoder(Record)
        launched: dict[Key, Launch] = {}
        recovered = Recovered()
        for number, path in self._segments():
            self._segment = max(self._segment, number)
            data = _read_regular(path)
            pos = 0
            while pos < len(data):
                if pos + _LENGTH.size > len(data):
                    recovered.torn += 1
                    break
                (length,) = _LENGTH.unpack_from(data, pos)
                start, pos = pos + _LENGTH.size, pos + _LENGTH.size + length
                if pos > len(data):
                    recovered.torn += 1
                    break
                try:
                    record = decoder.decode(data[start:pos])
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    raise JournalError(f"{path}: record at byte {start} is corrupt: {exc}") from exc
                key = (record.cache_id, record.req_id)
                if isinstance(record, Launch):
                    launched[key] = record
                else:
                    launch = launched.get(key)
                    if launch is not None and launch.generation == record.generation:
                        del launched[key]
                    recovered.outcomes.pop(key, None)
                    recovered.outcomes[key] = record
        recovered.interrupted = list(launched.values())
        return recovered

    def open(self, keep: Iterable[Outcome] = ()) -> None:
        """Start a fresh segment holding ``keep`` (what ``recover`` found that is still worth
        remembering), and delete every older segment."""
        self._rotate(keep, keep_previous=False)

    # -- hot path ------------------------------------------------------------------------------

    def launched(self, launches: Iterable[Launch]) -> None:
        """Record launches before they start (one write for the whole batch). On
        ``JournalError`` nothing of them is on record: they must not start."""
        self._write([*self._unrecorded, *launches])
        self._unrecorded.clear()

    def finished(self, outcomes: Iterable[Outcome]) -> None:
        """Record outcomes before their events are published. On ``JournalError`` they are kept
        and written with the next record."""
        self._unrecorded.extend(outcomes)
        self._write(self._unrecorded)
        self._unrecorded.clear()

    def rotate_if_full(self, running: Iterable[Launch]) -> bool:
        """Start a new segment when the current one is full; ``running`` are carried over."""
        if self._size < self.max_bytes // 2:
            return False
        self._rotate(running, keep_previous=True)
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # -- internals -----------------------------------------------------------------------------

    def _write(self, records: Iterable[Record]) -> None:
        chunks = []
        for record in records:
            payload = self._encoder.encode(record)
            chunks.append(_LENGTH.pack(len(payload)))
            chunks.append(payload)
        if not chunks:
            return
        data = b"".join(chunks)
        try:
            written = os.write(self._fd, data)
        except OSError as exc:
            self._failed(exc.strerror or str(exc))
            raise JournalError(self.problem) from exc
        if written != len(data):  # tmpfs full, or RLIMIT_FSIZE reached
            self._failed(f"short write ({written} of {len(data)} bytes)")
            raise JournalError(self.problem)
        self._size += len(data)
        self.problem = None

    def _failed(self, why: str) -> None:
        self.problem = f"cannot write {self._path(self._segment)}: {why}"
        try:
            os.ftruncate(self._fd, self._size)  # a torn record would hide the ones after it
        except OSError as exc:
            log.warning("cannot cut a torn record off %s: %s", self._path(self._segment), exc)

    def _rotate(self, carry: Iterable[Record], *, keep_previous: bool) -> None:
        """Start the next segment with ``carry``; on failure the current one stays in use."""
        old = [path for _, path in self._segments()]
        path = self._path(self._segment + 1)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            self.problem = f"cannot create {path}: {exc.strerror}"
            raise JournalError(self.problem) from exc
        previous = (self._fd, self._size)
        self._fd, self._size = fd, 0
        self._segment += 1
        try:
            self._write(carry)
        except JournalError:
            os.close(fd)
            path.unlink(missing_ok=True)
            self._fd, self._size = previous
            self._segment -= 1
            raise
        if previous[0] >= 0:
            os.close(previous[0])
        # The previous segment holds the outcomes of the recent past: keep it while running.
        for stale in old[:-1] if keep_previous else old:
            stale.unlink(missing_ok=True)
        log.debug("journal segment %s started (%d bytes carried over)", path.name, self._size)

    def _segments(self) -> list[tuple[int, Path]]:
        found = []
        for path in self.directory.iterdir():
            match = _NAME.match(path.name)
            if match:
                found.append((int(match[1]), path))
        return sorted(found)

    def _path(self, number: int) -> Path:
        return self.directory / f"journal.{number}"


def _read_regular(path: Path) -> bytes:
    """A segment's bytes; refuses anything but a regular file (a planted symlink, a fifo)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise JournalError(f"cannot open {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise JournalError(f"{path} is not a regular file")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
