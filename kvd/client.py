"""Client library for the engine side: control calls, notifications, and event subscriptions.

``Client`` is synchronous, ``AsyncClient`` is for asyncio code; both locate a daemon by its
runtime directory (``endpoints.json``) or by explicit endpoints. Their ``subscribe`` returns a
subscription that yields events in sequence order per topic and replays gaps
(``kvd.subscription``); ``ShmCache`` allocates a cache in shared memory for CPU use.

No call waits without a deadline (``timeout``), and a client found by its runtime directory
fails fast with ``KvdUnavailable`` ("kvd (pid N) is not running at DIR", "no kvd at DIR") when
no daemon serves it: checked before it first connects, and again when a wait times out.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

import msgspec
import zmq
import zmq.asyncio

from kvd.cpus import format_cpus, refused_on_a_thread
from kvd.endpoints import (
    Endpoints,
    KvdUnavailable,
    check_running,
    default_runtime_dir,
    read_endpoints,
)
from kvd.protocol import (
    Attach,
    Attached,
    BatchWindow,
    Configure,
    Configured,
    ControlReply,
    ControlRequest,
    DaemonStatus,
    Detach,
    Detached,
    Error,
    FormatRef,
    Heartbeat,
    Layout,
    Lease,
    Ping,
    Pong,
    ReadDone,
    ReadFailed,
    RequestStatus,
    Status,
    TensorSpec,
)
from kvd.subscription import AsyncSubscription, Delivery, EventsLost, ReplayError, Subscription

if TYPE_CHECKING:
    from kvd.shm import ShmCache

DEFAULT_TIMEOUT_S = 10.0
ATTACH_TIMEOUT_S = 120.0
"""An Attach's deadline when the client's timeout was left to the default: it opens memory,
compiles CUDA kernels, and a CPU kvd's first one waits for torch, which loads after READY
(seconds; tens on a machine much busier than its cores)."""


class KvdError(Exception):
    """kvd answered a control request with an Error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class KvdTimeout(TimeoutError):
    """kvd did not answer in time (is it running? is the runtime dir right?)."""


def resolve_runtime_dir(
    runtime_dir: str | Path | None = None,
    *,
    gpu: str = "0",
    endpoints: Endpoints | None = None,
) -> Path | None:
    """The runtime directory a client looks in (None when given explicit endpoints)."""
    if endpoints is not None:
        return None
    if runtime_dir is None:
        runtime_dir = os.environ.get("KVD_RUNTIME_DIR") or default_runtime_dir(gpu)
    return Path(runtime_dir)


class _Locator:
    """Where a client's daemon is, and whether one is there (see ``check_running``)."""

    def __init__(
        self, runtime_dir: str | Path | None, gpu: str, endpoints: Endpoints | None
    ) -> None:
        self.runtime_dir = resolve_runtime_dir(runtime_dir, gpu=gpu, endpoints=endpoints)
        self._endpoints = endpoints

    def endpoints(self) -> Endpoints:
        """The endpoints, read afresh from the runtime directory (a restarted kvd on TCP port 0
        binds new ports)."""
        if self._endpoints is not None:
            return self._endpoints
        assert self.runtime_dir is not None
        return read_endpoints(self.runtime_dir)

    def check(self) -> None:
        """Raise ``KvdUnavailable`` when no daemon serves the runtime directory."""
        if self.runtime_dir is not None:
            check_running(self.runtime_dir)

    def timed_out(self, what: str, timeout: float) -> KvdTimeout:
        """The error for a wait that timed out: ``KvdUnavailable`` if the daemon is gone."""
        self.check()
        return KvdTimeout(f"{what} in {timeout:g}s")


_ENCODER = msgspec.msgpack.Encoder()
_REPLY_DECODER = msgspec.msgpack.Decoder(ControlReply)


def _unwrap(reply: ControlReply, expected: type[Any]) -> Any:
    if isinstance(reply, Error):
        raise KvdError(reply.code, reply.message)
    if not isinstance(reply, expected):
        raise KvdError(
            "internal", f"expected a {expected.__name__} reply, got {type(reply).__name__}"
        )
    return reply


