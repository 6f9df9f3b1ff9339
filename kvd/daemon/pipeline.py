"""The data path on the event loop: ingest -> validate -> batcher -> executor -> publisher.

Every accepted ReadDone ends in exactly one Ready or Failed, published only after its blocks
were post-processed (or found to need no work). A notification kvd has already answered is
answered again from the outcome it recorded, and a repeat of one still in flight is absorbed by
the event that will answer it: blocks are rewritten at most once per (cache, req_id,
generation). Launches and outcomes go to the journal first, so a crash leaves nothing a new kvd
cannot answer for. Every refused notification is counted, logged and, when its req_id could be
read, answered with a Failed event that touched nothing: on its cache's topic, or on
``UNATTACHED_TOPIC`` when its cache is not attached.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable

import msgspec

from kvd.daemon.batcher import Batch, Batcher
from kvd.daemon.executor import Executor, Job, WorkItem
from kvd.daemon.journal import Journal, JournalError, Outcome, Recovered
from kvd.daemon.ledger import Ledger, Request, State
from kvd.daemon.logs import RateLimitedLog, clipped
from kvd.daemon.metrics import Metrics
from kvd.daemon.publisher import Publisher
from kvd.daemon.registry import Registry
from kvd.daemon.routes import Rejection, Route
from kvd.daemon.timers import WindowTimer
from kvd.daemon.validate import InFlight, Repeat, identify, parts, validate_read_done
from kvd.daemon.window import AutoWindow
from kvd.protocol import (
    UNATTACHED_TOPIC,
    BatchWindow,
    Failed,
    IngestMessage,
    MessageHeader,
    ReadDone,
    ReadFailed,
    Ready,
    Reason,
    decode_header,
)

log = logging.getLogger(__name__)

# msgspec reports the path of a bad field; these fields have reason codes of their own.
_FIELD_REASONS = {"`$.remote_layout`": Reason.INVALID_LAYOUT}
# Failed events for undecodable notifications name at most this many block ids.
_IDS_IN_REJECTIONS = 1024

INTERRUPTED_MESSAGE = (
    "kvd stopped while it may have been rewriting these blocks (a crash, a kill or a forced "
    "exit): their contents are undefined; read them again under a new generation, or recompute"
)


class Pipeline:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        registry: Registry,
        publisher: Publisher,
        metrics: Metrics,
        journal: Journal,
        *,
        batch_window_us: BatchWindow,
        max_batch_blocks: int,
        max_message_bytes: int,
        executor_factory: Callable[[asyncio.AbstractEventLoop, Callable[[Job], None]], Executor]
        | None = None,
    ) -> None:
        self.loop = loop
        self.registry = registry
        self.publisher = publisher
        self.metrics = metrics
        self.journal = journal
        self.ledger = Ledger()
        self.auto = AutoWindow()
        """What the auto window knows; it learns the launch cost from every job, auto or not."""
        self.batcher = Batcher(self._window(batch_window_us), max_batch_blocks)
        self.max_message_bytes = max_message_bytes
        factory = executor_factory or Executor
        self.executor = factory(loop, self._job_done)
        self.accepting = True
        self.closing = False
        """Set on the way out: a job that finishes after this is left to the journal."""
        self._decoder = msgspec.msgpack.Decoder(IngestMessage)
        self._timer = WindowTimer(loop, self.kick)
        self._drained: asyncio.Future[None] | None = None
        self._idle_caches: dict[str, asyncio.Future[None]] = {}
        self._launch_cpu_ns: deque[int] = deque()
        """The loop's CPU time to launch each job in flight, in order (auto window)."""
        self._rejection_log = RateLimitedLog(log)
        # Fault injection for the crash tests: SIGKILL at a named point, never set in service.
        self._crash_at = os.environ.get("KVD_TEST_CRASH_AT", "")

    # -- start ----------------------------------------------------------------------------------

    def recover(self, recovered: Recovered) -> int:
        """Take over what the journal of the previous run holds; returns how many launches it
        left without an outcome, each now answered with Failed(interrupted)."""
        for outcome in recovered.outcomes.values():
            self.ledger.outcomes.put(outcome)
        for launch in recovered.interrupted:
            outcome = Outcome(
                launch.cache_id,
                launch.req_id,
                launch.generation,
                Reason.INTERRUPTED,
                INTERRUPTED_MESSAGE,
                launch.block_ids,
                launch.remote_engine_id,
            )
            self.ledger.outcomes.put(outcome)
        self.journal.open(self.ledger.outcomes.values())
        for launch in recovered.interrupted:
            answer = self.ledger.outcomes.get((launch.cache_id, launch.req_id))
            assert answer is not None
            self._publish_outcome(answer)
        return len(recovered.interrupted)

    # -- ingest ---------------------------------------------------------------------------------

    def on_ingest(self, frames: list[bytes]) -> None:
        """Handle one message from the ingest socket (the reader calls ``kick`` after a burst)."""
        self.metrics.messages.value += 1
        frame = frames[-1]
        if len(frames) != 1:
            self._reject_frame(
                frame, Reason.INVALID_MESSAGE, f"expected 1 frame, got {len(frames)}"
            )
            return
        if len(frame) > self.max_message_bytes:
            self._reject_frame(
                frame,
                Reason.MESSAGE_TOO_LARGE,
                f"message is {len(frame)} bytes, the limit is {self.max_message_bytes}",
            )
            return
        try:
            msg = self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            text = str(exc)
            code = next(
                (r for path, r in _FIELD_REASONS.items() if text.endswith(path)),
                Reason.INVALID_MESSAGE,
            )
            self._reject_frame(frame, code, text)
            return
        if isinstance(msg, ReadDone):
            self._read_done(msg)
        else:
            self._read_failed(msg)

    def _read_done(self, msg: ReadDone) -> None:
        received_ns = time.monotonic_ns()
        verdict = validate_read_done(msg, self.registry, self.ledger)
        if not isinstance(verdict, Route):
            if not self.accepting and isinstance(verdict, Rejection):
                self._reject(msg, Reason.SHUTTING_DOWN, "kvd is draining")
            else:
                self._known_or_refused(msg, verdict)
        elif not self.accepting:
            self._reject(msg, Reason.SHUTTING_DOWN, "kvd is draining")
        elif not verdict.any_work(parts(msg)):
            self._answer_at_once(msg, received_ns)
        else:
            request = Request(
                req_id=msg.req_id,
                cache_id=msg.cache_id,
                generation=msg.generation,
                physical_block_ids=msg.physical_block_ids,
                remote_format=verdict.remote_format,
                remote_block_size=verdict.remote_block_size,
                remote_ranks=verdict.remote_ranks,
                remote_engine_id=msg.remote_engine_id,
                received_ns=received_ns,
                covered_sub_blocks=msg.covered_sub_blocks,
                groups=[(g.num_blocks, g.covered_sub_blocks) for g in msg.groups] or None,
                cuda_event=msg.cuda_event,
            )
            self.ledger.accept(request)
            self.ledger.advance(request, State.BATCHED)
            self.batcher.add(
                request, received_ns, idle=self.executor.has_capacity(), held=len(self.ledger)
            )

    def _known_or_refused(
        self, msg: ReadDone | ReadFailed, verdict: Rejection | Repeat | InFlight
    ) -> None:
        if isinstance(verdict, Rejection):
            self._reject(msg, verdict.code, verdict.message)
        elif isinstance(verdict, Repeat):
            self.metrics.repeats.value += 1
            self._publish_outcome(verdict.outcome)
        else:
            # Its one event is still to come and answers this copy too.
            self.metrics.repeats.value += 1
            log.debug("repeat of %r (generation %d) while in flight", msg.req_id, msg.generation)

    def _answer_at_once(self, msg: ReadDone, received_ns: int) -> None:
        """Nothing to rewrite (NHD -> NHD, MLA, no blocks): Ready without the executor.

        Nothing is touched, so no outcome is recorded: a repeat is checked and answered afresh.
        """
        cache_id = msg.cache_id
        elapsed_ns = time.monotonic_ns() - received_ns
        self._publish(
            cache_id,
            self._event(
                msg.req_id,
                cache_id,
                msg.generation,
                msg.physical_block_ids,
                msg.remote_engine_id,
                elapsed_us=elapsed_ns // 1000,
            ),
        )
        self._count_answer(True, elapsed_ns)
        self.metrics.ready_untouched.value += 1
        self.ledger.untouched.put(cache_id, msg.req_id, msg.generation)

    def _count_answer(self, ready: bool, elapsed_ns: int) -> None:
        metrics = self.metrics
        (metrics.ready if ready else metrics.failed).value += 1
        metrics.read_done_to_ready.observe(elapsed_ns / 1e9)

    def _read_failed(self, msg: ReadFailed) -> None:
        known = identify(msg, self.ledger)
        if known is not None:
            self._known_or_refused(msg, known)
            return
        reason = msg.reason or "the engine reported the NIXL read as failed"
        self._reject(msg, Reason.READ_FAILED, reason, counted=False)
        self.metrics.failed.value += 1

    def _reject_frame(self, frame: bytes, code: Reason, message: str) -> None:
        self._reject(decode_header(frame) or MessageHeader(), code, message)

    def _reject(
        self,
        source: ReadDone | ReadFailed | MessageHeader,
        code: Reason,
        message: str,
        *,
        counted: bool = True,
    ) -> None:
        """Count, log and (when its req_id is known) answer a notification kvd will not process.

        Nothing was touched, so a repeat of it is checked afresh; the refusal is kept only for
        Status queries, and only for an attached cache.
        """
        req_id, cache_id = source.req_id, source.cache_id
        message = clipped(message)  # it may quote a field of the notification, however long
        if counted:
            self.metrics.rejections.inc(code)
            self._rejection_log.warning(
                code.value,
                "rejected %s (req_id=%.200r cache_id=%.200r): %s",
                code.value,
                req_id,
                cache_id,
                message,
            )
        if not req_id:
            return  # nobody to answer: counted and logged only
        attached = cache_id in self.registry
        ids = getattr(source, "physical_block_ids", [])
        event = self._event(
            req_id,
            cache_id,
            source.generation,
            ids[:_IDS_IN_REJECTIONS],
            source.remote_engine_id,
            code=code,
            message=message,
        )
        self._publish(cache_id if attached else UNATTACHED_TOPIC, event)
        if attached:
            self.ledger.untouched.put(cache_id, req_id, source.generation, code, message)

    # -- settings -------------------------------------------------------------------------------

    def configure(
        self, batch_window_us: BatchWindow | None = None, max_batch_blocks: int | None = None
    ) -> None:
        """Change the window and the cap in force; waiting batches get them at once."""
        if batch_window_us is not None:
            self.batcher.set_window(self._window(batch_window_us))
        if max_batch_blocks is not None:
            self.batcher.set_max_blocks(max_batch_blocks)
        self.kick()

    @property
    def batch_window_us(self) -> int:
        """The window in force: the fixed one, or the latest the auto window chose."""
        auto = self.batcher.auto
        return (auto.last_ns if auto is not None else self.batcher.window_ns) // 1000

    def _window(self, batch_window_us: BatchWindow) -> int | AutoWindow:
        return self.auto if batch_window_us == "auto" else batch_window_us * 1000

    # -- batching and execution -----------------------------------------------------------------

    def kick(self) -> None:
        """Launch what is due if the executor can take it; arm the window timer for the rest."""
        if not self.batcher.waiting:
            return  # the common case after a burst of notifications that needed no work
        if not self.executor.has_capacity():
            return  # the job in progress kicks again when it is done
        now = time.monotonic_ns()
        while due := self.batcher.take_due(now, draining=not self.accepting):
            self._launch(due)
            if not self.executor.has_capacity():
                return
        deadline = self.batcher.next_deadline_ns()
        if deadline is not None:
            self._timer.arm(deadline)

    def _launch(self, batches: list[Batch]) -> None:
        now = time.monotonic_ns()
        cpu_ns = time.thread_time_ns()
        launching = []
        for batch in batches:
            cache = self.registry.get(batch.cache_id)
            assert cache is not None, "a cache cannot be detached while requests are in flight"
            problem = cache.lost or cache.memory_problem()
            if problem is not None:
                # Checked before anything is touched: these requests fail untouched.
                cache.lost = problem
                for request in batch.requests:
                    self._finish_untouched(request, Reason.MEMORY_UNAVAILABLE, problem)
                continue
            launching.append((batch, cache))
        if not launching:
            return
        # On record before any byte moves: a crash from here on is reported by the next start.
        try:
            self.journal.launched(r.launch_record() for b, _ in launching for r in b.requests)
        except JournalError as exc:
            # No block is rewritten without its Launch record: refuse them, untouched.
            self._journal_failed(exc)
            message = f"{exc}; the blocks are untouched, send the notification again later"
            for batch, _ in launching:
                for request in batch.requests:
                    self._finish_untouched(request, Reason.JOURNAL_UNAVAILABLE, message)
            return
        items = []
        metrics = self.metrics
        for batch, cache in launching:
            for request in batch.requests:
                self.ledger.advance(request, State.LAUNCHED)
                metrics.queue_wait.observe((now - request.received_ns) / 1e9)
            rewrites = cache.rewrites(
                batch.remote_format, batch.remote_block_size, batch.remote_ranks
            )
            requests = [part for r in batch.requests for part in r.parts()]
            item = WorkItem(batch, rewrites, requests, batch.num_blocks * cache.work_bytes)
            if cache.num_groups > 1:  # validation: one part per group, in group order
                item.groups = [requests[g :: cache.num_groups] for g in range(cache.num_groups)]
            item.markers = [r.cuda_event for r in batch.requests if r.cuda_event]
            items.append(item)
            metrics.batch_blocks.observe(batch.num_blocks)
            metrics.batches.value += 1
        self._launch_cpu_ns.append(time.thread_time_ns() - cpu_ns)
        # Last: the worker needs the GIL this thread holds until the loop next sleeps.
        self.executor.submit(Job(items))

    def _journal_failed(self, exc: JournalError) -> None:
        self.metrics.journal_errors.value += 1
        self._rejection_log.warning("journal", "the journal cannot be written: %s", exc)

    def job_launched(self, job: Job) -> None:
        """``ready_cuda_event``: announce each request whose launch was enqueued, with the
        CUDA event its blocks are ready at, before the GPU ran it. Its outcome is journaled, and
        it leaves the ledger, when the work has completed (``_job_done``): a crash before then
        is answered Failed(interrupted) by the next start, like any launch without an outcome.
        """
        if self.closing:
            return
        for item in job.items:
            if item.error is not None or not item.cuda_event:
                continue
            item.announced = True
            for request in item.batch.requests:
                self._announce(request, item.cuda_event)

    def _job_done(self, job: Job) -> None:
        # Jobs finish in the order they were submitted (one worker thread, one waiter).
        cpu_ns = time.thread_time_ns()
        launch_cpu_ns = self._launch_cpu_ns.popleft()
        if self.closing:
            return  # the sockets are going: the next start reports these as interrupted
        finished: list[tuple[Request, Outcome, bool]] = []
        for item in job.items:
            if item.lost is not None:
                cache = self.registry.get(item.batch.cache_id)
                if cache is not None:
                    cache.lost = item.lost
            for request in item.batch.requests:
                self.ledger.advance(request, State.DONE)
                if item.error is not None:
                    # Launched, so on record either way: a repeat gets this same answer.
                    request.error = (item.code, item.error)
                finished.append((request, self._outcome(request), item.announced))
        if self._crash_at == "after_transform":
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            self.journal.finished(outcome for _, outcome, _ in finished)
        except JournalError as exc:
            # The work is done and stays announced; the journal writes the outcomes later.
            self._journal_failed(exc)
        for request, _, announced in finished:
            if not announced:
                self._announce(request)
        # The events are out: what follows is bookkeeping no engine waits for.
        for request, outcome, _ in finished:
            self._retire(request, outcome)
        metrics = self.metrics
        metrics.transform.observe((job.finished_ns - job.started_ns) / 1e9)
        for item in job.items:
            if item.error is None:
                metrics.blocks.value += item.num_blocks
                metrics.bytes.value += item.nbytes
        try:
            self.journal.rotate_if_full(r.launch_record() for r in self.ledger.launched())
        except JournalError as exc:
            self._journal_failed(exc)  # the current segment stays in use
        # What the job cost: the work it took, on the loop and the device. Not wall time: waits
        # for the GIL or a wake-up overlap with other work, and batching does not save them.
        self.auto.job(
            sum(item.num_blocks for item in job.items),
            launch_cpu_ns + job.work_ns + time.thread_time_ns() - cpu_ns,
        )
        self.kick()

    def _outcome(self, request: Request) -> Outcome:
        code, message = request.error or ("", "")
        return Outcome(
            request.cache_id,
            request.req_id,
            request.generation,
            code,
            message,
            request.physical_block_ids,
            request.remote_engine_id,
        )

    def _finish(self, request: Request, outcome: Outcome | None) -> None:
        """Publish the one event of a request and retire it (``_retire``)."""
        self._announce(request)
        self._retire(request, outcome)

    def _retire(self, request: Request, outcome: Outcome | None) -> None:
        """Take a request whose event went out off the ledger; ``outcome`` is remembered when
        the request's blocks were touched."""
        self.ledger.publish(request, outcome)
        if self._drained is not None and not self.ledger and not self._drained.done():
            self._drained.set_result(None)
        waiting = self._idle_caches
        if waiting and request.cache_id in waiting and not self.ledger.in_flight(request.cache_id):
            waiting.pop(request.cache_id).set_result(None)

    def _finish_untouched(self, request: Request, code: Reason, message: str) -> None:
        request.error = (code, message)
        self.metrics.rejections.inc(code)
        self._finish(request, None)
        self.ledger.untouched.put(
            request.cache_id, request.req_id, request.generation, code, message
        )

    def _announce(self, request: Request, cuda_event: bytes = b"") -> None:
        """Publish the one event of an accepted request and count it as answered."""
        elapsed_ns = time.monotonic_ns() - request.received_ns
        code, message = request.error or ("", "")
        event = self._event(
            request.req_id,
            request.cache_id,
            request.generation,
            request.physical_block_ids,
            request.remote_engine_id,
            code=code,
            message=message,
            elapsed_us=elapsed_ns // 1000,
            cuda_event=cuda_event,
        )
        self._publish(request.cache_id, event)
        self._count_answer(not code, elapsed_ns)

    def _event(
        self,
        req_id: str,
        cache_id: str,
        generation: int,
        block_ids: list[int],
        remote_engine_id: str,
        *,
        code: str = "",
        message: str = "",
        elapsed_us: int = 0,
        cuda_event: bytes = b"",
    ) -> Ready | Failed:
        """The one place an event is made: Ready when ``code`` is empty, else Failed naming
        ``block_ids`` as invalid; stamped with this run's epoch."""
        if not code:
            return Ready(
                req_id=req_id,
                cache_id=cache_id,
                physical_block_ids=block_ids,
                remote_engine_id=remote_engine_id,
                elapsed_us=elapsed_us,
                generation=generation,
                epoch=self.publisher.epoch,
                cuda_event=cuda_event,
            )
        return Failed(
            req_id=req_id,
            cache_id=cache_id,
            code=code,
            message=message,
            invalid_block_ids=block_ids,
            remote_engine_id=remote_engine_id,
            generation=generation,
            epoch=self.publisher.epoch,
        )

    def _publish(self, topic: str, event: Ready | Failed) -> None:
        self.publisher.publish(topic, event)
        self.metrics.events.value += 1

    def _publish_outcome(self, outcome: Outcome) -> None:
        """Publish a recorded outcome again (a repeated notification, or after a restart)."""
        event = self._event(
            outcome.req_id,
            outcome.cache_id,
            outcome.generation,
            outcome.block_ids,
            outcome.remote_engine_id,
            code=outcome.code,
            message=outcome.message,
        )
        self._publish(outcome.cache_id, event)

    # -- lifecycle ------------------------------------------------------------------------------

    def stop_accepting(self) -> None:
        """Answer new notifications with Failed(shutting_down); waiting batches go without their
        window, a job at a time as the executor takes them."""
        self.accepting = False
        self.kick()

    async def drain(self, timeout: float) -> bool:
        """Stop accepting, finish everything accepted, publish it; True if done in time."""
        self.stop_accepting()
        return await self.wait_idle(timeout)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until no request is in flight; True if none is."""
        if not self.ledger:
            return True
        self._drained = self.loop.create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._drained), timeout)
        except TimeoutError:
            return False
        return True

    def fail_unlaunched(self, message: str) -> int:
        """Answer every request not yet launched with Failed(shutting_down): nothing of theirs
        was touched. Launched ones are left alone: their executor may still be writing, so
        either they finish and are published, or the journal reports them at the next start.
        Returns how many were failed."""
        self.batcher.take_all()
        waiting = [r for r in self.ledger.requests() if r.state < State.LAUNCHED]
        for request in waiting:
            self._finish_untouched(request, Reason.SHUTTING_DOWN, message)
        return len(waiting)

    def fail_waiting(self, cache_id: str, message: str) -> int:
        """Answer every request of ``cache_id`` not yet launched with Failed(cache_detached):
        nothing of theirs was touched. Launched ones go on and are published. Returns how many
        were failed."""
        failed = 0
        for batch in self.batcher.take_cache(cache_id):
            for request in batch.requests:
                self._finish_untouched(request, Reason.CACHE_DETACHED, message)
                failed += 1
        self.auto.forget(lambda key: key[0] == cache_id)
        self.kick()
        return failed

    async def wait_cache_idle(self, cache_id: str) -> None:
        """Wait until no request of ``cache_id`` is in flight."""
        if not self.ledger.in_flight(cache_id):
            return
        idle = self._idle_caches.get(cache_id)
        if idle is None:
            idle = self._idle_caches[cache_id] = self.loop.create_future()
        await asyncio.shield(idle)

    def close(self, timeout: float | None = None) -> bool:
        self._timer.close()
        return self.executor.close(timeout)
