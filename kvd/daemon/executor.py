"""Runs post-process jobs off the event loop, on dedicated threads.

The loop submits a ``Job`` (batches resolved to the tensors they touch) and gets the result
back through ``loop.call_soon_threadsafe``; it never waits on compute or on the GPU. The worker
only touches the tensors a job names. A job's outcome is reported only after its work has
completed: on the CPU when the kernel returns, on CUDA when the event recorded after its
launches on the dedicated stream has completed.

When the device itself fails (a sticky CUDA error: an illegal address, a kernel fault), every
later CUDA call fails too and what the jobs in flight wrote is unknown. The executor then
reports no job it has not seen complete, takes no more work, and calls ``on_fatal`` once: the
daemon exits, and its next start answers the launched requests from the journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from kvd.daemon.batcher import Batch
from kvd.daemon.routes import Rewrite
from kvd.kernels.faults import DeviceFailed, MarkerError, MemoryFault
from kvd.protocol import Reason

if TYPE_CHECKING:  # the kernels load after READY (see kvd.kernels)
    from kvd.kernels.device import CudaEvent, Lane

log = logging.getLogger(__name__)


class WorkItem(msgspec.Struct, eq=False, gc=False):
    """One batch, resolved: the kernel passes of its cache and each request's blocks (a
    Struct, like ``Job``: made per job, cheaper than a dataclass).

    The ids were checked at ingest (in range, unique, owned by this batch alone).
    """

    batch: Batch
    rewrites: list[Rewrite]
    requests: list[tuple[list[int], int]]
    """(block ids, covered_sub_blocks) of each request of the batch, in batch order, and of
    each of its groups."""
    nbytes: int
    """Bytes the rewrite may touch: listed blocks times the bytes of one block id."""
    error: str | None = None
    """Set by the worker when the transform raised; the batch's requests then fail."""
    code: Reason = Reason.TRANSFORM_FAILED
    """``invalid_format`` when the kernels refused the pair before writing a byte."""
    lost: str | None = None
    """Set when the cache's memory faulted (a segment shrank): no later request may touch it."""
    crashed: bool = False
    """The transform raised something unexpected (on CUDA: maybe the device's error)."""
    cuda_event: bytes = b""
    """With ``ready_events``: the IPC handle of the event recorded behind the launches."""
    announced: bool = False
    """Set by the pipeline once the item's Ready went out, before its work completed."""
    groups: list[list[tuple[list[int], int]]] = []
    """For a cache attached in several groups: ``requests`` of each group (a group's passes
    rewrite those alone)."""
    markers: list[bytes] = []
    """The engines' markers (``ReadDone.cuda_event``) kvd's stream waits on before the
    item's first write (CUDA only: validation refuses them elsewhere)."""

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
            rewrite.apply(item.requests if rewrite.group < 0 else item.groups[rewrite.group])
        except DeviceFailed:
            raise  # not this item's failure: the executor's
        except MemoryFault as exc:
            item.error = item.lost = f"memory fault while rewriting: {exc}"
            log.error("post-process of %d blocks: %s", item.num_blocks, exc)
        except ValueError as exc:  # PlanError and FormatError are ValueErrors too
            item.error = str(exc)
            item.code = Reason.INVALID_FORMAT if n == 0 else Reason.TRANSFORM_FAILED
            log.error("post-process of %d blocks refused: %s", item.num_blocks, exc)
        # A failed transform must fail its requests, not the worker: report and go on.
        except Exception as exc:
            log.exception("post-process of %d blocks failed", item.num_blocks)
            item.error = f"{type(exc).__name__}: {exc}"
            item.crashed = True
        if item.error is not None:
            return


class Job(msgspec.Struct, eq=False, gc=False):
    items: list[WorkItem]
    submitted_ns: int = 0
    started_ns: int = 0
    finished_ns: int = 0
    work_ns: int = 0
    """What the job cost the device: the executor thread's CPU time (CPU), or from its launch
    to its event complete (CUDA). Waiting for the GIL or a wake-up is not work."""


DoneCallback = Callable[[Job], None]
FatalCallback = Callable[[str], None]


