"""Heterogeneous TP: a decode rank reading from a prefill of another TP size, with vLLM's own
descriptor math, on scratch pages.

For each decode rank, vLLM 0.32's NIXL worker code (imported from the installed wheel, not
re-derived) computes the TP mapping (``compute_tp_mapping``), the local descriptors at the
remote block size (``_build_fa_local``), their per-remote-rank split (``_build_local_splits_
from_plan``, prefill TP > decode TP), the remote descriptors with this rank's head offset
(``_build_fa_remote``) and the descriptor ids of a request's blocks (``_map_block_ids_for_
block_size_ratio``, ``_compute_desc_ids``). Each (local, remote) descriptor pair is then copied
byte for byte, as NIXL's READ would, from the prefill ranks' caches into a decode cache full
of stale bytes; kvd's post-process rewrites the request's blocks with the remote format the
connector names (``kvd.vllm.formats.landed_format``), and every page must equal what a single
decode instance at the decode's TP holds: pages written from the logical K and V of the
rank's heads at the decode block size (by vLLM's ``cpu_attn_reshape_and_cache`` for the CPU
format, by torch for the GPU ones). Skipped when vLLM (the CPU build) is not importable.
"""

from __future__ import annotations

import ctypes
import dataclasses
import warnings
import zlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvd.dtypes import dtype_name
from kvd.kernels.postprocess import CachePostProcess, region_views
from kvd.layout.geometry import tensor_geometry
from kvd.protocol import ShmRef, TensorSpec
from kvd.vllm.formats import CPU_ATTN_VEC_ISAS, TpLayoutError, landed_format
from kvd.vllm.holding import covered_sub_blocks
from kvd.vllm.split import plan_split_read, slice_sub_pages, split_remote_pages
from kvd.vllm.tp import split_sub_blocks

HEAD_DIM = 64  # vLLM's CPU kernel ("vec") takes head sizes that are multiples of 32
LAYERS = 2
TOKENS = 150  # not a multiple of any block size: the last local block is partly covered


@pytest.fixture(scope="module")
def vllm() -> SimpleNamespace:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:  # vLLM 0.34 moved the CPU kernels' wrappers out of _custom_ops
                import vllm._cpu_ops as ops
            except ModuleNotFoundError:
                import vllm._custom_ops as ops  # type: ignore[no-redef]
            from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
                NixlAgentMetadata,
            )
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
                NixlPullConnectorWorker,
            )
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import (
                compute_tp_mapping,
            )
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
            from vllm.v1.kv_cache_interface import FullAttentionSpec
    except Exception as exc:  # noqa: BLE001 (any failure to load vLLM means: not here)
        pytest.skip(f"vLLM's CPU build is not importable: {type(exc).__name__}: {exc}")
    return SimpleNamespace(
        ops=ops,
        get_isa=_get_attn_isa,
        topology=TransferTopology,
        agent_metadata=NixlAgentMetadata,
        worker=NixlPullConnectorWorker,
        compute_tp_mapping=compute_tp_mapping,
        full_attention=FullAttentionSpec,
    )


# -- pages written from logical K and V, independently of kvd's formats ---------------------------


def write_pages(vllm: SimpleNamespace, fmt: str, block_size: int, *, blocks: int, key, value):
    """One layer's cache of ``blocks`` pages holding tokens ``key``/``value`` ([T, heads, D])
    from block 0 on, zeros past them, as the engine that uses ``fmt`` writes it."""
    heads = key.shape[1]
    if fmt == "cpu_attn_vec":
        isa = vllm.get_isa(key.dtype, block_size, HEAD_DIM, "auto")
        if isa not in CPU_ATTN_VEC_ISAS:
            pytest.skip(f"vLLM picks ISA {isa!r} here, not one of the cpu_attn_vec format")
        cache = torch.zeros(blocks, heads, block_size, 2 * HEAD_DIM, dtype=key.dtype)
        k_cache, v_cache = cache.view(blocks, heads, 2 * block_size, HEAD_DIM).chunk(2, dim=2)
        slots = torch.arange(key.shape[0])
        vllm.ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)
        return cache
    # vLLM's packed-KV pages: each (head, token) holds its K channels, then its V channels.
    packed = torch.zeros(blocks * block_size, heads, 2 * HEAD_DIM, dtype=key.dtype)
    packed[: key.shape[0]] = torch.cat([key, value], dim=-1)
    by_token = packed.view(blocks, block_size, heads, 2 * HEAD_DIM)
    if fmt == "LBNHC":
        return by_token.contiguous()
    assert fmt == "LBHNC"
    return by_token.permute(0, 2, 1, 3).contiguous()


