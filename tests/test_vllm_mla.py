"""kvd's "mla" page format against vLLM 0.32's CPU MLA write ops.

vLLM allocates an MLA cache as [num_blocks, 1, block_size, kv_lora_rank + qk_rope_head_dim]
and fills it with CPU_MLA's ``do_kv_cache_update`` (any dtype, block size 16) or AMX_MLA's
``concat_and_cache_mla_cpu`` (bf16, block sizes divisible by 32). Latents are written at the
prefill block size, landed as a NIXL READ lands them in pages of the decode block size, handed
to kvd's post-process and compared with the same latents written at the decode block size.
Skipped when vLLM (the CPU build) is not importable.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

from kvd.kernels.postprocess import CachePostProcess, region_views
from kvd.layout.geometry import tensor_geometry
from kvd.protocol import ShmRef, TensorSpec

KV_LORA_RANK, ROPE_DIM = 512, 64
LATENT = KV_LORA_RANK + ROPE_DIM

Write = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""(kv_c_normed [T, kv_lora_rank], k_pe [T, rope], cache, slots): vLLM's MLA cache write."""


def _ops() -> tuple[Write, Write]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import vllm._custom_ops as ops
            from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
    except Exception as exc:  # noqa: BLE001 (any failure to load vLLM means: not here)
        pytest.skip(f"vLLM's CPU build is not importable: {type(exc).__name__}: {exc}")

    def cpu_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slots) -> None:
        # The method uses nothing of its instance; k_pe arrives as [T, 1, rope].
        CPUMLAImpl.do_kv_cache_update(None, kv_c, k_pe.unsqueeze(1), cache, slots, "auto", None)  # type: ignore[arg-type]

    def amx_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slots) -> None:
        ops.amx_mla_concat_and_cache(kv_c, k_pe, cache, slots)

    return cpu_mla, amx_mla


def write(op: Write, block_size: int, kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Pages as vLLM allocates and fills them: [blocks, 1, block_size, latent]."""
    blocks = -(-kv_c.shape[0] // block_size)
    cache = torch.zeros(blocks, 1, block_size, LATENT, dtype=kv_c.dtype)
    # The MLA layer hands the backends its cache without the head axis: [blocks, N, latent].
    op(kv_c, k_pe, cache[:, 0], torch.arange(kv_c.shape[0]))
    return cache


CASES = [
    # (backend, dtype, remote block size, local block size, covered)
    ("CPU_MLA", torch.float32, 16, 16, 0),
    ("CPU_MLA", torch.bfloat16, 16, 16, 0),
    ("AMX_MLA", torch.bfloat16, 32, 32, 0),
    ("AMX_MLA", torch.bfloat16, 32, 64, 0),
    ("AMX_MLA", torch.bfloat16, 32, 128, 0),
    ("AMX_MLA", torch.bfloat16, 64, 32, 0),
    ("AMX_MLA", torch.bfloat16, 32, 128, 3),  # the last page partly covered: zeroed tail
    ("AMX_MLA", torch.bfloat16, 32, 128, 5),  # the second page partly covered
]


@pytest.mark.parametrize(("backend", "dtype", "remote_block_size", "block_size", "covered"), CASES)
def test_landed_latents_equal_latents_written_at_the_decode_block_size(
    backend: str, dtype: torch.dtype, remote_block_size: int, block_size: int, covered: int
) -> None:
    cpu_mla, amx_mla = _ops()
    op = cpu_mla if backend == "CPU_MLA" else amx_mla
    torch.manual_seed(remote_block_size + block_size + covered)
    tokens = 2 * max(remote_block_size, block_size)
    kv_c = torch.randn(tokens, KV_LORA_RANK).to(dtype)
    k_pe = torch.randn(tokens, ROPE_DIM).to(dtype)
    remote = write(op, remote_block_size, kv_c, k_pe)
    landed_tokens = covered * remote_block_size if covered else tokens
    want = torch.zeros(tokens // block_size, 1, block_size, LATENT, dtype=dtype)
    written = write(op, block_size, kv_c[:landed_tokens], k_pe[:landed_tokens])
    want[: written.shape[0]] = written

    # The decode cache: random bytes everywhere, then the READ's bytes in the listed pages.
    num_blocks = 3 * tokens // block_size
    local = torch.randn(num_blocks, 1, block_size, LATENT).to(dtype)
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
        shape=list(local.shape),  # as KvdConnector attaches it: vLLM's [B, 1, N, latent] view
        dtype=str(dtype).removeprefix("torch."),  # type: ignore[arg-type]
        block_size=block_size,
        memory=ShmRef(name="unused"),
        page_format="mla",
        num_heads=1,
        head_dim=LATENT,
    )
    post = CachePostProcess(region_views(local, tensor_geometry(spec)))
    # Token-major pages: only a partly covered read leaves anything to do (its zeroed tail).
    assert post.needs_work("mla", remote_block_size, covered, len(ids)) == (covered != 0)
    post.apply([(ids, covered)], "mla", remote_block_size)

    for j, block in enumerate(ids):
        assert torch.equal(local[block].view(torch.uint8), want[j].view(torch.uint8)), f"page {j}"
    others = [b for b in range(num_blocks) if b not in ids]
    assert torch.equal(local[others].view(torch.uint8), untouched[others].view(torch.uint8))
