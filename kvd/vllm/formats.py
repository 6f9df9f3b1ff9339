"""Which kvd page format a vLLM 0.32 KV cache uses: from its attention backend, its
``KVCacheLayout`` and, on CPU, the ISA of the attention kernel. Pure logic, no vLLM import.

Only formats verified against vLLM's own write kernels are named; anything else is refused with
an error that says which backend, layout or ISA kvd does not know, never guessed: a wrong guess
would corrupt every transferred block without an error.
"""

from __future__ import annotations

# In vLLM 0.32 the content dim of a page packs K then V (head_size each) for these backends;
# their KVCacheLayout names are kvd presets of the same name (kvd.layout.formats.PRESETS).
PACKED_KV_BACKENDS = ("FLASH_ATTN", "FLASHINFER")
KV_CACHE_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
# vLLM's CPU attention ("CPU_ATTN") writes, per (block, head), K transposed [head_dim][block]
# then V [block][head_dim] under these ISAs (checked by running cpu_attn_reshape_and_cache).
CPU_ATTN_VEC_ISAS = ("vec", "vec16")
UNQUANTIZED_KV_DTYPES = ("auto", "bfloat16", "float16", "float32")
# fp8 with static scales: one k_scale/v_scale per layer from the checkpoint (1.0 without one),
# the same on both sides (vLLM's NIXL compatibility hash pins model and cache dtype). A page
# holds only 1-byte elements, laid out as an unquantized page (cpu_attn_reshape_and_cache
# checked for fp8_e4m3 and fp8_e5m2; "fp8" is fp8_e4m3), so kvd moves bytes and never scales.
STATIC_SCALE_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


class UnknownFormat(RuntimeError):
    """A KV cache whose page format kvd does not know; the message names what."""


def page_format(
    backend: str, kv_cache_layout: str, *, isa: str | None, use_mla: bool, kv_cache_dtype: str
) -> str:
    """The kvd preset of one engine's KV pages (local or remote).

    ``isa`` is the CPU attention ISA (``_get_attn_isa``) for the CPU backend: required there,
    ignored elsewhere (None when unknown: a remote CPU engine's ISA is not in the handshake).
    """
    if use_mla:
        raise UnknownFormat("MLA KV caches: kvd.vllm does not know vLLM 0.32's MLA page format yet")
    if kv_cache_dtype not in UNQUANTIZED_KV_DTYPES + STATIC_SCALE_KV_DTYPES:
        raise UnknownFormat(
            f"kv_cache_dtype {kv_cache_dtype!r}: kvd.vllm knows unquantized caches and fp8 "
            f"with static per-layer scales ({', '.join(STATIC_SCALE_KV_DTYPES)}), not caches "
            "whose scales are computed as tokens are written (per token and head, per block)"
        )
    if backend == "CPU_ATTN":
        if isa is None:
            raise UnknownFormat("CPU_ATTN with an unknown ISA: kvd cannot tell its page format")
        if isa not in CPU_ATTN_VEC_ISAS:
            raise UnknownFormat(
                f"CPU_ATTN with ISA {isa!r}: kvd knows the page format of ISAs "
                f"{', '.join(CPU_ATTN_VEC_ISAS)} only"
            )
        return "cpu_attn_vec"
    if backend in PACKED_KV_BACKENDS:
        if kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise UnknownFormat(
                f"{backend} with KV cache layout {kv_cache_layout!r}: kvd knows "
                f"{', '.join(KV_CACHE_LAYOUTS)}"
            )
        return kv_cache_layout
    raise UnknownFormat(
        f"attention backend {backend!r}: kvd.vllm knows the pages of CPU_ATTN and "
        f"{', '.join(PACKED_KV_BACKENDS)}"
    )


def remote_page_format(
    backend: str, kv_cache_layout: str, *, local: str, local_isa: str | None, kv_cache_dtype: str
) -> str:
    """The page format of a prefill engine, from what its NIXL handshake says.

    The handshake names the remote backend and layout but not a CPU engine's ISA: a remote
    CPU_ATTN engine is taken to write the same ISA family as this one (only ``vec`` and
    ``vec16`` are known, and they share their format), which holds for hosts of one kind.
    """
    isa = local_isa if backend == "CPU_ATTN" and local == "cpu_attn_vec" else None
    return page_format(
        backend, kv_cache_layout, isa=isa, use_mla=False, kv_cache_dtype=kv_cache_dtype
    )
