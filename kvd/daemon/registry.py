"""Attached KV caches: opens the engine's tensors (shared memory on CPU, CUDA IPC on GPU).

The registry owns the only references kvd holds to engine memory. Opening happens off the event
loop (``Registry.open`` runs in a worker thread); lookups are plain dict reads.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from kvd.dtypes import torch_dtype
from kvd.kernels import CachePostProcess, region_views
from kvd.layout.formats import FormatError, axes, legacy_remote_format
from kvd.layout.geometry import GeometryError, TensorGeometry, cache_geometry
from kvd.protocol import Attach, CudaIpcRef, Layout, PageFormat, Reason, ShmRef, TensorSpec
from kvd.shm import SHM_DIR

log = logging.getLogger(__name__)

_SHM_NAME = re.compile(r"^[A-Za-z0-9._-]{1,255}$")


class AttachError(Exception):
    """An Attach that cannot be honoured; ``code`` is a ``Reason`` for the Error reply."""

    def __init__(self, code: Reason, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True)
class AttachedTensor:
    spec: TensorSpec
    geometry: TensorGeometry
    tensor: torch.Tensor
    """The engine's tensor in its physical shape and dtype."""


@dataclass(frozen=True, eq=False)
class Rewrite:
    """One kernel pass of a batch: the post-process of the cache's tensors of one page format,
    from the remote format and block size the batch's notifications name."""

    postprocess: CachePostProcess
    remote: PageFormat
    remote_block_size: int

    def apply(self, block_ids: list[int]) -> None:
        self.postprocess.apply([(block_ids, 0)], self.remote, self.remote_block_size)


@dataclass(slots=True)
class AttachedCache:
    cache_id: str
    tensors: list[AttachedTensor]
    num_blocks: int
    block_size: int
    device: torch.device
    postprocesses: dict[PageFormat, CachePostProcess] = field(default_factory=dict)
    """The post-process of the cache's tensors, one per local page format."""
    _rewrites: dict[tuple[int, str], list[Rewrite]] = field(default_factory=dict)

    def legacy_layout_problem(self, remote_layout: Layout) -> str | None:
        """Why a legacy ``remote_layout`` names no remote format for this cache, or None."""
        try:
            for local in self.postprocesses:
                _legacy_remote(local, remote_layout)
        except FormatError as exc:
            return f"remote_layout: {exc}; send remote_format instead"
        return None

    def groups(self, ratio: int, remote_layout: str) -> list[Rewrite]:
        """The kernel passes a request under (ratio, remote_layout) needs; [] = no work.

        Memoised per cache, so requests reuse the prepared launches.
        """
        key = (ratio, remote_layout)
        known = self._rewrites.get(key)
        if known is None:
            remote_block_size = self.block_size // ratio
            known = []
            for local, postprocess in self.postprocesses.items():
                remote = _legacy_remote(local, cast(Layout, remote_layout))
                if postprocess.needs_work(remote, remote_block_size):
                    known.append(Rewrite(postprocess, remote, remote_block_size))
            self._rewrites[key] = known
        return known

    def needs_work(self, ratio: int, remote_layout: str) -> bool:
        return bool(self.groups(ratio, remote_layout))

    @property
    def nbytes(self) -> int:
        return sum(t.geometry.nbytes for t in self.tensors)

    @property
    def work_bytes(self) -> int:
        """Bytes of one block id across every region of the cache."""
        return sum(p.block_bytes for p in self.postprocesses.values())


def _legacy_remote(local: PageFormat, remote_layout: Layout) -> PageFormat:
    """The remote format a legacy ``remote_layout`` means; MLA pages have no H/N order."""
    if "H" not in axes(local) and local.regions != "head":
        return local
    return legacy_remote_format(local, remote_layout)


