"""The prefill side: a KV cache registered with NIXL, described to readers over a ZMQ handshake.

The exporter never sends bytes itself: decode-side readers pull blocks with NIXL READs, and
NIXL tells the exporter, with the notification ``<req_id>:<tp_size>``, that a reader is done with
a request's blocks (vLLM's prefill frees them once every decode rank has said so).

The exporter must still be *progressed*: with UCX over shared memory or TCP (no RDMA), a READ
only moves while the target's worker is polled. ``serve`` polls every ``progress_interval_s``;
an exporter that is polled rarely makes every READ from it as slow as its polling.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch
import zmq

from kvd.dtypes import dtype_name
from kvd.layout.formats import legacy_preset
from kvd.layout.geometry import TensorGeometry, shape_geometry
from kvd.nixl import agent as nixl_agent
from kvd.protocol import (
    CacheDescription,
    DTypeName,
    Error,
    Handshake,
    KVArrangement,
    Layout,
    Reason,
    RemoteTensor,
)

log = logging.getLogger("kvd.nixl.exporter")

# Measured here (UCX, loopback, 16 MiB READ): polling every 100 us moves ~3 GB/s, sleeping between
# 20 ms polls drops that below 0.5 GB/s. A poll with nothing to do costs a few microseconds.
DEFAULT_PROGRESS_INTERVAL_S = 100e-6


class Exporter:
    """Registers ``tensors`` (one engine's KV cache) with a NIXL agent and answers handshakes.

    ``tensors`` are contiguous physical cache tensors that share ``layout``, ``kv_arrangement``
    and ``block_size`` (see ``kvd.protocol.KVArrangement``). ``endpoint`` is where the handshake
    ROUTER binds (``tcp://127.0.0.1:0`` picks a port); ``self.endpoint`` is the bound address.
    Call ``poll`` from one thread (or run ``serve`` in one), often: see the module docstring.
    """

    def __init__(
        self,
        engine_id: str,
        tensors: Sequence[torch.Tensor],
        *,
        layout: Layout,
        kv_arrangement: KVArrangement,
        block_size: int,
        endpoint: str,
        tp_size: int = 1,
        backend: str = nixl_agent.DEFAULT_BACKEND,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if not tensors:
            raise ValueError("tensors: a cache needs at least one tensor")
        if tp_size < 1:
            raise ValueError(f"tp_size: must be >= 1, got {tp_size}")
        self.engine_id = engine_id
        self.tensors = list(tensors)
        self.tp_size = tp_size
        self.geometries = [
            _geometry(t, i, layout, kv_arrangement, block_size) for i, t in enumerate(tensors)
        ]
        first = self.geometries[0]
        for i, g in enumerate(self.geometries[1:], start=1):
            if (g.num_blocks, g.num_heads, g.head_dim, g.itemsize) != (
                first.num_blocks,
                first.num_heads,
                first.head_dim,
                first.itemsize,
            ):
                raise ValueError(f"tensors[{i}]: shape or dtype differs from tensors[0]")

        self.agent = nixl_agent.make_agent(engine_id, backend)
        mem_type = nixl_agent.mem_type(self.tensors[0])
        self._registered = self.agent.register_memory(
            nixl_agent.registration(self.tensors), mem_type
        )
        self.description = CacheDescription(
            engine_id=engine_id,
            agent_name=engine_id,
            agent_metadata=self.agent.get_agent_metadata(),
            mem_type="VRAM" if mem_type == "VRAM" else "DRAM",
            device_id=nixl_agent.device_id(self.tensors[0]),
            num_blocks=first.num_blocks,
            block_size=block_size,
            layout=layout,
            kv_arrangement=kv_arrangement,
            dtype=_dtype(self.tensors[0].dtype),
            num_heads=first.num_heads,
            head_dim=first.head_dim,
            tensors=[
                RemoteTensor(
                    name=f"layer.{i}",
                    base_addr=t.data_ptr(),
                    nbytes=g.nbytes,
                    block_len=g.block_bytes,
                )
                for i, (t, g) in enumerate(zip(self.tensors, self.geometries, strict=True))
            ],
            tp_size=tp_size,
            page_format=legacy_preset(kv_arrangement, layout),
        )
        self._reply = msgspec.msgpack.encode(self.description)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Handshake)
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(endpoint)
        self.endpoint: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._notified: Counter[str] = Counter()
        self._finished: list[str] = []
        self.handshakes = 0
        self.bad_notifications = 0

    def poll(self, timeout_ms: int = 0) -> None:
        """Answer pending handshakes (waiting up to ``timeout_ms``), progress NIXL and take its
        notifications."""
        if self._router.poll(timeout_ms, zmq.POLLIN):
            while True:
                try:
                    frames = self._router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._answer(frames)
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                self._take_notification(message)

    def serve(
        self,
        stop: threading.Event,
        progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
        on_finished: Callable[[list[str]], None] | None = None,
    ) -> None:
        """``poll`` every ``progress_interval_s`` until ``stop`` is set, handing each batch of
        finished requests to ``on_finished`` (else they wait for ``finished_requests``)."""
        if progress_interval_s <= 0:
            raise ValueError(f"progress_interval_s: must be > 0, got {progress_interval_s}")
        while not stop.is_set():
            self.poll(0)
            if on_finished is not None and self._finished:
                on_finished(self.finished_requests())
            stop.wait(progress_interval_s)

    def finished_requests(self) -> list[str]:
        """Requests every decode rank has read since the last call (their blocks may be freed)."""
        done, self._finished = self._finished, []
        return done

    def close(self) -> None:
        self._router.close()
        if self._own_context:
            self._context.term()
        self.agent.deregister_memory(self._registered)

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _answer(self, frames: list[bytes]) -> None:
        # REQ peers put an empty delimiter before the payload; DEALER peers may not.
        envelope, payload = frames[:-1], frames[-1]
        try:
            request = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("bad handshake request: %s", e)
            reply = self._encoder.encode(Error(code=Reason.INVALID_MESSAGE, message=str(e)))
        else:
            self.handshakes += 1
            log.info("handshake from %r", request.engine_id or "(unnamed reader)")
            reply = self._reply
        self._router.send_multipart([*envelope, reply])

    def _take_notification(self, message: bytes) -> None:
        req_id, sep, ranks = message.decode(errors="replace").rpartition(":")
        if not sep or not ranks.isdigit() or int(ranks) < 1:
            self.bad_notifications += 1
            log.warning("NIXL notification %r is not <req_id>:<tp_size>", message)
            return
        self._notified[req_id] += 1
        if self._notified[req_id] >= int(ranks):
            del self._notified[req_id]
            self._finished.append(req_id)


def _dtype(dtype: torch.dtype) -> DTypeName:
    name = dtype_name(dtype)
    if name is None:
        raise ValueError(f"dtype: {dtype} is not a KV-cache dtype kvd knows")
    return name


def _geometry(
    tensor: torch.Tensor, i: int, layout: Layout, kv_arrangement: KVArrangement, block_size: int
) -> TensorGeometry:
    dtype = dtype_name(tensor.dtype)
    if dtype is None:
        raise ValueError(f"tensors[{i}].dtype: {tensor.dtype} is not a KV-cache dtype kvd knows")
    if not tensor.is_contiguous():
        raise ValueError(f"tensors[{i}]: must be contiguous")
    return shape_geometry(
        list(tensor.shape),
        dtype=dtype,
        layout=layout,
        kv_arrangement=kv_arrangement,
        block_size=block_size,
        where=f"tensors[{i}]",
    )