class Executor:
    """One worker thread; ``capacity`` jobs may be outstanding before the daemon holds batches.

    ``on_fatal(reason)`` is called on the loop, once, when the device failed (see above).
    """

    capacity = 1

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_done: DoneCallback,
        on_fatal: FatalCallback | None = None,
    ) -> None:
        self._loop = loop
        self._on_done = on_done
        self._on_fatal = on_fatal
        self.failed: str | None = None
        """Why the device failed; from then on no job runs or is reported."""
        # Fault injection for the tests: the first job finds the device broken, or never
        # completes (a hung kernel). Never set in service.
        self._injected = os.environ.get("KVD_TEST_CRASH_AT", "")
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._jobs: list[Job] = []
        """Jobs submitted and not yet done, oldest first (at most ``capacity``)."""
        self._thread = threading.Thread(target=self._run, name="kvd-executor", daemon=True)
        self._thread.start()

    def has_capacity(self) -> bool:
        return self.failed is None and len(self._jobs) < self.capacity

    def stalled_s(self, now_ns: int) -> float:
        """Seconds the oldest job outstanding has waited to complete since its submission (0
        when idle): what the health check holds against ``executor_watchdog_s``."""
        return (now_ns - self._jobs[0].submitted_ns) / 1e9 if self._jobs else 0.0

    def submit(self, job: Job) -> None:
        """Run ``job``; ``on_done`` follows on the loop, never from inside this call."""
        job.submitted_ns = time.monotonic_ns()
        self._jobs.append(job)
        self._queue.put(job)

    def close(self, timeout: float | None = None) -> bool:
        """Let queued jobs finish, then stop the worker; True if it stopped within ``timeout``."""
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _work(self, job: Job) -> bool:
        """Run ``job`` on this thread; False when the device failed (it is not reported)."""
        job.started_ns = time.monotonic_ns()
        cpu_ns = time.thread_time_ns()
        try:
            self._check_injected_failure()
            for item in job.items:
                run_item(item)
        except DeviceFailed as exc:
            self._fail(str(exc))
            return False
        job.finished_ns = time.monotonic_ns()
        job.work_ns = time.thread_time_ns() - cpu_ns
        return True

    def _run(self) -> None:
        # A job is handled by a call of its own, so the thread holds no reference to it while
        # it waits for the next: the last job would keep a detached cache's memory mapped (and
        # its descriptor open) until another came.
        while self._take(self._queue.get()):
            pass

    def _take(self, job: Job | None) -> bool:
        """Run one job from the queue; False when the thread should stop."""
        if job is None:
            return False
        if self.failed is not None:
            return True  # launched on record, never run: the next start answers them
        if not self._work(job):
            return True
        try:
            self._loop.call_soon_threadsafe(self._finish, job)
        except RuntimeError:
            # The loop is closed: a forced exit already answered this job's requests.
            return False
        return True

    def _finish(self, job: Job) -> None:
        self._jobs.remove(job)
        self._on_done(job)

    def _check_injected_failure(self) -> None:
        if self._injected == "device_failure":
            raise DeviceFailed("injected by KVD_TEST_CRASH_AT=device_failure")
        if self._injected == "executor_stall":
            threading.Event().wait()  # forever: the thread is a daemon, the exit leaves it

    def _fail(self, reason: str) -> None:
        """The device failed (any thread): stop, and tell the loop once."""
        if self.failed is not None:
            return
        self.failed = reason
        log.critical("the device failed: %s", reason)
        with contextlib.suppress(RuntimeError):  # a closed loop: kvd is exiting anyway
            self._loop.call_soon_threadsafe(self._fatal, reason)

    def _fatal(self, reason: str) -> None:
        if self._on_fatal is not None:
            self._on_fatal(reason)