# -- vLLM's descriptor math ----------------------------------------------------------------------


@dataclass
class Side:
    """One engine rank's caches (a tensor per layer) and its geometry."""

    tp_rank: int
    tp_size: int
    block_size: int
    layers: list[torch.Tensor]

    @property
    def page_bytes(self) -> int:
        page = self.layers[0][0]
        return page.numel() * page.element_size()

    @property
    def num_blocks(self) -> int:
        return self.layers[0].shape[0]


def vllm_worker(vllm: SimpleNamespace, local: Side, total_heads: int) -> Any:
    """vLLM's NIXL pull worker for ``local``, holding only what its descriptor code reads
    (``register_kv_caches`` sets these from the caches: one region per layer, pages back to
    back, one full-attention group)."""
    worker = object.__new__(vllm.worker)
    worker.transfer_topo = vllm.topology(
        tp_rank=local.tp_rank,
        tp_size=local.tp_size,
        block_size=local.block_size,
        engine_id="decode",
        is_mla=False,
        is_mamba=False,
        total_num_kv_heads=total_heads,
        attn_backends=[],
    )
    worker.engine_id = "decode"
    worker.use_mla = False
    worker.device_id = 0
    worker.num_regions = LAYERS
    worker.block_len_per_layer = [local.page_bytes] * LAYERS
    worker.block_stride_per_layer = [local.page_bytes] * LAYERS
    worker.region_num_blocks = [local.num_blocks] * LAYERS
    worker.region_group_ids = [0] * LAYERS
    worker._uses_region_group_mapping = False
    worker._region_is_mla = [False] * LAYERS
    worker._transfer_layer_region_indices = []
    worker._transfer_layer_group_ids = []
    worker._group_spec_types = (vllm.full_attention,)
    worker._has_mamba = False
    worker._logical_num_blocks = local.num_blocks
    worker._ple_region_index = None
    return worker


def agent_metadata(vllm: SimpleNamespace, remote: Side, layout: str) -> Any:
    """What a prefill rank's NIXL handshake says of its caches."""
    return vllm.agent_metadata(
        engine_id="prefill",
        agent_metadata=b"",
        kv_caches_base_addr=[t.data_ptr() for t in remote.layers],
        device_id=0,
        num_blocks=remote.num_blocks,
        block_lens=[remote.page_bytes] * LAYERS,
        block_strides=[remote.page_bytes] * LAYERS,
        kv_cache_layout=layout,
        block_size=remote.block_size,
        ssm_sizes=(0, 0),
        attn_backend_name="CPU_ATTN",
        physical_blocks_per_logical_kv_block=1,
    )


def local_splits(
    vllm: SimpleNamespace, worker: Any, plan: Any, descs: np.ndarray, ratio: int, *, lift: bool
) -> list[np.ndarray]:
    """The local descriptors each source rank's READ writes (prefill TP > decode TP).

    vLLM refuses this with differing block sizes (an assert); with ``lift``, kvd's connector
    lifts it (``kvd.vllm.tp.split_sub_blocks``: vLLM's split applied to the sub-block
    descriptors it builds for the remote block size, as blocks of their own)."""
    split = vllm.worker._build_local_splits_from_plan
    if ratio > 1 and lift:
        handles = split_sub_blocks(
            worker, split, plan=plan, src_blocks_data=descs, num_fa_descs=len(descs), ratio=ratio
        )
    else:
        handles = list(split(worker, plan, descs, len(descs), ratio))
    return [np.asarray(h) for h in handles]


