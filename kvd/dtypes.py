"""The one dtype table: wire names, element sizes and torch dtypes.

Element sizes need no torch, so pure logic (geometry, planning) can use them; the torch side is
built on first use.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from kvd.protocol import DTypeName

if TYPE_CHECKING:
    import torch

ITEMSIZE: dict[DTypeName, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


class DTypeError(ValueError):
    """A dtype name the protocol does not know; the message names the field and the known ones."""


def itemsize(name: DTypeName, where: str = "dtype") -> int:
    """Bytes of one element of wire dtype ``name``; ``DTypeError`` naming ``where`` when the
    name is unknown (a spec built in Python, not decoded, is not checked against ``DTypeName``)."""
    size = ITEMSIZE.get(name)
    if size is None:
        raise DTypeError(f"{where}: unknown dtype {name!r}; known: {', '.join(ITEMSIZE)}")
    return size


@functools.cache
def _torch_table() -> dict[DTypeName, torch.dtype]:
    import torch

    return {name: getattr(torch, name) for name in ITEMSIZE}


def torch_dtype(name: DTypeName, where: str = "dtype") -> torch.dtype:
    """The torch dtype of a wire dtype name; ``DTypeError`` as ``itemsize`` says."""
    itemsize(name, where)
    return _torch_table()[name]


def dtype_name(dtype: torch.dtype) -> DTypeName | None:
    """The wire name of a torch dtype, or None when the protocol has none."""
    for name, candidate in _torch_table().items():
        if candidate == dtype:
            return name
    return None
