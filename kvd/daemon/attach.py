"""Attaching a cache: check its description, open its memory, prepare its post-process.

Runs in a worker thread (opening memory and warming CUDA kernels are slow); the result is
registered on the event loop by ``Registry.add``.
"""

from __future__ import annotations

import torch

from kvd.daemon.memory import AttachError, Opener, populate
from kvd.daemon.registry import AttachedCache, AttachedTensor, Owner
from kvd.dtypes import torch_dtype
from kvd.geometry import GeometryError, cache_geometry
from kvd.postprocess import BlockRows, block_rows, plan_groups
from kvd.protocol import Attach, Reason


def open_cache(request: Attach, device: torch.device, owner: Owner) -> AttachedCache:
    """Check and open an Attach's tensors (blocking: call from a worker thread)."""
    try:
        geometries = cache_geometry(request.tensors)
    except GeometryError as exc:
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
    cache = AttachedCache(
        cache_id=request.cache_id,
        tensors=tensors,
        num_blocks=geometries[0].num_blocks,
        block_size=geometries[0].block_size,
        device=device,
        owner=owner,
        segments=segments,
        views=_row_views(tensors),
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
    """Compile the CUDA kernels for this cache's geometries now, not on its first request.

    Runs the kernel on a one-block scratch copy of each geometry, never on the engine's memory.
    """
    seen = set()
    for view in cache.views:
        rows = view.rows
        key = (rows.shape[1:], rows.dtype)
        if key in seen:
            continue
        seen.add(key)
        scratch = torch.zeros((1, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        dummy = BlockRows(scratch, view.layout, view.block_size, view.num_heads, view.kv_parts)
        for ratio in (1, 2):
            if view.block_size % ratio == 0:
                for group in plan_groups([dummy], ratio=ratio, remote_layout="HND"):
                    group.apply([0])
    torch.cuda.synchronize(cache.device)


def _row_views(tensors: list[AttachedTensor]) -> list[BlockRows]:
    views = []
    for t in tensors:
        g = t.geometry
        if g.arrangement == "mla":
            continue  # no head axis: nothing to rewrite
        parts = [t.tensor[0], t.tensor[1]] if g.arrangement == "split" else [t.tensor]
        for part in parts:
            views.append(
                block_rows(
                    part,
                    layout=g.layout,
                    block_size=g.block_size,
                    num_heads=g.num_heads,
                    kv_parts=g.kv_parts,
                )
            )
    return views