def read(
    vllm: SimpleNamespace,
    local: Side,
    prefill: list[Side],
    total_heads: int,
    *,
    layout: str,
    local_ids: list[int],
    remote_ids: list[int],
    lift: bool = False,
    slice_pages: bool = True,
) -> None:
    """One request's READs into ``local`` from the prefill ranks it reads, as vLLM 0.32's
    ``_read_blocks_for_req`` posts them (one per source rank), executed as byte copies.

    Larger prefill blocks (nP > nD) are read as the connector reads them: each prefill rank's
    handshake split into sub-pages (``split_remote_pages``; ``remote_ids`` are then sub-block
    ids) and, with ``slice_pages``, the remote descriptors placed on this rank's heads
    (``slice_sub_pages``)."""
    worker = vllm_worker(vllm, local, total_heads)
    remote_tp = prefill[0].tp_size
    plan = vllm.compute_tp_mapping(worker.transfer_topo, remote_tp, worker._group_spec_types)
    metas = [agent_metadata(vllm, side, layout) for side in prefill]
    k = 1
    for meta in metas:
        k = split_remote_pages(meta, local.block_size)
    ratio = worker.transfer_topo.block_size_ratio(metas[0].block_size)
    tp_ratio = worker.transfer_topo.tp_ratio(remote_tp)
    local_descs = worker._build_fa_local([t.data_ptr() for t in local.layers], ratio)
    if tp_ratio < 0:
        sides = local_splits(vllm, worker, plan, local_descs, ratio, lift=lift)
    else:
        sides = [local_descs] * len(plan.all_source_ranks)
    assert len(sides) == len(plan.all_source_ranks)
    for side, rank in zip(sides, plan.all_source_ranks, strict=True):
        remote_descs = worker._build_fa_remote(plan, metas[rank], ratio)
        if k > 1 and slice_pages:
            remote_descs = slice_sub_pages(remote_descs, metas[rank], k)
        local_group, remote_group = [local_ids], [remote_ids]
        if ratio > 1:
            local_group, remote_group = worker._map_block_ids_for_block_size_ratio(
                local_group, remote_group, ratio
            )
        remote_desc_ids = worker._compute_desc_ids(
            block_ids=remote_group,
            dst_num_blocks=metas[rank].num_blocks,
            block_size_ratio=None,
            physical_blocks_per_logical=1,
            region_num_blocks=[metas[rank].num_blocks] * LAYERS,
            region_group_ids=[0] * LAYERS,
            uses_region_group_mapping=False,
        )
        local_desc_ids = worker._compute_desc_ids(
            block_ids=local_group,
            dst_num_blocks=local.num_blocks,
            block_size_ratio=ratio,
            physical_blocks_per_logical=1,
            region_num_blocks=[local.num_blocks] * LAYERS,
            region_group_ids=[0] * LAYERS,
            uses_region_group_mapping=False,
        )
        assert len(local_desc_ids) == len(remote_desc_ids)
        for ld, rd in zip(local_desc_ids, remote_desc_ids, strict=True):
            dst, dst_len, _ = (int(x) for x in side[ld])
            src, src_len, _ = (int(x) for x in remote_descs[rd])
            assert dst_len == src_len, "NIXL pairs descriptors of one length"
            ctypes.memmove(dst, src, dst_len)


# -- the cases -----------------------------------------------------------------------------------


def rank_heads(total_heads: int, tp_size: int, rank: int) -> slice:
    """A rank's KV heads; with more ranks than heads, vLLM gives each rank one, replicated."""
    if tp_size > total_heads:
        head = rank * total_heads // tp_size
        return slice(head, head + 1)
    per = total_heads // tp_size
    return slice(rank * per, (rank + 1) * per)