class CudaExecutor(Executor):
    """Launches on the lane's stream; a second thread waits for each job's event.

    Two jobs may be outstanding, so the next batch is launched while the GPU runs the last one.
    A launch that raised unexpectedly is followed by a check of the device (``CudaApi.broken``):
    a sticky error fails the device, any other fails the job's requests only. An error
    waiting for a job's event is asynchronous, hence sticky: the device has failed.

    With ``ready_events`` an interprocess event is also recorded behind each job's launches,
    its handle set on the job's items (``WorkItem.cuda_event``), and ``on_launched(job)``
    called at once, before the GPU ran the job; ``on_done`` still follows its completion. Such
    events come from a pool, and one is recorded again only after kvd saw its last recording
    complete: an engine that waits on it later waits at most for a later job of the same
    in-order stream.
    """

    capacity = 2

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_done: DoneCallback,
        lane: Lane,
        on_fatal: FatalCallback | None = None,
        *,
        ready_events: bool = False,
    ) -> None:
        self.lane = lane
        self.device = lane.device
        self.stream = lane.stream
        self.ready_events = ready_events
        self.on_launched: DoneCallback | None = None
        self._ipc_events: queue.SimpleQueue[tuple[CudaEvent, bytes]] = queue.SimpleQueue()
        self._waiting: queue.SimpleQueue[_Waiting | None] = queue.SimpleQueue()
        self._waiter = threading.Thread(target=self._wait, name="kvd-cuda-wait", daemon=True)
        self._waiter.start()
        super().__init__(loop, on_done, on_fatal)

    def close(self, timeout: float | None = None) -> bool:
        stopped = super().close(timeout)
        self._waiting.put(None)
        self._waiter.join(timeout)
        return stopped and not self._waiter.is_alive()

    def _run(self) -> None:
        self.lane.enter()  # this thread's device and stream, for good
        super()._run()

    def _take(self, job: Job | None) -> bool:
        """Launch one job from the queue (``Executor._run``); False when the thread should stop."""
        if job is None:
            return False
        if self.failed is not None:
            return True
        job.started_ns = time.monotonic_ns()
        try:
            waiting = self._launch(job)
        except DeviceFailed as exc:
            self._fail(str(exc))
            return True
        except RuntimeError as exc:  # recording the event failed: completion is unknowable
            self._fail(f"recording the completion event failed: {exc}")
            return True
        if waiting.ready is not None:
            try:  # posted before the waiter can see the job: the loop hears it first
                self._loop.call_soon_threadsafe(self._launched, job)
            except RuntimeError:
                return False  # the loop is closed: kvd is exiting
        self._waiting.put(waiting)
        return True

    def _launch(self, job: Job) -> _Waiting:
        """Launch every item of ``job``, each behind the engine markers it carries, and record
        the events behind them."""
        self._check_injected_failure()
        markers: list[CudaEvent] = []
        for item in job.items:
            if item.markers:
                try:
                    markers += self.lane.wait_for_markers(item.markers)
                except MarkerError as exc:
                    # Nothing of the item was enqueued: its blocks are untouched.
                    item.error = f"cuda_event: {exc}; the blocks are untouched"
                    item.code = Reason.INVALID_MESSAGE
                    log.error("post-process of %d blocks refused: %s", item.num_blocks, exc)
                    self._check_device()
                    continue
            run_item(item)
            if item.crashed:
                self._check_device()
        ready = None
        if self.ready_events and any(item.error is None for item in job.items):
            ready = self._ipc_event()
            for item in job.items:
                if item.error is None:
                    item.cuda_event = ready[1]
        # Blocking sync: the waiter thread sleeps instead of spinning on the event.
        event = self.lane.api.new_event(blocking=True)
        event.record(self.stream)
        return _Waiting(job, event, ready, markers)

    def _ipc_event(self) -> tuple[CudaEvent, bytes]:
        """An interprocess event from the pool (or a new one), recorded on the stream now."""
        api = self.lane.api
        try:
            event, handle = self._ipc_events.get_nowait()
        except queue.Empty:
            event, handle = api.new_event(interprocess=True), b""
        event.record(self.stream)  # creates it on the stream's device, the first time
        return event, handle or api.ipc_handle(event)

    def _launched(self, job: Job) -> None:
        if self.on_launched is not None:
            self.on_launched(job)

    def _check_device(self) -> None:
        why = self.lane.api.broken(self.device)
        if why is not None:
            raise DeviceFailed(why)

    def _wait(self) -> None:
        self.lane.api.set_device(self.device)
        while self._complete(self._waiting.get()):  # one call per job, as in ``_run``
            pass

    def _complete(self, entry: _Waiting | None) -> bool:
        """Wait for one launched job; False when the thread should stop."""
        if entry is None:
            return False
        if self.failed is not None:
            return True
        try:
            entry.event.synchronize()
        except RuntimeError as exc:  # asynchronous, so sticky: the context is gone
            self._fail(f"the CUDA post-process failed: {exc}")
            return True
        entry.markers.clear()  # the waits on them are consumed: they may close now
        if entry.ready is not None:
            self._ipc_events.put(entry.ready)  # its recording is complete: reusable
        entry.job.finished_ns = time.monotonic_ns()
        entry.job.work_ns = entry.job.finished_ns - entry.job.started_ns
        try:
            self._loop.call_soon_threadsafe(self._finish, entry.job)
        except RuntimeError:
            return False  # the loop is closed: a forced exit left this job to the journal
        return True


@dataclass(slots=True, eq=False)
class _Waiting:
    """A launched job, the event its completion is seen by, its interprocess event, and the
    engine markers its launches wait on (held open until the job completed)."""

    job: Job
    event: CudaEvent
    ready: tuple[CudaEvent, bytes] | None
    markers: list[CudaEvent]
