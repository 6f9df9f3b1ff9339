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

import functools
import inspect
import os
import typing
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypedDict, TypeVar, Unpack

import msgspec
import zmq
import zmq.asyncio

from kvd.cpus import format_cpus, refused_on_a_thread
from kvd.endpoints import (
    Endpoints,
    KvdUnavailable,
    check_running,
    client_runtime_dir,
    read_endpoints,
)
from kvd.protocol import (
    Attach,
    Attached,
    BatchWindow,
    BlockGroup,
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
    read_done_version,
)
from kvd.subscription import AsyncSubscription, Delivery, EventsLost, ReplayError, Subscription

if TYPE_CHECKING:
    from kvd.shm import ShmCache

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=zmq.Context[Any])
S = TypeVar("S", bound=zmq.Socket[Any])

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
    """The runtime directory a client looks in (None when given explicit endpoints):
    ``runtime_dir``, else ``KVD_RUNTIME_DIR``, else ``client_runtime_dir(gpu)``. ``{gpu}`` in
    the first two stands for ``gpu``: ``/run/kvd/{gpu}`` gives each rank of a TP engine its own
    GPU's kvd."""
    if endpoints is not None:
        return None
    if runtime_dir is None:
        runtime_dir = os.environ.get("KVD_RUNTIME_DIR") or client_runtime_dir(gpu)
    return Path(str(runtime_dir).replace("{gpu}", gpu))


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


@dataclass(frozen=True, slots=True)
class _Call(Generic[R]):
    """One control call: its request, the reply it must get, its deadline (None: the client's)
    and what a success changes on the client."""

    request: ControlRequest
    reply: type[R]
    timeout: float | None = None
    then: Callable[[], object] | None = None

    def frames(self) -> list[bytes]:
        return [b"", _ENCODER.encode(self.request)]

    def result(self, frames: list[bytes]) -> R:
        """The reply in ``frames``; ``KvdError`` for an Error or a reply of another kind."""
        reply = _REPLY_DECODER.decode(frames[-1])
        if isinstance(reply, Error):
            raise KvdError(reply.code, reply.message)
        if not isinstance(reply, self.reply):
            raise KvdError(
                "internal", f"expected a {self.reply.__name__} reply, got {type(reply).__name__}"
            )
        if self.then is not None:
            self.then()
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
    cuda_event: bytes
    remote_ranks: int


