"""Stand-ins for the CUDA calls kvd makes, so the CUDA path's thread and error discipline is
tested without a GPU: the runtime and driver libraries ``kvd.cudaipc`` loads with ctypes.

Each records ``(call, thread name, the calling thread's current device)``; the current device
is per thread and starts at 0, as CUDA's does.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

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
