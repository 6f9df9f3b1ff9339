"""The row permutation of one block, computed once per geometry and shared by every kernel."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class RowPlan:
    """New row ``i`` of a block is old row ``perm[i]``.

    ``runs`` lists (dst_row, src_row, n_rows) stretches of rows that move together, which lets
    merges (HND -> HND) move long stretches at a time.
    """

    perm: torch.Tensor
    _on_device: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def rows(self) -> int:
        return self.perm.numel()

    @functools.cached_property
    def runs(self) -> torch.Tensor:
        out: list[tuple[int, int, int]] = []
        for dst, src in enumerate(self.perm.tolist()):
            if out and out[-1][1] + out[-1][2] == src and out[-1][0] + out[-1][2] == dst:
                d, s, n = out[-1]
                out[-1] = (d, s, n + 1)
            else:
                out.append((dst, src, 1))
        return torch.tensor(out, dtype=torch.int64)

    def perm_on(self, device: torch.device) -> torch.Tensor:
        """``perm`` as int32 on ``device``, copied there once."""
        key = str(device)
        cached = self._on_device.get(key)
        if cached is None:
            cached = self._on_device[key] = self.perm.to(device=device, dtype=torch.int32)
        return cached
