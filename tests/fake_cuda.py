"""Stand-ins for the CUDA calls kvd makes, so the CUDA path's thread and error discipline is
tested without a GPU: the runtime and driver libraries ``kvd.cudaipc`` loads with ctypes, and
``HostCuda``, a ``kvd.kernels.device.CudaApi`` over host memory.

Each records ``(call, thread name, the calling thread's current device)``; the current device
is per thread and starts at 0, as CUDA's does.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from typing import Any

import torch

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_INVALID_HANDLE = 400


class FakeRuntime:
    """What ``kvd.cudaipc._runtime()`` returns: libcudart's functions that kvd calls."""

    def __init__(self, base: int = 0x7F0000000000) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self.open_handles: dict[int, bytes] = {}
        self.closed: list[int] = []
        self.events: dict[int, bytes] = {}
        self._next = base
        self._local = threading.local()
        self._lock = threading.Lock()
        self.fail_open = CUDA_SUCCESS

    def device(self) -> int:
        return getattr(self._local, "device", 0)

    def _record(self, name: str) -> None:
        with self._lock:
            self.calls.append((name, threading.current_thread().name, self.device()))

    def called(self, name: str) -> list[tuple[str, int]]:
        """(thread name, device) of each call of ``name``."""
        with self._lock:
            return [(thread, device) for call, thread, device in self.calls if call == name]

    # -- libcudart ----------------------------------------------------------------------------

    def cudaSetDevice(self, index: int) -> int:
        self._local.device = index
        self._record("cudaSetDevice")
        return CUDA_SUCCESS

    def cudaDeviceSynchronize(self) -> int:
        self._record("cudaDeviceSynchronize")
        return CUDA_SUCCESS

    def cudaIpcOpenMemHandle(self, ptr: Any, handle: Any, flags: int) -> int:
        self._record("cudaIpcOpenMemHandle")
        if self.fail_open:
            return self.fail_open
        with self._lock:
            address = self._next
            self._next += 1 << 32
            self.open_handles[address] = bytes(handle.reserved)
        ptr._obj.value = address  # ptr is ctypes.byref(c_void_p)
        return CUDA_SUCCESS

    def cudaIpcCloseMemHandle(self, ptr: Any) -> int:
        self._record("cudaIpcCloseMemHandle")
        address = ptr.value if isinstance(ptr, ctypes.c_void_p) else int(ptr)
        with self._lock:
            if self.open_handles.pop(address, None) is None:
                return CUDA_ERROR_INVALID_VALUE
            self.closed.append(address)
        return CUDA_SUCCESS

    def cudaGetErrorString(self, err: int) -> bytes:
        return f"fake error {err}".encode()

    def cudaGetLastError(self) -> int:
        return CUDA_SUCCESS


class FakeDriver:
    """What ``kvd.cudaipc._driver()`` returns: ``cuMemGetAddressRange`` over the runtime's
    opened allocations, each ``size`` bytes (or the error ``fail`` when set)."""

    def __init__(self, runtime: FakeRuntime, size: int = 1 << 30) -> None:
        self.runtime = runtime
        self.size = size
        self.fail = CUDA_SUCCESS

    def cuMemGetAddressRange_v2(self, base: Any, size: Any, address: int) -> int:
        self.runtime._record("cuMemGetAddressRange")
        if self.fail:
            return self.fail
        base._obj.value = address
        size._obj.value = self.size
        return CUDA_SUCCESS


class FakeStream:
    def __init__(self, device: torch.device, priority: int, name: str) -> None:
        self.device = device
        self.priority = priority
        self.name = name

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, api: HostCuda, interprocess: bool, blocking: bool) -> None:
        self.api = api
        self.interprocess = interprocess
        self.blocking = blocking
        self.recorded_on: FakeStream | None = None
        self.fail: BaseException | None = None
        """Raised by ``synchronize``: an asynchronous CUDA error surfacing."""
        self.handle = b""
        """The IPC handle it was opened from (``open_ipc_event``)."""

    def record(self, stream: Any) -> None:
        self.api.note("record")
        self.recorded_on = stream

    def synchronize(self) -> None:
        self.api.note("event.synchronize")
        gate = self.api.hold_completion
        if self.blocking and gate is not None:
            assert gate.wait(30), "the test never let the GPU work complete"
        if self.fail is not None:
            raise self.fail

    def query(self) -> bool:
        return True