class ReadDoneFields(TypedDict, total=False):
    """A ReadDone's optional fields, as ``read_done`` and ``read_done_message`` take them
    (``kvd.protocol.ReadDone`` says what each means; left out, each is its default there)."""

    remote_layout: Layout | None
    remote_format: FormatRef | None
    block_size_ratio: int
    remote_block_size: int
    remote_engine_id: str
    covered_sub_blocks: int
    generation: int


def read_done_message(
    req_id: str, cache_id: str, block_ids: Sequence[int], **fields: Unpack[ReadDoneFields]
) -> bytes:
    """The encoded ReadDone of ``req_id``'s blocks ``block_ids`` in ``cache_id``."""
    return _ENCODER.encode(
        ReadDone(req_id=req_id, cache_id=cache_id, physical_block_ids=list(block_ids), **fields)
    )


def read_failed_message(
    req_id: str,
    cache_id: str,
    block_ids: Sequence[int],
    reason: str = "",
    remote_engine_id: str = "",
    *,
    generation: int = 0,
) -> bytes:
    return _ENCODER.encode(
        ReadFailed(
            req_id=req_id,
            cache_id=cache_id,
            physical_block_ids=list(block_ids),
            reason=reason,
            remote_engine_id=remote_engine_id,
            generation=generation,
        )
    )


class _KnownCaches:
    """Cache ids a client may notify about: those it attached, and those kvd says are attached.

    A notification for any other id would be refused by kvd; checking first turns a typo into
    an exception at the call instead of a request that waits for an event.
    """

    def __init__(self) -> None:
        self.ids: set[str] = set()

    def check(self, cache_id: str, status: DaemonStatus | None) -> None:
        if status is not None:
            self.ids.update(c.cache_id for c in status.caches)
        if cache_id not in self.ids:
            attached = ", ".join(sorted(self.ids)) or "none"
            raise KvdError(
                "unknown_cache", f"cache_id: {cache_id!r} is not attached (attached: {attached})"
            )


_ZMQ_CPUS = 1024
"""libzmq's CPU sets (``cpu_set_t``) hold CPUs 0 to 1023."""


class IoCpusRefused(ValueError):
    """``io_cpus`` this process may not use; ``reason`` says which and why, without the name."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"io_cpus: {reason}")
        self.reason = reason


def _place_io_thread(ctx: zmq.Context[Any], cpus: frozenset[int]) -> None:
    """Before ``ctx``'s first socket, which starts its I/O thread."""
    why = None
    if cpus and max(cpus) >= _ZMQ_CPUS:
        why = f"libzmq places threads on CPUs below {_ZMQ_CPUS} only"
    elif refused := refused_on_a_thread(lambda: os.sched_setaffinity(0, cpus)):
        why = str(refused.strerror)
    if why is not None:
        ctx.term()
        raise IoCpusRefused(f"this process may not run on CPUs {format_cpus(cpus)}: {why}")
    for cpu in sorted(cpus):
        ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)