class Registry:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._caches: dict[str, AttachedCache] = {}

    def get(self, cache_id: str) -> AttachedCache | None:
        return self._caches.get(cache_id)

    def __contains__(self, cache_id: str) -> bool:
        return cache_id in self._caches

    def __len__(self) -> int:
        return len(self._caches)

    def caches(self) -> list[AttachedCache]:
        return list(self._caches.values())

    def open(self, request: Attach) -> AttachedCache:
        """Check and open an Attach's tensors (blocking I/O: call from a worker thread).

        The result is not registered yet: ``add`` does that on the event loop, so a cache id
        becomes visible atomically with respect to ingest.
        """
        if not request.cache_id:
            raise AttachError(Reason.INVALID_CACHE, "cache_id: must not be empty")
        try:
            geometries = cache_geometry(request.tensors)
        except GeometryError as exc:
            raise AttachError(Reason.INVALID_CACHE, str(exc)) from exc
        mappings: dict[bytes, Any] = {}  # one CUDA IPC mapping per allocation
        tensors = [
            AttachedTensor(
                spec, geometry, self._open_tensor(spec, geometry, f"tensors[{i}]", mappings)
            )
            for i, (spec, geometry) in enumerate(zip(request.tensors, geometries, strict=True))
        ]
        cache = AttachedCache(
            cache_id=request.cache_id,
            tensors=tensors,
            num_blocks=geometries[0].num_blocks,
            block_size=geometries[0].block_size,
            device=self.device,
            postprocesses=_postprocesses(tensors, self.device),
        )
        if self.device.type == "cuda":
            warm_up(cache)
        return cache

    def add(self, cache: AttachedCache) -> None:
        if cache.cache_id in self._caches:
            raise AttachError(Reason.CACHE_EXISTS, f"cache {cache.cache_id!r} is already attached")
        self._caches[cache.cache_id] = cache

    def remove(self, cache_id: str) -> AttachedCache:
        return self._caches.pop(cache_id)

    def _open_tensor(
        self, spec: TensorSpec, geometry: TensorGeometry, where: str, mappings: dict[bytes, Any]
    ) -> torch.Tensor:
        memory = spec.memory
        if isinstance(memory, ShmRef):
            if self.device.type != "cpu":
                raise AttachError(
                    Reason.INVALID_CACHE,
                    f"{where}.memory: shared memory needs a CPU daemon; this kvd runs on "
                    f"{self.device}, attach with a cuda_ipc handle",
                )
            raw = open_shm(memory, geometry.nbytes, where)
        elif isinstance(memory, CudaIpcRef):
            raw = self._open_cuda_ipc(memory, geometry.nbytes, where, mappings)
        dtype = torch_dtype(spec.dtype)
        if memory.offset % dtype.itemsize:
            raise AttachError(
                Reason.INVALID_CACHE,
                f"{where}.memory.offset: {memory.offset} is not a multiple of the {spec.dtype} "
                f"item size {dtype.itemsize}",
            )
        return raw.view(dtype).view(spec.shape)

    def _open_cuda_ipc(
        self, memory: CudaIpcRef, nbytes: int, where: str, mappings: dict[bytes, Any]
    ) -> torch.Tensor:
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
            mapping = mappings.get(memory.handle)
            if mapping is None:
                mapping = mappings[memory.handle] = cudaipc.IpcMapping(memory, self.device)
            return mapping.tensor(memory.offset, nbytes)
        except cudaipc.CudaIpcError as exc:
            raise AttachError(Reason.MEMORY_UNAVAILABLE, f"{where}.memory: {exc}") from exc


def warm_up(cache: AttachedCache) -> None:
    """Compile the CUDA kernels for this cache's formats now, not on its first request.

    Runs each kernel on scratch pages, never on the engine's memory.
    """
    for local, postprocess in cache.postprocesses.items():
        for ratio in (1, 2):
            if cache.block_size % ratio == 0 and "H" in axes(local):
                remote = legacy_remote_format(local, "HND")
                postprocess.warm_up(remote, cache.block_size // ratio)
    torch.cuda.synchronize(cache.device)


def open_shm(memory: ShmRef, nbytes: int, where: str = "memory") -> torch.Tensor:
    """Map ``nbytes`` of ``/dev/shm/<name>`` from ``memory.offset`` as a shared uint8 tensor."""
    if not _SHM_NAME.match(memory.name) or memory.name in (".", ".."):
        raise AttachError(
            Reason.INVALID_CACHE,
            f"{where}.memory.name: {memory.name!r} is not a shared-memory name "
            "(letters, digits, '.', '_', '-'; no '/')",
        )
    path = os.path.join(SHM_DIR, memory.name)
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise AttachError(
            Reason.MEMORY_UNAVAILABLE, f"{where}.memory: cannot open {path}: {exc.strerror}"
        ) from exc
    end = memory.offset + nbytes
    if size < end:
        raise AttachError(
            Reason.MEMORY_UNAVAILABLE,
            f"{where}.memory: {path} holds {size} bytes, the tensor needs bytes "
            f"{memory.offset}..{end}",
        )
    try:
        mapped = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    except RuntimeError as exc:
        raise AttachError(
            Reason.MEMORY_UNAVAILABLE, f"{where}.memory: cannot map {path}: {exc}"
        ) from exc
    populate(mapped)
    return mapped[memory.offset : end]


_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def populate(tensor: torch.Tensor) -> None:
    """Fill in kvd's page tables for a shared mapping now, without touching its bytes.

    Otherwise the first post-process of every page pays a page fault in kvd's process (a
    mapping's page tables are per process, however warm the engine's are).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE):
        log.debug("madvise(MADV_POPULATE_WRITE) failed: %s", os.strerror(ctypes.get_errno()))


def _postprocesses(
    tensors: Sequence[AttachedTensor], device: torch.device
) -> dict[PageFormat, CachePostProcess]:
    by_format: dict[PageFormat, list[AttachedTensor]] = {}
    for t in tensors:
        by_format.setdefault(t.geometry.format, []).append(t)
    return {
        fmt: CachePostProcess(
            [view for t in group for view in region_views(t.tensor, t.geometry)], device
        )
        for fmt, group in by_format.items()
    }