class HostCuda:
    """``kvd.kernels.device.CudaApi`` over host memory: "device" tensors are CPU tensors (so
    Triton's interpreter can run kvd's kernels on them), copies are immediate, events are done
    at once. Each thread's current device (0 at first) and stream are tracked, and every call
    is noted with them: ``notes`` holds (call, thread name, device index, stream name)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self.notes: list[tuple[str, str, int, str]] = []
        self.events: list[FakeEvent] = []
        self.broken_reason: str | None = None
        """What ``broken`` answers: the context's sticky error."""
        self.fail_next_event: BaseException | None = None
        """Raised by the next completion event's ``synchronize``: an asynchronous error."""
        self.pinned_bytes = 0
        self.waits: list[tuple[FakeStream, FakeEvent]] = []
        """(stream, event) of each ``wait_event``, in order."""
        self.hold_completion: threading.Event | None = None
        """When set, a job's completion event completes only once this is set."""
        self.unopenable: set[bytes] = set()
        """IPC event handles ``open_ipc_event`` refuses, as CUDA does a dead process's."""

    # -- what the thread has current --------------------------------------------------------

    def current(self) -> tuple[int, str]:
        stream = getattr(self._local, "stream", None)
        return getattr(self._local, "device", 0), stream.name if stream else "default"

    def note(self, call: str) -> None:
        device, stream = self.current()
        with self._lock:
            self.notes.append((call, threading.current_thread().name, device, stream))

    def noted(self, call: str) -> list[tuple[str, int, str]]:
        with self._lock:
            return [(t, d, s) for c, t, d, s in self.notes if c == call]

    # -- CudaApi ------------------------------------------------------------------------------

    def set_device(self, device: torch.device) -> None:
        self._local.device = device.index or 0
        self.note("set_device")

    def new_stream(self, device: torch.device, priority: int) -> Any:
        return FakeStream(device, priority, f"kvd{device.index}")

    @contextlib.contextmanager
    def use(self, device: torch.device, stream: Any) -> Iterator[None]:
        saved = (getattr(self._local, "device", 0), getattr(self._local, "stream", None))
        self._local.device, self._local.stream = device.index or 0, stream
        try:
            yield
        finally:
            self._local.device, self._local.stream = saved

    def set_stream(self, stream: Any) -> None:
        self._local.device, self._local.stream = stream.device.index or 0, stream

    def new_event(self, *, blocking: bool = False, interprocess: bool = False) -> FakeEvent:
        event = FakeEvent(self, interprocess, blocking)
        if blocking and self.fail_next_event is not None:  # a job's completion event
            event.fail, self.fail_next_event = self.fail_next_event, None
        with self._lock:
            self.events.append(event)
        return event

    def ipc_handle(self, event: Any) -> bytes:
        return id(event).to_bytes(8, "little") * 8

    def open_ipc_event(self, handle: bytes, device: torch.device) -> FakeEvent:
        self.note("open_ipc_event")
        if handle in self.unopenable:
            raise RuntimeError("CUDA error: invalid resource handle")
        event = FakeEvent(self, interprocess=True, blocking=False)
        event.handle = handle
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        self.note("wait_event")
        self.waits.append((stream, event))

    def pinned(self, nbytes: int) -> torch.Tensor:
        self.pinned_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8)

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def upload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.note("upload")
        return host.clone()

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.note("copy_async")
        dst.copy_(src)

    def synchronize(self, device: torch.device) -> None:
        self.note("synchronize")

    def broken(self, device: torch.device) -> str | None:
        self.note("broken")
        return self.broken_reason

    def time_ms(self, fn: Any, repeat: int) -> float | None:
        return None  # host work says nothing of a GPU's

    def capture(self, fn: Any, device: torch.device) -> Any:
        """As a graph: nothing runs now; each call of the result runs ``fn`` on the calling
        thread (under Triton's interpreter, the kernels on host memory)."""
        self.note("capture")
        return fn

    def free_cached(self, device: torch.device) -> None:
        self.note("free_cached")


class EngineEvent:
    """A stand-in for the engine's ``torch.cuda.Event(interprocess=True)``."""

    def __init__(self, engine: EngineCuda, interprocess: bool = False) -> None:
        assert interprocess, "a marker must be an interprocess event"
        self.engine = engine
        self.recorded_on: list[object] = []
        self.number = len(engine.events)
        engine.events.append(self)

    def record(self, stream: object = None) -> None:
        self.recorded_on.append(stream)
        self.engine.calls.append(("record", self.number, stream))

    def ipc_handle(self) -> bytes:
        assert self.recorded_on, "torch creates the event at its first record"
        return bytes([self.number % 256]) * 64


class EngineCuda:
    """``torch.cuda.Event`` and ``torch.cuda.current_stream`` as the engine side uses them
    (``kvd.cudaipc.HandOffMarkers``), installed with ``install(monkeypatch)``: events are
    numbered as made, every record is noted with the stream, and the current stream is
    ``current``."""

    def __init__(self) -> None:
        self.events: list[EngineEvent] = []
        self.calls: list[tuple[str, int, object]] = []
        self.current: object = "compute-stream"

    def install(self, monkeypatch: Any) -> None:
        monkeypatch.setattr(torch.cuda, "Event", lambda **kw: EngineEvent(self, **kw))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
