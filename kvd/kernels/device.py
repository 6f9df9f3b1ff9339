"""kvd's place on one CUDA device: its dedicated stream, the pinned ring that carries block ids
to the GPU, and the CUDA calls kvd makes, behind one small interface.

A thread's current CUDA device is its own and starts at 0, whatever the main thread chose; Triton
launches on the calling thread's current device and stream. So every thread of kvd that touches
CUDA sets its device explicitly, and launches happen only inside ``Lane.launching()``, which
makes the lane's device and stream current. The calls go through ``CudaApi`` (``TorchCuda`` in
service); tests replace it with a fake that tracks each thread's device and stream.

There is one ``Lane`` per device and process (``lane_for``): the executor's launches, the
attach thread's warm-up launches and the uploads of prepared plans all go to its one stream, in
the order they are enqueued.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvd.kernels.faults import MarkerError
from kvd.torch_cuda import ipc_handle, torch_cuda

RING_SLOTS = 8
"""Slots of the block-id ring: launches whose ids are still being read, at most."""
RING_SLOT_IDS = 1 << 16
"""Block ids one slot holds (256 KiB); a launch with more is split."""
MARKERS_OPEN = 256
"""Engine markers (``ReadDone.cuda_event``) a lane keeps open, least recently used first out.
An engine records its markers from a small pool, so each handle is opened once; one that
leaves stays open until the jobs that waited on it completed (they hold it)."""


class CudaEvent(Protocol):
    def record(self, stream: Any) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class CudaApi(Protocol):
    """The CUDA calls of kvd's daemon side (``TorchCuda``; a fake in tests)."""

    def set_device(self, device: torch.device) -> None:
        """Make ``device`` the calling thread's current device, for the thread's life."""

    def new_stream(self, device: torch.device, priority: int) -> Any: ...

    def use(self, device: torch.device, stream: Any) -> contextlib.AbstractContextManager[None]:
        """``device`` and ``stream`` current on the calling thread, for a ``with`` block."""

    def set_stream(self, stream: Any) -> None:
        """``stream`` (and its device) current on the calling thread, for the thread's life."""

    def new_event(self, *, blocking: bool = False, interprocess: bool = False) -> CudaEvent: ...

    def ipc_handle(self, event: CudaEvent) -> bytes:
        """The 64-byte ``cudaIpcEventHandle_t`` of an interprocess event (recorded once)."""

    def open_ipc_event(self, handle: bytes, device: torch.device) -> CudaEvent:
        """Another process's interprocess event (``cudaIpcOpenEventHandle``)."""

    def wait_event(self, stream: Any, event: CudaEvent) -> None:
        """``cudaStreamWaitEvent``: what is enqueued on ``stream`` from now on runs after the
        event's latest recording completed. Returns at once."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        """Page-locked host memory, uint8."""

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """Device memory, uint8."""

    def upload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A device copy of ``host``, enqueued on the current stream."""

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` without waiting, on the current stream (``src`` pinned)."""

    def synchronize(self, device: torch.device) -> None: ...

    def broken(self, device: torch.device) -> str | None:
        """Why the device's context is unusable (a sticky error), or None; may wait for the
        device. Called after a CUDA call failed, to tell a sticky error from one that is not."""

    def time_ms(self, fn: Callable[[], object], repeat: int) -> float | None:
        """The median milliseconds from an event recorded on the current stream before
        ``fn()`` to one recorded after it, each time on an idle stream (so a launch's host
        work counts too); waits for the device. None where work cannot be timed."""

    def capture(self, fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
        """``fn``'s work on the current stream captured once in a CUDA graph, without running
        it: the returned call launches the graph on the calling thread's current stream.
        Only this thread's calls are held to the capture's rules; waits for the device."""

    def free_cached(self, device: torch.device) -> None:
        """Give the memory torch holds cached back to the device (after a large scratch)."""


class TorchCuda:
    """``CudaApi`` through torch.cuda."""

    def set_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def new_stream(self, device: torch.device, priority: int) -> Any:
        return torch_cuda().Stream(device=device, priority=priority)

    @contextlib.contextmanager
    def use(self, device: torch.device, stream: Any) -> Iterator[None]:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            yield

    def set_stream(self, stream: Any) -> None:
        torch.cuda.set_stream(stream)

    def new_event(self, *, blocking: bool = False, interprocess: bool = False) -> CudaEvent:
        return torch_cuda().Event(blocking=blocking, interprocess=interprocess)

    def ipc_handle(self, event: CudaEvent) -> bytes:
        assert isinstance(event, torch.cuda.Event)
        return ipc_handle(event)

    def open_ipc_event(self, handle: bytes, device: torch.device) -> CudaEvent:
        return torch_cuda().Event.from_ipc_handle(device, handle)

    def wait_event(self, stream: Any, event: CudaEvent) -> None:
        stream.wait_event(event)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def upload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host.to(device)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def broken(self, device: torch.device) -> str | None:
        try:
            torch.cuda.synchronize(device)
        except RuntimeError as exc:  # torch.AcceleratorError too
            return str(exc)
        return None

    def time_ms(self, fn: Callable[[], object], repeat: int) -> float | None:
        start = torch_cuda().Event(enable_timing=True)
        end = torch_cuda().Event(enable_timing=True)
        times: list[float] = []
        for _ in range(repeat):
            torch.cuda.current_stream().synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
        return statistics.median(times)

    def capture(self, fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device):
            side = torch_cuda().Stream(device)
            # "thread_local": kvd's other threads (the executor launching, the waiter
            # synchronizing) go on; only this thread must not do what a capture forbids.
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                fn()
        replay: Callable[[], object] = graph.replay
        return replay

    def free_cached(self, device: torch.device) -> None:
        with torch.cuda.device(device):
            torch.cuda.empty_cache()


class IdRing:
    """Block ids on their way to the GPU: ``RING_SLOTS`` pinned host slots, each mirrored in
    device memory. A slot is written, copied to the device and read by launches on the lane's
    stream; an event recorded after those launches must complete before the slot is written
    again, so a slot is never overwritten while a copy or a launch still reads it. A slot taken
    by one thread (whose launch may be compiling for seconds) is not handed to another before
    its event is recorded. Nothing is allocated per launch. Use under ``Lane.launching()``."""

    def __init__(self, lane: Lane, slots: int = RING_SLOTS, slot_ids: int = RING_SLOT_IDS) -> None:
        self.lane = lane
        self.slots = slots
        self.slot_ids = slot_ids
        self._host: npt.NDArray[np.int32] | None = None
        self._host_tensor: torch.Tensor | None = None
        self._device: torch.Tensor | None = None
        self._events: list[CudaEvent | None] = [None] * slots
        self._busy = [False] * slots
        self._next = 0
        self._free = threading.Condition()

    def _allocate(self) -> None:
        api, n = self.lane.api, self.slots * self.slot_ids * 4
        self._host_tensor = api.pinned(n).view(torch.int32).view(self.slots, self.slot_ids)
        self._host = self._host_tensor.numpy()
        self._device = api.empty(n, self.lane.device).view(torch.int32)
        self._device = self._device.view(self.slots, self.slot_ids)

    def _take(self) -> int:
        with self._free:
            if self._device is None:
                self._allocate()
            while all(self._busy):
                self._free.wait()
            slot = self._next
            while self._busy[slot]:
                slot = (slot + 1) % self.slots
            self._next = (slot + 1) % self.slots
            self._busy[slot] = True
            return slot

    def _give_back(self, slot: int) -> None:
        with self._free:
            self._busy[slot] = False
            self._free.notify()

    @contextlib.contextmanager
    def slot(self, ids: npt.NDArray[np.int32]) -> Iterator[torch.Tensor]:
        """``ids`` on the device, for the launches of the ``with`` block."""
        if len(ids) > self.slot_ids:
            raise ValueError(f"{len(ids)} block ids do not fit a slot of {self.slot_ids}")
        slot = self._take()
        try:
            assert self._host is not None and self._host_tensor is not None
            assert self._device is not None
            event = self._events[slot]
            if event is not None:
                event.synchronize()  # normally long done: the ring holds several launches
            n = len(ids)
            self._host[slot, :n] = ids
            on_device = self._device[slot, :n]
            self.lane.api.copy_async(on_device, self._host_tensor[slot, :n])
            try:
                yield on_device
            finally:  # behind the copy and whatever was launched, even if a launch raised
                if event is None:
                    event = self._events[slot] = self.lane.api.new_event()
                event.record(self.lane.stream)
        finally:
            self._give_back(slot)


class Lane:
    """kvd's dedicated stream on one device, and what launches on it share: the id ring and
    the two-pass scratch. Several threads may enqueue (the executor; an attach worker warming
    up): the stream orders their work, and the ring never hands one slot to two of them."""

    def __init__(self, device: torch.device, priority: int = 0, api: CudaApi | None = None) -> None:
        self.device = device
        self.priority = priority
        self.api: CudaApi = api if api is not None else TorchCuda()
        self.stream = self.api.new_stream(device, priority)
        self.ids = IdRing(self)
        self._scratch: torch.Tensor | None = None
        self._entered = threading.local()
        self._markers: collections.OrderedDict[bytes, CudaEvent] = collections.OrderedDict()

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        """The lane's device and stream current on this thread, for enqueuing on the lane."""
        if getattr(self._entered, "yes", False):
            yield  # the executor's thread: current already, skip the context's cost
            return
        with self.api.use(self.device, self.stream):
            yield

    def enter(self) -> None:
        """Make the lane's device and stream current for the rest of the calling thread's life
        (kvd's own threads, which do nothing else with CUDA)."""
        self.api.set_device(self.device)
        self.api.set_stream(self.stream)
        self._entered.yes = True

    def upload(self, values: npt.NDArray[Any], dtype: torch.dtype) -> torch.Tensor:
        """``values`` on the device, enqueued on the lane's stream (under ``launching``)."""
        host = torch.from_numpy(np.array(values)).to(dtype)  # a copy: values may be read-only
        return self.api.upload(host, self.device)

    def scratch(self, nbytes: int) -> torch.Tensor:
        """At least ``nbytes`` of device memory, kept and reused (under ``launching``): work on
        the one stream is ordered, so each user starts after the last one finished, and memory
        replaced by a larger buffer is reused by the allocator only in that order too."""
        scratch = self._scratch
        if scratch is None or scratch.numel() < nbytes:
            scratch = self._scratch = self.api.empty(nbytes, self.device)
        return scratch

    def wait_for_markers(self, handles: Sequence[bytes]) -> list[CudaEvent]:
        """Make the stream wait, on the GPU, for each engine marker in ``handles`` (IPC event
        handles): kernels enqueued afterwards run once every one's latest recording completed.
        The executor's thread, under ``launching()``; never blocks the host.

        Returns the opened events: the caller holds them until the work enqueued behind them
        completed, so that one this lane stops caching is not destroyed under a pending wait.
        Raises ``MarkerError`` when a handle cannot be opened (the engine that recorded it is
        gone, or it is not an event of this device); the stream then waits on those before it.
        """
        waited = []
        for handle in dict.fromkeys(handles):  # one wait per distinct marker, in order
            event = self._markers.get(handle)
            if event is None:
                try:
                    event = self.api.open_ipc_event(handle, self.device)
                except RuntimeError as exc:
                    raise MarkerError(f"cudaIpcOpenEventHandle failed: {exc}") from exc
                self._markers[handle] = event
                while len(self._markers) > MARKERS_OPEN:
                    self._markers.popitem(last=False)
            else:
                self._markers.move_to_end(handle)
            self.api.wait_event(self.stream, event)
            waited.append(event)
        return waited

    def synchronize(self) -> None:
        self.api.synchronize(self.device)


_lanes: dict[torch.device, Lane] = {}
_lanes_lock = threading.Lock()


def lane_for(device: torch.device, priority: int | None = None) -> Lane:
    """The process's lane on ``device`` (a CUDA device with an index), made on first use with
    ``priority`` (default 0); a later different ``priority`` is refused."""
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"a CUDA device with an index is needed, got {device}")
    with _lanes_lock:
        lane = _lanes.get(device)
        if lane is None:
            lane = _lanes[device] = Lane(device, priority or 0)
        elif priority is not None and priority != lane.priority:
            raise ValueError(
                f"kvd's stream on {device} already has priority {lane.priority}, not {priority}"
            )
        return lane
