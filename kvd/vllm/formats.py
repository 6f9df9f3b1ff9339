"""Which kvd page format a vLLM KV cache uses: from its attention backend, its
``KVCacheLayout`` and, on CPU, the ISA of the attention kernel. Pure logic, no vLLM import.

Only formats verified against vLLM's own write kernels are named; anything else is refused with
an error that names the backend, layout, ISA or dtype, says why kvd will not guess, and names
the setting that avoids it where one exists.
"""

from __future__ import annotations

from kvd.layout.formats import PRESETS, head_slices_are_pages

# In vLLM 0.32 the content dim of a page packs K then V (head_size each) for these backends;
# their KVCacheLayout names are kvd presets of the same name (kvd.layout.formats.PRESETS).
PACKED_KV_BACKENDS = ("FLASH_ATTN", "FLASHINFER")
KV_CACHE_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
# vLLM 0.32's backends of state (Mamba-like) layers: their pages hold one state per block, which
# kvd never rewrites (``kvd.vllm.groups``).
STATE_BACKENDS = frozenset(
    {"MAMBA1_ATTN", "MAMBA2_ATTN", "GDN_ATTN", "LINEAR_ATTN", "SHORT_CONV_ATTN"}
)
# vLLM's CPU attention ("CPU_ATTN") writes, per (block, head), K transposed [head_dim][block]
# then V [block][head_dim] under these ISAs (checked by running cpu_attn_reshape_and_cache).
CPU_ATTN_VEC_ISAS = ("vec", "vec16")
# vLLM 0.32's MLA backends: the cache is the logical [B, H=1, N, C] of every backend, C one
# latent vector (kv_lora_rank + qk_rope_head_dim) per token, no separate K/V (MLAAttentionSpec,
# head_size_v 0); none overrides the shape. With one head every per-layer KVCacheLayout is
# token-major: the kvd preset "mla". Checked on CPU by running the write ops (CPU_MLA's
# do_kv_cache_update, AMX_MLA's concat_and_cache_mla_cpu: tests/test_vllm_mla.py); the GPU
# backends' Python was read (their concat_and_cache_mla kernel cannot run here).
MLA_BACKENDS = ("CPU_MLA", "AMX_MLA", "FLASHMLA", "TRITON_MLA", "FLASH_ATTN_MLA", "CUTLASS_MLA")
PER_LAYER_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC")


NO_GUESS = (
    "kvd will not guess a page format it has not verified against vLLM's own write kernel: "
    "a wrong guess rewrites every transferred block wrong, with no error anywhere"
)
_WITHOUT_KVD = (
    "serve this pair with vLLM's own NixlConnector at equal prefill and decode block sizes, "
    "where vLLM merges nothing"
)
# What avoids each CPU attention ISA kvd does not know, from vLLM's _get_attn_isa (cpu_attn.py,
# alike in 0.32, 0.33 and 0.34): "amx" is bfloat16 on a CPU with AMX tiles at a block size
# divisible by 32, and the CPU backend's kernels take multiples of 32 only; "neon" is every ARM
# CPU; "vxe", "vsx", "rvv" are s390x, POWER and RISC-V at block sizes divisible by 32.
_ISA_AVOID = {
    "amx": (
        "run the model in float16 or float32 (vLLM's dtype setting, e.g. --dtype float16), "
        "for which vLLM picks 'vec'; a block size does not help, as every block size the CPU "
        "backend takes (multiples of 32) selects 'amx' for bfloat16"
    ),
    "neon": f"vLLM picks 'neon' on every ARM CPU: {_WITHOUT_KVD}",
}
UNQUANTIZED_KV_DTYPES = ("auto", "bfloat16", "float16", "float32")
# fp8 with static scales: one k_scale/v_scale per layer from the checkpoint (1.0 without one),
# the same on both sides (vLLM's NIXL compatibility hash pins model and cache dtype). A page
# holds only 1-byte elements, laid out as an unquantized page (cpu_attn_reshape_and_cache
# checked for fp8_e4m3 and fp8_e5m2; "fp8" is fp8_e4m3), so kvd moves bytes and never scales.
STATIC_SCALE_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


class UnknownFormat(RuntimeError):
    """A KV cache whose page format kvd does not know: the message names what, says why kvd
    will not guess, and names the setting that avoids it (``avoid``) where one exists."""

    def __init__(self, what: str, avoid: str | None = None) -> None:
        message = f"{what}. {NO_GUESS}."
        if avoid:
            message += f" To avoid it: {avoid}."
        super().__init__(message)
        self.what = what
        self.avoid = avoid


