"""Prefill blocks larger than decode blocks (nP > nD) in vLLM 0.32's NIXL pull path: pure logic.

vLLM refuses nP > nD at the handshake. For nP < nD it splits each *local* page into r
descriptors, one per remote page; here each *remote* page is split into k = nP / nD
descriptors, one per local page, so remote block ``i`` lands across k local blocks, byte range
``[j * D, (j + 1) * D)`` of its page (D = P / k) in the j-th. vLLM already reads a remote
engine whose logical blocks are several kernel blocks (``physical_blocks_per_logical_kv_block``):
presented as k sub-pages of nD tokens per page, the prefill's cache is read with vLLM's own
descriptor lists and block-id expansion (remote block ``i`` -> sub-blocks ``i*k .. i*k+k-1``).
kvd then rewrites each group of k local pages, one remote page's bytes in order, into k pages
of the local format (``remote_block_size`` = nP in the ReadDone).

A group is read whole or not at all: the tokens of one local page are spread over the whole
remote page in most formats (CPU attention keeps K transposed, LBHNC keeps heads outermost).
When a request's last remote block holds fewer than k local blocks' tokens, there is no room to
land the rest of its page, so those local blocks are not read: vLLM is told they failed to load
(invalid block ids) and recomputes their tokens, fewer than nP, from the prompt.

Any TP pair reads so: a decode rank at a TP size above the prefill's reads its heads' byte
range of each remote page in k pieces (``slice_sub_pages``); at a prefill TP above the decode's
vLLM posts one READ per prefill rank, each writing its slot of every local page, so piece j of
each rank's page lands in the j-th local page of a group, which the ReadDone says
(``remote_ranks``).

A hybrid model (several KV cache groups) is read group by group (``plan_hybrid_split_read``);
a state (Mamba) group's blocks, whole states, are read 1:1 as vLLM lists them.
vLLM's scheduler takes no invalid block ids from a model with several groups, so a request
whose groups cannot all be read whole is recomputed instead, whole: one whose last remote block
holds fewer than k local blocks' tokens, and one whose sliding-window tail starts inside a
remote block (vLLM keeps the window's last blocks on each side, and the local block before such
a tail, where the page's first sub-page would land, is not among them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvd.vllm.groups import GroupKind


class SplitError(RuntimeError):
    """A prefill engine whose pages cannot be read as sub-pages; the message says why."""


def split_remote_pages(meta: Any, local_block_size: int) -> int:
    """k = nP / nD for a prefill engine's handshake metadata (``NixlAgentMetadata``), after
    rewriting it in place so that vLLM reads each remote page as k sub-pages of nD tokens:
    block size, block count, page length and stride per region, blocks per logical block.

    Returns 1 and leaves ``meta`` as it is when nP <= nD. Raises ``SplitError`` when nP is not
    a multiple of nD, or a region's pages are not back to back (stride != page length): a
    sub-page would then not be where ``stride / k`` puts it.
    """
    remote_block_size = int(meta.block_size)
    if remote_block_size <= local_block_size:
        return 1
    if remote_block_size % local_block_size:
        raise SplitError(
            f"block_size: the prefill's {remote_block_size} is not a multiple of this "
            f"engine's {local_block_size}"
        )
    k = remote_block_size // local_block_size
    for region, (length, stride) in enumerate(
        zip(meta.block_lens, meta.block_strides, strict=True)
    ):
        if length != stride or length % k:
            raise SplitError(
                f"region {region}: pages of {length} bytes every {stride} bytes cannot be read "
                f"as {k} sub-pages (kvd.vllm needs pages back to back, a multiple of {k} bytes)"
            )
    meta.block_size = local_block_size
    meta.num_blocks = meta.num_blocks * k
    meta.block_lens = [length // k for length in meta.block_lens]
    meta.block_strides = [stride // k for stride in meta.block_strides]
    if meta.region_num_blocks is not None:
        meta.region_num_blocks = [n * k for n in meta.region_num_blocks]
    meta.physical_blocks_per_logical_kv_block = meta.physical_blocks_per_logical_kv_block * k
    return k


def slice_sub_pages(descs: npt.NDArray[np.uint64], meta: Any, k: int) -> npt.NDArray[np.uint64]:
    """vLLM's remote descriptors of a split prefill engine (``meta`` as ``split_remote_pages``
    left it) for a decode rank at a TP size above the prefill's, placed so that sub-block
    ``i * k + j`` reads the ``j``-th of k pieces of this rank's byte range of remote page ``i``.

    vLLM reads a rank's heads at ``rank_offset_factor`` times the local page length into each
    *sub-page*: a range of one sub-page's bytes, which holds other heads than the rank's (in
    an HND page the first sub-page holds the first heads). The rank's range of the whole page
    starts k times further in, and its pieces follow each other, each a local page long. Rows
    that read whole sub-pages (replicated regions: MLA) are left as they are. ``descs`` is not
    changed; returns the placed rows (address, length, device)."""
    placed = np.array(descs, dtype=np.uint64, copy=True)
    row = 0
    blocks = meta.region_num_blocks or [meta.num_blocks] * len(meta.kv_caches_base_addr)
    for base, stride, count in zip(
        meta.kv_caches_base_addr, meta.block_strides, blocks, strict=True
    ):
        rows = placed[row : row + count]
        row += count
        length = int(rows[0, 1]) if count else stride
        if length >= stride:
            continue
        offset = int(rows[0, 0]) - int(base)  # rank_offset_factor * length
        sub = np.arange(count, dtype=np.uint64)
        rows[:, 0] = (
            np.uint64(base)
            + sub // np.uint64(k) * np.uint64(k * stride)
            + np.uint64(k * offset)
            + sub % np.uint64(k) * np.uint64(length)
        )
    if row != len(placed):
        raise SplitError(f"{len(placed)} remote descriptors for regions of {row} blocks")
    return placed


@dataclass(frozen=True, slots=True)
class SplitRead:
    """One request's READ from a split remote: ``local[q]`` receives remote sub-page
    ``remote[q]``; ``unread`` are the request's local blocks left for vLLM to recompute."""

    local: list[int]
    remote: list[int]
    unread: list[int]


