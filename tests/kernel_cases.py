"""Building caches of any page format and what they must hold after a post-process, for the
kernel tests (CPU here, Triton in its interpreter, CUDA on a GPU)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvd.dtypes import ITEMSIZE, torch_dtype
from kvd.kernels.device import Lane
from kvd.kernels.postprocess import CachePostProcess, RegionView, region_views
from kvd.layout.formats import (
    PageSizes,
    has_heads,
    is_cross_layer,
    num_regions,
    page_elements,
    resolve,
)
from kvd.layout.geometry import TensorGeometry, tensor_geometry
from kvd.protocol import DTypeName, FormatRef, ShmRef, TensorSpec
from tests.reference import expected_group, random_bytes


@dataclass
class Cache:
    """Tensors of one page format, their geometry and a copy of their bytes before."""

    geometry: TensorGeometry
    tensors: list[torch.Tensor]
    before: list[torch.Tensor]

    def regions(self) -> list[RegionView]:
        return [v for t in self.tensors for v in region_views(t, self.geometry)]

    def postprocess(self, backend: str = "auto", lane: Lane | None = None) -> CachePostProcess:
        device = self.tensors[0].device
        return CachePostProcess(self.regions(), device, backend, lane)  # type: ignore[arg-type]


def make_cache(
    page_format: FormatRef,
    *,
    dtype: DTypeName,
    block_size: int,
    num_blocks: int,
    heads: int = 3,
    head_dim: int = 4,
    layers: int = 2,
    tensors: int = 2,
    seed: int = 0,
    device: str = "cpu",
) -> Cache:
    """``tensors`` tensors of random bytes as an engine would attach them: [R, num_blocks,
    page] with regions, else [num_blocks, page]."""
    fmt = resolve(page_format)
    num_layers = layers if is_cross_layer(fmt) else 0
    heads = heads if has_heads(fmt) else 1
    sizes = PageSizes(max(1, num_layers), heads, block_size, head_dim, ITEMSIZE[dtype])
    lead = [num_regions(fmt, heads), num_blocks] if fmt.regions else [num_blocks]
    spec = TensorSpec(
        name="t",
        shape=[*lead, page_elements(fmt, sizes)],
        dtype=dtype,
        block_size=block_size,
        memory=ShmRef(name="x"),
        page_format=page_format,
        num_heads=heads if has_heads(fmt) else 0,
        head_dim=head_dim,
        num_layers=num_layers,
    )
    geometry = tensor_geometry(spec)
    made = [
        random_bytes(spec.shape, torch_dtype(dtype), seed * 100 + i).to(device)
        for i in range(tensors)
    ]
    return Cache(geometry, made, [t.clone() for t in made])


def region_pages(tensor: torch.Tensor, geometry: TensorGeometry) -> list[np.ndarray]:
    """Each region of ``tensor`` as a (num_blocks, page_bytes) uint8 array (a copy)."""
    raw = tensor.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()
    return [
        raw.reshape(geometry.num_regions, geometry.num_blocks, geometry.page_bytes)[i].copy()
        for i in range(geometry.num_regions)
    ]


def expected_pages(
    cache: Cache,
    tensor_index: int,
    requests: Sequence[tuple[Sequence[int], int]],
    remote: FormatRef,
    remote_block_size: int,
) -> list[np.ndarray]:
    """Each region of one tensor as it must be after ``apply(requests, remote, nP)``.

    ``covered`` follows vLLM: remote pages filled from the request's first block on.
    """
    g = cache.geometry
    nD, nP = g.block_size, remote_block_size
    pages_per_group = max(1, nP // nD)
    remote_pages = max(1, nD // nP)
    sizes = {"L": g.sizes.num_layers, "H": g.num_heads, "C": g.head_dim}
    regions = region_pages(cache.before[tensor_index], g)
    out = [r.copy() for r in regions]
    for i, pages in enumerate(regions):
        kv = "v" if g.format.regions == "kv" and i == 1 else "k"
        for ids, covered in requests:
            groups = [
                list(ids[j : j + pages_per_group]) for j in range(0, len(ids), pages_per_group)
            ]
            left = covered or len(groups) * remote_pages
            for group in groups:
                landed = np.concatenate([pages[b] for b in group])
                if left <= 0:
                    want = np.zeros_like(landed)
                else:
                    want = expected_group(
                        landed,
                        remote=resolve(remote),
                        local=g.format,
                        sizes=sizes,
                        remote_block_size=nP,
                        block_size=nD,
                        itemsize=g.itemsize,
                        covered=left if left < remote_pages else 0,
                        kv=kv,
                    )
                left -= remote_pages
                for j, b in enumerate(group):
                    out[i][b] = want[j * g.page_bytes : (j + 1) * g.page_bytes]
    return out


def check_cache(
    cache: Cache,
    requests: Sequence[tuple[Sequence[int], int]],
    remote: FormatRef,
    remote_block_size: int,
) -> None:
    """Every listed page holds what the reference says; every other page is unchanged."""
    listed = {b for ids, _ in requests for b in ids}
    for t in range(len(cache.tensors)):
        want = expected_pages(cache, t, requests, remote, remote_block_size)
        now = region_pages(cache.tensors[t], cache.geometry)
        for i, (w, n) in enumerate(zip(want, now, strict=True)):
            for b in range(cache.geometry.num_blocks):
                state = "listed" if b in listed else "unlisted"
                assert np.array_equal(n[b], w[b]), f"tensor {t} region {i} block {b} ({state})"
