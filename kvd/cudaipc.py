"""CUDA IPC: the engine exports its KV tensors, kvd maps them, without torch's private IPC path.

The wire carries the raw 64-byte ``cudaIpcMemHandle_t`` of the allocation that holds a tensor,
the tensor's byte offset in it, and the GPU's UUID, so any language can produce it and a
different ``CUDA_VISIBLE_DEVICES`` in the two processes cannot point kvd at the wrong GPU.

PyTorch's caching allocator hands out such handles through ``UntypedStorage._share_cuda_()``
(version byte, kind byte, then the handle). Memory from expandable segments (kind ``e``), from
``cudaMallocAsync`` or from vLLM's sleep-mode allocator is virtual memory that
``cudaIpcGetMemHandle`` cannot export: ``export_tensor`` refuses it with an explanation, and kvd
answers an Attach carrying anything but a 64-byte handle with ``invalid_cache``.

With kvd's ``ready_cuda_event`` setting, a ``Ready`` carries the handle of an interprocess CUDA
event instead of waiting for the GPU: ``wait_event`` makes the engine's stream wait for it.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import queue
import threading
from typing import Any

import torch

from kvd.protocol import CUDA_IPC_HANDLE_BYTES, CudaIpcRef
from kvd.torch_cuda import ipc_handle, share_cuda, torch_cuda

log = logging.getLogger(__name__)

HANDLE_BYTES = CUDA_IPC_HANDLE_BYTES
_LAZY_ENABLE_PEER_ACCESS = 1
_KIND_LEGACY = ord("c")
_KIND_EXPANDABLE = ord("e")


class CudaIpcError(Exception):
    """A tensor that cannot be exported, or a handle that cannot be opened."""


def device_uuid(device: torch.device) -> str:
    """``GPU-<uuid>``, as nvidia-smi prints it."""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def same_device(uuid_a: str, uuid_b: str) -> bool:
    def norm(u: str) -> str:
        return u.lower().removeprefix("gpu-")

    return norm(uuid_a) == norm(uuid_b)


def export_tensor(tensor: torch.Tensor) -> CudaIpcRef:
    """The memory reference of a CUDA tensor for an Attach (engine side).

    The tensor must stay allocated for as long as kvd has it attached.
    """
    if tensor.device.type != "cuda":
        raise CudaIpcError(f"export_tensor needs a CUDA tensor, got {tensor.device}")
    shared = share_cuda(tensor)
    handle, storage_offset = shared[1], shared[3]
    if handle is None:
        raise CudaIpcError("an empty tensor has no memory to export")
    handle = bytes(handle)
    if len(handle) == HANDLE_BYTES + 2 and handle[1] == _KIND_LEGACY:
        handle = handle[2:]
    elif len(handle) >= 2 and handle[1] == _KIND_EXPANDABLE:
        raise CudaIpcError(
            "this tensor lives in an expandable segment (PYTORCH_CUDA_ALLOC_CONF / "
            "PYTORCH_ALLOC_CONF has expandable_segments:True), which cudaIpcGetMemHandle cannot "
            "export; allocate the KV cache with expandable_segments:False"
        )
    elif len(handle) != HANDLE_BYTES:
        raise CudaIpcError(f"unexpected CUDA IPC handle format ({len(handle)} bytes)")
    offset = storage_offset + tensor.storage_offset() * tensor.element_size()
    return CudaIpcRef(handle=handle, offset=offset, device_uuid=device_uuid(tensor.device))


def check_handle(ref: CudaIpcRef, where: str) -> str | None:
    """None if ``ref.handle`` can be a cudaIpcMemHandle_t, else why not."""
    handle = ref.handle
    if len(handle) == HANDLE_BYTES:
        return None
    if len(handle) >= 2 and handle[1] == _KIND_EXPANDABLE:
        return (
            f"{where}.memory.handle: a PyTorch expandable-segment handle; such allocations cannot "
            "be exported with CUDA IPC: allocate the KV cache with expandable_segments:False"
        )
    return f"{where}.memory.handle: must be a 64-byte cudaIpcMemHandle_t, got {len(handle)} bytes"


EVENTS_CACHED = 256
"""Opened kvd events kept per engine process (kvd reuses a small pool of them)."""
_events: collections.OrderedDict[tuple[int, bytes], torch.cuda.Event] = collections.OrderedDict()
_events_lock = threading.Lock()


def wait_event(handle: bytes, stream: torch.cuda.Stream | None = None) -> None:
    """Make ``stream`` (default: the current stream) wait, on the GPU, for the post-process a
    kvd ``Ready`` with ``cuda_event`` announced (engine side; ``cudaStreamWaitEvent``).

    Returns at once; work enqueued on ``stream`` afterwards runs once kvd's kernels are done.
    ``stream`` must be on the GPU kvd serves (the one the blocks are on). Each handle is opened
    once (``cudaIpcOpenEventHandle``) and kept: kvd reuses a small pool of events. Call
    ``forget_events`` when kvd restarts (a new ``epoch``): the old handles are dead.
    """
    if len(handle) != HANDLE_BYTES:
        raise CudaIpcError(
            f"cuda_event: a 64-byte cudaIpcEventHandle_t is needed, got {len(handle)}"
        )
    stream = stream if stream is not None else torch.cuda.current_stream()
    key = (stream.device_index, bytes(handle))
    with _events_lock:
        event = _events.get(key)
        if event is None:
            event = torch_cuda().Event.from_ipc_handle(stream.device, handle)
            _events[key] = event
            while len(_events) > EVENTS_CACHED:
                _events.popitem(last=False)
        else:
            _events.move_to_end(key)
    stream.wait_event(event)


def forget_events() -> None:
    """Drop the kvd events ``wait_event`` opened (after kvd restarted)."""
    with _events_lock:
        _events.clear()


MARKERS_MAX = 1024
"""Hand-off markers an engine process keeps at most (``HandOffMarkers``)."""


class HandOffMarkers:
    """Engine side: the markers a ``ReadDone`` carries as ``cuda_event``, the other direction
    of the ordering. kvd's stream waits on a marker before its first write to the request's
    blocks, so kvd's writes come after everything the engine's stream had enqueued at the
    hand-off (a kernel of an earlier step still reading those blocks for another request).

    ``record`` records an interprocess event on the engine's stream (one per step suffices:
    every request handed off in that step carries the same marker); ``carry``/``drop`` count
    the requests holding it. A marker is recorded again only once no request carries it any
    more, that is once each one's Ready or Failed arrived (kvd enqueued its wait by then, or
    never will), and its event is destroyed only with this object (after kvd detached the
    cache). So at most ``limit`` events exist: one per step whose requests are all still
    waiting for kvd. Never waits on the GPU: event records and handle reads only.
    """

    def __init__(self, limit: int = MARKERS_MAX) -> None:
        self.limit = limit
        self._events: dict[bytes, torch.cuda.Event] = {}
        self._carriers: dict[bytes, int] = {}
        self._free: list[bytes] = []

    def record(self, stream: torch.cuda.Stream | None = None) -> bytes | None:
        """A marker recorded now on ``stream`` (default: the current stream), carried by no
        request yet; None when ``limit`` markers are all carried (the caller must not hand
        the blocks to kvd then: recompute them)."""
        stream = stream if stream is not None else torch.cuda.current_stream()
        if self._free:
            handle = self._free.pop()
            self._events[handle].record(stream)
        elif len(self._events) < self.limit:
            event = torch_cuda().Event(interprocess=True)
            event.record(stream)  # creates it, on the stream's device
            handle = ipc_handle(event)
            self._events[handle] = event
        else:
            return None
        self._carriers[handle] = 0
        return handle

    def carry(self, handle: bytes) -> None:
        """One more request carries ``handle`` (sent, or to be sent, in its ReadDone)."""
        self._carriers[handle] += 1

    def drop(self, handle: bytes) -> None:
        """A request that carried ``handle`` was answered (or given up on): when it was the
        last, the marker may be recorded again."""
        left = self._carriers[handle] - 1
        if left:
            self._carriers[handle] = left
        else:
            del self._carriers[handle]
            self._free.append(handle)

    @property
    def carried(self) -> int:
        """Markers some request still carries."""
        return len(self._carriers)


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * HANDLE_BYTES)]


@functools.cache
def _runtime() -> Any:
    """The CUDA runtime library torch itself loaded (found in this process's mappings)."""
    torch_cuda().init()
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    if not paths:
        raise CudaIpcError("cannot find the CUDA runtime (libcudart) torch loaded")
    lib = ctypes.CDLL(sorted(paths)[0])
    lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]
    lib.cudaIpcOpenMemHandle.restype = ctypes.c_int
    lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
    lib.cudaIpcCloseMemHandle.restype = ctypes.c_int
    lib.cudaGetErrorString.argtypes = [ctypes.c_int]
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    lib.cudaGetLastError.restype = ctypes.c_int
    lib.cudaSetDevice.argtypes = [ctypes.c_int]
    lib.cudaSetDevice.restype = ctypes.c_int
    lib.cudaDeviceSynchronize.restype = ctypes.c_int
    return lib