CASES = [
    # (KV heads, prefill TP, decode TP, prefill block, decode block, prefill layout/format,
    #  decode format)
    (2, 1, 2, 32, 64, "cpu_attn_vec", "cpu_attn_vec"),
    (2, 1, 2, 32, 32, "cpu_attn_vec", "cpu_attn_vec"),
    (2, 2, 1, 32, 32, "cpu_attn_vec", "cpu_attn_vec"),
    (4, 1, 2, 32, 64, "cpu_attn_vec", "cpu_attn_vec"),
    (4, 1, 4, 16, 64, "cpu_attn_vec", "cpu_attn_vec"),
    (4, 2, 1, 32, 32, "cpu_attn_vec", "cpu_attn_vec"),
    (4, 4, 2, 32, 32, "cpu_attn_vec", "cpu_attn_vec"),
    (4, 1, 2, 32, 64, "LBHNC", "LBHNC"),
    (4, 1, 2, 32, 64, "LBHNC", "LBNHC"),  # vLLM's enable_permute_local_kv: NHD decode
    (4, 2, 1, 32, 32, "LBHNC", "LBHNC"),
    (4, 2, 1, 32, 32, "LBHNC", "LBNHC"),
]
LIFTED = [
    # prefill TP > decode TP with differing block sizes: vLLM refuses it, kvd's rewrite does not
    (2, 2, 1, 32, 64, "cpu_attn_vec", "cpu_attn_vec"),
    (4, 2, 1, 32, 64, "cpu_attn_vec", "cpu_attn_vec"),
    (4, 4, 2, 16, 64, "cpu_attn_vec", "cpu_attn_vec"),
    (4, 2, 1, 32, 64, "LBHNC", "LBHNC"),
    (4, 2, 1, 32, 64, "LBHNC", "LBNHC"),
]


def case_id(case: tuple[Any, ...]) -> str:
    heads, p_tp, d_tp, n_p, n_d, remote, local = case
    return f"{heads}heads-tp{p_tp}to{d_tp}-{n_p}to{n_d}-{remote}to{local}"


SPLIT = [
    # prefill blocks larger than the decode's (nP > nD) at a decode TP above the prefill's:
    # each rank's heads of a page, in k pieces (``kvd.vllm.split.slice_sub_pages``)
    (2, 1, 2, 64, 32, "cpu_attn_vec", "cpu_attn_vec"),
    (4, 1, 2, 128, 32, "cpu_attn_vec", "cpu_attn_vec"),
    (4, 1, 4, 64, 32, "cpu_attn_vec", "cpu_attn_vec"),
    (2, 1, 4, 64, 32, "cpu_attn_vec", "cpu_attn_vec"),  # more decode ranks than KV heads
    (4, 2, 4, 64, 32, "cpu_attn_vec", "cpu_attn_vec"),
    (4, 1, 2, 64, 32, "LBHNC", "LBHNC"),
    (4, 1, 2, 64, 32, "LBHNC", "LBNHC"),
]
RANKED = [
    # prefill blocks larger than the decode's at a prefill TP above the decode's: each prefill
    # rank's page lands in k pieces, piece j of every rank side by side in the j-th local page
    # (``ReadDone.remote_ranks``)
    (2, 2, 1, 64, 32, "cpu_attn_vec", "cpu_attn_vec"),
    (4, 2, 1, 64, 32, "cpu_attn_vec", "cpu_attn_vec"),
    (4, 2, 1, 128, 32, "cpu_attn_vec", "cpu_attn_vec"),
    (4, 4, 1, 64, 32, "cpu_attn_vec", "cpu_attn_vec"),
    (4, 4, 2, 64, 32, "cpu_attn_vec", "cpu_attn_vec"),
    (4, 2, 1, 64, 32, "LBHNC", "LBHNC"),
    (4, 2, 1, 64, 32, "LBHNC", "LBNHC"),
]


