"""The calls into torch.cuda that torch leaves unannotated, typed as kvd makes them, so mypy
checks each call instead of a ``type: ignore`` hiding it. Both sides use it (the daemon's
``kvd.kernels.device``, the engine's ``kvd.cudaipc``); it imports torch.

Attributes are looked up on each call, so a test's stand-in for ``torch.cuda.Event`` is seen.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch


class _EventClass(Protocol):
    def __call__(
        self, *, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> torch.cuda.Event: ...

    def from_ipc_handle(self, device: torch.device, handle: bytes) -> torch.cuda.Event:
        """Another process's interprocess event (``cudaIpcOpenEventHandle``)."""


class _StreamClass(Protocol):
    def __call__(
        self, device: torch.device | None = None, priority: int = 0
    ) -> torch.cuda.Stream: ...


class TorchCudaModule(Protocol):
    """``torch.cuda``'s unannotated members kvd calls."""

    Event: _EventClass
    Stream: _StreamClass

    def init(self) -> None: ...


def torch_cuda() -> TorchCudaModule:
    return cast(TorchCudaModule, torch.cuda)


class _IpcEvent(Protocol):
    def ipc_handle(self) -> bytes: ...


def ipc_handle(event: torch.cuda.Event) -> bytes:
    """The 64-byte ``cudaIpcEventHandle_t`` of an interprocess event (recorded once)."""
    typed: _IpcEvent = event
    return bytes(typed.ipc_handle())


class _CudaStorage(Protocol):
    def _share_cuda_(self) -> tuple[Any, ...]: ...


def share_cuda(tensor: torch.Tensor) -> tuple[Any, ...]:
    """``UntypedStorage._share_cuda_()`` of the tensor's storage: (device, handle, size,
    offset, ...); the handle is a version byte, a kind byte, then the IPC handle."""
    storage: _CudaStorage = tensor.untyped_storage()
    return storage._share_cuda_()
