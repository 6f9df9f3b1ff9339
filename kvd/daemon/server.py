"""The daemon's lifecycle: startup -> main loop -> shutdown.

Startup binds every socket, opens a CUDA device and recovers the journal, and only then reports
ready (to systemd too, with READY=1). A CPU daemon gets there without torch, numpy or the kernels,
most of a start's time: they load just after READY, off the loop (``load_kernels``), so a
restarted kvd is back for its engines as soon as it can be.

SIGTERM or SIGINT starts a graceful drain, bounded by ``drain_timeout_s``: new notifications
are answered with Failed(shutting_down), accepted ones are finished and published, then sockets
close before the context. A second signal forces the exit, answering what is still unfinished
with Failed(shutting_down).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
import secrets
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from kvd import __version__
from kvd.cpus import format_cpus
from kvd.daemon import health
from kvd.daemon.binding import EndpointError, bind, normalize_endpoint
from kvd.daemon.config import Config
from kvd.daemon.connection_guard import FD_RESERVE, HANDSHAKE_S, ConnectionGuard, raise_fd_limit
from kvd.daemon.control import Control
from kvd.daemon.executor import CudaExecutor, Executor, Job
from kvd.daemon.journal import Journal, JournalError
from kvd.daemon.metrics import Metrics
from kvd.daemon.metrics_http import HEALTH_PATH, READY_PATH, MetricsServer, parse_metrics_addr
from kvd.daemon.pipeline import Pipeline
from kvd.daemon.publisher import Publisher, ReplayServer, peer_queue
from kvd.daemon.reader import SocketReader
from kvd.daemon.registry import Registry
from kvd.daemon.runtime_dir import (
    RuntimeLock,
    prepare_runtime_dir,
    remove_runtime_files,
    write_endpoints,
)
from kvd.daemon.sdnotify import Notifier
from kvd.daemon.timers import Every
from kvd.daemon.zmq_io import yield_io_threads
from kvd.endpoints import Endpoints, default_runtime_dir

log = logging.getLogger(__name__)

EXIT_DEVICE_FAILED = 3
"""Exit status after the device failed (a sticky CUDA error): only a new process gets a working
CUDA context, so kvd exits and its service manager restarts it (``Restart=on-failure``)."""
EXECUTOR_GRACE_S = 1.0
"""On a drain timeout, how long the running post-process may still take to finish."""

# How often STATUS= is refreshed for `systemctl status` (only sent when it changed).
STATUS_INTERVAL_S = 5.0
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")


class StartupError(RuntimeError):
    """The daemon cannot start; the message says what to change."""


def parse_device(spec: str) -> str:
    """The daemon's device, ``'cpu'`` or ``'cuda:N'``; a CUDA one is checked and initialised.

    Only a CUDA device imports torch here: a CPU daemon's torch loads after READY.
    """
    match = _DEVICE.fullmatch(spec)
    if match is None:
        raise StartupError(f"device: {spec!r} is not supported; use 'cpu' or 'cuda[:N]'")
    if match[1] == "cpu":
        return "cpu"
    import torch

    from kvd.torch_cuda import torch_cuda

    if not torch.cuda.is_available():
        raise StartupError(f"device: {spec!r} was asked for, but CUDA is not available here")
    index = int(match[2]) if match[2] is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise StartupError(
            f"device: {spec!r}: only {torch.cuda.device_count()} CUDA devices are visible"
        )
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    torch_cuda().init()
    return str(device)


def load_kernels(device: str) -> None:
    """Import torch, numpy and the kernels (a second idle, tens beside busy engines).

    Run off the loop just after READY, so the first Attach finds them loaded; an Attach that
    comes sooner imports them in its own worker thread (the import lock makes it wait for this).

    Then everything loaded so far is put out of the garbage collector's reach (``gc.freeze``):
    it lives as long as kvd, and every full collection would walk its ~170,000 objects again,
    a pause of 100 ms or more on the loop.
    """
    try:
        from kvd.daemon import attach  # noqa: F401  (imported for its imports)
        from kvd.kernels import cpu
    except ImportError as exc:
        log.error("cannot load the kernels (%s): every Attach will fail", exc)
        return
    finally:
        gc.freeze()
    if device == "cpu" and not cpu.available():
        log.warning(
            "the compiled CPU kernel is not built (no C compiler at install time?): the "
            "post-process uses plain torch ops, several times slower"
        )


class Server:
    def __init__(self, config: Config, notifier: Notifier | None = None) -> None:
        self.config = config
        self.should_exit = False
        self.force_exit = False
        self.work_abandoned = False
        """True when kvd stopped with a transform still running on the executor thread."""
        self.device_failure: str | None = None
        """Why the device failed, if it did: kvd then exits with ``EXIT_DEVICE_FAILED``."""
        self.endpoints: Endpoints | None = None
        self.metrics = Metrics()
        self.notifier = notifier if notifier is not None else Notifier.from_env()
        self._exit = asyncio.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sockets: list[zmq.Socket[bytes]] = []
        self._readers: list[SocketReader] = []
        self._lock: RuntimeLock | None = None
        self._runtime_dir: Path | None = None
        self._pipeline: Pipeline | None = None
        self._registry: Registry | None = None
        self._control: Control | None = None
        self._dedicated_cpus = False
        self._ingest_reader: SocketReader | None = None
        self._replay: ReplayServer | None = None
        self._connections: ConnectionGuard | None = None
        self._metrics_server: MetricsServer | None = None
        self._timers: list[Every] = []
        self._last_status = ""
        self.on_ready: Callable[[Server], None] | None = None
        self.started = False
        """Startup finished: sockets bound, journal recovered, notifications read."""

    def run(self) -> int:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(self.serve())

    async def serve(self) -> int:
        try:
            await self.startup()
        except (StartupError, EndpointError) as exc:
            log.error("cannot start: %s", exc)
            self.notifier.status(f"cannot start: {exc}")
            if self._pipeline is not None:
                self._pipeline.close(timeout=1.0)
            await self._close_sockets()
            return 2
        try:
            await self.main_loop()
        finally:
            clean = await self.shutdown()
        if self.device_failure is not None:
            return EXIT_DEVICE_FAILED
        return 0 if clean else 1

    async def startup(self) -> None:
        config = self.config
        loop = asyncio.get_running_loop()
        device = parse_device(config.device)
        if config.ready_cuda_event and device == "cpu":
            raise StartupError("ready_cuda_event: CUDA events need a daemon on a CUDA device")
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
        self._dedicated_cpus = config.dedicated_cpus and yield_io_threads(ctx)
        if self._dedicated_cpus and len(os.sched_getaffinity(0)) == os.cpu_count():
            log.warning(
                "dedicated_cpus is set, but kvd may run on every CPU of this machine: "
                "give it CPUs of its own (systemd CPUAffinity=, taskset), or unset it"
            )
        self._ctx = ctx
        # Each socket's options are set before it is bound: its listener copies them then, and
        # gives them to every connection it accepts. A peer's message over a socket's maximum
        # size closes its connection before any of it is read.
        # Ingest: a ceiling well above the limit reported on, so oversized frames still get a
        # Failed answer instead of a silent disconnect.
        ingest = self._socket(zmq.PULL, max(16 * config.max_message_bytes, 64 << 20))
        # What kvd queues per peer, bounded by bytes: past it an engine's notifications wait in
        # the engine, a subscriber misses events (and replays them), a replay waits its turn.
        queue = peer_queue(config.peer_queue_bytes, config.max_message_bytes)
        ingest.setsockopt(zmq.RCVHWM, queue)
        # A subscriber sends subscriptions (the PUB socket keeps each topic until the peer
        # leaves) and replay requests: a topic and a seq each.
        events = self._socket(zmq.PUB, config.max_subscription_bytes)
        events.setsockopt(zmq.SNDHWM, queue)
        replay = self._socket(zmq.ROUTER, config.max_subscription_bytes)
        replay.setsockopt(zmq.SNDHWM, queue)
        # Control frames up to 2x the limit are read and answered message_too_large.
        control = self._socket(zmq.ROUTER, 2 * config.max_message_bytes)
        bound = {
            "control": bind(control, wanted["control"], "control"),
            "ingest": bind(ingest, wanted["ingest"], "ingest"),
            "events": bind(events, wanted["events"], "events"),
            "replay": bind(replay, wanted["replay"], "replay"),
        }

        self._connections = self._guard_connections(
            loop, {"control": control, "ingest": ingest, "events": events, "replay": replay}
        )

        registry = Registry(device)
        self._registry = registry
        journal = Journal(runtime_dir, config.journal_max_bytes)
        try:
            recovered = journal.recover()
        except JournalError as exc:
            raise StartupError(f"journal: {exc}") from exc
        # A fresh epoch per start lets subscribers tell a restart (seqs begin at 1 again).
        epoch = secrets.randbits(63)
        publisher = Publisher(events, config.replay_buffer, epoch, config.replay_buffer_bytes)

        def executor_factory(
            loop: asyncio.AbstractEventLoop, done: Callable[[Job], None]
        ) -> Executor:
            if device != "cpu":
                import torch

                from kvd.kernels.device import lane_for

                lane = lane_for(torch.device(device), config.stream_priority)
                return CudaExecutor(
                    loop,
                    done,
                    lane,
                    on_fatal=self.device_failed,
                    ready_events=config.ready_cuda_event,
                )
            return Executor(loop, done, on_fatal=self.device_failed)

        pipeline = Pipeline(
            loop,
            registry,
            publisher,
            self.metrics,
            journal,
            batch_window_us=config.batch_window_us,
            max_batch_blocks=config.max_batch_blocks,
            max_message_bytes=config.max_message_bytes,
            executor_factory=executor_factory,
        )
        self._pipeline = pipeline
        if isinstance(pipeline.executor, CudaExecutor):
            pipeline.executor.on_launched = pipeline.job_launched
        try:
            interrupted = pipeline.recover(recovered)
        except JournalError as exc:
            raise StartupError(f"journal: {exc}") from exc
        if interrupted:
            log.warning(
                "%d requests were being rewritten when the last kvd stopped: answered with "
                "Failed(interrupted)",
                interrupted,
            )
        self._control = Control(
            control, registry, pipeline, self.metrics, config, dedicated_cpus=self._dedicated_cpus
        )
        self.metrics.gauge(
            "kvd_in_flight_requests",
            "Requests accepted and not yet answered.",
            lambda: len(pipeline.ledger),
        )
        self.metrics.gauge("kvd_attached_caches", "Caches attached.", lambda: len(registry))
        connections = self._connections
        self.metrics.gauge(
            "kvd_peer_connections", "Peer connections open, all sockets.", lambda: len(connections)
        )
        self.metrics.gauge(
            "kvd_journal_failing",
            "1 while the launch journal cannot be written (new work is refused), else 0.",
            lambda: journal.problem is not None,
        )
        self.metrics.gauge(
            "kvd_batch_window_seconds",
            "The batching window in force (with batch_window_us = auto, kvd's latest choice).",
            lambda: pipeline.batch_window_us / 1e6,
        )

        metrics_url = await self._start_metrics()
        self.endpoints = Endpoints(**bound, metrics=metrics_url, pid=os.getpid())
        write_endpoints(runtime_dir, self.endpoints)

        self._ingest_reader = SocketReader(
            loop,
            ingest,
            pipeline.on_ingest,
            after=pipeline.kick,
            multipart=False,
            sends=False,
            on_error=lambda _: self.metrics.handler_errors.inc("ingest"),
        )
        control_reader = SocketReader(
            loop,
            control,
            self._control.on_request,
            copy=False,
            on_error=lambda _: self.metrics.handler_errors.inc("control"),
        )
        self._control.after_reply = control_reader.poke
        self._readers = [self._ingest_reader, control_reader]
        self._replay = ReplayServer(
            replay,
            publisher.log,
            epoch,
            self.metrics.replays,
            abandoned=self.metrics.replays_abandoned,
            dropped=self.metrics.replays_dropped,
        )
        self._replay.start()
        for sig in _HANDLED_SIGNALS:
            loop.add_signal_handler(sig, self.handle_exit, sig)
        log.info(
            "kvd %s serving on %s (device %s, cpus %s%s, batch window %s us, max %d blocks per "
            "batch, engine lease %gs); control %s, ingest %s, events %s, replay %s",
            __version__,
            runtime_dir,
            device,
            format_cpus(os.sched_getaffinity(0)),
            " dedicated" if self._dedicated_cpus else "",
            config.batch_window_us,
            config.max_batch_blocks,
            config.engine_lease_s,
            bound["control"],
            bound["ingest"],
            bound["events"],
            bound["replay"],
        )
        if metrics_url:
            log.info("metrics at %s", metrics_url)
        self.started = True
        self._announce_ready(loop)
        if self.on_ready is not None:
            self.on_ready(self)
        loop.run_in_executor(None, load_kernels, device)

    def _guard_connections(
        self, loop: asyncio.AbstractEventLoop, sockets: dict[str, zmq.Socket[bytes]]
    ) -> ConnectionGuard:
        """Take every descriptor allowed, and keep peers from taking the last of them."""
        limit = raise_fd_limit()
        bound = self.config.max_connections
        if bound > limit - FD_RESERVE:
            bound = max(limit - FD_RESERVE, 1)
            log.warning(
                "max_connections lowered from %d to %d: the descriptor limit is %d "
                "(raise LimitNOFILE)",
                self.config.max_connections,
                bound,
                limit,
            )
        return ConnectionGuard(loop, sockets, bound, self.metrics.connections_refused)

    async def _start_metrics(self) -> str:
        """Listen for scrapes if ``metrics_addr`` is set; returns the URL bound or ''."""
        if not self.config.metrics_addr:
            return ""
        try:
            host, port = parse_metrics_addr(self.config.metrics_addr)
        except ValueError as exc:
            raise StartupError(str(exc)) from exc
        server = MetricsServer(
            self.metrics.render, {HEALTH_PATH: self.liveness, READY_PATH: self.readiness}
        )
        try:
            url = await server.start(host, port)
        except OSError as exc:
            raise StartupError(
                f"metrics_addr: cannot listen on {self.config.metrics_addr!r}: "
                f"{exc.strerror or exc}"
            ) from exc
        self._metrics_server = server
        return url

    def liveness(self) -> health.Verdict:
        """What ``/healthz`` answers (``kvd.daemon.health``)."""
        pipeline = self._pipeline
        stalled_s = pipeline.executor.stalled_s(time.monotonic_ns()) if pipeline else 0.0
        return health.liveness(self.device_failure, stalled_s, self.config.executor_watchdog_s)

    def readiness(self) -> health.Verdict:
        """What ``/readyz`` answers."""
        accepting = self._pipeline is not None and self._pipeline.accepting
        return health.readiness(self.started, accepting, self.liveness())

    def _announce_ready(self, loop: asyncio.AbstractEventLoop) -> None:
        notifier = self.notifier
        if not notifier.enabled:
            return
        self._last_status = self.summary()
        notifier.ready(self._last_status)
        interval = notifier.watchdog_interval_s
        if interval is not None:
            self._timers.append(Every(loop, interval, notifier.watchdog))
        self._timers.append(Every(loop, STATUS_INTERVAL_S, self._report_status))

    def summary(self) -> str:
        """One line for `systemctl status`: caches, requests in flight, outcomes so far."""
        caches = len(self._registry) if self._registry is not None else 0
        in_flight = len(self._pipeline.ledger) if self._pipeline is not None else 0
        return (
            f"serving {_counted(caches, 'cache')}, {_counted(in_flight, 'request')} in flight, "
            f"{self.metrics.ready.value} ready, {self.metrics.failed.value} failed"
        )

    def _report_status(self) -> None:
        if self.should_exit:
            return  # the drain's STATUS stays until exit
        status = self.summary()
        if status != self._last_status:
            self._last_status = status
            self.notifier.status(status)

    async def main_loop(self) -> None:
        await self._exit.wait()

    def handle_exit(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            self.force_exit = True
            log.warning("second %s: forcing exit", name)
            self.notifier.status(f"{name} again: forcing exit")
        else:
            in_flight = len(self._pipeline.ledger) if self._pipeline is not None else 0
            log.info("%s received: draining %d requests in flight", name, in_flight)
            self.notifier.stopping(f"draining {_counted(in_flight, 'request')} in flight")
            if self._pipeline is not None:
                # From this point every new notification is refused, however soon it arrives.
                self._pipeline.stop_accepting()
        self.should_exit = True
        self._exit.set()

    def device_failed(self, reason: str) -> None:
        """The executor found the device broken: stop at once, answering only what is known.

        Requests not launched get Failed(shutting_down) (nothing of theirs was touched); those
        launched and not seen complete get nothing now, since their blocks may be partly
        written: the journal holds them, and the next start answers Failed(interrupted).
        """
        if self.device_failure is not None:
            return
        self.device_failure = reason
        log.critical(
            "the device failed (%s): kvd exits with status %d to be restarted with a new CUDA "
            "context; the requests it launched are answered by the next start",
            reason,
            EXIT_DEVICE_FAILED,
        )
        self.notifier.stopping(f"device failed: {reason}"[:200])
        # Torch's teardown would call into the broken context, and the executor thread may be
        # stuck in it: leave without the interpreter's teardown (see kvd.commands.serve.run).
        self.work_abandoned = True
        self.force_exit = self.should_exit = True
        if self._pipeline is not None:
            self._pipeline.stop_accepting()
        self._exit.set()

    async def shutdown(self) -> bool:
        clean = True
        pipeline = self._pipeline
        if pipeline is not None:
            if not self.force_exit and not await self._drain(pipeline):
                clean = False
            failed = pipeline.fail_unlaunched("kvd stopped before it started on these blocks")
            if failed:
                log.error("exit with %d requests not started: answered with Failed", failed)
                clean = False
            if self._ingest_reader is not None:
                # Notifications that reached the socket during the drain get their Failed now.
                self._ingest_reader.flush()
            if len(pipeline.ledger) and not self.force_exit:
                # A job still running: its own outcome is better news than a later "interrupted".
                await pipeline.wait_idle(EXECUTOR_GRACE_S)
            left = len(pipeline.ledger)
            # Never announce a Failed for blocks that may still be written: the journal holds
            # these launches, and the next start answers them with Failed(interrupted).
            pipeline.closing = True
            if left:
                log.error(
                    "exit with %d requests still being rewritten: the next kvd started on %s "
                    "answers them with Failed(interrupted)",
                    left,
                    self._runtime_dir,
                )
                clean = False
            if not pipeline.close(timeout=0.0 if left else 1.0):
                self.work_abandoned = True
                clean = False
        if self._control is not None:
            await self._control.close()
        await self._close_sockets()
        log.info("kvd stopped")
        return clean

    async def _drain(self, pipeline: Pipeline) -> bool:
        timeout = self.config.drain_timeout_s
        drain = asyncio.ensure_future(pipeline.drain(timeout))
        self._exit.clear()
        forced = asyncio.ensure_future(self._exit.wait())
        done, _ = await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        if drain in done:
            if not drain.result():
                log.error("drain did not finish within %gs", timeout)
                return False
            return True
        drain.cancel()
        return False

    async def _close_sockets(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers = []
        if self._metrics_server is not None:
            await self._metrics_server.close()
            self._metrics_server = None
        for reader in self._readers:
            reader.close()
        self._readers = []
        if self._connections is not None:
            self._connections.close()
        if self._replay is not None:
            self._replay.stop()
            self._replay = None
        self._ingest_reader = None
        for sock in self._sockets:
            # Let queued events reach subscribers, but never hang the exit on a dead peer.
            sock.close(linger=500)
        self._sockets = []
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._lock is not None:
            assert self._runtime_dir is not None
            remove_runtime_files(self._runtime_dir, self.endpoints)
            self._lock.release(remove=True)
            self._lock = None
        if self._pipeline is not None:
            self._pipeline.journal.close()
        loop = asyncio.get_running_loop()
        for sig in _HANDLED_SIGNALS:
            loop.remove_signal_handler(sig)
        self.notifier.close()

    def _socket(self, kind: int, max_message_bytes: int) -> zmq.Socket[bytes]:
        """A socket for kvd to bind: a peer's message over ``max_message_bytes`` closes its
        connection unread."""
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        self._sockets.append(sock)
        return sock


def _counted(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    if sys.platform == "win32" or os.environ.get("KVD_NO_UVLOOP"):
        return None
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory
