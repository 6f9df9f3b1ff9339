"""kvd's cpu_attn_vec format against vLLM's own CPU attention write kernel.

Tokens are written with vLLM's ``cpu_attn_reshape_and_cache`` at the prefill block size into
pages, landed as a NIXL READ would land them in pages of the decode block size (remote pages
back to back, or one remote page across several local pages), post-processed by kvd, and
compared with the same tokens written directly at the decode block size, for unquantized and
fp8 caches (static scales: the kernel writes 1-byte elements where an unquantized cache has
its elements). Skipped when vLLM (the CPU build) is not importable, and fp8 where vLLM refuses
it on this CPU.
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

import pytest
import torch

from kvd.dtypes import dtype_name
from kvd.kernels.postprocess import CachePostProcess, region_views
from kvd.layout.formats import PRESETS, PageSizes, element_offset
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


def cache_dtype(dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The dtype vLLM allocates the cache in: uint8 for fp8 (STR_DTYPE_TO_TORCH_DTYPE)."""
    return dtype if kv_cache_dtype == "auto" else torch.uint8


def write(
    vllm_ops, block_size: int, blocks: int, key, value, *, kv_cache_dtype: str
) -> torch.Tensor:
    """Pages as vLLM's CPU backend allocates and fills them: [blocks, heads, block_size, 2D]."""
    ops, get_isa = vllm_ops
    try:
        isa = get_isa(key.dtype, block_size, HEAD_DIM, kv_cache_dtype)
    except NotImplementedError as exc:  # fp8 without AVX-512 or AMX: vLLM's own reason
        pytest.skip(str(exc))
    if isa != "vec":
        pytest.skip(f"vLLM picks ISA {isa!r} here, not 'vec' (the cpu_attn_vec format)")
    dtype = cache_dtype(key.dtype, kv_cache_dtype)
    cache = torch.zeros(blocks, HEADS, block_size, 2 * HEAD_DIM, dtype=dtype)
    k_cache, v_cache = cache.view(blocks, HEADS, 2 * block_size, HEAD_DIM).chunk(2, dim=2)
    slots = torch.arange(key.shape[0])
    # Static scales, as vLLM passes a layer's _k_scale_float/_v_scale_float (1.0 without a
    # checkpoint's): not 1.0 here, to show kvd never needs them.
    ops.cpu_attn_reshape_and_cache(
        key, value, k_cache, v_cache, slots, isa, 0.5, 2.0, kv_cache_dtype=kv_cache_dtype
    )
    return cache


@pytest.mark.parametrize(
    "cache",
    [
        (torch.float32, "auto"),
        (torch.bfloat16, "auto"),
        (torch.float32, "fp8"),
        (torch.float32, "fp8_e4m3"),
        (torch.float32, "fp8_e5m2"),
    ],
)
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
    vllm_ops, remote_block_size: int, block_size: int, covered: int, cache
) -> None:
    dtype, kv_cache_dtype = cache
    torch.manual_seed(remote_block_size + block_size + covered)
    tokens = 2 * max(remote_block_size, block_size)
    key = torch.randn(tokens, HEADS, HEAD_DIM).to(dtype)
    value = torch.randn(tokens, HEADS, HEAD_DIM).to(dtype)
    remote = write(
        vllm_ops,
        remote_block_size,
        tokens // remote_block_size,
        key,
        value,
        kv_cache_dtype=kv_cache_dtype,
    )
    landed_tokens = covered * remote_block_size if covered else tokens
    want = write(
        vllm_ops,
        block_size,
        tokens // block_size,
        key[:landed_tokens],
        value[:landed_tokens],
        kv_cache_dtype=kv_cache_dtype,
    )

    # The decode cache: random bytes everywhere, then the READ's bytes in the listed pages. A
    # READ moves bytes, so the remote pages, end to end, fill the listed pages in order.
    num_blocks = 3 * tokens // block_size
    shape = (num_blocks, HEADS, block_size, 2 * HEAD_DIM)
    if remote.dtype == torch.uint8:
        local = torch.randint(0, 256, shape, dtype=torch.uint8)
    else:
        local = torch.randn(shape).to(dtype)
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

    wire_dtype = dtype_name(local.dtype)
    assert wire_dtype is not None
    spec = TensorSpec(
        name="layer.0",
        shape=list(local.shape),
        dtype=wire_dtype,
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


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_elements_land_where_the_cpu_attn_vec_format_says(vllm_ops, kv_cache_dtype) -> None:
    """Every byte the kernel writes for (K or V, head, token, channel) sits at kvd's
    ``element_offset``. The values are exact fp8 numbers with scale 1.0, so each stored byte
    is known: the bytes of ``fp8(value)``, the kernel's rounding aside."""
    block_size = 32
    fp8 = torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
    g = torch.Generator().manual_seed(7)
    # Finite, non-negative fp8 encodings (0x70 and above hold the largest ones and NaN).
    k_bytes, v_bytes = torch.randint(0, 0x70, (2, block_size, HEADS, HEAD_DIM), generator=g).to(
        torch.uint8
    )
    key, value = k_bytes.view(fp8).float(), v_bytes.view(fp8).float()
    ops, get_isa = vllm_ops
    try:
        isa = get_isa(torch.float32, block_size, HEAD_DIM, kv_cache_dtype)
    except NotImplementedError as exc:
        pytest.skip(str(exc))
    assert isa == "vec"
    page = torch.zeros(1, HEADS, block_size, 2 * HEAD_DIM, dtype=torch.uint8)
    k_cache, v_cache = page.view(1, HEADS, 2 * block_size, HEAD_DIM).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        key, value, k_cache, v_cache, torch.arange(block_size), isa, kv_cache_dtype=kv_cache_dtype
    )
    flat = page.reshape(-1)
    fmt = PRESETS["cpu_attn_vec"]
    sizes = PageSizes(
        num_layers=1, num_heads=HEADS, block_size=block_size, head_dim=HEAD_DIM, itemsize=1
    )
    placed: list[int] = []
    for kv, written in (("k", k_bytes), ("v", v_bytes)):
        offsets = torch.empty(block_size, HEADS, HEAD_DIM, dtype=torch.long)
        for token in range(block_size):
            for head in range(HEADS):
                for channel in range(HEAD_DIM):
                    _, offsets[token, head, channel] = element_offset(
                        fmt, sizes, kv=kv, head=head, token=token, channel=channel
                    )
        assert torch.equal(flat[offsets], written), kv
        placed += offsets.reshape(-1).tolist()
    assert sorted(placed) == list(range(flat.numel()))  # the page holds nothing else
