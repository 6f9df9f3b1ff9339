"""Prefill TP above decode TP with smaller prefill blocks, which vLLM 0.32 refuses although its
descriptors express it.

vLLM refuses the pair twice: its handshake check ("Different local/remote block sizes are not
supported when P TP > D TP") and ``_build_local_splits_from_plan`` ("Head-sharded attention
reads with P_TP > D_TP and heterogeneous block sizes are not supported"), both asserts. Its
descriptors need neither: the local descriptors at the remote block size cut each local page
into ``ratio`` sub-blocks (``_build_fa_local``), and the per-source-rank split of those, taken
as blocks of their own, writes each source rank's whole page at its head slot inside each
sub-block, while the remote descriptors (``_build_fa_remote``) already read whole remote pages
(local page / ratio / source ranks). A sub-block then holds this rank's heads in head order
at the remote block size, as at equal TP, and kvd rewrites it like any other
(``kvd.vllm.formats.landed_format``; ``tests/test_vllm_tp.py`` checks the bytes).

Only attention caches are lifted: MLA is replicated (read whole, never split), and Mamba state
is sharded differently; both keep vLLM's refusal. So does a vLLM whose worker lacks what this
reads or overrides (``KvdWorker._validate_remote_agent_handshake``,
``_build_local_splits_from_plan``): the pair is then refused at the handshake and recomputed.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any


def lifts(worker: Any, remote_tp_size: int, remote_block_size: int) -> int:
    """The block-size ratio of a pair kvd lifts vLLM's refusal for (prefill TP above this
    rank's, prefill blocks a proper divisor of the local ones, attention caches read straight
    into device memory), else 0."""
    topo = worker.transfer_topo
    local_tp, local_block = int(topo.tp_size), int(topo.block_size)
    if remote_tp_size <= local_tp or remote_block_size >= local_block:
        return 0
    if local_block % remote_block_size:
        return 0
    # An attribute this vLLM lacks keeps its refusal.
    if getattr(worker, "use_mla", True) or getattr(worker, "_has_mamba", True):
        return 0
    if getattr(worker, "use_host_buffer", True):
        return 0
    return local_block // remote_block_size


def as_equal_blocks(nixl_agent_meta: Any, ratio: int) -> Any:
    """A prefill rank's handshake metadata as if its pages were ``ratio`` of its pages back to
    back, for vLLM's own checks of everything else: its page-length check then holds exactly
    when ``ratio`` remote pages of every source rank fill a local page."""
    return dataclasses.replace(
        nixl_agent_meta,
        block_size=nixl_agent_meta.block_size * ratio,
        block_lens=[n * ratio for n in nixl_agent_meta.block_lens],
        block_strides=[s * ratio for s in nixl_agent_meta.block_strides],
    )


class _SubBlocks:
    """``worker`` with each region's ``ratio`` sub-blocks per page counted as blocks, for vLLM's
    own methods to run on: its functions bind to this view, everything else is the worker's.

    Not a copy: vLLM's worker shuts its NIXL agent down in ``__del__``, and a copy's collection
    once released the real worker's descriptor lists and stopped its handshake executor."""

    def __init__(self, worker: Any, ratio: int) -> None:
        self._worker = worker
        self.region_num_blocks = [n * ratio for n in worker.region_num_blocks]

    def __getattr__(self, name: str) -> Any:
        attr = inspect.getattr_static(type(self._worker), name, None)
        if inspect.isfunction(attr):
            return attr.__get__(self, type(self))
        return getattr(self._worker, name)


def split_sub_blocks(
    worker: Any,
    split: Callable[..., Any],
    *,
    plan: Any,
    src_blocks_data: Any,
    num_fa_descs: int,
    ratio: int,
) -> list[list[tuple[int, int, int]]]:
    """vLLM's per-source-rank split (``split``: its ``_build_local_splits_from_plan``) of the
    local descriptors at the remote block size, each of a region's ``ratio`` sub-blocks per
    page taken as a block: one descriptor list per source rank, in ``plan.all_source_ranks``
    order. ``worker`` is neither changed nor copied."""
    return list(split(_SubBlocks(worker, ratio), plan, src_blocks_data, num_fa_descs, 1))