def read_done_message(
    req_id: str,
    cache_id: str,
    block_ids: Sequence[int],
    *,
    groups: Sequence[tuple[int, int]] = (),
    **fields: Unpack[ReadDoneFields],
) -> bytes:
    """The encoded ReadDone of ``req_id``'s blocks ``block_ids`` in ``cache_id``; ``groups``:
    (blocks, covered_sub_blocks) of each KV cache group of a hybrid model, splitting
    ``block_ids`` in order (sent as protocol version 2, or 3 with ``remote_ranks`` above 1:
    ``read_done_version``)."""
    return _ENCODER.encode(
        ReadDone(
            req_id=req_id,
            cache_id=cache_id,
            physical_block_ids=list(block_ids),
            groups=[BlockGroup(num_blocks=n, covered_sub_blocks=c) for n, c in groups],
            v=read_done_version(groups=bool(groups), remote_ranks=fields.get("remote_ranks", 0)),
            **fields,
        )
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


class _ClientCore(Generic[C, S]):
    """What ``Client`` and ``AsyncClient`` share: where kvd is, the deadlines, the caches this
    client may notify about, the sockets, and each control call's request and reply (the
    ``_call_*`` builders, made methods by ``_blocking`` and ``_awaitable``). The two flavours
    add only the waiting: ``_request``, ``send_raw``, ``subscribe``."""

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
        self._ctx = self._new_context()
        if io_cpus is not None:
            _place_io_thread(self._ctx, io_cpus)
        self._control: S | None = None
        self._push: S | None = None
        self._caches = _KnownCaches()

    def _new_context(self) -> C:
        raise NotImplementedError

    # -- control: each call's request and reply ------------------------------------------------

    def _call_ping(self) -> _Call[Pong]:
        return _Call(Ping(), Pong)

    def _call_attach(
        self,
        cache_id: str,
        tensors: Sequence[TensorSpec],
        *,
        engine_id: str = "",
        release_with_process: bool = False,
    ) -> _Call[Attached]:
        """Attach a cache. ``release_with_process``: its memory dies with this process, so kvd
        detaches it as soon as this process is gone (else after ``engine_lease_s``)."""
        request = Attach(
            cache_id=cache_id,
            tensors=list(tensors),
            engine_id=engine_id,
            release_with_process=release_with_process,
        )
        return _Call(
            request, Attached, self._attach_timeout, lambda: self._caches.ids.add(cache_id)
        )

    def _call_detach(
        self, cache_id: str, *, engine_id: str = "", force: bool = False
    ) -> _Call[Detached]:
        """Detach a cache this client (or ``engine_id``) attached; ``force`` is for operators
        running as kvd's user."""
        request = Detach(cache_id=cache_id, engine_id=engine_id, force=force)
        return _Call(request, Detached, then=lambda: self._caches.ids.discard(cache_id))

    def _call_status(self) -> _Call[DaemonStatus]:
        return _Call(Status(), DaemonStatus)

    def _call_request_status(self, req_id: str, cache_id: str = "") -> _Call[RequestStatus]:
        return _Call(Status(req_id=req_id, cache_id=cache_id), RequestStatus)

    def _call_configure(
        self,
        *,
        batch_window_us: BatchWindow | None = None,
        max_batch_blocks: int | None = None,
    ) -> _Call[Configured]:
        """Change the batching of the running kvd (only as kvd's user or root, over ipc); with
        no argument, only ask. Returns the settings in force."""
        request = Configure(batch_window_us=batch_window_us, max_batch_blocks=max_batch_blocks)
        return _Call(request, Configured)

    def _call_heartbeat(self, engine_id: str) -> _Call[Lease]:
        """Tell kvd engine ``engine_id`` is alive. Once an engine sent one, kvd detaches its
        caches when none comes for ``Lease.lease_s``: call it every third of that."""
        return _Call(Heartbeat(engine_id=engine_id), Lease)

    def _timeout_of(self, call: _Call[Any]) -> float:
        return self.timeout if call.timeout is None else call.timeout

    def _control_socket(self) -> S:
        if self._control is None:
            self._locator.check()
            self.endpoints = self._locator.endpoints()
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoints.control)
            self._control = sock
        return self._control

    def _no_reply(self, timeout: float) -> Exception:
        """The error of a call whose reply did not come in ``timeout``."""
        # A late reply would be taken for the next request's: start over with a new socket.
        if self._control is not None:
            self._control.close()
            self._control = None
        return self._locator.timed_out(f"no reply from kvd at {self.endpoints.control}", timeout)

    # -- notifications and events ---------------------------------------------------------------

    def ingest_socket(self, *, linger_s: float) -> S:
        """A new PUSH socket to kvd's ingest endpoint, for a thread that sends notifications
        itself (a socket serves one thread). Unbounded: a send never blocks once connected;
        ``linger_s`` is how long unsent frames are kept when it is closed."""
        sock: S = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(self.endpoints.ingest)
        return sock

    def _push_socket(self) -> S:
        if self._push is None:
            self._locator.check()
            # Keep unsent notifications for a while on close: losing one strands a request.
            self._push = self.ingest_socket(linger_s=self.timeout)
        return self._push

    def close(self) -> None:
        """Close every socket of this client, its subscriptions' too, then the context.

        Unsent notifications get the socket's linger (the client timeout) to go out.
        """
        self._ctx.destroy()
        self._control = self._push = None


