from __future__ import annotations

import pytest

from kvd.geometry import (
    GeometryError,
    cache_geometry,
    duplicate_ids,
    out_of_range_ids,
    resolve_ratio,
    tensor_geometry,
)
from kvd.protocol import ShmRef, TensorSpec


def spec(shape, *, arrangement="split", layout="NHD", block_size=16, name="t", dtype="bfloat16"):
    return TensorSpec(
        name=name,
        shape=shape,
        dtype=dtype,
        layout=layout,
        kv_arrangement=arrangement,
        block_size=block_size,
        memory=ShmRef(name="x"),
    )


@pytest.mark.parametrize(
    ("shape", "arrangement", "layout", "expected"),
    [
        ([2, 10, 16, 4, 64], "split", "NHD", (10, 4, 64, 1)),
        ([2, 10, 4, 16, 64], "split", "HND", (10, 4, 64, 1)),
        ([10, 2, 16, 4, 64], "blocks_first", "NHD", (10, 4, 64, 2)),
        ([10, 4, 16, 64], "single", "HND", (10, 4, 64, 1)),
        ([10, 16, 576], "mla", "NHD", (10, 1, 576, 1)),
    ],
)
def test_shapes(shape, arrangement, layout, expected) -> None:
    g = tensor_geometry(spec(shape, arrangement=arrangement, layout=layout))
    assert (g.num_blocks, g.num_heads, g.head_dim, g.kv_parts) == expected
    assert g.row_bytes == g.head_dim * 2


def test_nbytes_counts_both_halves_of_split() -> None:
    g = tensor_geometry(spec([2, 10, 16, 4, 64]))
    assert g.nbytes == 2 * 10 * 16 * 4 * 64 * 2


@pytest.mark.parametrize(
    ("shape", "kwargs", "message"),
    [
        ([2, 10, 16, 4], {}, "needs 5 dimensions"),
        ([3, 10, 16, 4, 64], {}, "K/V axis of 2"),
        ([2, 10, 8, 4, 64], {}, "block_size: 16 does not match"),
        ([2, 10, 16, 4, 64], {"block_size": 0}, "block_size: must be > 0"),
        ([2, 0, 16, 4, 64], {}, "every dimension must be > 0"),
    ],
)
def test_bad_shapes_name_the_field(shape, kwargs, message) -> None:
    with pytest.raises(GeometryError, match=message):
        tensor_geometry(spec(shape, **kwargs), "tensors[3]")
    with pytest.raises(GeometryError, match=r"tensors\[3\]"):
        tensor_geometry(spec(shape, **kwargs), "tensors[3]")


def test_cache_tensors_must_agree() -> None:
    with pytest.raises(GeometryError, match=r"tensors\[1\].shape: num_blocks 9 differs"):
        cache_geometry([spec([2, 10, 16, 4, 64], name="a"), spec([2, 9, 16, 4, 64], name="b")])
    with pytest.raises(GeometryError, match="names must be unique"):
        cache_geometry([spec([2, 10, 16, 4, 64]), spec([2, 10, 16, 4, 64])])
    with pytest.raises(GeometryError, match="at least one tensor"):
        cache_geometry([])


def test_resolve_ratio() -> None:
    assert resolve_ratio(64, 4, 0) == 4
    assert resolve_ratio(64, 0, 16) == 4
    assert resolve_ratio(64, 4, 16) == 4
    for args, message in [
        ((64, 0, 0), "give block_size_ratio or remote_block_size"),
        ((64, 3, 0), "does not divide"),
        ((64, -1, 0), ">= 1"),
        ((64, 0, 48), "does not divide"),
        ((64, 2, 16), "contradicts"),
    ]:
        with pytest.raises(ValueError, match=message):
            resolve_ratio(*args)


def test_block_id_checks() -> None:
    assert out_of_range_ids([0, 5, 9], 10) == []
    assert out_of_range_ids([0, -1, 10, 3], 10) == [-1, 10]
    assert out_of_range_ids([], 10) == []
    assert duplicate_ids([1, 2, 3]) == []
    assert duplicate_ids([1, 2, 1, 3, 2, 1]) == [1, 2, 1]
