"""A hybrid model's KV cache groups in kvd.vllm (``kvd.vllm.groups``): pure logic.

The groups are vLLM's own spec classes (skipped where vLLM is not importable); the pairing
rules and the region keys need no vLLM.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvd.vllm.groups import (
    Group,
    GroupError,
    attached_apart,
    distinct_regions,
    request_groups,
    state_layers,
    transfer_groups,
)

FULL = Group("full", 32, ("model.layers.1.self_attn.attn",))
WINDOW = Group("sliding_window", 32, ("model.layers.0.self_attn.attn",))


def config(*specs: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)]
    return SimpleNamespace(transfer_groups=tuple(groups))


def test_attention_and_state_groups_are_taken_and_other_kinds_refused_by_name() -> None:
    spec = pytest.importorskip("vllm.v1.kv_cache_interface")
    common = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
    full = spec.FullAttentionSpec(block_size=32, **common)
    window = spec.SlidingWindowSpec(block_size=32, sliding_window=32, **common)
    found = transfer_groups(config(window, full), 32)
    assert [g.kind for g in found] == ["sliding_window", "full"]
    assert found[0].layers == ("layer.0",)
    assert not attached_apart(found)
    with pytest.raises(GroupError, match=r"KV cache group 1 \(FullAttentionSpec: layer.1\): "):
        transfer_groups(config(window, spec.FullAttentionSpec(block_size=64, **common)), 32)
    # Groups of block sizes of their own (a window layer of half the head size): attached apart.
    wide = spec.SlidingWindowSpec(block_size=64, sliding_window=32, **{**common, "head_size": 32})
    apart = transfer_groups(config(wide, full), 64)
    assert [(g.block_size, g.head_size) for g in apart] == [(64, 32), (32, 64)]
    assert attached_apart(apart)
    # A state group's blocks are states, not tokens: any block size, never attached.
    mamba = spec.MambaSpec(
        block_size=1024, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode="none"
    )
    found = transfer_groups(config(mamba, full), 32)
    assert [g.kind for g in found] == ["state", "full"]
    assert state_layers(found) == {"layer.0"}
    with pytest.raises(GroupError, match=r"all state \(Mamba\) groups.*NixlConnector"):
        transfer_groups(config(mamba), 32)
    chunked = spec.ChunkedLocalAttentionSpec(block_size=32, attention_chunk_size=64, **common)
    with pytest.raises(
        GroupError, match=r"group 1 \(ChunkedLocalAttentionSpec: layer.1\): .* not proven here"
    ):
        transfer_groups(config(full, chunked), 32)


def test_each_group_has_its_own_coverage() -> None:
    # 32 -> 32: a 300-token prompt, window blocks 8, 9 of 10; the full group all 10.
    window = [50, 51]
    full = list(range(10, 20))
    assert request_groups([WINDOW, FULL], [window, full], [2, 10], 1) == [
        (window, 2),
        (full, 10),
    ]
    # 32 -> 64 for a 40-token prompt: one local block each, both windows start at token 0.
    assert request_groups([WINDOW, FULL], [[7], [8]], [2, 2], 2) == [([7], 2), ([8], 2)]
    # An empty group (a window the request never reached) names no block.
    assert request_groups([WINDOW, FULL], [[], [8]], [0, 1], 2) == [([], 0), ([8], 1)]


def test_state_groups_are_left_out_of_a_read_done() -> None:
    state = Group("state", 1024, ("model.layers.0.mixer",))
    assert request_groups([state, FULL], [[3], [8, 9]], [1, 4], 2) == [([8, 9], 4)]
    assert request_groups([state, WINDOW, FULL], [[3], [9], [8, 9]], [1, 2, 4], 2) == [
        ([9], 2),
        ([8, 9], 4),
    ]


def test_windows_paired_from_different_first_tokens_are_recomputed() -> None:
    """32 -> 64, a 300-token prompt: the decode's window holds local blocks 3, 4 (tokens 192
    on), the prefill's remote blocks 8, 9 (tokens 256 on): vLLM lands 8 in block 3."""
    why = request_groups([WINDOW, FULL], [[3, 4], list(range(5))], [2, 10], 2)
    assert isinstance(why, str) and why.startswith("group 0 (sliding window): vLLM paired")
    # 32 -> 32 where the prefill kept one window block more: vLLM reads its last one only.
    assert request_groups([WINDOW, FULL], [[4], list(range(5))], [2, 5], 1) == [
        ([4], 1),
        (list(range(5)), 5),
    ]
    # Without a full-attention group nothing says where the window starts: only 1:1 pairs.
    assert request_groups([WINDOW], [[3, 4]], [2], 1) == [([3, 4], 2)]
    assert isinstance(request_groups([WINDOW], [[3]], [2], 2), str)


def test_windows_of_block_sizes_of_their_own_start_where_the_full_group_says() -> None:
    """Window blocks of 128 tokens beside full ones of 64 (64 and 32 on the prefill, 32 -> 64).
    A 100-token prompt: one local window block (tokens 0 on), two remote ones (0 on): aligned.
    A 300-token prompt: local block 2 (tokens 256 on), remote blocks 3, 4 (192 on): apart.
    Window blocks smaller than the full group's leave the window's start open: recomputed."""
    window = Group("sliding_window", 128, ("l0",))
    full = Group("full", 64, ("l1",))
    assert request_groups([window, full], [[7], [8, 9]], [2, 4], 2) == [([7], 2), ([8, 9], 4)]
    why = request_groups([window, full], [[7], [8, 9, 10, 11, 12]], [2, 10], 2)
    assert isinstance(why, str) and "from different first tokens" in why
    narrow = Group("sliding_window", 32, ("l0",))
    why = request_groups([narrow, full], [[7], [8, 9]], [1, 2], 1)
    assert isinstance(why, str) and "from different first tokens" in why


def test_regions_are_keyed_by_address_and_geometry() -> None:
    pool = torch.zeros(4 * 2 * 32 * 128)
    shared = pool.view(4, 2, 32, 128)
    regions = distinct_regions({"l0": shared, "l1": pool.view(4, 2, 32, 128), "l2": shared})
    assert [name for name, _ in regions] == ["l0"]
    other = torch.zeros(4, 2, 32, 128)
    assert [n for n, _ in distinct_regions({"l0": shared, "l1": other})] == ["l0", "l1"]
    with pytest.raises(GroupError, match=r"layers 'l0' and 'l1' view one region at 0x"):
        distinct_regions({"l0": shared, "l1": pool.view(8, 2, 16, 128)})
