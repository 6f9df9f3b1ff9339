"""Batching decisions: which accepted requests are post-processed together, and when.

Pure logic, driven by the caller's clock. Requests are grouped by (cache, remote format,
remote block size), the key under which one kernel pass can rewrite all their blocks. A batch
becomes due when its oldest request has waited the window or it holds ``max_blocks`` blocks;
the daemon takes due batches whenever the executor can accept work, so while the executor is
busy batches keep filling up (up to ``max_blocks``) instead of queueing many small passes. One
job takes due batches of up to ``max_blocks`` blocks in all, oldest first.

The window is fixed (``window_ns``) or picked per batch by an ``AutoWindow`` when the batch
opens. Both settings may change while batches wait: a new fixed window moves their deadlines.
"""

from __future__ import annotations

from operator import attrgetter

import msgspec

from kvd.daemon.ledger import RemoteFormat, Request
from kvd.daemon.window import AutoWindow

BatchKey = tuple[str, RemoteFormat, int, int]
"""(cache_id, remote_format, remote_block_size, remote_ranks)."""


class Batch(msgspec.Struct, eq=False, gc=False):
    """Requests rewritten by one kernel pass (a Struct: one per job, cheaper than a dataclass)."""

    key: BatchKey
    opened_ns: int
    deadline_ns: int
    """When the batch is due."""
    limit_ns: int
    """The latest its deadline may move to (an auto window moves it while requests arrive)."""
    requests: list[Request] = msgspec.field(default_factory=list)
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

    @property
    def remote_ranks(self) -> int:
        return self.key[3]

    def block_ids(self) -> list[int]:
        return [b for r in self.requests for b in r.physical_block_ids]


_opened = attrgetter("opened_ns")


class Batcher:
    def __init__(self, window_ns: int | AutoWindow, max_blocks: int) -> None:
        self.window_ns = 0
        self.auto: AutoWindow | None = None
        self.max_blocks = 1
        self._open: dict[BatchKey, Batch] = {}
        self._full: list[Batch] = []
        self.set_window(window_ns)
        self.set_max_blocks(max_blocks)

    def set_window(self, window: int | AutoWindow) -> None:
        """A fixed window in ns, or an ``AutoWindow``; batches already waiting get it too."""
        if isinstance(window, AutoWindow):
            self.auto = window
            for batch in self._open.values():
                batch.deadline_ns = batch.limit_ns = batch.opened_ns + window.window_ns(batch.key)
            return
        if window < 0:
            raise ValueError(f"window_ns must be >= 0, got {window}")
        self.auto = None
        self.window_ns = window
        for batch in self._open.values():
            batch.deadline_ns = batch.limit_ns = batch.opened_ns + window

    def set_max_blocks(self, max_blocks: int) -> None:
        """A new cap; open batches that reach it become full (due) at once."""
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        for key, batch in list(self._open.items()):
            if batch.num_blocks >= max_blocks:
                self._full.append(self._open.pop(key))

    def __len__(self) -> int:
        """Requests waiting in batches."""
        return sum(len(b.requests) for b in self._open.values()) + sum(
            len(b.requests) for b in self._full
        )

    @property
    def waiting(self) -> bool:
        """Whether any request waits in a batch (cheaper than ``len``)."""
        return bool(self._open or self._full)

    def add(self, request: Request, now_ns: int, *, idle: bool = True, held: int = 0) -> Batch:
        """Put ``request`` into the open batch of its key, opening one if needed.

        A request is never split; one larger than ``max_blocks`` gets a batch of its own.
        ``idle`` says whether the executor could take a job now. With an auto window, a batch
        that opens while it is busy gets no window (it fills until the executor is free); one
        that opens while it is idle waits while requests keep coming (each arrival moves its
        deadline to the auto window's patience from now), never past the auto window, and goes
        at once when the ``held`` requests kvd holds (this one included) are all it held lately.
        """
        key = (
            request.cache_id,
            request.remote_format,
            request.remote_block_size,
            request.remote_ranks,
        )
        n = len(request.physical_block_ids)
        auto = self.auto
        if auto is not None:
            auto.arrival(key, now_ns, held)
        batch = self._open.get(key)
        if batch is not None and batch.num_blocks + n > self.max_blocks:
            self._full.append(self._open.pop(key))
            batch = None
        if batch is None:
            if auto is None:
                limit = deadline = now_ns + self.window_ns
            elif idle:
                limit = now_ns + auto.window_ns(key)
                deadline = (
                    now_ns if auto.all_in(held) else min(limit, now_ns + auto.patience_ns(key))
                )
            else:
                limit = deadline = now_ns
            batch = Batch(key, now_ns, deadline, limit)
            self._open[key] = batch
        elif auto is not None:
            wait = 0 if auto.all_in(held) else auto.patience_ns(key)
            batch.deadline_ns = min(batch.limit_ns, now_ns + wait)
        batch.requests.append(request)
        batch.num_blocks += n
        if batch.num_blocks >= self.max_blocks:
            self._full.append(self._open.pop(key))
        return batch

    def take_due(self, now_ns: int, *, draining: bool = False) -> list[Batch]:
        """Remove and return one job's worth of due batches, oldest first: as many as fit in
        ``max_blocks`` blocks in all, and at least one. A batch is due when it is full or its
        window has passed; while ``draining``, every waiting batch is.

        The others stay due for the next job. A job is answered when all of it is done, so a
        bound keeps a backlog from holding the oldest requests' answers behind everyone
        else's work, and leaves untouched what a forced exit or a device failure cuts short.
        """
        due = self._full + [b for b in self._open.values() if draining or now_ns >= b.deadline_ns]
        if not due:
            return []
        due.sort(key=_opened)
        job = due[:1]
        blocks = job[0].num_blocks
        for batch in due[1:]:
            blocks += batch.num_blocks
            if blocks > self.max_blocks:
                break
            job.append(batch)
        if self._full:
            taken = {id(b) for b in job}
            self._full = [b for b in self._full if id(b) not in taken]
        for batch in job:
            if self._open.get(batch.key) is batch:
                del self._open[batch.key]
        return job

    def take_all(self) -> list[Batch]:
        """Every waiting batch regardless of its window and the cap (to fail them all)."""
        batches = self._full + list(self._open.values())
        self._full = []
        self._open.clear()
        batches.sort(key=lambda b: b.opened_ns)
        return batches

    def take_cache(self, cache_id: str) -> list[Batch]:
        """Every waiting batch of ``cache_id`` (its cache is being detached)."""
        taken = [b for b in self._full if b.cache_id == cache_id]
        self._full = [b for b in self._full if b.cache_id != cache_id]
        for key in [k for k in self._open if k[0] == cache_id]:
            taken.append(self._open.pop(key))
        return taken

    def next_deadline_ns(self) -> int | None:
        """When the earliest open batch becomes due; None when nothing waits on a window."""
        if self._full:
            return 0
        if not self._open:
            return None
        return min(b.deadline_ns for b in self._open.values())
