"""Attaching a cache: check its description, open its memory, prepare its post-process.

Runs in a worker thread (opening memory and warming CUDA kernels are slow); the result is
registered on the event loop by ``Registry.add``. This module is where the daemon's torch, numpy
and kernels come from: it is imported off the loop, after READY (``server.load_kernels``), or by
the first Attach if that comes sooner.
"""

from __future__ import annotations

import torch

from kvd.daemon.memory import AttachError, Opener
from kvd.daemon.registry import AttachedCache, AttachedTensor, Owner
from kvd.dtypes import torch_dtype
from kvd.kernels.device import lane_for
from kvd.kernels.postprocess import CachePostProcess, region_views
from kvd.layout.formats import FormatError, has_heads, legacy_remote_format
from kvd.layout.geometry import GeometryError, cache_geometry, group_block_sizes
from kvd.protocol import Attach, PageFormat, Reason
from kvd.shm import populate


def open_cache(request: Attach, device_name: str, owner: Owner) -> AttachedCache:
    """Check and open an Attach's tensors on ``device_name`` (``Registry.device``), blocking:
    call from a worker thread."""
    device = torch.device(device_name)
    if device.type == "cuda":
        lane_for(device).api.set_device(device)  # a worker thread starts on device 0
    try:
        geometries = cache_geometry(request.tensors)
    except (GeometryError, FormatError) as exc:
        raise AttachError(Reason.INVALID_CACHE, str(exc)) from exc
    opener = Opener(device)
    try:
        tensors = []
        for i, (spec, geometry) in enumerate(zip(request.tensors, geometries, strict=True)):
            where = f"tensors[{i}]"
            dtype = torch_dtype(spec.dtype)
            _check_alignment(spec.memory.offset, spec.dtype, dtype.itemsize, where)
            raw, span = opener.open(spec.memory, geometry.nbytes, where)
            tensors.append(AttachedTensor(spec, geometry, raw.view(dtype).view(spec.shape), span))
    except BaseException:
        opener.close()
        raise
    segments = [
        (segment, max(t.span.end for t in tensors if t.span.backing == segment.backing))
        for segment in opener.segments.values()
    ]
    for t in tensors:
        if t.tensor.device.type == "cpu":
            populate(t.tensor)
    block_sizes = group_block_sizes(request.tensors, geometries)
    cache = AttachedCache(
        cache_id=request.cache_id,
        tensors=tensors,
        num_blocks=geometries[0].num_blocks,
        block_size=block_sizes[0],
        device=device,
        owner=owner,
        segments=segments,
        postprocesses=_postprocesses(tensors, device),
        group_block_sizes=block_sizes,
    )
    if device.type == "cuda":
        warm_up(cache)
    return cache


def _check_alignment(offset: int, dtype: str, itemsize: int, where: str) -> None:
    if offset % itemsize:
        raise AttachError(
            Reason.INVALID_CACHE,
            f"{where}.memory.offset: {offset} is not a multiple of the {dtype} item size "
            f"{itemsize}",
        )


def warm_up(cache: AttachedCache) -> None:
    """Compile the CUDA kernels for this cache's formats now, not on its first request.

    Runs each kernel on scratch pages, never on the engine's memory: for a remote page in the
    other head/token order, at the local block size and half of it. Sets the calling thread's
    device; the launches go to kvd's stream (``CachePostProcess`` makes it current).
    """
    lane = lane_for(cache.device)
    lane.api.set_device(cache.device)
    for (_, local), postprocess in cache.postprocesses.items():
        if not has_heads(local):
            continue
        for ratio in (1, 2):
            if postprocess.block_size % ratio == 0:
                remote = legacy_remote_format(local, "HND")
                postprocess.warm_up(remote, postprocess.block_size // ratio)
    lane.synchronize()


def _postprocesses(
    tensors: list[AttachedTensor], device: torch.device
) -> dict[tuple[int, PageFormat], CachePostProcess]:
    """One post-process per group and local page format, over every region of its tensors."""
    by_format: dict[tuple[int, PageFormat], list[AttachedTensor]] = {}
    for t in tensors:
        by_format.setdefault((t.spec.group, t.geometry.format), []).append(t)
    return {
        fmt: CachePostProcess(
            [view for t in group for view in region_views(t.tensor, t.geometry)], device
        )
        for fmt, group in by_format.items()
    }
