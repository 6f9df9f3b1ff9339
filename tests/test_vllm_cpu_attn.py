"""kvd's cpu_attn_vec format against vLLM's own CPU attention write kernel.

Tokens are written with vLLM's ``cpu_attn_reshape_and_cache`` at the prefill block size into
pages, landed as a NIXL READ would land them in pages of the decode block size (remote pages
back to back, or one remote page across several local pages), post-processed by kvd, and
compared with the same tokens written directly at the decode block size. Skipped when vLLM
(the CPU build) is not importable.
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

import pytest
import torch

from kvd.kernels.postprocess import CachePostProcess, region_views
from kvd.layout.geometry import tensor_geometry
from kvd.protocol import ShmRef, TensorSpec

HEADS, HEAD_DIM = 2, 64


@pytest.fixture(scope="module")
def vllm_ops() -> tuple[ModuleType, Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:  # vLLM 0.34 moved the CPU kernels' wrappers out of _custom_ops
                import vllm._cpu_ops as ops
            except ModuleNotFoundError:
                import vllm._custom_ops as ops  # type: ignore[no-redef]
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception as exc:  # noqa: BLE001 (any failure to load vLLM means: not here)
        pytest.skip(f"vLLM's CPU build is not importable: {type(exc).__name__}: {exc}")
    return ops, _get_attn_isa


def write(vllm_ops, block_size: int, blocks: int, key, value) -> torch.Tensor:
    """Pages as vLLM's CPU backend allocates and fills them: [blocks, heads, block_size, 2D]."""
    ops, get_isa = vllm_ops
    isa = get_isa(key.dtype, block_size, HEAD_DIM)
    if isa != "vec":
        pytest.skip(f"vLLM picks ISA {isa!r} here, not 'vec' (the cpu_attn_vec format)")
    cache = torch.zeros(blocks, HEADS, block_size, 2 * HEAD_DIM, dtype=key.dtype)
    k_cache, v_cache = cache.view(blocks, HEADS, 2 * block_size, HEAD_DIM).chunk(2, dim=2)
    slots = torch.arange(key.shape[0])
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("remote_block_size", "block_size", "covered"),
    [
        (32, 64, 0),
        (32, 128, 0),
        (64, 128, 0),
        (32, 32, 0),
        (64, 32, 0),
        (128, 32, 0),
        (32, 128, 5),  # the second page holds one of its four remote pages: zeroed tail
        (32, 128, 3),  # the first page partly covered, the second never reached: zeroed
        (32, 64, 3),
    ],
)
def test_merged_pages_equal_pages_written_at_the_decode_block_size(
    vllm_ops, remote_block_size: int, block_size: int, covered: int, dtype
) -> None:
    torch.manual_seed(remote_block_size + block_size + covered)
    tokens = 2 * max(remote_block_size, block_size)
    key = torch.randn(tokens, HEADS, HEAD_DIM).to(dtype)
    value = torch.randn(tokens, HEADS, HEAD_DIM).to(dtype)
    remote = write(vllm_ops, remote_block_size, tokens // remote_block_size, key, value)
    landed_tokens = covered * remote_block_size if covered else tokens
    want = write(
        vllm_ops, block_size, tokens // block_size, key[:landed_tokens], value[:landed_tokens]
    )

    # The decode cache: random bytes everywhere, then the READ's bytes in the listed pages. A
    # READ moves bytes, so the remote pages, end to end, fill the listed pages in order.
    num_blocks = 3 * tokens // block_size
    local = torch.randn(num_blocks, HEADS, block_size, 2 * HEAD_DIM).to(dtype)
    ids = torch.randperm(num_blocks)[: tokens // block_size].tolist()
    page_bytes = local[0].numel() * local.element_size()
    landed = remote.view(torch.uint8).reshape(-1)
    if covered:  # what the READ did not write stays as it was
        landed = landed[: covered * page_bytes * remote_block_size // block_size]
    raw = local.view(torch.uint8).view(num_blocks, page_bytes)
    for j, block in enumerate(ids):
        chunk = landed[j * page_bytes : (j + 1) * page_bytes]
        raw[block, : len(chunk)] = chunk
    untouched = local.clone()

    spec = TensorSpec(
        name="layer.0",
        shape=list(local.shape),
        dtype=str(dtype).removeprefix("torch."),  # type: ignore[arg-type]
        block_size=block_size,
        memory=ShmRef(name="unused"),
        page_format="cpu_attn_vec",
        num_heads=HEADS,
        head_dim=HEAD_DIM,
    )
    post = CachePostProcess(region_views(local, tensor_geometry(spec)))
    assert post.needs_work("cpu_attn_vec", remote_block_size, covered, len(ids)) == (
        remote_block_size != block_size or covered != 0
    )
    post.apply([(ids, covered)], "cpu_attn_vec", remote_block_size)

    for j, block in enumerate(ids):
        assert torch.equal(local[block].view(torch.uint8), want[j].view(torch.uint8)), f"page {j}"
    others = [b for b in range(num_blocks) if b not in ids]
    assert torch.equal(local[others].view(torch.uint8), untouched[others].view(torch.uint8))
