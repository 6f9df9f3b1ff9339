"""The decode side: pull a request's blocks from a prefill peer with NIXL READs, then tell kvd.

``Reader`` registers the local caches (the tensors kvd has attached), shakes hands with each
prefill exporter once, prepares descriptor lists once per (peer, chunks) and per (cache, ratio),
and issues one READ per request (``kvd.nixl.mapping`` maps the blocks, in both directions).
``poll`` checks the READs without waiting and sends kvd a ``ReadDone`` for each finished one, or
a ``ReadFailed`` naming the request's local blocks when NIXL reports an error, the peer is gone,
or the READ outlives ``read_timeout_s``.

Every ``read`` ends in exactly one ``ReadResult`` from ``poll`` and exactly one notification to
kvd, failures included (a bad block list, an unknown peer): nothing is left unanswered. The
notification goes out as soon as the READ is seen to end, which for a READ that completes
inside its post (common for small ones) is within ``read`` itself; its ``ReadResult`` comes with
the next ``poll``, so kvd's event for it may arrive before the result does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import zmq

from kvd.dtypes import itemsize
from kvd.layout.formats import FormatError, legacy_format, resolve
from kvd.layout.geometry import (
    BlockIdError,
    BlockIds,
    GeometryError,
    TensorGeometry,
    block_id_list,
    cache_geometry,
    check_tensor,
    group_shape,
    shape_geometry,
)
from kvd.nixl import agent as nixl_agent
from kvd.nixl.mapping import (
    MappingError,
    Region,
    local_descriptors,
    plan_read,
    remote_descriptors,
    tensor_regions,
)
from kvd.protocol import (
    CacheDescription,
    Error,
    FormatRef,
    Handshake,
    HandshakeReply,
    Layout,
    TensorSpec,
)
from kvd.shm import physical_shape

if TYPE_CHECKING:
    from kvd.client import Client

log = logging.getLogger("kvd.nixl.reader")

DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0


class HandshakeError(RuntimeError):
    """A prefill exporter did not answer, answered an error, or describes an unusable cache."""


@dataclass(frozen=True, slots=True)
class ReadResult:
    """How one ``read`` ended. ``reason`` is empty when ``ok``; times are ``time.monotonic``."""

    req_id: str
    engine_id: str
    cache_id: str
    local_block_ids: list[int]
    ok: bool
    reason: str
    nbytes: int
    started: float
    finished: float


@dataclass(slots=True)
class _Peer:
    description: CacheDescription
    agent_name: str
    regions: list[Region]
    dlists: dict[int, Any]  # chunks per block -> prepared dlist (1: whole blocks, from the start)


@dataclass(slots=True)
class _LocalCache:
    cache_id: str
    layout: Layout
    geometry: TensorGeometry
    regions: list[Region]
    registered: Any
    mem_type: str
    device_id: int
    dlists: dict[int, Any] = field(default_factory=dict)  # block_size_ratio -> prepared dlist


@dataclass(slots=True)
class _Pending:
    req_id: str
    engine_id: str
    cache_id: str
    local_block_ids: list[int]
    remote_layout: Layout
    remote_format: FormatRef | None
    remote_block_size: int
    block_size_ratio: int  # 0 when it cannot say it (a remote block larger than a local one)
    nbytes: int
    handle: Any
    started: float
    deadline: float


class Reader:
    """NIXL READs for one decode engine; use from one thread (or one asyncio loop).

    ``kvd`` receives the notifications (its sends never block). ``tp_size`` goes into the
    prefill-side notification ``<req_id>:<tp_size>``.
    """

    def __init__(
        self,
        engine_id: str,
        kvd: Client,
        *,
        tp_size: int = 1,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        backend: str = nixl_agent.DEFAULT_BACKEND,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if read_timeout_s <= 0:
            raise ValueError(f"read_timeout_s: must be > 0, got {read_timeout_s}")
        self.engine_id = engine_id
        self.kvd = kvd
        self.tp_size = tp_size
        self.read_timeout_s = read_timeout_s
        self.agent = nixl_agent.make_agent(engine_id, backend)
        self._nixl_errors = nixl_agent.nixl_errors()
        self._context = context or zmq.Context.instance()
        self._peers: dict[str, _Peer] = {}
        self._caches: dict[str, _LocalCache] = {}
        self._pending: list[_Pending] = []
        self._results: list[ReadResult] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(HandshakeReply)
        self._wakeup: asyncio.Event | None = None  # set by read() while run() waits

    @property
    def in_flight(self) -> int:
        """READs issued and not yet reported by ``poll``."""
        return len(self._pending)

    # -- setup ---------------------------------------------------------------------------------

    def add_cache(
        self, cache_id: str, tensors: Sequence[torch.Tensor], specs: Sequence[TensorSpec]
    ) -> None:
        """Register a local cache (the tensors behind ``specs``, as attached to kvd)."""
        if cache_id in self._caches:
            raise ValueError(f"cache_id: {cache_id!r} is already added")
        if len(tensors) != len(specs):
            raise ValueError(f"tensors: {len(tensors)} given for {len(specs)} specs")
        geometries = cache_geometry(specs)
        first = geometries[0]
        for i, (t, g) in enumerate(zip(tensors, geometries, strict=True)):
            check_tensor(t, g, f"tensors[{i}] ({specs[i].name})")
            if g != first:
                raise ValueError(f"tensors[{i}]: geometry differs from tensors[0]")
        if len({s.layout for s in specs}) != 1:
            raise ValueError("specs: every tensor of a cache must have the same layout")
        registered = self.agent.register_memory(
            nixl_agent.registration(list(tensors)), nixl_agent.mem_type(tensors[0])
        )
        regions = [
            r
            for t, g in zip(tensors, geometries, strict=True)
            for r in tensor_regions(t.data_ptr(), g)
        ]
        self._caches[cache_id] = _LocalCache(
            cache_id=cache_id,
            layout=specs[0].layout or "NHD",
            geometry=first,
            regions=regions,
            registered=registered,
            mem_type=nixl_agent.mem_type(tensors[0]),
            device_id=nixl_agent.device_id(tensors[0]),
        )

    def connect(self, endpoint: str, timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S) -> str:
        """Shake hands with the exporter at ``endpoint``; returns its engine id.

        Raises ``HandshakeError`` when it does not answer within ``timeout_s`` or describes a
        cache this reader cannot address.
        """
        sock = self._context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send(self._encoder.encode(Handshake(engine_id=self.engine_id)))
            if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
                raise HandshakeError(f"{endpoint}: no handshake reply within {timeout_s}s")
            frame = sock.recv()
        finally:
            sock.close()
        try:
            reply = self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise HandshakeError(f"{endpoint}: undecodable handshake reply: {e}") from None
        if isinstance(reply, Error):
            raise HandshakeError(f"{endpoint}: {reply.code}: {reply.message}")
        return self.add_peer(reply)

    def add_peer(self, description: CacheDescription) -> str:
        """Use a peer whose description arrived some other way; returns its engine id."""
        regions = _remote_regions(description)
        _check_page_format(description)
        if description.engine_id in self._peers:
            self.remove_peer(description.engine_id)
        try:
            agent_name = self.agent.add_remote_agent(description.agent_metadata)
            if isinstance(agent_name, bytes):
                agent_name = agent_name.decode()
            # Wire up now, not on the first READ: that would stall the caller's loop.
            self.agent.make_connection(agent_name)
            remote_dlist = self.agent.prep_xfer_dlist(
                agent_name,
                remote_descriptors(regions, description.device_id),
                description.mem_type,
            )
        except self._nixl_errors as e:
            raise HandshakeError(f"peer {description.engine_id!r}: NIXL refused it: {e}") from e
        self._peers[description.engine_id] = _Peer(
            description, agent_name, regions, {1: remote_dlist}
        )
        log.info(
            "peer %r: %d blocks of %d tokens, %s, %d tensors",
            description.engine_id,
            description.num_blocks,
            description.block_size,
            description.layout,
            len(description.tensors),
        )
        return description.engine_id

    def remove_peer(self, engine_id: str) -> None:
        peer = self._peers.pop(engine_id)
        for dlist in peer.dlists.values():
            self.agent.release_dlist_handle(dlist)
        self.agent.remove_remote_agent(peer.agent_name)

    # -- requests ------------------------------------------------------------------------------

    def read(
        self,
        req_id: str,
        engine_id: str,
        cache_id: str,
        remote_block_ids: BlockIds,
        local_block_ids: BlockIds,
    ) -> None:
        """Issue the READ of one request.

        Remote blocks no larger than local ones (``r`` = local / remote block size): remote
        blocks ``r*j .. r*j+r-1`` into local block ``j``, the last one maybe partly. Larger
        ones (``k`` = remote / local block size): remote block ``i`` across local blocks
        ``k*i .. k*i+k-1``, so ``local_block_ids`` lists exactly ``k`` per remote block.
        Never raises for a bad request: it becomes a failed ``ReadResult`` and a ``ReadFailed``.
        """
        now = time.monotonic()
        try:
            local_ids = block_id_list(local_block_ids, "local_block_ids")
        except BlockIdError as e:  # no ids to name: the engine knows its request by req_id
            self._fail(req_id, engine_id, cache_id, [], reason=str(e), started=now)
            return
        try:
            peer, cache, ratio, chunks = self._route(engine_id, cache_id)
            plan = plan_read(
                remote_block_ids,
                local_ids,
                ratio=ratio,
                chunks=chunks,
                num_regions=len(cache.regions),
                remote_num_blocks=peer.description.num_blocks,
                local_num_blocks=cache.geometry.num_blocks,
            )
            handle = self.agent.make_prepped_xfer(
                "READ",
                self._local_dlist(cache, ratio),
                plan.local,
                self._remote_dlist(peer, chunks),
                plan.remote,
                f"{req_id}:{self.tp_size}".encode(),
            )
        except (MappingError, HandshakeError) as e:
            self._fail(req_id, engine_id, cache_id, local_ids, reason=str(e), started=now)
            return
        except self._nixl_errors as e:
            self._fail(
                req_id,
                engine_id,
                cache_id,
                local_ids,
                reason=f"NIXL: {_nixl_reason(e)}",
                started=now,
            )
            return
        pending = _Pending(
            req_id=req_id,
            engine_id=engine_id,
            cache_id=cache_id,
            local_block_ids=local_ids,
            remote_layout=peer.description.layout,
            remote_format=peer.description.page_format,
            remote_block_size=peer.description.block_size,
            block_size_ratio=ratio if chunks == 1 else 0,
            nbytes=len(remote_block_ids) * sum(r.block_len for r in peer.regions),
            handle=handle,
            started=now,
            deadline=now + self.read_timeout_s,
        )
        try:
            state = self.agent.transfer(handle)
        except self._nixl_errors as e:
            self._finish(pending, f"NIXL: {_nixl_reason(e)}")
            return
        if state == "ERR":
            self._finish(pending, "NIXL transfer state ERR at post")
            return
        if state == "DONE":  # small READs can complete inside the post
            self._finish(pending, "")
            if self._wakeup is not None:
                self._wakeup.set()
            return
        self._pending.append(pending)
        if self._wakeup is not None:
            self._wakeup.set()

    def poll(self) -> list[ReadResult]:
        """Check every READ in flight without waiting; notify kvd of the finished ones."""
        still: list[_Pending] = []
        now = time.monotonic()
        for p in self._pending:
            try:
                state = self.agent.check_xfer_state(p.handle)
            except self._nixl_errors as e:
                self._finish(p, f"NIXL: {_nixl_reason(e)}")
                continue
            if state == "DONE":
                self._finish(p, "")
            elif state == "ERR":
                self._finish(p, "NIXL transfer state ERR")
            elif now >= p.deadline:
                self._finish(p, f"NIXL READ not done after {self.read_timeout_s}s")
            else:
                still.append(p)
        self._pending = still
        results, self._results = self._results, []
        return results

    async def run(
        self,
        stop: asyncio.Event,
        on_result: Callable[[ReadResult], None],
        interval_s: float = 0.0002,
    ) -> None:
        """``poll`` every ``interval_s`` until ``stop`` is set; results go to ``on_result``.

        With nothing in flight it sleeps until the next ``read`` (or ``stop``), so an idle reader
        costs no CPU.
        """
        self._wakeup = asyncio.Event()
        stopping = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                for result in self.poll():
                    on_result(result)
                if self._pending:
                    await asyncio.sleep(interval_s)
                    continue
                self._wakeup.clear()
                waking = asyncio.create_task(self._wakeup.wait())
                await asyncio.wait({waking, stopping}, return_when=asyncio.FIRST_COMPLETED)
                waking.cancel()
        finally:
            stopping.cancel()
            self._wakeup = None

    def close(self) -> None:
        """Give up READs in flight (each reported failed to kvd) and release NIXL resources."""
        for p in self._pending:
            self._finish(p, "reader closed")
        self._pending = []
        for engine_id in list(self._peers):
            self.remove_peer(engine_id)
        self._settle()  # endpoints closing and READs given up finish before memory goes
        for cache in self._caches.values():
            for dlist in cache.dlists.values():
                self.agent.release_dlist_handle(dlist)
            self.agent.deregister_memory(cache.registered)
        self._caches.clear()

    # -- internals -----------------------------------------------------------------------------

    def _route(self, engine_id: str, cache_id: str) -> tuple[_Peer, _LocalCache, int, int]:
        """The peer, the cache, and (block_size_ratio, chunks) between them."""
        peer = self._peers.get(engine_id)
        if peer is None:
            raise HandshakeError(f"engine_id: no handshake with {engine_id!r}")
        cache = self._caches.get(cache_id)
        if cache is None:
            raise MappingError(f"cache_id: {cache_id!r} was not added to the reader")
        return peer, cache, *_group(peer, cache)

    def _local_dlist(self, cache: _LocalCache, ratio: int) -> Any:
        dlist = cache.dlists.get(ratio)
        if dlist is None:
            dlist = self.agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT",
                local_descriptors(cache.regions, ratio, cache.device_id),
                cache.mem_type,
            )
            cache.dlists[ratio] = dlist
        return dlist

    def _remote_dlist(self, peer: _Peer, chunks: int) -> Any:
        dlist = peer.dlists.get(chunks)
        if dlist is None:
            dlist = self.agent.prep_xfer_dlist(
                peer.agent_name,
                remote_descriptors(peer.regions, peer.description.device_id, chunks),
                peer.description.mem_type,
            )
            peer.dlists[chunks] = dlist
        return dlist

    def _finish(self, p: _Pending, reason: str) -> None:
        try:
            self.agent.release_xfer_handle(p.handle)
        except self._nixl_errors as e:
            # A READ still running cannot always be aborted; its blocks are reported failed.
            log.warning("request %r: could not release the NIXL handle: %s", p.req_id, e)
        if reason:
            self._settle()
            self._fail(
                p.req_id,
                p.engine_id,
                p.cache_id,
                p.local_block_ids,
                reason=reason,
                started=p.started,
            )
            return
        finished = time.monotonic()
        # block_size_ratio too when it can say it, for a kvd that predates remote_block_size.
        self.kvd.read_done(
            p.req_id,
            p.cache_id,
            p.local_block_ids,
            remote_layout=None if p.remote_format is not None else p.remote_layout,
            remote_format=p.remote_format,
            block_size_ratio=p.block_size_ratio,
            remote_block_size=p.remote_block_size,
            remote_engine_id=p.engine_id,
        )
        self._results.append(
            ReadResult(
                p.req_id,
                p.engine_id,
                p.cache_id,
                p.local_block_ids,
                True,
                "",
                p.nbytes,
                p.started,
                finished,
            )
        )

    def _settle(self) -> None:
        """Progress the agent until UCX has nothing left to do.

        A READ that fails part-way (its peer died during the post) can leave operations queued
        on UCX's endpoint that only progress completes, with an error. Without a progress
        thread nothing else runs them, and destroying the agent with them queued aborts the
        process (UCX asserts its endpoint queues are empty). NIXL's notification check
        progresses the worker until it is idle; decode receives no notifications.
        """
        try:
            self.agent.get_new_notifs()
        except self._nixl_errors as e:
            log.warning("progressing the NIXL agent after a failure: %s", e)

    def _fail(
        self,
        req_id: str,
        engine_id: str,
        cache_id: str,
        local_block_ids: list[int],
        *,
        reason: str,
        started: float,
    ) -> None:
        log.warning("request %r from %r failed: %s", req_id, engine_id, reason)
        finished = time.monotonic()
        self.kvd.read_failed(req_id, cache_id, local_block_ids, reason, engine_id)
        if self._wakeup is not None:
            self._wakeup.set()
        self._results.append(
            ReadResult(
                req_id,
                engine_id,
                cache_id,
                local_block_ids,
                False,
                reason,
                0,
                started,
                finished,
            )
        )


def _remote_regions(d: CacheDescription) -> list[Region]:
    """The peer's regions, after checking that its description is self-consistent."""
    where = f"peer {d.engine_id!r}"
    if not d.tensors:
        raise HandshakeError(f"{where}: tensors: the description lists no tensor")
    try:
        g = shape_geometry(
            physical_shape(
                d.kv_arrangement,
                d.layout,
                num_blocks=d.num_blocks,
                block_size=d.block_size,
                num_heads=d.num_heads,
                head_dim=d.head_dim,
            ),
            dtype=d.dtype,
            layout=d.layout,
            kv_arrangement=d.kv_arrangement,
            block_size=d.block_size,
        )
    except GeometryError as e:
        raise HandshakeError(f"{where}: {e}") from None
    regions = []
    for i, t in enumerate(d.tensors):
        if t.block_len != g.block_bytes or t.nbytes != g.nbytes:
            raise HandshakeError(
                f"{where}: tensors[{i}]: block_len {t.block_len} / nbytes {t.nbytes} do not match "
                f"{d.num_blocks} blocks of {d.block_size} tokens x {d.num_heads} heads x "
                f"{d.head_dim} {d.dtype} ({g.block_bytes} / {g.nbytes})"
            )
        regions.extend(tensor_regions(t.base_addr, g))
    return regions


