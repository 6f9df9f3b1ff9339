"""A hybrid model's KV cache groups in vLLM's NIXL pull path: pure logic, no sockets.

A hybrid model (Gemma 3, gpt-oss: sliding-window and full-attention layers) has one KV cache
group per kind of layer, all drawing blocks from one pool and, when their pages are the same
size, from the same tensors: a block id names one group's page in every tensor. A request's
READ fills each group's blocks apart, so each group has its own coverage, and kvd is told
every group of a request in one ReadDone (``groups``): one outcome for the request.

vLLM 0.32 clips a sliding-window group to its in-window tail on each side, keeps the prefill's
last blocks where it lists more than the local blocks hold, and pairs the two lists from their
first blocks, so the prefill's pages land in the right local blocks only when both tails start
at the same token. At 32 -> 64 with a 32-token window they do (one local block
of 64 tokens, two remote blocks of 32: ``tests/vllm/test_hybrid.py``); kvd checks it for every
request from the full-attention group's lengths, and a request whose tails start apart is
recomputed: no rewrite of pages moves bytes between blocks.

Groups whose layers' pages hold different tokens (other head sizes, as Gemma 4 sizes its
sliding and full layers apart) get block sizes of their own from vLLM, the pages the same size,
and each tensor is one layer of every group: kvd attaches each group's views apart
(``TensorSpec.group``) and is told each group's blocks.

State groups (Mamba, whose blocks each hold one running state, not tokens) move 1:1 at any
block-size ratio, into decode pages laid out as the prefill's (vLLM reads only the state's
bytes, never a page's padding): nothing to rewrite, so kvd is never told their blocks and never
attaches their views of the cache. A model of state groups only has nothing for kvd to do. Other
kinds of group are refused by name at startup.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvd.vllm.holding import covered_sub_blocks

GroupKind = Literal["full", "sliding_window", "state"]


class GroupError(ValueError):
    """A KV cache group kvd.vllm does not take; the message names it."""


@dataclass(frozen=True, slots=True)
class Group:
    kind: GroupKind
    block_size: int
    layers: tuple[str, ...]
    head_size: int = 0
    """An attention group's head size (0: a state group's, or not known)."""


def transfer_groups(kv_cache_config: Any, block_size: int) -> list[Group]:
    """The groups of ``kv_cache_config`` (vLLM's ``KVCacheConfig``) whose blocks NIXL moves,
    checked: attention groups, full or sliding-window, with block sizes that divide the
    worker's ``block_size`` (their least common multiple), and state (Mamba) groups, whose
    blocks are not tokens."""
    groups = getattr(kv_cache_config, "transfer_groups", None)
    if groups is None:
        groups = kv_cache_config.kv_cache_groups
    found = []
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        names = {cls.__name__ for cls in type(spec).__mro__}
        layers = tuple(group.layer_names)
        shown = f"KV cache group {i} ({type(spec).__name__}: {', '.join(layers[:4])})"
        kind: GroupKind
        if "SlidingWindowSpec" in names:
            kind = "sliding_window"
        elif "FullAttentionSpec" in names and "SinkFullAttentionSpec" not in names:
            kind = "full"
        elif "MambaSpec" in names:
            found.append(Group("state", spec.block_size, layers))
            continue
        else:
            raise GroupError(
                f"{shown}: kvd.vllm takes full-attention, sliding-window and state (Mamba) "
                "groups; this kind's pages are not proven here"
            )
        if block_size % spec.block_size:
            raise GroupError(
                f"{shown}: blocks of {spec.block_size} tokens do not divide the worker's "
                f"{block_size}"
            )
        found.append(Group(kind, spec.block_size, layers, int(spec.head_size)))
    if all(group.kind == "state" for group in found):
        raise GroupError(
            "this model's KV cache groups are all state (Mamba) groups, which move as they are: "
            "kvd has nothing to post-process (use vLLM's NixlConnector)"
        )
    return found


def attached_apart(groups: Sequence[Group]) -> bool:
    """Whether kvd attaches each attention group's views of the cache apart: their block sizes
    differ (``TensorSpec.group``; the ReadDone then lists every attention group)."""
    return len({group.block_size for group in groups if group.kind != "state"}) > 1


def state_layers(groups: Sequence[Group]) -> frozenset[str]:
    """The layers of the state groups: kvd attaches none of their views of the cache."""
    return frozenset(layer for group in groups if group.kind == "state" for layer in group.layers)


def request_groups(
    groups: Sequence[Group],
    local: Sequence[Sequence[int]],
    remote_counts: Sequence[int],
    ratio: int,
    ranges: Sequence[range | None] = (),
) -> list[tuple[list[int], int]] | str:
    """(local block ids, covered_sub_blocks) of each attention group of one request, as a
    ReadDone's ``groups`` say them (state groups, never rewritten, are left out); or why no
    ReadDone can say them (the request is then recomputed).

    ``local``: the request's local blocks per group (vLLM's ``local_physical_block_ids``);
    ``remote_counts``: how many remote blocks each group read; ``ratio``: nD / nP (>= 1);
    ``ranges``: vLLM 0.34's covered ranges per group, where it records them.
    """
    f = next((g for g, group in enumerate(groups) if group.kind == "full"), None)
    full = None if f is None else (groups[f], len(local[f]), remote_counts[f])
    parts: list[tuple[list[int], int]] = []
    for g, group in enumerate(groups):
        if group.kind == "state":
            continue
        blocks = [int(b) for b in local[g]]
        if not blocks:
            parts.append((blocks, 0))
            continue
        # vLLM reads the last len(blocks) * ratio remote blocks where there are more.
        read = min(remote_counts[g], len(blocks) * ratio)
        if group.kind == "sliding_window" and not _window_aligned(
            group, len(blocks), read, ratio, full=full
        ):
            return (
                f"group {g} (sliding window): vLLM paired its last {len(blocks)} local blocks "
                f"with the prefill's last {remote_counts[g]} (ratio {ratio}) from different "
                "first tokens"
            )
        covered = covered_sub_blocks(
            len(blocks), ratio, remote_counts[g], ranges[g] if g < len(ranges) else None
        )
        if covered is None:
            return f"group {g}: its READ filled sub-blocks no ReadDone says"
        parts.append((blocks, covered))
    return parts


def _window_aligned(
    window: Group,
    num_local: int,
    num_remote: int,
    ratio: int,
    *,
    full: tuple[Group, int, int] | None,
) -> bool:
    """Whether a sliding-window group's local and remote lists start at the same token. A
    full-attention group of the same request (``full``: it, and its local and remote block
    counts) holds every block on both sides: its block counts bound the request's tokens, and
    the window's lists end where they end. Where the window's blocks are smaller than the full
    group's those bounds may not fix its first token: then it is taken as not aligned (the
    request is recomputed)."""
    if full is None:
        return ratio == 1 and num_local == num_remote
    group, full_local, full_remote = full
    starts = [
        _window_start(window.block_size // scale, group.block_size // scale, count, listed)
        for scale, count, listed in ((1, full_local, num_local), (ratio, full_remote, num_remote))
    ]
    return starts[0] is not None and starts[0] == starts[1]


def _window_start(window_size: int, full_size: int, full_blocks: int, listed: int) -> int | None:
    """The first token of the last ``listed`` window blocks of a request that fills
    ``full_blocks`` full-attention blocks; None where those do not fix it."""
    first = (full_blocks - 1) * full_size + 1  # the fewest and the most tokens
    last = full_blocks * full_size
    blocks = {-(-tokens // window_size) for tokens in (first, last)}
    if len(blocks) != 1:
        return None
    return (blocks.pop() - listed) * window_size


def distinct_regions(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """One (layer name, tensor) per memory region the layers' KV caches view, in order.

    Layers of a hybrid model's groups share tensors: such views are one region, kvd attaches
    it once. A region is keyed by its address, block length and strides, never by its address
    alone (vLLM #57661: regions merged by address corrupted DeepSeek-V4.1): layers that view
    one address with different geometry are refused, naming them.
    """
    seen: dict[int, tuple[str, tuple[Any, ...]]] = {}
    regions = []
    for name, tensor in tensors.items():
        key = (tuple(tensor.shape), tensor.stride(), tensor.dtype)
        first = seen.get(tensor.data_ptr())
        if first is None:
            seen[tensor.data_ptr()] = (name, key)
            regions.append((name, tensor))
        elif first[1] != key:
            block_bytes = tensor.stride(0) * tensor.element_size()
            raise GroupError(
                f"layers {first[0]!r} and {name!r} view one region at {tensor.data_ptr():#x} "
                f"differently (shape {first[1][0]} strides {first[1][1]} {first[1][2]}; shape "
                f"{key[0]} strides {key[1]} {key[2]}, {block_bytes} bytes a block): kvd "
                "cannot rewrite both"
            )
    return regions
