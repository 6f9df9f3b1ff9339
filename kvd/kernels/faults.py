"""What the kernels raise when memory or the device fails under them.

Apart from the kernels so the daemon's loop side catches them without importing torch, numpy
or Triton (``kvd serve`` reaches READY before those load).
"""

from __future__ import annotations

import signal


class MemoryFault(RuntimeError):
    """The kernel touched memory that is gone (SIGBUS: the engine truncated a shared-memory
    file kvd maps; SIGSEGV: unmapped). Pages of the call may be partly rewritten."""

    def __init__(self, signo: int, address: int) -> None:
        try:
            name = signal.Signals(signo).name
        except ValueError:
            name = f"signal {signo}"
        super().__init__(f"{name} at address {address:#x} while rewriting pages")
        self.signal = signo
        self.address = address


class DeviceFailed(RuntimeError):
    """The device's context is broken (a sticky CUDA error such as an illegal address): every
    later CUDA call fails, and what the work in flight wrote is unknown. Only a new process
    gets a new context."""


class MarkerError(Exception):
    """An engine's marker (``ReadDone.cuda_event``) that cannot be opened: the engine that
    recorded it is gone, or it is no event of this device. Nothing was enqueued behind it."""