@functools.cache
def _driver() -> Any:
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/libcuda.so" in line}
    try:
        lib = ctypes.CDLL(sorted(paths)[0] if paths else "libcuda.so.1")
    except OSError as exc:
        raise CudaIpcError(f"cannot load the CUDA driver library (libcuda): {exc}") from exc
    lib.cuMemGetAddressRange_v2.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    ]
    lib.cuMemGetAddressRange_v2.restype = ctypes.c_int
    return lib


class IpcMapping:
    """One opened allocation (kvd's side); closed when the last tensor viewing it is gone.

    Opening sets the calling thread's current device to ``device``. The allocation's extent is
    asked of the driver, and a mapping whose extent is unknown is refused: kvd writes through
    it, so a bound it cannot check is a bound it must not assume. Closing waits until kvd's work
    on the device is done, on a thread of its own (``_Closer``), whichever thread drops the last
    reference: the event loop must never wait on the GPU.
    """

    def __init__(self, ref: CudaIpcRef, device: torch.device) -> None:
        lib = _runtime()
        index = _index(device)
        handle = _IpcHandle.from_buffer_copy(ref.handle)
        ptr = ctypes.c_void_p()
        _check(lib, lib.cudaSetDevice(index), "cudaSetDevice")
        err = lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), handle, _LAZY_ENABLE_PEER_ACCESS)
        if err:
            lib.cudaGetLastError()  # clear it, or torch reports it later in an unrelated call
            raise CudaIpcError(
                f"cudaIpcOpenMemHandle failed: {lib.cudaGetErrorString(err).decode()} ({err}); "
                "the exporting process must be alive and on the same GPU"
            )
        address = int(ptr.value or 0)
        try:
            self.nbytes = _extent(address)
        except CudaIpcError:
            lib.cudaIpcCloseMemHandle(ctypes.c_void_p(address))  # nothing of kvd's used it yet
            raise
        self.ptr = address
        self.device = device
        self._lib = lib

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over ``nbytes`` from ``offset``; it keeps this mapping open."""
        if offset + nbytes > self.nbytes:
            raise CudaIpcError(
                f"the allocation holds {self.nbytes} bytes, the tensor needs bytes "
                f"{offset}..{offset + nbytes}"
            )
        view = _ArrayInterface(self, self.ptr + offset, nbytes)
        out = torch.as_tensor(view, device=self.device)
        if out.data_ptr() != self.ptr + offset:
            raise CudaIpcError("torch copied the mapped memory instead of viewing it")
        return out

    def __del__(self) -> None:
        if getattr(self, "ptr", 0):
            _closer.close_later(self._lib, self.ptr, _index(self.device))
            self.ptr = 0


def _index(device: torch.device) -> int:
    if device.type != "cuda" or device.index is None:
        raise CudaIpcError(f"a CUDA device with an index is needed, got {device}")
    return device.index


def _check(lib: Any, err: int, call: str) -> None:
    if err:
        raise CudaIpcError(f"{call} failed: {lib.cudaGetErrorString(err).decode()} ({err})")


def _extent(address: int) -> int:
    """Bytes from ``address`` (where an IPC mapping starts) to the end of its allocation."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    err = _driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), address)
    end = int(base.value) + int(size.value)
    if err or not base.value <= address < end:
        raise CudaIpcError(
            f"cuMemGetAddressRange failed ({err}) for the opened handle: the size of the "
            "engine's allocation is unknown, so the tensors' bounds in it cannot be checked"
        )
    return end - address