class Client:
    """Synchronous client; one per thread (ZMQ sockets are not thread-safe)."""

    def __init__(
        self,
        runtime_dir: str | Path | None = None,
        *,
        gpu: str = "0",
        endpoints: Endpoints | None = None,
        timeout: float | None = None,
        io_cpus: frozenset[int] | None = None,
    ) -> None:
        """``io_cpus``: the CPUs ZMQ's I/O thread, which moves this client's messages, runs on;
        by default the CPUs of the thread that makes the client's first socket. ``IoCpusRefused``
        (a ``ValueError``) when this process may not run there."""
        self._locator = _Locator(runtime_dir, gpu, endpoints)
        self.runtime_dir = self._locator.runtime_dir
        self.endpoints = self._locator.endpoints()
        self.timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        """Seconds a call waits for its reply (``DEFAULT_TIMEOUT_S`` unless given)."""
        self._attach_timeout = ATTACH_TIMEOUT_S if timeout is None else None
        """An Attach's, when ``timeout`` was not given; else an Attach waits ``timeout`` too."""
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        if io_cpus is not None:
            _place_io_thread(self._ctx, io_cpus)
        self._control: zmq.Socket[bytes] | None = None
        self._push: zmq.Socket[bytes] | None = None
        self._caches = _KnownCaches()

    # -- control --------------------------------------------------------------------------------

    def ping(self) -> Pong:
        result: Pong = _unwrap(self._call(Ping()), Pong)
        return result

    def attach(
        self, cache_id: str, tensors: Sequence[TensorSpec], *, engine_id: str = ""
    ) -> Attached:
        request = Attach(cache_id=cache_id, tensors=list(tensors), engine_id=engine_id)
        result: Attached = _unwrap(self._call(request, self._attach_timeout), Attached)
        self._caches.ids.add(cache_id)
        return result

    def detach(self, cache_id: str, *, engine_id: str = "", force: bool = False) -> Detached:
        """Detach a cache this client (or ``engine_id``) attached; ``force`` is for operators
        running as kvd's user."""
        request = Detach(cache_id=cache_id, engine_id=engine_id, force=force)
        result: Detached = _unwrap(self._call(request), Detached)
        self._caches.ids.discard(cache_id)
        return result

    def status(self) -> DaemonStatus:
        result: DaemonStatus = _unwrap(self._call(Status()), DaemonStatus)
        return result

    def request_status(self, req_id: str, cache_id: str = "") -> RequestStatus:
        reply = self._call(Status(req_id=req_id, cache_id=cache_id))
        result: RequestStatus = _unwrap(reply, RequestStatus)
        return result

    def configure(
        self,
        *,
        batch_window_us: BatchWindow | None = None,
        max_batch_blocks: int | None = None,
    ) -> Configured:
        """Change the batching of the running kvd (only as kvd's user or root, over ipc); with
        no argument, only ask. Returns the settings in force."""
        request = Configure(batch_window_us=batch_window_us, max_batch_blocks=max_batch_blocks)
        result: Configured = _unwrap(self._call(request), Configured)
        return result

    def heartbeat(self, engine_id: str) -> Lease:
        """Tell kvd engine ``engine_id`` is alive. Once an engine sent one, kvd detaches its
        caches when none comes for ``Lease.lease_s``: call it every third of that."""
        result: Lease = _unwrap(self._call(Heartbeat(engine_id=engine_id)), Lease)
        return result

    def _call(self, request: ControlRequest, timeout: float | None = None) -> ControlReply:
        """Send ``request`` and wait ``timeout`` (else the client's) for the reply."""
        timeout = self.timeout if timeout is None else timeout
        sock = self._control_socket()
        sock.send_multipart([b"", _ENCODER.encode(request)])
        if not sock.poll(int(timeout * 1000)):
            # A late reply would be taken for the next request's: start over with a new socket.
            sock.close()
            self._control = None
            raise self._locator.timed_out(f"no reply from kvd at {self.endpoints.control}", timeout)
        frames = sock.recv_multipart()
        return _REPLY_DECODER.decode(frames[-1])

    def _control_socket(self) -> zmq.Socket[bytes]:
        if self._control is None:
            self._locator.check()
            self.endpoints = self._locator.endpoints()
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoints.control)
            self._control = sock
        return self._control

    # -- notifications --------------------------------------------------------------------------

    def read_done(
        self,
        req_id: str,
        cache_id: str,
        block_ids: Sequence[int],
        **fields: Unpack[ReadDoneFields],
    ) -> None:
        """Tell kvd the READs of ``req_id`` landed in ``block_ids``; the answer is an event.

        Raises ``KvdError("unknown_cache")`` at once when ``cache_id`` is not attached. Sending
        the same (cache_id, req_id, generation) again is safe: kvd answers it with the outcome
        of the first and touches nothing.
        """
        if cache_id not in self._caches.ids:
            self._caches.check(cache_id, self.status())
        self.send_raw(read_done_message(req_id, cache_id, block_ids, **fields))

    def read_failed(
        self,
        req_id: str,
        cache_id: str,
        block_ids: Sequence[int],
        reason: str = "",
        remote_engine_id: str = "",
        *,
        generation: int = 0,
    ) -> None:
        self.send_raw(
            read_failed_message(
                req_id, cache_id, block_ids, reason, remote_engine_id, generation=generation
            )
        )

    def send_raw(self, frame: bytes) -> None:
        """Send one already-encoded frame on the ingest socket (tests and tools)."""
        if self._push is None:
            self._locator.check()
            # Keep unsent notifications for a while on close: losing one strands a request.
            self._push = self.ingest_socket(linger_s=self.timeout)
        self._push.send(frame)

    def ingest_socket(self, *, linger_s: float) -> zmq.Socket[bytes]:
        """A new PUSH socket to kvd's ingest endpoint, for a thread that sends notifications
        itself (a socket serves one thread). Unbounded: a send never blocks once connected;
        ``linger_s`` is how long unsent frames are kept when it is closed."""
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(self.endpoints.ingest)
        return sock

    # -- events ---------------------------------------------------------------------------------

    def subscribe(self, topics: Iterable[str] = (), *, from_seq: int | None = None) -> Subscription:
        """Events of ``topics`` (cache ids; all if empty). With ``from_seq``, start there."""
        self._locator.check()
        return Subscription(
            self._ctx,
            self.endpoints,
            topics,
            from_seq=from_seq,
            timeout=self.timeout,
            check=self._locator.check,
        )

    def close(self) -> None:
        """Close every socket of this client, its subscriptions' too, then the context.

        Unsent notifications get the socket's linger (the client timeout) to go out.
        """
        self._ctx.destroy()
        self._control = self._push = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """The asyncio flavour of ``Client`` (control calls and notifications)."""

    def __init__(
        self,
        runtime_dir: str | Path | None = None,
        *,
        gpu: str = "0",
        endpoints: Endpoints | None = None,
        timeout: float | None = None,
        io_cpus: frozenset[int] | None = None,
    ) -> None:
        """``io_cpus``: the CPUs ZMQ's I/O thread, which moves this client's messages, runs on;
        by default the CPUs of the thread that makes the client's first socket. ``IoCpusRefused``
        (a ``ValueError``) when this process may not run there."""
        self._locator = _Locator(runtime_dir, gpu, endpoints)
        self.runtime_dir = self._locator.runtime_dir
        self.endpoints = self._locator.endpoints()
        self.timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        """Seconds a call waits for its reply (``DEFAULT_TIMEOUT_S`` unless given)."""
        self._attach_timeout = ATTACH_TIMEOUT_S if timeout is None else None
        """An Attach's, when ``timeout`` was not given; else an Attach waits ``timeout`` too."""
        self._ctx = zmq.asyncio.Context()
        if io_cpus is not None:
            _place_io_thread(self._ctx, io_cpus)
        self._control: zmq.asyncio.Socket | None = None
        self._push: zmq.asyncio.Socket | None = None
        self._caches = _KnownCaches()

    async def ping(self) -> Pong:
        result: Pong = _unwrap(await self._call(Ping()), Pong)
        return result

    async def attach(
        self, cache_id: str, tensors: Sequence[TensorSpec], *, engine_id: str = ""
    ) -> Attached:
        reply = await self._call(
            Attach(cache_id=cache_id, tensors=list(tensors), engine_id=engine_id),
            self._attach_timeout,
        )
        result: Attached = _unwrap(reply, Attached)
        self._caches.ids.add(cache_id)
        return result

    async def detach(self, cache_id: str, *, engine_id: str = "", force: bool = False) -> Detached:
        reply = await self._call(Detach(cache_id=cache_id, engine_id=engine_id, force=force))
        result: Detached = _unwrap(reply, Detached)
        self._caches.ids.discard(cache_id)
        return result

    async def status(self) -> DaemonStatus:
        result: DaemonStatus = _unwrap(await self._call(Status()), DaemonStatus)
        return result

    async def request_status(self, req_id: str, cache_id: str = "") -> RequestStatus:
        reply = await self._call(Status(req_id=req_id, cache_id=cache_id))
        result: RequestStatus = _unwrap(reply, RequestStatus)
        return result

    async def configure(
        self,
        *,
        batch_window_us: BatchWindow | None = None,
        max_batch_blocks: int | None = None,
    ) -> Configured:
        """As ``Client.configure``."""
        request = Configure(batch_window_us=batch_window_us, max_batch_blocks=max_batch_blocks)
        result: Configured = _unwrap(await self._call(request), Configured)
        return result

    async def heartbeat(self, engine_id: str) -> Lease:
        """As ``Client.heartbeat``."""
        result: Lease = _unwrap(await self._call(Heartbeat(engine_id=engine_id)), Lease)
        return result

    async def _call(self, request: ControlRequest, timeout: float | None = None) -> ControlReply:
        """As ``Client._call``."""
        timeout = self.timeout if timeout is None else timeout
        if self._control is None:
            self._locator.check()
            self.endpoints = self._locator.endpoints()
            self._control = self._ctx.socket(zmq.DEALER)
            self._control.setsockopt(zmq.LINGER, 0)
            self._control.connect(self.endpoints.control)
        sock = self._control
        await sock.send_multipart([b"", _ENCODER.encode(request)])
        if not await sock.poll(int(timeout * 1000)):
            sock.close()
            self._control = None
            raise self._locator.timed_out(f"no reply from kvd at {self.endpoints.control}", timeout)
        frames = await sock.recv_multipart()
        return _REPLY_DECODER.decode(frames[-1])

    async def read_done(
        self,
        req_id: str,
        cache_id: str,
        block_ids: Sequence[int],
        **fields: Unpack[ReadDoneFields],
    ) -> None:
        """As ``Client.read_done``."""
        if cache_id not in self._caches.ids:
            self._caches.check(cache_id, await self.status())
        await self.send_raw(read_done_message(req_id, cache_id, block_ids, **fields))

    async def read_failed(
        self,
        req_id: str,
        cache_id: str,
        block_ids: Sequence[int],
        reason: str = "",
        remote_engine_id: str = "",
        *,
        generation: int = 0,
    ) -> None:
        await self.send_raw(
            read_failed_message(
                req_id, cache_id, block_ids, reason, remote_engine_id, generation=generation
            )
        )

    async def send_raw(self, frame: bytes) -> None:
        if self._push is None:
            self._locator.check()
            self._push = self._ctx.socket(zmq.PUSH)
            self._push.setsockopt(zmq.LINGER, int(self.timeout * 1000))
            self._push.setsockopt(zmq.SNDHWM, 0)
            self._push.connect(self.endpoints.ingest)
        await self._push.send(frame)

    def subscribe(
        self, topics: Iterable[str] = (), *, from_seq: int | None = None
    ) -> AsyncSubscription:
        """Events of ``topics`` (cache ids; all if empty), for ``async for``."""
        self._locator.check()
        return AsyncSubscription(
            self._ctx,
            self.endpoints,
            topics,
            from_seq=from_seq,
            timeout=self.timeout,
            check=self._locator.check,
        )

    def close(self) -> None:
        """Close every socket of this client, its subscriptions' too, then the context.

        Unsent notifications get the socket's linger (the client timeout) to go out.
        """
        self._ctx.destroy()
        self._control = self._push = None


def __getattr__(name: str) -> Any:
    # ShmCache needs torch; importing it lazily keeps `kvd status` and `kvd tail` quick.
    if name == "ShmCache":
        from kvd.shm import ShmCache

        return ShmCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AsyncClient",
    "AsyncSubscription",
    "Client",
    "Delivery",
    "EventsLost",
    "KvdError",
    "KvdTimeout",
    "KvdUnavailable",
    "ReplayError",
    "ShmCache",
    "Subscription",
]
