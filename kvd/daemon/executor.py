"""Runs post-process jobs off the event loop, on dedicated threads.

The loop submits a ``Job`` (batches resolved to the tensors they touch) and gets the result
back through ``loop.call_soon_threadsafe``; it never waits on compute or on the GPU. The worker
only touches the tensors a job names. A job's outcome is reported only after its work has
completed: on the CPU when the kernel returns, on CUDA when the event recorded after its
launches on the dedicated stream has completed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvd.daemon.batcher import Batch
from kvd.daemon.registry import Rewrite
from kvd.kernels import MemoryFault
from kvd.kernels.device import CudaEvent, Lane
from kvd.layout.formats import FormatError
from kvd.layout.planner import PlanError
from kvd.protocol import Reason

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class WorkItem:
    """One batch, resolved: the kernel passes of its cache and each request's blocks.

    The ids were checked at ingest (in range, unique, owned by this batch alone).
    """

    batch: Batch
    rewrites: list[Rewrite]
    requests: list[tuple[list[int], int]]
    """(block ids, covered_sub_blocks) of each request of the batch, in batch order."""
    nbytes: int
    """Bytes the rewrite may touch: listed blocks times the bytes of one block id."""
    error: str | None = None
    """Set by the worker when the transform raised; the batch's requests then fail."""
    code: Reason = Reason.TRANSFORM_FAILED
    """``invalid_format`` when the kernels refused the pair before writing a byte."""
    lost: str | None = None
    """Set when the cache's memory faulted (a segment shrank): no later request may touch it."""

    @property
    def num_blocks(self) -> int:
        return sum(len(ids) for ids, _ in self.requests)


def run_item(item: WorkItem) -> None:
    """Apply every kernel pass of ``item``; a failure is recorded on it, never raised.

    The kernels check everything before their first write, so a refusal in the first pass
    leaves the blocks untouched; a memory fault (a segment shrank) loses the cache.
    """
    for n, rewrite in enumerate(item.rewrites):
        try:
            rewrite.apply(item.requests)
        except MemoryFault as exc:
            item.error = item.lost = f"memory fault while rewriting: {exc}"
            log.error("post-process of %d blocks: %s", item.num_blocks, exc)
        except (PlanError, FormatError, ValueError) as exc:
            item.error = str(exc)
            item.code = Reason.INVALID_FORMAT if n == 0 else Reason.TRANSFORM_FAILED
            log.error("post-process of %d blocks refused: %s", item.num_blocks, exc)
        # A failed transform must fail its requests, not the worker: report and go on.
        except Exception as exc:
            log.exception("post-process of %d blocks failed", item.num_blocks)
            item.error = f"{type(exc).__name__}: {exc}"
        if item.error is not None:
            return


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
                run_item(item)
            job.finished_ns = time.monotonic_ns()
            try:
                self._loop.call_soon_threadsafe(self._finish, job)
            except RuntimeError:
                # The loop is closed: a forced exit already answered this job's requests.
                return

    def _finish(self, job: Job) -> None:
        self._outstanding -= 1
        self._on_done(job)


class CudaExecutor(Executor):
    """Launches on the lane's stream; a second thread waits for each job's event.

    Two jobs may be outstanding, so the next batch is launched while the GPU runs the last one.
    """

    capacity = 2

    def __init__(self, loop: asyncio.AbstractEventLoop, on_done: DoneCallback, lane: Lane) -> None:
        self.lane = lane
        self.device = lane.device
        self.stream = lane.stream
        self._waiting: queue.SimpleQueue[tuple[Job, CudaEvent] | None] = queue.SimpleQueue()
        self._waiter = threading.Thread(target=self._wait, name="kvd-cuda-wait", daemon=True)
        self._waiter.start()
        super().__init__(loop, on_done)

    def close(self, timeout: float | None = None) -> bool:
        stopped = super().close(timeout)
        self._waiting.put(None)
        self._waiter.join(timeout)
        return stopped and not self._waiter.is_alive()

    def _run(self) -> None:
        self.lane.enter()  # this thread's device and stream, for good
        while (job := self._queue.get()) is not None:
            job.started_ns = time.monotonic_ns()
            for item in job.items:
                run_item(item)
            # Blocking sync: the waiter thread sleeps instead of spinning on the event.
            event = self.lane.api.new_event(blocking=True)
            event.record(self.stream)
            self._waiting.put((job, event))

    def _wait(self) -> None:
        self.lane.api.set_device(self.device)
        while (entry := self._waiting.get()) is not None:
            job, event = entry
            try:
                event.synchronize()
            except RuntimeError as exc:  # an asynchronous CUDA error: the work is undefined
                log.exception("the CUDA post-process failed")
                for item in job.items:
                    item.error = item.error or f"CUDA error: {exc}"
            job.finished_ns = time.monotonic_ns()
            self._loop.call_soon_threadsafe(self._finish, job)
