"""The control socket: Attach, Detach, Status, Ping, Configure and Heartbeat, each answered
with one reply.

Requests arrive on a ROUTER; REQ clients send (identity, empty, body) and DEALER clients
(identity, body); the reply reuses the same envelope. Opening an Attach's memory runs in a
worker thread, so a slow open never stalls ingest. A cache remembers who attached it (the
connection and the engine id): only they, or an operator running as kvd's user, may detach it.

Engines come and go (``leases.py`` decides when one is gone): a cache whose engine is gone, an
operator's forced Detach, and an Attach by the same engine of a cache it already holds (a
restart) all detach the cache the same way. New notifications for it are refused, those not
yet launched get Failed(cache_detached), the launched ones finish and are published, and only
then is its memory released.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from kvd import __version__
from kvd.daemon.leases import Leases
from kvd.daemon.ledger import State
from kvd.daemon.logs import clipped
from kvd.daemon.memory import AttachError
from kvd.daemon.metrics import Metrics
from kvd.daemon.peers import Connection, is_operator
from kvd.daemon.pipeline import Pipeline
from kvd.daemon.registry import AttachedCache, Owner, Registry
from kvd.daemon.timers import Every
from kvd.protocol import (
    PROTOCOL_VERSION,
    Attach,
    Attached,
    CacheInfo,
    Configure,
    Configured,
    ControlReply,
    ControlRequest,
    DaemonStatus,
    Detach,
    Detached,
    Error,
    Heartbeat,
    Lease,
    Ping,
    Pong,
    Reason,
    RequestState,
    RequestStatus,
    Status,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from kvd.daemon.config import Config

log = logging.getLogger(__name__)

_STATE_NAMES: dict[State, RequestState] = {
    State.ACCEPTED: "accepted",
    State.BATCHED: "batched",
    State.LAUNCHED: "launched",
    State.DONE: "done",
}
LEASE_CHECKS_PER_LEASE = 4
"""How often, per lease, kvd looks whether engines' connections are still open (at most 1/s)."""


