"""Runs post-process jobs off the event loop, on one dedicated worker thread.

The loop submits a ``Job`` (batches resolved to the tensors they touch) and gets the result
back through ``loop.call_soon_threadsafe``; it never waits on compute. The worker only touches
the tensors a job names. A job's outcome is reported only after its work has completed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvd.batcher import Batch
from kvd.postprocess import BlockRows, postprocess_tensors

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class WorkItem:
    """One batch, resolved: the row views of its cache and the blocks to rewrite."""

    batch: Batch
    views: list[BlockRows]
    block_ids: list[int]
    nbytes: int
    """Bytes the rewrite moves: listed blocks times the bytes of one block in every view."""
    error: str | None = None
    """Set by the worker when the transform raised; the batch's requests then fail."""


@dataclass(slots=True, eq=False)
class Job:
    items: list[WorkItem]
    submitted_ns: int = 0
    started_ns: int = 0
    finished_ns: int = 0


DoneCallback = Callable[[Job], None]


class Executor:
    """One worker thread; ``capacity`` jobs may be outstanding before the daemon holds batches."""

    capacity = 1

    def __init__(self, loop: asyncio.AbstractEventLoop, on_done: DoneCallback) -> None:
        self._loop = loop
        self._on_done = on_done
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._outstanding = 0
        self._thread = threading.Thread(target=self._run, name="kvd-executor", daemon=True)
        self._thread.start()

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def has_capacity(self) -> bool:
        return self._outstanding < self.capacity

    def submit(self, job: Job) -> None:
        job.submitted_ns = time.monotonic_ns()
        self._outstanding += 1
        self._queue.put(job)

    def close(self, timeout: float | None = None) -> bool:
        """Let queued jobs finish, then stop the worker; True if it stopped within ``timeout``."""
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            job.started_ns = time.monotonic_ns()
            for item in job.items:
                try:
                    postprocess_tensors(
                        item.views,
                        item.block_ids,
                        ratio=item.batch.block_size_ratio,
                        remote_layout=item.batch.remote_layout,
                    )
                # A failed transform must fail its requests, not the worker: report and go on.
                except Exception as exc:
                    log.exception("post-process of %d blocks failed", len(item.block_ids))
                    item.error = f"{type(exc).__name__}: {exc}"
            job.finished_ns = time.monotonic_ns()
            try:
                self._loop.call_soon_threadsafe(self._finish, job)
            except RuntimeError:
                # The loop is closed: a forced exit already answered this job's requests.
                return

    def _finish(self, job: Job) -> None:
        self._outstanding -= 1
        self._on_done(job)