def page_format(
    backend: str, kv_cache_layout: str, *, isa: str | None, use_mla: bool, kv_cache_dtype: str
) -> str:
    """The kvd preset of one engine's KV pages (local or remote).

    ``isa`` is the CPU attention ISA (``_get_attn_isa``) for the CPU backend: required there,
    ignored elsewhere (None when unknown: a remote CPU engine's ISA is not in the handshake).
    """
    if kv_cache_dtype not in UNQUANTIZED_KV_DTYPES + STATIC_SCALE_KV_DTYPES:
        raise UnknownFormat(
            f"kv_cache_dtype {kv_cache_dtype!r}: kvd.vllm knows unquantized caches and fp8 "
            f"with static per-layer scales ({', '.join(STATIC_SCALE_KV_DTYPES)}), not caches "
            "whose scales are computed as tokens are written (per token and head, per block)",
            avoid="kv_cache_dtype='auto' (the model's dtype) or 'fp8' with static scales",
        )
    if use_mla or backend in MLA_BACKENDS:
        if kv_cache_dtype not in UNQUANTIZED_KV_DTYPES:
            # No MLA write op that takes fp8 runs here to check the latent bytes against.
            raise UnknownFormat(
                f"MLA caches in {kv_cache_dtype!r}: kvd.vllm knows unquantized MLA caches only",
                avoid="kv_cache_dtype='auto' (the model's dtype)",
            )
        return _mla_format(backend, kv_cache_layout)
    if backend == "CPU_ATTN":
        if isa is None:
            raise UnknownFormat(
                "CPU_ATTN with an unknown ISA (a CPU prefill engine's ISA is not in the NIXL "
                "handshake, and this decode engine is not a CPU one to compare with): kvd "
                "cannot tell its page format",
                avoid="run prefill and decode on CPUs of one kind",
            )
        if isa not in CPU_ATTN_VEC_ISAS:
            raise UnknownFormat(
                f"CPU_ATTN with ISA {isa!r}: kvd knows the page format of ISAs "
                f"{', '.join(CPU_ATTN_VEC_ISAS)} only",
                avoid=_ISA_AVOID.get(
                    isa, f"no setting kvd knows selects those here: {_WITHOUT_KVD}"
                ),
            )
        return "cpu_attn_vec"
    if backend in PACKED_KV_BACKENDS:
        if kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise UnknownFormat(
                f"{backend} with KV cache layout {kv_cache_layout!r}: kvd knows "
                f"{', '.join(KV_CACHE_LAYOUTS)}",
                avoid="leave VLLM_KV_CACHE_LAYOUT unset (vLLM's NIXL connector asks for LBHNC)",
            )
        return kv_cache_layout
    raise UnknownFormat(
        f"attention backend {backend!r}: kvd.vllm knows the pages of CPU_ATTN and "
        f"{', '.join(PACKED_KV_BACKENDS)}",
        avoid=(
            f"select {' or '.join(PACKED_KV_BACKENDS)} with vLLM's --attention-backend on the "
            "engine that uses it"
        ),
    )


def _mla_format(backend: str, kv_cache_layout: str) -> str:
    if backend not in MLA_BACKENDS:
        raise UnknownFormat(
            f"MLA attention backend {backend!r}: kvd.vllm knows the MLA pages of "
            f"{', '.join(MLA_BACKENDS)}"
        )
    if kv_cache_layout not in PER_LAYER_LAYOUTS:
        # A cross-layer layout puts every layer in one page: not the "mla" preset.
        raise UnknownFormat(
            f"{backend} with KV cache layout {kv_cache_layout!r}: kvd knows MLA caches of "
            f"one tensor per layer ({', '.join(PER_LAYER_LAYOUTS)})"
        )
    return "mla"


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


class TpLayoutError(UnknownFormat):
    """A prefill/decode TP pair whose READs land bytes kvd cannot name as a page format."""


def landed_format(remote_format: str, *, local_tp: int, remote_tp: int) -> str:
    """The page format of what the READs land in one remote block's worth of a local page
    (a sub-page), for a prefill engine of TP size ``remote_tp`` and a decode rank of TP size
    ``local_tp``; ``remote_format`` is the prefill's page format (``remote_page_format``).

    With equal TP a sub-page is one remote page. With another TP size it holds this rank's KV
    heads, in head order, at the remote block size (vLLM 0.32 ``nixl/tp_mapping.py``,
    ``base_worker.py``): with decode TP above prefill TP, the byte range vLLM reads from one
    prefill rank's page at ``rank_offset_factor`` times its length; with prefill TP above
    decode TP, every source rank's whole page back to back, in head-slot order. Either is a
    page of ``remote_format`` with this rank's head count exactly when a head range of a page
    is itself a page (H outermost: ``cpu_attn_vec``, ``LBHNC``); kvd then plans it as that
    format with the local head count. Any other format is refused: its byte ranges per rank
    are not head ranges. MLA caches are replicated across ranks and read whole.

    Raises ``TpLayoutError`` naming the field at fault.
    """
    for field, size in (("local_tp", local_tp), ("remote_tp", remote_tp)):
        if size < 1:
            raise TpLayoutError(f"{field}: {size} is not a TP size (at least 1)")
    if max(local_tp, remote_tp) % min(local_tp, remote_tp):
        raise TpLayoutError(
            f"remote_tp: {remote_tp} and local_tp: {local_tp}: one TP size must divide the "
            "other (as vLLM requires)"
        )
    if local_tp == remote_tp or remote_format == "mla":
        return remote_format
    fmt = PRESETS.get(remote_format)
    if fmt is None or not head_slices_are_pages(fmt):
        raise TpLayoutError(
            f"remote_format {remote_format!r} with prefill TP {remote_tp} and decode TP "
            f"{local_tp}: a byte range of its pages per TP rank is not a range of heads (H is "
            "not the outermost axis of its pages), so what the READs land is no page format",
            avoid=(
                "give the prefill a layout with heads outermost (LBHNC, what vLLM's NIXL "
                "connector asks for), or run prefill and decode at one TP size"
            ),
        )
    return remote_format
