"""Deterministic KV content: what the demo's prefill writes and its decode side checks.

Every byte of every (engine, region, block, token, head, row byte) gets a value from a small
integer hash, so the decode side can recompute what any remote block held without asking the
prefill process, and a block in the wrong place, a token out of order or a head swapped shows.
"""

from __future__ import annotations

import torch

_MODULUS = 2_147_483_647  # 2**31 - 1: products of two residues stay inside int64


def token_rows(
    seed: int, region: int, block_ids: torch.Tensor, *, tokens: int, heads: int, row_bytes: int
) -> torch.Tensor:
    """Content of ``block_ids`` (1-D int64) of one region, as uint8 in NHD order.

    Shape ``(len(block_ids), tokens, heads, row_bytes)``; ``region`` numbers a cache's K/V
    regions (``2 * layer + kv`` for split caches).
    """
    b = block_ids.to(torch.int64).view(-1, 1, 1, 1)
    t = torch.arange(tokens, dtype=torch.int64).view(1, -1, 1, 1)
    h = torch.arange(heads, dtype=torch.int64).view(1, 1, -1, 1)
    c = torch.arange(row_bytes, dtype=torch.int64).view(1, 1, 1, -1)
    x = (seed * 1_000_003 + region * 7_919 + b * 104_729 + t * 131 + h * 17 + c) % _MODULUS
    x = (x * 48_271) % _MODULUS
    x = x ^ (x >> 13)
    x = (x * 16_807) % _MODULUS
    return (x ^ (x >> 11)).to(torch.uint8)


def fill(tensor: torch.Tensor, seed: int, region_base: int, *, layout: str, heads: int) -> None:
    """Write every block of a split tensor ``(2, num_blocks, *block)`` with ``token_rows``."""
    raw = tensor.view(torch.uint8)
    num_blocks = raw.shape[1]
    tokens = raw.shape[2] if layout == "NHD" else raw.shape[3]
    all_blocks = torch.arange(num_blocks)
    for kv in range(2):
        rows = token_rows(
            seed, region_base + kv, all_blocks, tokens=tokens, heads=heads, row_bytes=raw.shape[-1]
        )
        raw[kv].copy_(rows if layout == "NHD" else rows.transpose(1, 2))


def request_tokens(local: torch.Tensor, block_ids: list[int], *, layout: str) -> torch.Tensor:
    """The rows of one region's ``block_ids`` in request order, NHD: ``(tokens, heads, row)``.

    ``local`` is one region ``(num_blocks, *block)`` of a cache, viewed as uint8.
    """
    blocks = local[torch.tensor(block_ids, dtype=torch.int64)]
    if layout == "HND":
        blocks = blocks.transpose(1, 2)
    return blocks.reshape(-1, blocks.shape[2], blocks.shape[3])