def run_case(
    vllm: SimpleNamespace,
    case: tuple[Any, ...],
    *,
    lift: bool = False,
    slice_pages: bool = True,
    ranked: bool = True,
) -> None:
    total_heads, p_tp, d_tp, n_p, n_d, remote_fmt, local_fmt = case
    torch.manual_seed(zlib.crc32(case_id(case).encode()))
    key = [torch.randn(TOKENS, total_heads, HEAD_DIM) for _ in range(LAYERS)]
    value = [torch.randn(TOKENS, total_heads, HEAD_DIM) for _ in range(LAYERS)]
    remote_blocks = -(-TOKENS // n_p)
    local_blocks = -(-TOKENS // n_d)
    # The prefill ranks: each its heads, the request in random blocks of a larger cache.
    p_num = 2 * remote_blocks + 3
    remote_ids = torch.randperm(p_num)[:remote_blocks].tolist()
    prefill = []
    for rank in range(p_tp):
        heads = rank_heads(total_heads, p_tp, rank)
        layers = []
        for layer in range(LAYERS):
            written = write_pages(
                vllm,
                remote_fmt,
                n_p,
                blocks=remote_blocks,
                key=key[layer][:, heads],
                value=value[layer][:, heads],
            )
            cache = torch.randn(p_num, *written.shape[1:])
            cache[remote_ids] = written
            layers.append(cache)
        prefill.append(Side(rank, p_tp, n_p, layers))

    k = max(n_p // n_d, 1)
    if k > 1:  # whole groups of k local blocks are read, the rest recomputed (``plan_split_read``)
        covered = 0  # all they hold
        sub_ids = [i * k + j for i in remote_ids for j in range(k)]
    else:
        covered = covered_sub_blocks(local_blocks, n_d // n_p, remote_blocks, None)
        assert covered is not None
    layout = "LBHNC"  # what a prefill of either format says in its handshake on CPU/GPU here
    fmt = landed_format(remote_fmt, local_tp=d_tp, remote_tp=p_tp)
    remote_ranks = max(p_tp // d_tp, 1) if k > 1 and ranked else 1
    d_num = 3 * local_blocks
    for rank in range(d_tp):
        heads = rank_heads(total_heads, d_tp, rank)
        want = [
            write_pages(
                vllm,
                local_fmt,
                n_d,
                blocks=local_blocks,
                key=key[layer][:, heads],
                value=value[layer][:, heads],
            )
            for layer in range(LAYERS)
        ]
        layers = [torch.randn(d_num, *w.shape[1:]) for w in want]  # stale bytes
        stale = [t.clone() for t in layers]
        local_ids = torch.randperm(d_num)[:local_blocks].tolist()
        read_ids = remote_ids
        if k > 1:
            split = plan_split_read(local_ids, sub_ids, k, 0)
            assert split.local and split.unread == local_ids[len(split.local) :]
            local_ids, read_ids = split.local, split.remote
        decode = Side(rank, d_tp, n_d, layers)
        read(
            vllm,
            decode,
            prefill,
            total_heads,
            layout=layout,
            local_ids=local_ids,
            remote_ids=read_ids,
            lift=lift,
            slice_pages=slice_pages,
        )
        if (n_p != n_d or local_fmt != remote_fmt) and layers[0][local_ids[0]].abs().sum() > 0:
            # Not vacuous: what landed is not yet the decode's pages.
            assert not torch.equal(layers[0][local_ids], want[0])
        for layer, tensor in enumerate(layers):
            wire_dtype = dtype_name(tensor.dtype)
            assert wire_dtype is not None
            spec = TensorSpec(
                name=f"layer.{layer}",
                shape=list(tensor.shape),
                dtype=wire_dtype,
                block_size=n_d,
                memory=ShmRef(name="unused"),
                page_format=local_fmt,
                num_heads=want[layer].shape[1 if local_fmt != "LBNHC" else 2],
                head_dim=HEAD_DIM,
            )
            post = CachePostProcess(region_views(tensor, tensor_geometry(spec)))
            post.apply([(local_ids, covered)], fmt, n_p, remote_ranks=remote_ranks)
            for j, block in enumerate(local_ids):
                assert torch.equal(tensor[block], want[layer][j]), (
                    f"decode rank {rank}, layer {layer}, block {j} of {local_blocks}"
                )
            others = [b for b in range(d_num) if b not in local_ids]
            assert torch.equal(tensor[others], stale[layer][others]), "a block not read changed"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_a_decode_rank_holds_what_a_single_instance_at_its_tp_holds(vllm, case) -> None:
    run_case(vllm, case)


def test_vllm_refuses_prefill_tp_above_decode_tp_with_differing_block_sizes(vllm) -> None:
    """The refusal kvd's lifted cases stand beside (``_build_local_splits_from_plan``)."""
    with pytest.raises(AssertionError, match="Head-sharded attention reads with P_TP > D_TP"):
        run_case(vllm, LIFTED[0])


@pytest.mark.parametrize("case", LIFTED, ids=case_id)
def test_prefill_tp_above_decode_tp_with_differing_block_sizes_lands_a_rewritable_page(
    vllm, case
) -> None:
    """Without vLLM's refusal its descriptors land, in each sub-page, every source rank's
    whole page back to back in slot order: this rank's heads in order, at the remote block
    size, which kvd rewrites like any other sub-page."""
    run_case(vllm, case, lift=True)


@pytest.mark.parametrize("case", SPLIT, ids=case_id)
def test_larger_prefill_blocks_at_a_higher_decode_tp_land_this_rank_s_heads(vllm, case) -> None:
    """Each decode rank's byte range of a prefill page, in k local pages: a page of the prefill's
    format with this rank's heads, which kvd splits like any other."""
    run_case(vllm, case)


def test_vllm_s_sub_page_offsets_alone_read_other_ranks_heads(vllm) -> None:
    """Without ``slice_sub_pages`` vLLM reads this rank's share of each sub-page, not of the
    page: in an HND page another rank's heads (why the pair was refused before)."""
    with pytest.raises(AssertionError, match="decode rank 0, layer 0, block 0"):
        run_case(vllm, SPLIT[0], slice_pages=False)


@pytest.mark.parametrize("case", RANKED, ids=case_id)
def test_larger_prefill_blocks_from_a_higher_prefill_tp_land_interleaved_by_rank(
    vllm, case
) -> None:
    """vLLM's READs from a prefill at R times the decode's TP, each prefill rank's page split
    into k sub-pages, write rank r's j-th piece at slot r of the group's j-th local page: kvd,
    told ``remote_ranks`` R, rewrites the group from that arrangement."""
    run_case(vllm, case)


def test_ranks_interleaved_pages_read_as_one_page_are_wrong(vllm) -> None:
    """Without ``remote_ranks`` the same landed bytes rewrite wrong: the pieces are not one
    page's bytes in order (why the pair was refused before)."""
    with pytest.raises(AssertionError, match="decode rank 0, layer 0, block 0"):
        run_case(vllm, RANKED[0], ranked=False)


def test_a_remote_format_whose_head_slices_are_not_pages_is_refused_by_name() -> None:
    assert landed_format("LBNHC", local_tp=2, remote_tp=2) == "LBNHC"
    assert landed_format("LBHNC", local_tp=1, remote_tp=2) == "LBHNC"
    with pytest.raises(TpLayoutError, match=r"remote_format 'LBNHC'.*prefill TP 1.*decode TP 2"):
        landed_format("LBNHC", local_tp=2, remote_tp=1)
    with pytest.raises(TpLayoutError, match="remote_format 'BLHNC'"):
        landed_format("BLHNC", local_tp=1, remote_tp=2)
    with pytest.raises(TpLayoutError, match="local_tp: 0"):
        landed_format("LBHNC", local_tp=0, remote_tp=2)
    with pytest.raises(TpLayoutError, match="remote_tp: 3 and local_tp: 2"):
        landed_format("LBHNC", local_tp=2, remote_tp=3)


def handshake_worker(vllm: SimpleNamespace, cls: type, local: Side, remote: Side, heads: int):
    """A worker of ``cls`` as vLLM's handshake check reads it, the prefill engine registered."""
    from vllm.distributed.kv_transfer.kv_connector.utils import EngineTransferInfo

    worker = vllm_worker(vllm, local, heads)
    worker.__class__ = cls
    worker.transfer_topo.register_remote_engine(
        "prefill",
        EngineTransferInfo(
            remote_tp_size=remote.tp_size,
            remote_block_len=remote.page_bytes,
            remote_block_size=remote.block_size,
            remote_physical_blocks_per_logical=1,
        ),
    )
    worker.dcp_size = 1
    worker.dst_region_group_ids = {"prefill": [0] * LAYERS}
    worker._physical_blocks_per_logical_kv_block = 1
    worker.use_host_buffer = False
    worker.kv_cache_layout = "LBHNC"
    worker.kv_transfer_config = SimpleNamespace(enable_permute_local_kv=False)
    worker.enable_permute_local_kv = False
    worker.backend_name = "CPU_ATTN"
    worker._is_hma_required = False
    worker.dst_num_blocks = {"prefill": remote.num_blocks}
    return worker


@pytest.mark.parametrize("heads", [2, 4])
def test_kvd_lets_through_what_vllm_refuses_at_the_handshake_and_nothing_else(
    vllm, heads: int
) -> None:
    """Prefill TP 2 at 32 -> decode TP 1 at 64: vLLM's own check refuses it; kvd's override
    runs vLLM's checks on the pages the sub-blocks fill, so a prefill page of another length
    (here: of the other head count) is still refused."""
    from kvd.vllm.connector import KvdWorker

    def side(tp: int, rank: int, block_size: int, page_heads: int) -> Side:
        return Side(rank, tp, block_size, [torch.zeros(4, page_heads, block_size, 2 * HEAD_DIM)])

    local = side(1, 0, 64, heads)
    remote = side(2, 0, 32, heads // 2)
    meta = agent_metadata(vllm, remote, "LBHNC")
    meta.kv_caches_base_addr = meta.kv_caches_base_addr[:1] * LAYERS
    meta.block_lens = meta.block_lens[:1] * LAYERS
    meta.block_strides = meta.block_strides[:1] * LAYERS
    stock = handshake_worker(vllm, vllm.worker, local, remote, heads)
    with pytest.raises(AssertionError, match="not supported when P TP > D TP"):
        stock._validate_remote_agent_handshake(meta, 2)
    handshake_worker(vllm, KvdWorker, local, remote, heads)._validate_remote_agent_handshake(
        meta, 2
    )
    wrong = dataclasses.replace(meta, block_lens=[n * 2 for n in meta.block_lens])
    with pytest.raises(AssertionError, match="SPLIT region 0"):
        handshake_worker(vllm, KvdWorker, local, remote, heads)._validate_remote_agent_handshake(
            wrong, 2
        )


def test_the_lifted_split_neither_changes_nor_copies_the_worker(vllm) -> None:
    """vLLM's worker shuts its NIXL agent down in ``__del__``: a copy of it, once collected,
    released the real worker's descriptor lists (a real TP 2 -> 1 pair failed so)."""
    import gc

    deleted: list[int] = []

    class Worker(vllm.worker):  # type: ignore[misc,name-defined]
        def __del__(self) -> None:
            deleted.append(id(self))

    local = Side(0, 1, 64, [torch.zeros(4, 2, 64, 2 * HEAD_DIM) for _ in range(LAYERS)])
    worker = vllm_worker(vllm, local, 2)
    worker.__class__ = Worker
    plan = vllm.compute_tp_mapping(worker.transfer_topo, 2, worker._group_spec_types)
    descs = worker._build_fa_local([t.data_ptr() for t in local.layers], 2)
    blocks = list(worker.region_num_blocks)
    splits = split_sub_blocks(
        worker,
        vllm.worker._build_local_splits_from_plan,
        plan=plan,
        src_blocks_data=descs,
        num_fa_descs=len(descs),
        ratio=2,
    )
    gc.collect()
    assert deleted == [] and worker.region_num_blocks == blocks
    assert len(splits) == 2 and all(len(h) == len(descs) for h in splits)
