"""The daemon's lifecycle: startup -> main loop -> shutdown.

Startup binds every socket and only then reports ready. SIGTERM or SIGINT starts a graceful
drain: new notifications are answered with Failed(shutting_down), accepted ones are finished and
published, then sockets close before the context. A second signal forces the exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import zmq

from kvd import __version__
from kvd.config import Config
from kvd.control import Control
from kvd.executor import CudaExecutor, Executor, Job
from kvd.kernels import cpu as kernels_cpu
from kvd.metrics import Metrics
from kvd.pipeline import Pipeline
from kvd.protocol import Reason
from kvd.publisher import Publisher
from kvd.registry import Registry
from kvd.sockets import (
    EndpointError,
    Endpoints,
    RuntimeLock,
    SocketReader,
    bind,
    default_runtime_dir,
    normalize_endpoint,
    prepare_runtime_dir,
    write_endpoints,
)

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 10.0
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StartupError(RuntimeError):
    """The daemon cannot start; the message says what to change."""


def parse_device(spec: str) -> torch.device:
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise StartupError(f"device: {spec!r} is not a device ('cpu' or 'cuda[:N]')") from exc
    if device.type not in ("cpu", "cuda"):
        raise StartupError(f"device: {spec!r} is not supported; use 'cpu' or 'cuda[:N]'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise StartupError(f"device: {spec!r} was asked for, but CUDA is not available here")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise StartupError(
                f"device: {spec!r}: only {torch.cuda.device_count()} CUDA devices are visible"
            )
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        torch.cuda.init()  # type: ignore[no-untyped-call]
    return device


class Server:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.should_exit = False
        self.force_exit = False
        self.endpoints: Endpoints | None = None
        self.metrics = Metrics()
        self._exit = asyncio.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sockets: list[zmq.Socket[bytes]] = []
        self._readers: list[SocketReader] = []
        self._lock: RuntimeLock | None = None
        self._runtime_dir: Path | None = None
        self._pipeline: Pipeline | None = None
        self._control: Control | None = None
        self.on_ready: Callable[[Server], None] | None = None

    def run(self) -> int:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(self.serve())

    async def serve(self) -> int:
        try:
            await self.startup()
        except (StartupError, EndpointError) as exc:
            log.error("cannot start: %s", exc)
            await self._close_sockets()
            return 2
        try:
            await self.main_loop()
        finally:
            clean = await self.shutdown()
        return 0 if clean else 1

    async def startup(self) -> None:
        config = self.config
        loop = asyncio.get_running_loop()
        device = parse_device(config.device)
        if device.type == "cpu" and not kernels_cpu.available():
            log.warning(
                "the compiled CPU kernel is not built (no C compiler at install time?): the "
                "post-process uses plain torch ops, several times slower"
            )
        runtime_dir = (
            Path(config.runtime_dir) if config.runtime_dir else default_runtime_dir(config.gpu)
        )
        self._runtime_dir = runtime_dir
        prepare_runtime_dir(runtime_dir)
        self._lock = RuntimeLock(runtime_dir)
        self._lock.acquire()

        wanted = {
            name: normalize_endpoint(getattr(config, f"{name}_endpoint"), runtime_dir, name)
            for name in ("control", "ingest", "events", "replay")
        }
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._ctx = ctx
        ingest = self._socket(zmq.PULL)
        # A hard ceiling well above the limit we report on, so oversized frames still get a
        # Failed answer instead of a silent disconnect.
        ingest.setsockopt(zmq.MAXMSGSIZE, max(16 * config.max_message_bytes, 64 << 20))
        ingest.setsockopt(zmq.RCVHWM, 0)
        events = self._socket(zmq.PUB)
        events.setsockopt(zmq.SNDHWM, 1_000_000)
        replay = self._socket(zmq.ROUTER)
        replay.setsockopt(zmq.SNDHWM, 0)  # a replay answer is bounded by the buffer
        control = self._socket(zmq.ROUTER)
        bound = {
            "control": bind(control, wanted["control"], "control"),
            "ingest": bind(ingest, wanted["ingest"], "ingest"),
            "events": bind(events, wanted["events"], "events"),
            "replay": bind(replay, wanted["replay"], "replay"),
        }
        self.endpoints = Endpoints(**bound)
        write_endpoints(runtime_dir, self.endpoints)

        registry = Registry(device)
        # A fresh epoch per start lets subscribers tell a restart (seqs begin at 1 again).
        publisher = Publisher(events, config.replay_buffer, epoch=secrets.randbits(63))
        executor_factory = None
        if device.type == "cuda":

            def executor_factory(
                loop: asyncio.AbstractEventLoop, done: Callable[[Job], None]
            ) -> Executor:
                return CudaExecutor(loop, done, device, priority=config.stream_priority)

        pipeline = Pipeline(
            loop,
            registry,
            publisher,
            self.metrics,
            batch_window_us=config.batch_window_us,
            max_batch_blocks=config.max_batch_blocks,
            max_message_bytes=config.max_message_bytes,
            executor_factory=executor_factory,
        )
        self._pipeline = pipeline
        self._control = Control(control, registry, pipeline, self.metrics, config)
        self.metrics.gauge(
            "kvd_in_flight_requests",
            "Requests accepted and not yet answered.",
            lambda: len(pipeline.ledger),
        )
        self.metrics.gauge("kvd_attached_caches", "Caches attached.", lambda: len(registry))
        self.metrics.gauge(
            "kvd_batch_window_seconds",
            "The batching window in force.",
            lambda: config.batch_window_us / 1e6,
        )

        self._readers = [
            SocketReader(loop, ingest, pipeline.on_ingest, after=pipeline.kick, multipart=False),
            SocketReader(loop, control, self._control.on_request),
            SocketReader(loop, replay, lambda frames: publisher.answer_replay(replay, frames)),
        ]
        for sig in _HANDLED_SIGNALS:
            loop.add_signal_handler(sig, self.handle_exit, sig)
        log.info(
            "kvd %s serving on %s (device %s, batch window %d us, max %d blocks per batch); "
            "control %s, ingest %s, events %s, replay %s",
            __version__,
            runtime_dir,
            device,
            config.batch_window_us,
            config.max_batch_blocks,
            bound["control"],
            bound["ingest"],
            bound["events"],
            bound["replay"],
        )
        if self.on_ready is not None:
            self.on_ready(self)

    async def main_loop(self) -> None:
        await self._exit.wait()

    def handle_exit(self, sig: int) -> None:
        if self.should_exit:
            self.force_exit = True
            log.warning("second %s: forcing exit", signal.Signals(sig).name)
        else:
            log.info("%s received: draining", signal.Signals(sig).name)
        self.should_exit = True
        self._exit.set()

    async def shutdown(self) -> bool:
        clean = True
        pipeline = self._pipeline
        if pipeline is not None:
            if not self.force_exit:
                in_flight = len(pipeline.ledger)
                if in_flight:
                    log.info("draining %d requests in flight", in_flight)
                drained = await self._drain(pipeline)
                if not drained:
                    clean = False
            left = len(pipeline.ledger)
            if left:
                failed = pipeline.fail_unfinished(
                    Reason.SHUTTING_DOWN, "kvd exited before the post-process finished"
                )
                log.error("exit with %d requests unfinished: answered them with Failed", failed)
                clean = False
            if not pipeline.close(timeout=1.0):
                log.error("executor did not stop in time")
                clean = False
        if self._control is not None:
            await self._control.close()
        await self._close_sockets()
        log.info("kvd stopped")
        return clean

    async def _drain(self, pipeline: Pipeline) -> bool:
        drain = asyncio.ensure_future(pipeline.drain(DRAIN_TIMEOUT_S))
        self._exit.clear()
        forced = asyncio.ensure_future(self._exit.wait())
        done, _ = await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        if drain in done:
            if not drain.result():
                log.error("drain did not finish within %.1fs", DRAIN_TIMEOUT_S)
                return False
            return True
        drain.cancel()
        return False

    async def _close_sockets(self) -> None:
        for reader in self._readers:
            reader.close()
        self._readers = []
        for sock in self._sockets:
            # Let queued events reach subscribers, but never hang the exit on a dead peer.
            sock.close(linger=500)
        self._sockets = []
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        loop = asyncio.get_running_loop()
        for sig in _HANDLED_SIGNALS:
            loop.remove_signal_handler(sig)

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self._sockets.append(sock)
        return sock


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    if sys.platform == "win32" or os.environ.get("KVD_NO_UVLOOP"):
        return None
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory
