"""The two decode connectors ``kvd bench vllm`` compares, timed the same way.

Loaded by vLLM from ``kv_connector_module_path="kvd.bench.vllm_connectors"`` (this module
imports vLLM): ``TimedNixlConnector`` is vLLM's own NIXL connector, ``TimedKvdConnector`` is
``KvdConnector``. Their decode workers share two timing layers, placed in the MRO so that both
measure the same code:

- ``_TimedWhole``, outermost: the worker's whole ``get_transfer_results`` (vLLM 0.32's name for
  the connector's per-step ``get_finished``; the model runner calls it once per engine step,
  with or without a forward), in wall time and in the engine thread's CPU time (on a shared
  machine wall time includes waiting for a core; CPU time does not); so are the two below;
- ``_TimedPoll``, just above vLLM's ``NixlPullConnectorWorker``: vLLM's own
  ``get_transfer_results``, the NIXL polling both connectors share, and inside it the inline
  post-process (stock runs it; ``KvdWorker`` overrides it with nothing).

So per step: shared polling = poll - inline post-process; what a connector adds = whole - poll
(kvd: its hand-offs and its drain of kvd's events; stock: the timing layer alone). The figures
stay in memory (a bounded number of steps) and leave the worker by ``take_timings``, called by
the bench through ``LLM.collective_rpc`` at the end of a run: nothing is written per step.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from kvd.vllm.connector import (
    KVConnectorRole,
    KVConnectorTransferResults,
    KvdConnector,
    KvdWorker,
    NixlBaseConnector,
    NixlPullConnector,
    NixlPullConnectorScheduler,
    NixlPullConnectorWorker,
)

MAX_STEPS = 200_000
"""Steps kept per run (the oldest are dropped): an idle engine polls every step, so a long run
must not grow without bound."""

PER_STEP = ("whole_s", "whole_cpu_s", "poll_s", "poll_cpu_s", "inline_s", "inline_cpu_s", "moved")
"""``StepTimings``' per-step series, each a deque of ``MAX_STEPS``."""


class StepTimings:
    """Per engine step: the whole ``get_transfer_results``, vLLM's polling inside it, and the
    inline post-process inside that, in seconds of wall and of the engine thread's CPU time;
    per request, landed (vLLM's polling saw its READ done) to released (returned to the
    scheduler as received)."""

    def __init__(self) -> None:
        self.whole_s: deque[float] = deque(maxlen=MAX_STEPS)
        self.whole_cpu_s: deque[float] = deque(maxlen=MAX_STEPS)
        self.poll_s: deque[float] = deque(maxlen=MAX_STEPS)
        self.poll_cpu_s: deque[float] = deque(maxlen=MAX_STEPS)
        self.inline_s: deque[float] = deque(maxlen=MAX_STEPS)
        self.inline_cpu_s: deque[float] = deque(maxlen=MAX_STEPS)
        self.moved: deque[bool] = deque(maxlen=MAX_STEPS)
        """Per step: whether a READ landed or a request was released in it."""
        self.landed = 0
        self.landed_to_released_s: list[float] = []
        self.failed = 0
        self.landed_at: dict[str, float] = {}

    def step(
        self,
        results: KVConnectorTransferResults,
        *,
        whole_s: float,
        whole_cpu_s: float,
        poll_s: float,
        poll_cpu_s: float,
        inline_s: float,
        inline_cpu_s: float,
        landed: int,
    ) -> None:
        self.whole_s.append(whole_s)
        self.whole_cpu_s.append(whole_cpu_s)
        self.poll_s.append(poll_s)
        self.poll_cpu_s.append(poll_cpu_s)
        self.inline_s.append(inline_s)
        self.inline_cpu_s.append(inline_cpu_s)
        self.moved.append(bool(landed or results.finished_recving))
        self.landed += landed
        now = time.perf_counter()
        for req_id in results.finished_recving:
            landed_at = self.landed_at.pop(req_id, None)
            if req_id in results.failed_recving:
                self.failed += 1
            elif landed_at is not None:
                self.landed_to_released_s.append(now - landed_at)

    def take(self) -> dict[str, Any]:
        """The figures so far, as JSON-ready lists; the next run starts from nothing (requests
        still held stay held)."""
        taken: dict[str, Any] = {name: list(getattr(self, name)) for name in PER_STEP}
        taken |= {
            "landed": self.landed,
            "landed_to_released_s": self.landed_to_released_s,
            "failed": self.failed,
            "held": len(self.landed_at),
        }
        for name in PER_STEP:
            getattr(self, name).clear()
        self.landed = 0
        self.landed_to_released_s = []
        self.failed = 0
        return taken