def _blocking(
    build: Callable[Concatenate[Any, P], _Call[R]],
) -> Callable[Concatenate[Client, P], R]:
    """The ``Client`` method of a ``_ClientCore._call_*`` builder: build, send, wait."""

    def method(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._request(build(self, *args, **kwargs))

    return _named_after(build, method, "Client")


def _awaitable(
    build: Callable[Concatenate[Any, P], _Call[R]],
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, R]]:
    """The ``AsyncClient`` method of a ``_ClientCore._call_*`` builder."""

    async def method(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self._request(build(self, *args, **kwargs))

    return _named_after(build, method, "AsyncClient")


def _named_after(build: Callable[..., Any], method: F, owner: str) -> F:
    """``method`` as ``help()`` shows it: ``build``'s name less ``_call_``, its docstring, and
    its signature with the reply as the result."""
    functools.update_wrapper(method, build)
    name = build.__name__.removeprefix("_call_")
    signature = inspect.signature(build, eval_str=True)
    (reply,) = typing.get_args(signature.return_annotation)
    method.__name__, method.__qualname__ = name, f"{owner}.{name}"
    vars(method)["__signature__"] = signature.replace(return_annotation=reply)
    return method


class Client(_ClientCore[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]):
    """Synchronous client; one per thread (ZMQ sockets are not thread-safe)."""

    def _new_context(self) -> zmq.Context[zmq.Socket[bytes]]:
        return zmq.Context()

    # -- control --------------------------------------------------------------------------------

    ping = _blocking(_ClientCore._call_ping)
    attach = _blocking(_ClientCore._call_attach)
    detach = _blocking(_ClientCore._call_detach)
    status = _blocking(_ClientCore._call_status)
    request_status = _blocking(_ClientCore._call_request_status)
    configure = _blocking(_ClientCore._call_configure)
    heartbeat = _blocking(_ClientCore._call_heartbeat)

    def _request(self, call: _Call[R]) -> R:
        """Send ``call``'s request and wait for its reply (``KvdTimeout`` after its timeout)."""
        timeout, sock = self._timeout_of(call), self._control_socket()
        sock.send_multipart(call.frames())
        if not sock.poll(int(timeout * 1000)):
            raise self._no_reply(timeout)
        return call.result(sock.recv_multipart())

    # -- notifications --------------------------------------------------------------------------

    def read_done(
        self,
        req_id: str,
        cache_id: str,
        block_ids: Sequence[int],
        *,
        groups: Sequence[tuple[int, int]] = (),
        **fields: Unpack[ReadDoneFields],
    ) -> None:
        """Tell kvd the READs of ``req_id`` landed in ``block_ids``; the answer is an event.

        Raises ``KvdError("unknown_cache")`` at once when ``cache_id`` is not attached. Sending
        the same (cache_id, req_id, generation) again is safe: kvd answers it with the outcome
        of the first and touches nothing. ``cuda_event``: the IPC handle of an event recorded on
        the engine's stream at hand-off, which kvd's stream waits on before writing
        (``kvd.cudaipc.HandOffMarkers``; ``ReadDone.cuda_event``).
        """
        if cache_id not in self._caches.ids:
            self._caches.check(cache_id, self.status())
        self.send_raw(read_done_message(req_id, cache_id, block_ids, groups=groups, **fields))

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
        self._push_socket().send(frame)

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

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_ClientCore[zmq.asyncio.Context, zmq.asyncio.Socket]):
    """The asyncio flavour of ``Client`` (control calls and notifications)."""

    def _new_context(self) -> zmq.asyncio.Context:
        return zmq.asyncio.Context()

    ping = _awaitable(_ClientCore._call_ping)
    attach = _awaitable(_ClientCore._call_attach)
    detach = _awaitable(_ClientCore._call_detach)
    status = _awaitable(_ClientCore._call_status)
    request_status = _awaitable(_ClientCore._call_request_status)
    configure = _awaitable(_ClientCore._call_configure)
    heartbeat = _awaitable(_ClientCore._call_heartbeat)

    async def _request(self, call: _Call[R]) -> R:
        """As ``Client._request``."""
        timeout, sock = self._timeout_of(call), self._control_socket()
        await sock.send_multipart(call.frames())
        if not await sock.poll(int(timeout * 1000)):
            raise self._no_reply(timeout)
        return call.result(await sock.recv_multipart())

    async def read_done(
        self,
        req_id: str,
        cache_id: str,
        block_ids: Sequence[int],
        *,
        groups: Sequence[tuple[int, int]] = (),
        **fields: Unpack[ReadDoneFields],
    ) -> None:
        """As ``Client.read_done``."""
        if cache_id not in self._caches.ids:
            self._caches.check(cache_id, await self.status())
        await self.send_raw(read_done_message(req_id, cache_id, block_ids, groups=groups, **fields))

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
        await self._push_socket().send(frame)

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
