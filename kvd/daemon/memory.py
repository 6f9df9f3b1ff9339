"""Opening the engine's memory: POSIX shared memory on CPU, CUDA IPC handles on GPU.

kvd writes into what it opens, so opening is where trust is checked. A shared-memory name is
opened with ``O_NOFOLLOW`` inside ``/dev/shm`` only, must be a regular file owned by kvd's user
or by one of kvd's groups, and is mapped from that same descriptor (no second lookup by path
that a rename could redirect). It must be fully allocated: /dev/shm is RAM, and kvd's writes to
a sparse file's holes would allocate RAM the engine never reserved (a whole cache's worth, as
kvd faults its pages in at Attach). The descriptor stays open, so a segment the engine shrinks,
or punches holes in, after Attach is noticed before kvd touches it (``unusable``) instead of
killing kvd with SIGBUS or allocating.

Every tensor also gets its *backing span*: (what it lives in, first byte, end byte). The registry
refuses two tensors whose spans overlap, so no byte is ever rewritten through two names.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvd.protocol import SHM_DIR, CudaIpcRef, Reason, ShmRef

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_SHM_NAME = re.compile(r"^[A-Za-z0-9._-]{1,255}$")


class AttachError(Exception):
    """An Attach that cannot be honoured; ``code`` is a ``Reason`` for the Error reply."""

    def __init__(self, code: Reason, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


Backing = tuple[object, ...]
"""What a tensor's bytes live in: ("shm", st_dev, st_ino) or ("cuda", device uuid, handle)."""


@dataclass(frozen=True, slots=True)
class Span:
    backing: Backing
    start: int
    end: int

    def overlaps(self, other: Span) -> bool:
        return self.backing == other.backing and self.start < other.end and other.start < self.end


class SharedSegment:
    """One ``/dev/shm`` file, opened once per Attach and mapped whole, read-write."""

    def __init__(self, name: str, where: str) -> None:
        if not _SHM_NAME.match(name) or name in (".", ".."):
            raise AttachError(
                Reason.INVALID_CACHE,
                f"{where}.memory.name: {name!r} is not a shared-memory name "
                "(letters, digits, '.', '_', '-'; no '/')",
            )
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(self.path, flags)
        except OSError as exc:
            why = "a symbolic link" if exc.errno == 40 else exc.strerror  # ELOOP
            raise AttachError(
                Reason.MEMORY_UNAVAILABLE, f"{where}.memory: cannot open {self.path}: {why}"
            ) from exc
        try:
            st = os.fstat(fd)
            self._map = _map_trusted(fd, st, f"{where}.memory: {self.path}")
        except BaseException:
            os.close(fd)
            raise
        self.size = st.st_size
        self.backing: Backing = ("shm", st.st_dev, st.st_ino)
        self.fd = fd
        import torch  # here, not at the top: the registry imports this module before READY

        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def tensor(self, offset: int, nbytes: int, where: str) -> torch.Tensor:
        end = offset + nbytes
        if self.size < end:
            raise AttachError(
                Reason.MEMORY_UNAVAILABLE,
                f"{where}.memory: {self.path} holds {self.size} bytes, the tensor needs bytes "
                f"{offset}..{end}",
            )
        return self.bytes[offset:end]

    def unusable(self, end: int) -> str | None:
        """Why bytes ``[0, end)`` can no longer be touched (the file is smaller now, or some of
        its pages were freed), or None."""
        try:
            st = os.fstat(self.fd)
        except OSError as exc:
            return f"{self.path}: fstat failed: {exc.strerror}"
        if st.st_size < end:
            problem = (
                f"{self.path} shrank to {st.st_size} bytes after Attach; the cache needs {end}"
            )
        elif sparse := _sparse(st):
            problem = f"{self.path} {sparse} after Attach"
        else:
            return None
        return f"{problem}: its blocks were not touched, detach it and attach again"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _map_trusted(fd: int, st: os.stat_result, where: str) -> mmap.mmap:
    """Map the whole file behind ``fd`` if kvd may write it: a regular, non-empty file owned by
    kvd's user or by one of its groups."""
    if not stat.S_ISREG(st.st_mode):
        raise AttachError(Reason.MEMORY_UNAVAILABLE, f"{where} is not a regular file")
    if st.st_uid != os.geteuid() and st.st_gid not in {os.getegid(), *os.getgroups()}:
        raise AttachError(
            Reason.MEMORY_UNAVAILABLE,
            f"{where} belongs to uid {st.st_uid} and gid {st.st_gid}, neither kvd's user nor "
            "one of its groups",
        )
    if st.st_size == 0:
        raise AttachError(Reason.MEMORY_UNAVAILABLE, f"{where} is empty")
    sparse = _sparse(st)
    if sparse:
        raise AttachError(
            Reason.MEMORY_UNAVAILABLE,
            f"{where} {sparse}: kvd's writes would allocate the rest, RAM the engine never "
            "reserved; allocate the whole file (posix_fallocate, or write every page) before "
            "Attach",
        )
    return mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def _sparse(st: os.stat_result) -> str | None:
    """What part of the file is not allocated (its holes, as /dev/shm counts them), or None.

    Only the total is known (``st_blocks``), not where: a file is whole when it has as many
    bytes allocated as it is long.
    """
    allocated = st.st_blocks * 512
    if allocated >= st.st_size:
        return None
    return f"is sparse: {allocated} of its {st.st_size} bytes are allocated"


