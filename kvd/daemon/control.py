"""The control socket: Attach, Detach, Status and Ping, each answered with one reply.

Requests arrive on a ROUTER; REQ clients send (identity, empty, body) and DEALER clients
(identity, body); the reply reuses the same envelope. Opening an Attach's memory runs in a
worker thread, so a slow open never stalls ingest. A cache remembers who attached it (the
connection and the engine id): only they, or an operator running as kvd's user, may detach it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from kvd import __version__
from kvd.daemon.attach import open_cache
from kvd.daemon.ledger import State
from kvd.daemon.memory import AttachError
from kvd.daemon.metrics import Metrics
from kvd.daemon.pipeline import Pipeline
from kvd.daemon.registry import Owner, Registry
from kvd.protocol import (
    PROTOCOL_VERSION,
    Attach,
    Attached,
    CacheInfo,
    ControlReply,
    ControlRequest,
    DaemonStatus,
    Detach,
    Detached,
    Error,
    Ping,
    Pong,
    Reason,
    RequestState,
    RequestStatus,
    Status,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvd.daemon.config import Config

log = logging.getLogger(__name__)

_STATE_NAMES: dict[State, RequestState] = {
    State.ACCEPTED: "accepted",
    State.BATCHED: "batched",
    State.LAUNCHED: "launched",
    State.DONE: "done",
}


class Control:
    def __init__(
        self,
        sock: zmq.Socket[bytes],
        registry: Registry,
        pipeline: Pipeline,
        metrics: Metrics,
        config: Config,
    ) -> None:
        self._sock = sock
        self._registry = registry
        self._pipeline = pipeline
        self._metrics = metrics
        self._config = config
        self._decoder = msgspec.msgpack.Decoder(ControlRequest)
        self._encoder = msgspec.msgpack.Encoder()
        self._started = time.monotonic()
        self._tasks: set[asyncio.Task[None]] = set()
        self._opening: set[str] = set()
        self.after_reply: Callable[[], None] | None = None
        """Called after each reply: attach replies leave from a task, outside the socket's reader
        (see ``SocketReader.poke``)."""

    def on_request(self, frames: list[zmq.Frame]) -> None:
        """One request, received with ``copy=False``: the last frame's source descriptor tells
        who sent it (for an operator's forced Detach)."""
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
            task = asyncio.get_running_loop().create_task(self._attach(envelope, request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        if isinstance(request, Detach):
            self._send(envelope, self._detach(request, envelope[0], frames[-1]))
            return
        self._send(envelope, self._answer(request))

    def _decode(self, body: bytes) -> Attach | Detach | Status | Ping | Error:
        if len(body) > self._config.max_message_bytes:
            return self._error(
                Reason.MESSAGE_TOO_LARGE,
                f"message is {len(body)} bytes, the limit is {self._config.max_message_bytes}",
            )
        try:
            return self._decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            return self._error(Reason.INVALID_MESSAGE, str(exc)[:1000])

    def _answer(self, request: Status | Ping) -> ControlReply:
        if isinstance(request, Ping):
            return Pong(version=__version__, protocol_version=PROTOCOL_VERSION, pid=os.getpid())
        if request.req_id is None:
            return self.daemon_status()
        return self.request_status(request.req_id, request.cache_id)

    async def _attach(self, envelope: list[bytes], request: Attach) -> None:
        cache_id = request.cache_id
        if cache_id in self._registry or cache_id in self._opening:
            self._send(
                envelope,
                self._error(Reason.CACHE_EXISTS, f"cache_id: {cache_id!r} is already attached"),
            )
            return
        self._opening.add(cache_id)
        owner = Owner(routing_id=envelope[0], engine_id=request.engine_id)
        try:
            cache = await asyncio.to_thread(open_cache, request, self._registry.device, owner)
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
        log.info(
            "attached cache %r: %d tensors, %d blocks of %d tokens, %.1f MiB",
            cache_id,
            len(cache.tensors),
            cache.num_blocks,
            cache.block_size,
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

    def _detach(self, request: Detach, routing_id: bytes, frame: zmq.Frame) -> ControlReply:
        cache_id = request.cache_id
        cache = self._registry.get(cache_id)
        if cache is None:
            return self._error(Reason.UNKNOWN_CACHE, f"cache_id: {cache_id!r} is not attached")
        owner = cache.owner
        allowed = routing_id == owner.routing_id or (
            bool(owner.engine_id) and request.engine_id == owner.engine_id
        )
        if not allowed and request.force:
            uid = _peer_uid(frame)
            allowed = uid is not None and uid in (0, os.geteuid())
            if not allowed:
                return self._error(
                    Reason.NOT_OWNER,
                    f"force: only kvd's user or root may force a detach, over an ipc socket "
                    f"(the peer is uid {uid if uid is not None else 'unknown'})",
                )
        if not allowed:
            return self._error(
                Reason.NOT_OWNER,
                f"cache_id: {cache_id!r} was attached by another connection"
                + (f" (engine {owner.engine_id!r})" if owner.engine_id else "")
                + "; detach it from there, with its engine_id, or as an operator with force",
            )
        busy = self._pipeline.ledger.in_flight(cache_id)
        if busy:
            return self._error(
                Reason.CACHE_BUSY,
                f"cache_id: {cache_id!r} has {busy} requests in flight; detach after they finish",
            )
        self._registry.remove(cache_id)
        log.info("detached cache %r", cache_id)
        return Detached(cache_id=cache_id)

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
        return DaemonStatus(
            version=__version__,
            protocol_version=PROTOCOL_VERSION,
            pid=os.getpid(),
            uptime_s=round(time.monotonic() - self._started, 3),
            device=str(self._registry.device),
            batch_window_us=self._config.batch_window_us,
            max_batch_blocks=self._config.max_batch_blocks,
            in_flight=len(ledger),
            caches=[
                CacheInfo(
                    cache_id=c.cache_id,
                    num_blocks=c.num_blocks,
                    block_size=c.block_size,
                    num_tensors=len(c.tensors),
                    nbytes=c.nbytes,
                    in_flight=ledger.in_flight(c.cache_id),
                )
                for c in self._registry.caches()
            ],
            counters=self._metrics.counters(),
            rejections=self._metrics.rejection_counts(),
        )

    def _error(self, code: Reason, message: str) -> Error:
        self._metrics.rejections.inc(code)
        log.warning("control request rejected (%s): %s", code.value, message)
        return Error(code=code, message=message)

    def _send(self, envelope: list[bytes], reply: ControlReply) -> None:
        # ROUTER drops replies to peers that went away; that is the right answer to a gone peer.
        self._sock.send_multipart([*envelope, self._encoder.encode(reply)], zmq.NOBLOCK)
        if self.after_reply is not None:
            self.after_reply()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


_UCRED = struct.Struct("3i")


def _peer_uid(frame: zmq.Frame) -> int | None:
    """The uid of the process that sent ``frame`` over an ipc socket (None over TCP)."""
    try:
        fd = frame.get(zmq.SRCFD)
        peer = socket.socket(fileno=os.dup(fd))
    except (zmq.ZMQError, OSError):
        return None
    try:
        uid: int
        _, uid, _ = _UCRED.unpack(
            peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
    except OSError:
        return None
    finally:
        peer.close()
    return uid