class Control:
    def __init__(
        self,
        sock: zmq.Socket[bytes],
        registry: Registry,
        pipeline: Pipeline,
        metrics: Metrics,
        config: Config,
        *,
        dedicated_cpus: bool = False,
    ) -> None:
        self._sock = sock
        self._dedicated_cpus = dedicated_cpus
        """Whether ``config.dedicated_cpus`` took effect (it is skipped where refused)."""
        self._registry = registry
        self._pipeline = pipeline
        self._metrics = metrics
        self._config = config
        self._decoder = msgspec.msgpack.Decoder(ControlRequest)
        self._encoder = msgspec.msgpack.Encoder()
        self._started = time.monotonic()
        self._tasks: set[asyncio.Task[None]] = set()
        self._opening: set[str] = set()
        self._detaching: dict[str, asyncio.Task[None]] = {}
        self.leases = Leases(config.engine_lease_s)
        self._lease_timer: Every | None = None
        if config.engine_lease_s:
            interval = min(1.0, config.engine_lease_s / LEASE_CHECKS_PER_LEASE)
            self._lease_timer = Every(asyncio.get_running_loop(), interval, self.check_leases)
        self.after_reply: Callable[[], None] | None = None
        """Called after each reply: attach replies leave from a task, outside the socket's reader
        (see ``SocketReader.poke``)."""

    def on_request(self, frames: list[zmq.Frame]) -> None:
        """One request, received with ``copy=False``: the last frame's source descriptor tells
        who sent it (for operators' requests, and engines' connections)."""
        if len(frames) < 2:
            log.warning("control message without an envelope (%d frames) ignored", len(frames))
            self._metrics.rejections.inc(Reason.INVALID_MESSAGE)
            return
        envelope, body = [f.bytes for f in frames[:-1]], frames[-1].bytes
        reply = self._decode(body)
        if isinstance(reply, Error):
            self._send(envelope, reply)
            return
        request = reply
        if request.v != PROTOCOL_VERSION:
            self._send(
                envelope,
                self._error(
                    Reason.UNSUPPORTED_VERSION,
                    f"v: protocol version {request.v} is not supported (this kvd speaks "
                    f"{PROTOCOL_VERSION})",
                ),
            )
            return
        if isinstance(request, Attach):
            owner = Owner(envelope[0], request.engine_id, Connection.of(frames[-1]))
            self._spawn(self._attach(envelope, request, owner))
        elif isinstance(request, Detach):
            self._detach(envelope, request, frames[-1])
        elif isinstance(request, Configure):
            self._send(envelope, self._configure(request, frames[-1]))
        elif isinstance(request, Heartbeat):
            owner = Owner(envelope[0], request.engine_id, Connection.of(frames[-1]))
            self._send(envelope, self._heartbeat(owner))
        else:
            self._send(envelope, self._answer(request))

    def _spawn(self, coro: Coroutine[None, None, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _decode(self, body: bytes) -> ControlRequest | Error:
        if len(body) > self._config.max_message_bytes:
            return self._error(
                Reason.MESSAGE_TOO_LARGE,
                f"message is {len(body)} bytes, the limit is {self._config.max_message_bytes}",
            )
        try:
            return self._decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            return self._error(Reason.INVALID_MESSAGE, str(exc))

    def _answer(self, request: Status | Ping) -> ControlReply:
        if isinstance(request, Ping):
            return Pong(version=__version__, protocol_version=PROTOCOL_VERSION, pid=os.getpid())
        if request.req_id is None:
            return self.daemon_status()
        return self.request_status(request.req_id, request.cache_id)

    # -- caches ---------------------------------------------------------------------------------

    async def _attach(self, envelope: list[bytes], request: Attach, owner: Owner) -> None:
        cache_id = request.cache_id
        old = self._registry.get(cache_id)
        same_engine = (
            old is not None and bool(owner.engine_id) and old.owner.engine_id == owner.engine_id
        )
        if cache_id in self._opening or (old is not None and not same_engine):
            by = f" by engine {old.owner.engine_id!r}" if old and old.owner.engine_id else ""
            self._send(
                envelope,
                self._error(
                    Reason.CACHE_EXISTS,
                    f"cache_id: {cache_id!r} is already attached{by}; the same engine_id "
                    "replaces it",
                ),
            )
            return
        self._opening.add(cache_id)
        try:
            if old is not None:
                log.info(
                    "engine %r attached cache %r again (restarted?): the old one is detached "
                    "once its requests are answered",
                    owner.engine_id,
                    cache_id,
                )
                await self._detach_when_answered(
                    old,
                    f"engine {owner.engine_id!r} attached cache {cache_id!r} again: the requests "
                    "of the earlier attach that were not started are not done",
                )
            cache = await asyncio.to_thread(_open_cache, request, self._registry.device, owner)
            try:
                self._registry.add(cache)
            except AttachError:
                cache.close()
                raise
        except AttachError as exc:
            self._send(envelope, self._error(exc.code, exc.message))
            return
        finally:
            self._opening.discard(cache_id)
        self.leases.attached(cache_id, owner.engine_id, with_process=request.release_with_process)
        log.info(
            "attached cache %r%s: %d tensors, %d blocks of %s tokens, %.1f MiB",
            cache_id,
            f" of engine {owner.engine_id!r}" if owner.engine_id else "",
            len(cache.tensors),
            cache.num_blocks,
            "/".join(map(str, cache.group_block_sizes)),
            cache.nbytes / 2**20,
        )
        self._send(
            envelope,
            Attached(
                cache_id=cache_id,
                num_blocks=cache.num_blocks,
                block_size=cache.block_size,
                num_tensors=len(cache.tensors),
                nbytes=cache.nbytes,
            ),
        )

    def _detach(self, envelope: list[bytes], request: Detach, frame: zmq.Frame) -> None:
        cache_id = request.cache_id
        cache = self._registry.get(cache_id)
        if cache is None:
            self._send(
                envelope,
                self._error(Reason.UNKNOWN_CACHE, f"cache_id: {cache_id!r} is not attached"),
            )
            return
        owner = cache.owner
        allowed = envelope[0] == owner.routing_id or (
            bool(owner.engine_id) and request.engine_id == owner.engine_id
        )
        if not allowed and request.force:
            allowed, uid = is_operator(frame)
            if not allowed:
                self._send(
                    envelope,
                    self._error(
                        Reason.NOT_OWNER,
                        "force: only kvd's user or root may force a detach, over an ipc socket "
                        f"(the peer is uid {uid if uid is not None else 'unknown'})",
                    ),
                )
                return
        if not allowed:
            self._send(
                envelope,
                self._error(
                    Reason.NOT_OWNER,
                    f"cache_id: {cache_id!r} was attached by another connection"
                    + (f" (engine {owner.engine_id!r})" if owner.engine_id else "")
                    + "; detach it from there, with its engine_id, or as an operator with force",
                ),
            )
            return
        busy = self._pipeline.ledger.in_flight(cache_id)
        if busy and not request.force:
            self._send(
                envelope,
                self._error(
                    Reason.CACHE_BUSY,
                    f"cache_id: {cache_id!r} has {busy} requests in flight; detach after they "
                    "finish, or with force to answer them first",
                ),
            )
            return
        if not busy and cache.detaching is None:
            self._release(cache)
            self._send(envelope, Detached(cache_id=cache_id))
            return

        async def detach_then_reply() -> None:
            await self._detach_when_answered(
                cache, f"cache {cache_id!r} was detached before these requests were started"
            )
            self._send(envelope, Detached(cache_id=cache_id))

        self._spawn(detach_then_reply())

    async def _detach_when_answered(self, cache: AttachedCache, why: str) -> None:
        """Refuse new notifications for ``cache``, fail its waiting requests with ``why``, let
        the launched ones finish, then release it. Concurrent callers share one detach."""
        task = self._detaching.get(cache.cache_id)
        if task is None:
            task = self._spawn(self._detach_cache(cache, why))
            self._detaching[cache.cache_id] = task
        await asyncio.shield(task)

    async def _detach_cache(self, cache: AttachedCache, why: str) -> None:
        cache_id = cache.cache_id
        try:
            cache.detaching = why
            self.leases.detached(cache_id)
            failed = self._pipeline.fail_waiting(cache_id, why)
            launched = self._pipeline.ledger.in_flight(cache_id)
            if failed or launched:
                log.warning(
                    "detaching cache %r: %d requests not started answered with "
                    "Failed(cache_detached); waiting for %d being rewritten",
                    cache_id,
                    failed,
                    launched,
                )
            await self._pipeline.wait_cache_idle(cache_id)
            self._release(cache)
        finally:
            del self._detaching[cache_id]

    def _release(self, cache: AttachedCache) -> None:
        self._registry.remove(cache.cache_id)
        self.leases.detached(cache.cache_id)
        log.info("detached cache %r; its memory is released", cache.cache_id)

    # -- engines --------------------------------------------------------------------------------

    def _heartbeat(self, owner: Owner) -> Lease:
        renewed = self.leases.heartbeat(owner.engine_id, time.monotonic())
        for cache_id in renewed:
            cache = self._registry.get(cache_id)
            if cache is not None:
                cache.owner = owner  # the engine may have reconnected: this is its connection now
        return Lease(engine_id=owner.engine_id, lease_s=self.leases.lease_s, cache_ids=renewed)

    def check_leases(self) -> None:
        """Start the lease of caches whose engine's connection closed; detach expired ones."""
        now = time.monotonic()
        lease_s = self.leases.lease_s
        for cache_id in self.leases.watched():
            cache = self._registry.get(cache_id)
            connection = cache.owner.connection if cache is not None else None
            if cache is None or connection is None or connection.is_open():
                continue
            gone = connection.process_gone()
            if self.leases.connection_closed(cache_id, now, process_gone=gone):
                engine = _engine_name(cache)
                if self.leases.process_gone(cache_id):
                    log.warning(
                        "cache %r: %s closed its control connection and its process (pid %s) "
                        "is gone, with the cache's memory: detaching it now",
                        cache_id,
                        engine,
                        connection.pid,
                    )
                else:
                    log.warning(
                        "cache %r: the control connection of %s closed; it is detached in %gs "
                        "unless the engine comes back (Heartbeat or Attach)",
                        cache_id,
                        engine,
                        lease_s,
                    )
        for cache_id in self.leases.expired(now):
            cache = self._registry.get(cache_id)
            process_gone = self.leases.process_gone(cache_id)
            self.leases.detached(cache_id)
            if cache is None or cache.detaching is not None:
                continue
            self._metrics.leases_expired.value += 1
            engine = _engine_name(cache)
            connection = cache.owner.connection
            if process_gone and connection is not None:
                why = f"its process (pid {connection.pid}) is gone"
            else:
                why = f"no connection or heartbeat for {lease_s:g}s"
            log.warning("cache %r: %s is gone (%s): detaching it", cache_id, engine, why)
            self._spawn(
                self._detach_when_answered(
                    cache,
                    f"{engine} is gone ({why}): cache {cache_id!r} was detached before these "
                    "requests were started",
                )
            )

    # -- settings -------------------------------------------------------------------------------

    def _configure(self, request: Configure, frame: zmq.Frame) -> ControlReply:
        changes = {
            name: value
            for name in ("batch_window_us", "max_batch_blocks")
            if (value := getattr(request, name)) is not None
        }
        if changes:
            allowed, uid = is_operator(frame)
            if not allowed:
                return self._error(
                    Reason.NOT_PERMITTED,
                    f"{', '.join(changes)}: only kvd's user or root may change settings, over "
                    f"an ipc socket (the peer is uid {uid if uid is not None else 'unknown'})",
                )
            self._pipeline.configure(request.batch_window_us, request.max_batch_blocks)
            log.info("settings changed: %s", ", ".join(f"{k} = {v}" for k, v in changes.items()))
        return self.configured()

    def configured(self) -> Configured:
        pipeline = self._pipeline
        return Configured(
            batch_window_us=pipeline.batch_window_us,
            max_batch_blocks=pipeline.batcher.max_blocks,
            batch_window_auto=pipeline.batcher.auto is not None,
        )

    # -- status ---------------------------------------------------------------------------------

    def request_status(self, req_id: str, cache_id: str = "") -> RequestStatus:
        ledger = self._pipeline.ledger
        request = ledger.find(req_id, cache_id)
        if request is not None:
            return RequestStatus(
                req_id=req_id, state=_STATE_NAMES[request.state], cache_id=request.cache_id
            )
        known = [
            o
            for memory in (ledger.outcomes, ledger.untouched)
            for o in memory.by_req_id(req_id)
            if not cache_id or o.cache_id == cache_id
        ]
        if not known:
            return RequestStatus(req_id=req_id, state="unknown")
        outcome = known[0]
        return RequestStatus(
            req_id=req_id,
            state="failed" if outcome.code else "ready",
            cache_id=outcome.cache_id,
            code=outcome.code,
            message=outcome.message,
        )

    def daemon_status(self) -> DaemonStatus:
        ledger = self._pipeline.ledger
        now = time.monotonic()
        return DaemonStatus(
            version=__version__,
            protocol_version=PROTOCOL_VERSION,
            pid=os.getpid(),
            uptime_s=round(time.monotonic() - self._started, 3),
            device=str(self._registry.device),
            batch_window_us=self._pipeline.batch_window_us,
            max_batch_blocks=self._pipeline.batcher.max_blocks,
            batch_window_auto=self._pipeline.batcher.auto is not None,
            engine_lease_s=self.leases.lease_s,
            cpus=sorted(os.sched_getaffinity(0)),
            dedicated_cpus=self._dedicated_cpus,
            in_flight=len(ledger),
            caches=[
                CacheInfo(
                    cache_id=c.cache_id,
                    num_blocks=c.num_blocks,
                    block_size=c.block_size,
                    num_tensors=len(c.tensors),
                    nbytes=c.nbytes,
                    in_flight=ledger.in_flight(c.cache_id),
                    engine_id=c.owner.engine_id,
                    expires_in_s=self.leases.expires_in(c.cache_id, now),
                    detaching=c.detaching is not None,
                    group_block_sizes=c.group_block_sizes if c.num_groups > 1 else [],
                )
                for c in self._registry.caches()
            ],
            counters=self._metrics.counters(),
            rejections=self._metrics.rejection_counts(),
            journal_problem=self._pipeline.journal.problem or "",
        )

    def _error(self, code: Reason, message: str) -> Error:
        message = clipped(message)  # it may quote a field of the request, however long
        self._metrics.rejections.inc(code)
        log.warning("control request rejected (%s): %s", code.value, message)
        return Error(code=code, message=message)

    def _send(self, envelope: list[bytes], reply: ControlReply) -> None:
        # ROUTER drops replies to peers that went away; that is the right answer to a gone peer.
        self._sock.send_multipart([*envelope, self._encoder.encode(reply)], zmq.NOBLOCK)
        if self.after_reply is not None:
            self.after_reply()

    async def close(self) -> None:
        if self._lease_timer is not None:
            self._lease_timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _open_cache(request: Attach, device: str, owner: Owner) -> AttachedCache:
    """``attach.open_cache``, imported here, in the worker thread: importing torch takes seconds
    on a busy machine, and the loop must not wait for it."""
    from kvd.daemon.attach import open_cache

    return open_cache(request, device, owner)


def _engine_name(cache: AttachedCache) -> str:
    return f"engine {cache.owner.engine_id!r}" if cache.owner.engine_id else "its engine"