def _check_page_format(d: CacheDescription) -> None:
    """A stated ``page_format`` must be the one ``kv_arrangement`` and ``layout`` name: the
    reader addresses blocks from those, kvd rewrites them from the format."""
    if d.page_format is None:
        return
    where = f"peer {d.engine_id!r}"
    try:
        stated = resolve(d.page_format, f"{where}: page_format")
    except FormatError as e:
        raise HandshakeError(str(e)) from None
    if stated != legacy_format(d.kv_arrangement, d.layout):
        raise HandshakeError(
            f"{where}: page_format {d.page_format!r} is not the format of kv_arrangement "
            f"{d.kv_arrangement!r} and layout {d.layout!r}"
        )


def _group(peer: _Peer, cache: _LocalCache) -> tuple[int, int]:
    """(block_size_ratio, chunks) between ``peer`` and ``cache`` (one of them 1), or
    ``MappingError`` saying why none: ratio r when the remote block size divides the local one,
    chunks k when it is k times the local one."""
    d, g = peer.description, cache.geometry
    where = f"peer {d.engine_id!r} into cache {cache.cache_id!r}"
    if d.kv_arrangement != g.arrangement:
        raise MappingError(
            f"{where}: kv_arrangement {d.kv_arrangement!r} differs from {g.arrangement!r}"
        )
    if (d.num_heads, d.head_dim) != (g.num_heads, g.head_dim):
        raise MappingError(
            f"{where}: num_heads x head_dim {d.num_heads} x {d.head_dim} differs from "
            f"{g.num_heads} x {g.head_dim}"
        )
    if itemsize(d.dtype, f"peer {d.engine_id!r}: dtype") != g.itemsize:
        raise MappingError(f"{where}: dtype {d.dtype} has another element size")
    if len(peer.regions) != len(cache.regions):
        raise MappingError(
            f"{where}: the remote cache has {len(peer.regions)} K/V regions "
            f"({len(d.tensors)} tensors), the local one {len(cache.regions)}"
        )
    try:
        chunks, ratio = group_shape(g.block_size, d.block_size)
    except ValueError:
        raise MappingError(
            f"{where}: remote block_size {d.block_size} does not divide local {g.block_size}, "
            "nor is it a multiple of it"
        ) from None
    remote_len, local_len = peer.regions[0].block_len, cache.regions[0].block_len
    if remote_len * ratio != local_len * chunks:
        raise MappingError(
            f"{where}: a remote block of {remote_len} bytes and a local one of {local_len} "
            f"do not fit at block sizes {d.block_size} -> {g.block_size}"
        )
    return ratio, chunks


def _nixl_reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
