"""An independent, obviously-correct statement of the post-process, for tests only.

It follows DESIGN.md token by token with explicit index arithmetic and shares no code with
kvd.postprocess: local block b, sub-block s, sub-block token t', head h.
"""

from __future__ import annotations

import torch


def remote_row(
    s: int, kv: int, t_sub: int, h: int, *, kv_parts: int, sub: int, heads: int, remote_layout: str
) -> int:
    """Row index, inside one local block, where NIXL put (sub-block s, K/V part kv, t', h)."""
    base = s * kv_parts * sub * heads + kv * sub * heads
    return base + (h * sub + t_sub if remote_layout == "HND" else t_sub * heads + h)


def local_row(kv: int, t: int, h: int, *, block_size: int, heads: int, local_layout: str) -> int:
    """Row index of (K/V part kv, token t, head h) in the local layout."""
    base = kv * block_size * heads
    return base + (t * heads + h if local_layout == "NHD" else h * block_size + t)


def expected_block(
    block: torch.Tensor,
    *,
    kv_parts: int,
    block_size: int,
    heads: int,
    ratio: int,
    remote_layout: str,
    local_layout: str,
) -> torch.Tensor:
    """What one received block must hold after the post-process (``block`` is left alone)."""
    rows = block.reshape(kv_parts * block_size * heads, -1)
    out = torch.empty_like(rows)
    sub = block_size // ratio
    for s in range(ratio):
        for kv in range(kv_parts):
            for t_sub in range(sub):
                for h in range(heads):
                    src = remote_row(
                        s,
                        kv,
                        t_sub,
                        h,
                        kv_parts=kv_parts,
                        sub=sub,
                        heads=heads,
                        remote_layout=remote_layout,
                    )
                    dst = local_row(
                        kv,
                        s * sub + t_sub,
                        h,
                        block_size=block_size,
                        heads=heads,
                        local_layout=local_layout,
                    )
                    out[dst] = rows[src]
    return out.reshape(block.shape)


def random_bytes(shape: list[int] | tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` with random bytes (any bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(*shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
