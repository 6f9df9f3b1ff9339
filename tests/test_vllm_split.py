"""kvd.vllm.split: reading prefill blocks larger than decode blocks, without vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from kvd.vllm.groups import GroupKind
from kvd.vllm.split import (
    SplitError,
    SplitRead,
    plan_hybrid_split_read,
    plan_split_read,
    split_remote_pages,
)


@dataclass
class AgentMetadata:
    """The fields of vLLM 0.32's ``NixlAgentMetadata`` that ``split_remote_pages`` rewrites."""

    block_size: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    region_num_blocks: list[int] | None = None
    physical_blocks_per_logical_kv_block: int = 1
    kv_caches_base_addr: list[int] = field(default_factory=lambda: [1 << 20, 1 << 24])


def test_a_larger_remote_page_reads_as_k_sub_pages_where_they_are() -> None:
    page = 2 * 64 * 2 * 64  # heads x tokens x 2 * head_dim, 1-byte elements
    meta = AgentMetadata(64, 10, [page, page], [page, page], [10, 10])
    assert split_remote_pages(meta, 32) == 2
    assert (meta.block_size, meta.num_blocks, meta.region_num_blocks) == (32, 20, [20, 20])
    assert meta.block_lens == [page // 2] * 2 and meta.physical_blocks_per_logical_kv_block == 2
    # vLLM's descriptor of sub-block i*k + j: base + (i*k + j) * stride, len bytes. It must be
    # bytes [j * D, (j + 1) * D) of remote page i.
    for i in range(10):
        for j in range(2):
            addr = meta.kv_caches_base_addr[1] + (i * 2 + j) * meta.block_strides[1]
            assert addr == meta.kv_caches_base_addr[1] + i * page + j * meta.block_lens[1]


def test_remote_pages_no_larger_are_left_to_vllm() -> None:
    meta = AgentMetadata(32, 10, [4096], [4096])
    assert split_remote_pages(meta, 64) == 1 and split_remote_pages(meta, 32) == 1
    assert meta == AgentMetadata(32, 10, [4096], [4096])


@pytest.mark.parametrize(
    ("meta", "why"),
    [
        (AgentMetadata(96, 10, [4096], [4096]), "not a multiple of this engine's 64"),
        (AgentMetadata(128, 10, [4096], [8192]), "region 0: pages of 4096 bytes every 8192"),
    ],
)
def test_remote_pages_that_cannot_be_split_are_refused(meta: AgentMetadata, why: str) -> None:
    with pytest.raises(SplitError, match=why):
        split_remote_pages(meta, 64)


@pytest.mark.parametrize(
    ("local", "remote_blocks", "k", "computed", "want"),
    [
        # 300 tokens, 64 -> 32: 10 local blocks, 5 remote blocks, all whole groups.
        (list(range(10)), 5, 2, 0, SplitRead(list(range(10)), list(range(10)), [])),
        # 70 tokens, 64 -> 32: the second remote block holds 6 tokens, one local block's worth.
        ([7, 3, 9], 2, 2, 0, SplitRead([7, 3], [0, 1], [9])),
        # 40 tokens, 128 -> 32: one remote block, two local blocks of its four: nothing read.
        ([5, 6], 1, 4, 0, SplitRead([], [], [5, 6])),
        # 300 tokens, 128 -> 32: two whole groups, the third remote block's 44 tokens recomputed.
        (list(range(10)), 3, 4, 0, SplitRead(list(range(8)), list(range(8)), [8, 9])),
        # A local prefix hit of 2 blocks (one whole group): the rest pairs from sub-block 2 on.
        ([7, 8, 9], 3, 2, 2, SplitRead([7, 8], [2, 3], [9])),
        # A prefix hit ending inside a group: that group has no room for its page.
        ([7, 8, 9], 3, 2, 1, SplitRead([], [], [7, 8, 9])),
    ],
)
def test_a_request_reads_whole_groups_and_leaves_the_rest_to_recompute(
    local: list[int], remote_blocks: int, k: int, computed: int, want: SplitRead
) -> None:
    sub_blocks = [i * k + j for i in range(remote_blocks) for j in range(k)]
    assert plan_split_read(local, sub_blocks, k, computed) == want


def hybrid_lists(
    tokens: int, k: int, *, block: int = 32, window: int = 32
) -> tuple[list[list[int]], list[list[int]]]:
    """(local, remote sub-blocks) per group, [full, sliding window], of a request of ``tokens``
    as vLLM 0.32 clips them: a sliding-window group keeps its last cdiv(window, block) + 1
    blocks on each side. Local block i is 100 + i (full) or 200 + i; remote sub-block j of the
    full group is 1000 + j, of the window group 2000 + j: a pairing shows in the ids."""
    local_blocks = -(-tokens // block)
    remote_blocks = -(-tokens // (block * k))
    keep_local = -(-window // block) + 1
    keep_remote = -(-window // (block * k)) + 1
    local = [list(range(100, 100 + local_blocks)), list(range(200, 200 + local_blocks))]
    remote = [
        list(range(1000, 1000 + remote_blocks * k)),
        list(range(2000, 2000 + remote_blocks * k)),
    ]
    local[1] = local[1][-keep_local:]
    remote[1] = remote[1][-keep_remote * k :]
    return local, remote


KINDS: list[Literal["full", "sliding_window"]] = ["full", "sliding_window"]


def test_a_hybrid_request_reads_each_group_where_its_tokens_are() -> None:
    # 100 tokens, 64 -> 32: local blocks 0-3, window tail 2-3; the prefill's window tail is
    # its last 2 blocks, sub-blocks 0-3, of which 2-3 hold the local tail's tokens.
    local, remote = hybrid_lists(100, 2)
    plans = plan_hybrid_split_read(KINDS, local, remote, 2, [0, 0])
    assert plans == [
        SplitRead([100, 101, 102, 103], [1000, 1001, 1002, 1003], []),
        SplitRead([202, 203], [2002, 2003], []),
    ]
    # 300 tokens: local tail 8-9, the prefill's 3-4 (sub-blocks 6-9): 8-9 are its last two.
    local, remote = hybrid_lists(300, 2)
    plans = plan_hybrid_split_read(KINDS, local, remote, 2, [0, 0])
    assert not isinstance(plans, str)
    assert plans[1] == SplitRead([208, 209], [2008, 2009], [])
    assert plans[0].local == list(range(100, 110)) and plans[0].unread == []


@pytest.mark.parametrize(
    ("tokens", "k", "window", "why"),
    [
        # The last remote block holds 16 tokens: one local block of its two.
        (80, 2, 32, "group 0: 1 local blocks hold part of a remote block"),
        # 128 -> 32, 100 tokens: the window's tail starts at local block 2, inside remote 0.
        (100, 4, 32, "group 1 (sliding window): its 2 local blocks from block 2"),
        # 64 -> 32 with a 64-token window: a tail of 3 blocks from block 1.
        (128, 2, 64, "group 1 (sliding window): its 3 local blocks from block 1"),
    ],
)
def test_a_hybrid_request_not_read_whole_is_recomputed_whole(
    tokens: int, k: int, window: int, why: str
) -> None:
    local, remote = hybrid_lists(tokens, k, window=window)
    plans = plan_hybrid_split_read(KINDS, local, remote, k, [0, 0])
    assert isinstance(plans, str) and plans.startswith(why), plans


def test_a_hybrid_request_with_a_window_prefix_hit_is_recomputed() -> None:
    local, remote = hybrid_lists(100, 2)
    plans = plan_hybrid_split_read(KINDS, local, remote, 2, [0, 2])
    assert isinstance(plans, str) and "group 1 (sliding window)" in plans


def test_a_hybrid_model_without_a_full_attention_group_is_not_read() -> None:
    local, remote = hybrid_lists(100, 2)
    plans = plan_hybrid_split_read(["sliding_window"], local[1:], remote[1:], 2, [0])
    assert isinstance(plans, str) and "no full-attention group" in plans


def test_a_state_group_is_read_one_to_one_beside_whole_attention_groups() -> None:
    """A Mamba hybrid: the attention group in whole groups of k, the state group's blocks as
    vLLM lists them (one state each, never split); a request whose attention group cannot be
    read whole is recomputed, state and all."""
    kinds: list[GroupKind] = ["state", "full"]
    full_local, full_remote = list(range(10, 14)), [i * 2 + j for i in (5, 8) for j in (0, 1)]
    plans = plan_hybrid_split_read(kinds, [[3], full_local], [[7], full_remote], 2, [0, 0])
    assert plans == [SplitRead([3], [7], []), SplitRead(full_local, full_remote, [])]
    partial = plan_hybrid_split_read(kinds, [[3], full_local], [[7], full_remote[:3]], 2, [0, 0])
    assert isinstance(partial, str) and "group 1: 2 local blocks hold part of a remote" in partial
