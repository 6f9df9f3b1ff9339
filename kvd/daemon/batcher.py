"""Batching decisions: which accepted requests are post-processed together, and when.

Pure logic, driven by the caller's clock. Requests are grouped by (cache, remote format,
remote block size), the key under which one kernel pass can rewrite all their blocks. A batch
becomes due when its oldest request has waited ``window_ns`` or it holds ``max_blocks`` blocks; the
daemon takes due batches whenever the executor can accept work, so while the executor is busy
batches keep filling up (up to ``max_blocks``) instead of queueing many small passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvd.daemon.ledger import RemoteFormat, Request

BatchKey = tuple[str, RemoteFormat, int]
"""(cache_id, remote_format, remote_block_size)."""


@dataclass(slots=True, eq=False)
class Batch:
    key: BatchKey
    opened_ns: int
    requests: list[Request] = field(default_factory=list)
    num_blocks: int = 0

    @property
    def cache_id(self) -> str:
        return self.key[0]

    @property
    def remote_format(self) -> RemoteFormat:
        return self.key[1]

    @property
    def remote_block_size(self) -> int:
        return self.key[2]

    def block_ids(self) -> list[int]:
        return [b for r in self.requests for b in r.physical_block_ids]


class Batcher:
    def __init__(self, window_ns: int, max_blocks: int) -> None:
        if window_ns < 0:
            raise ValueError(f"window_ns must be >= 0, got {window_ns}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.window_ns = window_ns
        self.max_blocks = max_blocks
        self._open: dict[BatchKey, Batch] = {}
        self._full: list[Batch] = []

    def __len__(self) -> int:
        """Requests waiting in batches."""
        return sum(len(b.requests) for b in self._open.values()) + sum(
            len(b.requests) for b in self._full
        )

    @property
    def waiting(self) -> bool:
        """Whether any request waits in a batch (cheaper than ``len``)."""
        return bool(self._open or self._full)

    def add(self, request: Request, now_ns: int) -> Batch:
        """Put ``request`` into the open batch of its key, opening one if needed.

        A request is never split; one larger than ``max_blocks`` gets a batch of its own.
        """
        key = (request.cache_id, request.remote_format, request.remote_block_size)
        n = len(request.physical_block_ids)
        batch = self._open.get(key)
        if batch is not None and batch.num_blocks + n > self.max_blocks:
            self._full.append(self._open.pop(key))
            batch = None
        if batch is None:
            batch = Batch(key, now_ns)
            self._open[key] = batch
        batch.requests.append(request)
        batch.num_blocks += n
        if batch.num_blocks >= self.max_blocks:
            self._full.append(self._open.pop(key))
        return batch

    def take_due(self, now_ns: int) -> list[Batch]:
        """Remove and return every batch that is full or whose window has passed, oldest first."""
        due = self._full
        self._full = []
        for key, batch in list(self._open.items()):
            if now_ns - batch.opened_ns >= self.window_ns:
                due.append(self._open.pop(key))
        due.sort(key=lambda b: b.opened_ns)
        return due

    def take_all(self) -> list[Batch]:
        """Every waiting batch regardless of its window (used when draining)."""
        batches = self._full + list(self._open.values())
        self._full = []
        self._open.clear()
        batches.sort(key=lambda b: b.opened_ns)
        return batches

    def next_deadline_ns(self) -> int | None:
        """When the earliest open batch becomes due; None when nothing waits on a window."""
        if self._full:
            return 0
        if not self._open:
            return None
        return min(b.opened_ns for b in self._open.values()) + self.window_ns