class _Closer:
    """Closes IPC mappings on a thread of its own, each once kvd's work on its device is done.

    ``close_later`` never blocks (it may run on the event loop, in a finaliser). The thread
    sets its current device, waits for the device (``cudaDeviceSynchronize``: every stream of
    kvd's, so no launch can still use the mapping), then closes the handle.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, int, int]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def close_later(self, lib: Any, ptr: int, index: int) -> None:
        self._queue.put((lib, ptr, index))
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="kvd-cuda-ipc-close", daemon=True
                    )
                    self._thread.start()

    def _run(self) -> None:
        while True:
            lib, ptr, index = self._queue.get()
            # All three calls are made whatever the others return: a handle is closed even
            # when the device reports an error (its context may be gone).
            for call, err in (
                ("cudaSetDevice", lib.cudaSetDevice(index)),
                ("cudaDeviceSynchronize", lib.cudaDeviceSynchronize()),
                ("cudaIpcCloseMemHandle", lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr))),
            ):
                if err:
                    log.error(
                        "closing the CUDA IPC mapping at %#x: %s failed: %s (%d)",
                        ptr,
                        call,
                        lib.cudaGetErrorString(err).decode(),
                        err,
                    )


_closer = _Closer()


class _ArrayInterface:
    """What ``torch.as_tensor`` needs to view device memory; holds the mapping alive."""

    def __init__(self, mapping: IpcMapping, ptr: int, nbytes: int) -> None:
        self.mapping = mapping
        self.__cuda_array_interface__ = {
            "version": 3,
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
        }