def plan_split_read(
    local: Sequence[int], remote_sub_blocks: Sequence[int], k: int, local_computed: int
) -> SplitRead:
    """What to read of one request, in whole groups of k local blocks.

    ``local``: the local blocks vLLM would read into, those after the ``local_computed`` blocks
    of its local prefix cache hit, in token order. ``remote_sub_blocks``: the remote
    sub-blocks of the whole prompt, k per remote block, in token order (the i-th local block
    of the sequence pairs with the i-th sub-block).
    """
    if local_computed % k:  # the first group is partly computed here: no room for its page
        return SplitRead([], [], list(local))
    groups = min(len(local), len(remote_sub_blocks) - local_computed) // k
    n = max(groups, 0) * k
    return SplitRead(
        list(local[:n]),
        list(remote_sub_blocks[local_computed : local_computed + n]),
        list(local[n:]),
    )


def plan_hybrid_split_read(
    kinds: Sequence[GroupKind],
    local: Sequence[Sequence[int]],
    remote_sub_blocks: Sequence[Sequence[int]],
    k: int,
    local_computed: Sequence[int],
) -> list[SplitRead] | str:
    """Each group's read of one request of a hybrid model, every group in whole groups of k
    local blocks; or why the request cannot be read so (it is then recomputed).

    ``kinds``: each KV cache group's kind; ``local``: the local blocks vLLM would read into per
    group (a sliding-window group's in-window tail); ``remote_sub_blocks``: the remote
    sub-blocks per group, k per remote block (a sliding-window group's tail, of the prefill's
    window); ``local_computed``: each group's blocks of a local prefix cache hit.

    A full-attention group holds every block of the sequence on both sides, so it places the
    sliding-window tails: each ends where the full group's lists end. A state (Mamba) group's
    blocks are read as vLLM lists them, one state per block: its descriptors and block ids
    stay at the prefill's logical geometry, which the split metadata keeps (block count
    divided by blocks per logical block, stride multiplied by it).
    """
    full = next((g for g, kind in enumerate(kinds) if kind == "full"), None)
    if full is None:
        return "no full-attention group places the sliding-window groups' blocks"
    computed = [local_computed[g] if g < len(local_computed) else 0 for g in range(len(kinds))]
    last = len(local[full]) + computed[full]  # the sequence's local blocks: every list ends there
    remote_last = len(remote_sub_blocks[full])
    plans: dict[int, SplitRead] = {}
    for g, kind in enumerate(kinds):
        if kind == "full":
            plan = plan_split_read(local[g], remote_sub_blocks[g], k, computed[g])
            if plan.unread:
                return (
                    f"group {g}: {len(plan.unread)} local blocks hold part of a remote block of "
                    f"{k} (no group of a hybrid model can be recomputed alone)"
                )
            plans[g] = plan
    for g, kind in enumerate(kinds):
        tail, remote_tail = local[g], remote_sub_blocks[g]
        if kind == "full":
            continue
        if kind == "state":  # whole states, 1:1 at the logical geometry vLLM keeps for them
            plans[g] = SplitRead(list(tail), list(remote_tail), [])
            continue
        if not tail:
            plans[g] = SplitRead([], [], [])
            continue
        first = last - len(tail)
        offset = first - (remote_last - len(remote_tail))
        if (
            computed[g]
            or first % k
            or len(tail) % k
            or not 0 <= offset <= len(remote_tail) - len(tail)
        ):
            return (
                f"group {g} (sliding window): its {len(tail)} local blocks from block {first} "
                f"are not whole remote blocks of {k} among the prefill's last "
                f"{len(remote_tail) // k}"
            )
        plans[g] = SplitRead(list(tail), list(remote_tail[offset : offset + len(tail)]), [])
    return [plans[g] for g in range(len(kinds))]