class _TimedPoll(NixlPullConnectorWorker):
    """vLLM's polling (and stock's inline post-process), timed; just above vLLM's worker."""

    timings: StepTimings
    _inline_s: float
    _inline_cpu_s: float
    _last_poll_s: float
    _last_poll_cpu_s: float
    _landed: int

    def get_transfer_results(self) -> KVConnectorTransferResults:
        self._inline_s = self._inline_cpu_s = 0.0
        started = time.perf_counter()
        cpu_started = time.thread_time()
        results = super().get_transfer_results()
        # Noted inside the polling's window, before a connector changes the sets: the timing's
        # own work then counts as polling, which both connectors share, not as additions.
        landed = results.finished_recving - results.failed_recving
        if landed:
            now = time.perf_counter()
            for req_id in landed:
                self.timings.landed_at[req_id] = now
        self._landed = len(landed)
        self._last_poll_cpu_s = time.thread_time() - cpu_started
        self._last_poll_s = time.perf_counter() - started
        return results

    def post_process_device_kv_on_receive(self, *args: Any, **kwargs: Any) -> None:
        started, cpu_started = time.perf_counter(), time.thread_time()
        super().post_process_device_kv_on_receive(*args, **kwargs)
        self._inline_s += time.perf_counter() - started
        self._inline_cpu_s += time.thread_time() - cpu_started


class _TimedWhole(NixlPullConnectorWorker):
    """The whole per-step ``get_transfer_results``, timed; outermost."""

    timings: StepTimings
    _inline_s: float
    _inline_cpu_s: float
    _last_poll_s: float
    _last_poll_cpu_s: float
    _landed: int

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.timings = StepTimings()
        self._inline_s = self._inline_cpu_s = self._last_poll_s = self._last_poll_cpu_s = 0.0
        self._landed = 0

    def get_transfer_results(self) -> KVConnectorTransferResults:
        # The CPU clock (a system call) outside the wall window, the wall clock inside the CPU
        # window: additions (whole less polling) hold as little of the timing as can be.
        cpu_started = time.thread_time()
        started = time.perf_counter()
        results = super().get_transfer_results()
        whole_s = time.perf_counter() - started
        whole_cpu_s = time.thread_time() - cpu_started
        self.timings.step(
            results,
            whole_s=whole_s,
            whole_cpu_s=whole_cpu_s,
            poll_s=self._last_poll_s,
            poll_cpu_s=self._last_poll_cpu_s,
            inline_s=self._inline_s,
            inline_cpu_s=self._inline_cpu_s,
            landed=self._landed,
        )
        return results


class TimedStockWorker(_TimedWhole, _TimedPoll):
    """vLLM's NIXL pull worker, post-processing inline."""


class TimedKvdWorker(_TimedWhole, KvdWorker, _TimedPoll):
    """``KvdWorker``: its ``super().get_transfer_results()`` lands in ``_TimedPoll``."""


class TimedNixlConnector(NixlPullConnector):
    """vLLM's NIXL connector with ``TimedStockWorker`` on decode workers."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        # Not NixlPullConnector.__init__: it would build an untimed worker (a NIXL agent) first.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPullConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
            self.connector_worker = None
        else:
            self.connector_scheduler = None
            self.connector_worker = TimedStockWorker(vllm_config, self.engine_id, kv_cache_config)


class TimedKvdConnector(KvdConnector):
    """``KvdConnector`` with ``TimedKvdWorker`` on decode workers."""

    worker_class = TimedKvdWorker


def take_timings(worker: Any) -> dict[str, Any]:
    """For ``LLM.collective_rpc``: this worker's connector figures since the last call."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector_worker = get_kv_transfer_group().connector_worker
    if not isinstance(connector_worker, _TimedWhole):
        raise TypeError(f"{type(connector_worker).__name__} is not a timed connector worker")
    return connector_worker.timings.take()