class Opener:
    """Opens the memory of one Attach: each shm segment and CUDA allocation once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.segments: dict[str, SharedSegment] = {}
        self._cuda: dict[bytes, Any] = {}

    def open(
        self, memory: ShmRef | CudaIpcRef, nbytes: int, where: str
    ) -> tuple[torch.Tensor, Span]:
        """The tensor's bytes (uint8) and its backing span."""
        if isinstance(memory, ShmRef):
            if self.device.type != "cpu":
                raise AttachError(
                    Reason.INVALID_CACHE,
                    f"{where}.memory: shared memory needs a CPU daemon; this kvd runs on "
                    f"{self.device}, attach with a cuda_ipc handle",
                )
            segment = self.segments.get(memory.name)
            if segment is None:
                segment = self.segments[memory.name] = SharedSegment(memory.name, where)
            raw = segment.tensor(memory.offset, nbytes, where)
            return raw, Span(segment.backing, memory.offset, memory.offset + nbytes)
        raw = self._open_cuda_ipc(memory, nbytes, where)
        backing = ("cuda", memory.device_uuid, bytes(memory.handle))
        return raw, Span(backing, memory.offset, memory.offset + nbytes)

    def close(self) -> None:
        for segment in self.segments.values():
            segment.close()

    def _open_cuda_ipc(self, memory: CudaIpcRef, nbytes: int, where: str) -> torch.Tensor:
        if self.device.type != "cuda":
            raise AttachError(
                Reason.INVALID_CACHE,
                f"{where}.memory: cuda_ipc memory needs a daemon started with --device cuda",
            )
        from kvd import cudaipc

        problem = cudaipc.check_handle(memory, where)
        if problem:
            raise AttachError(Reason.INVALID_CACHE, problem)
        mine = cudaipc.device_uuid(self.device)
        if memory.device_uuid and not cudaipc.same_device(memory.device_uuid, mine):
            raise AttachError(
                Reason.INVALID_CACHE,
                f"{where}.memory.device_uuid: the tensor is on {memory.device_uuid}, this kvd "
                f"serves {mine} ({self.device})",
            )
        try:
            mapping = self._cuda.get(memory.handle)
            if mapping is None:
                mapping = self._cuda[memory.handle] = cudaipc.IpcMapping(memory, self.device)
            result: torch.Tensor = mapping.tensor(memory.offset, nbytes)
            return result
        except cudaipc.CudaIpcError as exc:
            raise AttachError(Reason.MEMORY_UNAVAILABLE, f"{where}.memory: {exc}") from exc
