"""The data path on the event loop: ingest -> validate -> batcher -> executor -> publisher.

Every accepted ReadDone ends in exactly one Ready or Failed, published only after its blocks
were post-processed (or found to need no work). Every rejected notification is counted, logged
and, when its req_id could be read, answered with a Failed event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec

from kvd.daemon.batcher import Batch, Batcher
from kvd.daemon.executor import Executor, Job, WorkItem
from kvd.daemon.ledger import Ledger, Request, State
from kvd.daemon.logs import RateLimitedLog
from kvd.daemon.metrics import Metrics
from kvd.daemon.publisher import Publisher
from kvd.daemon.registry import Registry
from kvd.daemon.timers import WindowTimer
from kvd.daemon.validate import Rejection, validate_read_done
from kvd.protocol import (
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


class Pipeline:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        registry: Registry,
        publisher: Publisher,
        metrics: Metrics,
        *,
        batch_window_us: int,
        max_batch_blocks: int,
        max_message_bytes: int,
        executor_factory: Callable[[asyncio.AbstractEventLoop, Callable[[Job], None]], Executor]
        | None = None,
    ) -> None:
        self.loop = loop
        self.registry = registry
        self.publisher = publisher
        self.metrics = metrics
        self.ledger = Ledger()
        self.batcher = Batcher(batch_window_us * 1000, max_batch_blocks)
        self.max_message_bytes = max_message_bytes
        factory = executor_factory or Executor
        self.executor = factory(loop, self._job_done)
        self.accepting = True
        self._decoder = msgspec.msgpack.Decoder(IngestMessage)
        self._timer = WindowTimer(loop, self.kick)
        self._drained: asyncio.Future[None] | None = None
        self._rejection_log = RateLimitedLog(log)

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
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
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
        if not self.accepting:
            self._reject(msg, Reason.SHUTTING_DOWN, "kvd is draining")
            return
        received_ns = time.monotonic_ns()
        result = validate_read_done(msg, self.registry, self.ledger)
        if isinstance(result, Rejection):
            self._reject(msg, result.code, result.message)
            return
        cache, ratio = result
        if msg.remote_layout is None:
            self._reject(msg, Reason.INVALID_LAYOUT, "remote_layout: must be given")
            return
        if not msg.physical_block_ids or not cache.needs_work(ratio, msg.remote_layout):
            self._answer_at_once(msg, received_ns)
            return
        request = Request(
            req_id=msg.req_id,
            cache_id=msg.cache_id,
            physical_block_ids=msg.physical_block_ids,
            block_size_ratio=ratio,
            remote_layout=msg.remote_layout,
            remote_engine_id=msg.remote_engine_id,
            received_ns=received_ns,
        )
        self.ledger.accept(request)
        self.ledger.advance(request, State.BATCHED)
        self.batcher.add(request, received_ns)

    def _answer_at_once(self, msg: ReadDone, received_ns: int) -> None:
        """Nothing to rewrite (NHD -> NHD, MLA, no blocks): Ready without the executor.

        The request is accepted and published in this one step, so it never sits in the
        ledger; only its outcome is recorded.
        """
        elapsed_ns = time.monotonic_ns() - received_ns
        self.publisher.publish(
            msg.cache_id,
            Ready(
                req_id=msg.req_id,
                cache_id=msg.cache_id,
                physical_block_ids=msg.physical_block_ids,
                remote_engine_id=msg.remote_engine_id,
                elapsed_us=elapsed_ns // 1000,
            ),
        )
        self._count_answer(True, elapsed_ns)
        self.ledger.remember(msg.req_id, msg.cache_id)

    def _count_answer(self, ready: bool, elapsed_ns: int) -> None:
        metrics = self.metrics
        (metrics.ready if ready else metrics.failed).value += 1
        metrics.events.value += 1
        metrics.read_done_to_ready.observe(elapsed_ns / 1e9)

    def _read_failed(self, msg: ReadFailed) -> None:
        if self.ledger.get(msg.req_id) is not None:
            self._reject(
                msg,
                Reason.DUPLICATE_REQUEST,
                f"req_id: {msg.req_id!r} is already in flight; this ReadFailed is ignored",
            )
            return
        reason = msg.reason or "the engine reported the NIXL read as failed"
        self.publisher.publish(
            msg.cache_id,
            Failed(
                req_id=msg.req_id,
                cache_id=msg.cache_id,
                code=Reason.READ_FAILED,
                message=reason,
                invalid_block_ids=msg.physical_block_ids,
                remote_engine_id=msg.remote_engine_id,
            ),
        )
        self.metrics.failed.value += 1
        self.metrics.events.value += 1
        self.ledger.remember(msg.req_id, msg.cache_id, Reason.READ_FAILED, reason)

    def _reject_frame(self, frame: bytes, code: Reason, message: str) -> None:
        self._reject(decode_header(frame) or MessageHeader(), code, message)

    def _reject(
        self, source: ReadDone | ReadFailed | MessageHeader, code: Reason, message: str
    ) -> None:
        """Count, log and (when its req_id is known) answer a notification kvd will not process."""
        req_id, cache_id = source.req_id, source.cache_id
        self.metrics.rejections.inc(code)
        self._rejection_log.warning(
            code.value,
            "rejected %s (req_id=%r cache_id=%r): %s",
            code.value,
            req_id,
            cache_id,
            message,
        )
        if not req_id:
            return  # nobody to answer: counted and logged only
        self.publisher.publish(
            cache_id,
            Failed(
                req_id=req_id,
                cache_id=cache_id,
                code=code,
                message=message,
                invalid_block_ids=source.physical_block_ids,
                remote_engine_id=source.remote_engine_id,
            ),
        )
        self.metrics.events.value += 1
        if self.ledger.get(req_id) is None:
            self.ledger.remember(req_id, cache_id, code, message)

    # -- batching and execution -----------------------------------------------------------------

    def kick(self) -> None:
        """Launch what is due if the executor can take it; arm the window timer for the rest."""
        if not self.batcher.waiting:
            return  # the common case after a burst of notifications that needed no work
        if self.executor.has_capacity():
            now = time.monotonic_ns()
            due = self.batcher.take_due(now) if self.accepting else self.batcher.take_all()
            if due:
                self._launch(due)
        deadline = self.batcher.next_deadline_ns()
        if deadline is not None and self.executor.has_capacity():
            self._timer.arm(deadline)

    def _launch(self, batches: list[Batch]) -> None:
        items = []
        now = time.monotonic_ns()
        for batch in batches:
            cache = self.registry.get(batch.cache_id)
            assert cache is not None, "a cache cannot be detached while requests are in flight"
            for request in batch.requests:
                self.ledger.advance(request, State.LAUNCHED)
                self.metrics.queue_wait.observe((now - request.received_ns) / 1e9)
            block_ids = batch.block_ids()
            groups = cache.groups(batch.block_size_ratio, batch.remote_layout)
            items.append(WorkItem(batch, groups, block_ids, len(block_ids) * cache.work_bytes))
            self.metrics.batch_blocks.observe(batch.num_blocks)
            self.metrics.batches.value += 1
        self.executor.submit(Job(items))

    def _job_done(self, job: Job) -> None:
        self.metrics.transform.observe((job.finished_ns - job.started_ns) / 1e9)
        for item in job.items:
            if item.error is None:
                self.metrics.blocks.value += len(item.block_ids)
                self.metrics.bytes.value += item.nbytes
            for request in item.batch.requests:
                if request.state == State.PUBLISHED:
                    continue  # already answered by fail_unfinished on a forced exit
                self.ledger.advance(request, State.DONE)
                if item.error is not None:
                    request.error = (Reason.TRANSFORM_FAILED, item.error)
                self._finish(request)
        self.kick()

    def _finish(self, request: Request) -> None:
        """Publish the one event of a DONE request and retire it from the ledger."""
        elapsed_ns = time.monotonic_ns() - request.received_ns
        if request.error is None:
            event: Ready | Failed = Ready(
                req_id=request.req_id,
                cache_id=request.cache_id,
                physical_block_ids=request.physical_block_ids,
                remote_engine_id=request.remote_engine_id,
                elapsed_us=elapsed_ns // 1000,
            )
            code = message = ""
        else:
            code, message = request.error
            event = Failed(
                req_id=request.req_id,
                cache_id=request.cache_id,
                code=code,
                message=message,
                invalid_block_ids=request.physical_block_ids,
                remote_engine_id=request.remote_engine_id,
            )
        self.publisher.publish(request.cache_id, event)
        self._count_answer(not code, elapsed_ns)
        self.ledger.publish(request, code, message)
        if self._drained is not None and not self.ledger and not self._drained.done():
            self._drained.set_result(None)

    # -- lifecycle ------------------------------------------------------------------------------

    def stop_accepting(self) -> None:
        """Answer new notifications with Failed(shutting_down) and launch every batch now."""
        self.accepting = False
        self.kick()

    async def drain(self, timeout: float) -> bool:
        """Stop accepting, finish everything accepted, publish it; True if done in time."""
        self.stop_accepting()
        if not self.ledger:
            return True
        self._drained = self.loop.create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._drained), timeout)
        except TimeoutError:
            return False
        return True

    def fail_unfinished(self, code: Reason, message: str) -> int:
        """Answer every request still in flight with Failed (forced exit); returns how many."""
        requests = self.ledger.requests()
        self.batcher.take_all()
        for request in requests:
            while request.state < State.DONE:
                self.ledger.advance(request, State(request.state + 1))
            request.error = (code, message)
            self._finish(request)
        return len(requests)

    def close(self, timeout: float | None = None) -> bool:
        self._timer.close()
        return self.executor.close(timeout)
