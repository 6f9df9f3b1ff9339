from __future__ import annotations

import math

import msgspec
import pytest

from kvd.layout.formats import PRESETS
from kvd.layout.geometry import (
    GeometryError,
    cache_geometry,
    check_block_ids,
    resolve_remote_block_size,
    tensor_geometry,
)
from kvd.protocol import PageFormat, ShmRef, TensorSpec


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


def format_spec(shape, page_format, *, block_size=16, heads=4, head_dim=64, layers=0):
    return TensorSpec(
        name="t",
        shape=shape,
        dtype="bfloat16",
        block_size=block_size,
        memory=ShmRef(name="x"),
        page_format=page_format,
        num_heads=heads,
        head_dim=head_dim,
        num_layers=layers,
    )


@pytest.mark.parametrize(
    ("shape", "arrangement", "layout", "preset", "expected"),
    [
        ([2, 10, 16, 4, 64], "split", "NHD", "NHD", (10, 4, 64, 2)),
        ([2, 10, 4, 16, 64], "split", "HND", "HND", (10, 4, 64, 2)),
        ([10, 2, 16, 4, 64], "blocks_first", "NHD", "blocks_first_NHD", (10, 4, 64, 1)),
        ([10, 4, 16, 64], "single", "HND", "single_HND", (10, 4, 64, 1)),
        ([10, 16, 576], "mla", "NHD", "mla", (10, 1, 576, 1)),
    ],
)
def test_legacy_shapes(shape, arrangement, layout, preset, expected) -> None:
    g = tensor_geometry(spec(shape, arrangement=arrangement, layout=layout))
    assert (g.num_blocks, g.num_heads, g.head_dim, g.num_regions) == expected
    assert g.format == PRESETS[preset]
    assert g.nbytes == 10 * g.page_bytes * g.num_regions
    assert (g.arrangement, g.layout) == (arrangement, layout)


def test_nbytes_counts_both_halves_of_split() -> None:
    g = tensor_geometry(spec([2, 10, 16, 4, 64]))
    assert g.nbytes == 2 * 10 * 16 * 4 * 64 * 2
    assert g.page_bytes == g.block_bytes == 16 * 4 * 64 * 2


@pytest.mark.parametrize(
    ("shape", "kwargs", "message"),
    [
        ([2, 10, 16, 4], {}, "needs 5 dimensions"),
        ([3, 10, 16, 4, 64], {}, "K/V axis of 2"),
        ([2, 10, 8, 4, 64], {}, "block_size: 16 does not match"),
        ([2, 10, 16, 4, 64], {"block_size": 0}, "block_size: must be > 0"),
        ([2, 0, 16, 4, 64], {}, "every dimension must be > 0"),
        ([2, 10, 16, 4, 64], {"dtype": "float64"}, r"\.dtype: unknown dtype 'float64'; known: "),
        ([2, 10, 16, 4, 64], {"layout": "XYZ"}, r"\.layout: unknown layout 'XYZ'; known: "),
        ([2, 10, 16, 4, 64], {"arrangement": "x"}, r"\.kv_arrangement: unknown kv_arrangement"),
    ],
)
def test_bad_shapes_name_the_field(shape, kwargs, message) -> None:
    with pytest.raises(GeometryError, match=message):
        tensor_geometry(spec(shape, **kwargs), "tensors[3]")
    with pytest.raises(GeometryError, match=r"tensors\[3\]"):
        tensor_geometry(spec(shape, **kwargs), "tensors[3]")


@pytest.mark.parametrize(
    ("shape", "page_format", "kwargs", "regions", "num_blocks"),
    [
        ([10, 4, 16, 128], "cpu_attn_vec", {}, 1, 10),  # as vLLM allocates it
        ([10, 4, 16, 128], "LBHNC", {}, 1, 10),
        ([10, 3, 4, 16, 128], "BLHNC", {"layers": 3}, 1, 10),
        ([4, 10, 16, 128], "LHBNC", {}, 4, 10),
        ([2, 10, 16, 4, 64], "NHD", {}, 2, 10),
        ([2, 10, 4096], "HND", {}, 2, 10),  # the page's dims are free; only its bytes count
        ([10, 16, 64], "mla", {"heads": 0}, 1, 10),
        ([10, 2 * 16 * 64 * 4], PageFormat(outer=("H",), k=("N", "C"), v=("C", "N")), {}, 1, 10),
    ],
)
def test_page_format_shapes(shape, page_format, kwargs, regions, num_blocks) -> None:
    g = tensor_geometry(format_spec(shape, page_format, **kwargs), "tensors[0]")
    assert (g.num_regions, g.num_blocks) == (regions, num_blocks)
    assert g.nbytes == 2 * math.prod(shape)
    assert g.arrangement is None


@pytest.mark.parametrize(
    ("shape", "page_format", "kwargs", "message"),
    [
        (
            [10, 4, 16, 128],
            "cpu_attn",
            {},
            r"tensors\[2\]\.page_format: unknown preset 'cpu_attn'; known: NHD, HND",
        ),
        (
            [10, 4, 16, 128],
            PageFormat(k=("H", "N", "H", "C")),
            {},
            r"tensors\[2\]\.page_format\.k: axis 'H' appears twice",
        ),
        ([10, 4, 16, 128], PageFormat(k=("H", "N")), {}, r"page_format\.k: axes \['C'\] missing"),
        (
            [10, 4, 16, 128],
            PageFormat(outer=("H",), k=("N", "C"), regions="kv"),
            {},
            r"page_format\.outer: a page of regions 'kv' holds one part",
        ),
        ([10, 4, 16, 128], "LBHNC", {"head_dim": 0}, r"tensors\[2\]\.head_dim: must be > 0"),
        ([10, 4, 16, 128], "LBHNC", {"heads": 0}, r"num_heads: must be > 0"),
        ([10, 4, 16, 128], "LBHNC", {"layers": 2}, r"num_layers: 2 given, but the format has no L"),
        ([10, 4, 16, 128], "BLHNC", {}, r"num_layers: must be > 0 for a cross-layer format"),
        ([10, 4, 16, 64], "LBHNC", {}, r"shape: a page of 16 tokens .* holds 16384 bytes"),
        ([3, 10, 16, 128], "LHBNC", {}, r"shape: regions 'head' needs shape\[0\] = 4"),
        ([10], "LBHNC", {}, r"shape: needs \[num_blocks, \*page\]"),
        ([10, 16, 64], "mla", {"heads": 2}, r"num_heads: 2 given, but the format has no H axis"),
    ],
)
def test_page_format_errors_name_the_field(shape, page_format, kwargs, message) -> None:
    with pytest.raises(GeometryError, match=message):
        tensor_geometry(format_spec(shape, page_format, **kwargs), "tensors[2]")


def test_a_spec_needs_a_format() -> None:
    bare = TensorSpec(name="t", shape=[1], dtype="uint8", block_size=1, memory=ShmRef(name="x"))
    with pytest.raises(GeometryError, match="give page_format, or layout and kv_arrangement"):
        tensor_geometry(bare)


def test_cache_tensors_must_agree() -> None:
    with pytest.raises(GeometryError, match=r"tensors\[1\].shape: num_blocks 9 differs"):
        cache_geometry([spec([2, 10, 16, 4, 64], name="a"), spec([2, 9, 16, 4, 64], name="b")])
    with pytest.raises(GeometryError, match="names must be unique"):
        cache_geometry([spec([2, 10, 16, 4, 64]), spec([2, 10, 16, 4, 64])])
    with pytest.raises(GeometryError, match="at least one tensor"):
        cache_geometry([])


def test_resolve_remote_block_size() -> None:
    assert resolve_remote_block_size(64, 4, 0) == 16
    assert resolve_remote_block_size(64, 0, 16) == 16
    assert resolve_remote_block_size(64, 4, 16) == 16
    assert resolve_remote_block_size(16, 0, 64) == 64, "remote blocks larger than local ones"
    for args, message in [
        ((64, 0, 0), "give block_size_ratio or remote_block_size"),
        ((64, 3, 0), "block_size_ratio: 3 does not divide"),
        ((64, -1, 0), "block_size_ratio: must be >= 1"),
        ((64, 0, 48), "remote_block_size: 48 does not divide"),
        ((64, 2, 16), "block_size_ratio: 2 contradicts"),
        ((16, 1, 64), "contradicts"),
    ]:
        with pytest.raises(ValueError, match=message):
            resolve_remote_block_size(*args)


def test_block_id_checks() -> None:
    assert check_block_ids([0, 5, 9], 10) is None
    assert check_block_ids([], 10) is None
    bad = check_block_ids([0, -1, 10, 3], 10)
    assert bad is not None and bad.fault == "out_of_range"
    assert str(bad) == "[-1, 10] outside [0, 10)"
    dup = check_block_ids([1, 2, 1, 3, 2, 1], 10)
    assert dup is not None and dup.fault == "duplicate" and str(dup) == "[1, 2, 1] listed twice"
    many = check_block_ids(list(range(20, 40)), 10)
    assert many is not None and str(many).startswith("[20, 21, 22, 23, 24, 25, 26, 27] (+12 more)")
    assert isinstance(many, ValueError)


def test_an_unknown_dtype_names_the_field_and_the_known_ones() -> None:
    bad = msgspec.structs.replace(format_spec([10, 4, 16, 64], "LBHNC"), dtype="float64")
    with pytest.raises(
        GeometryError,
        match=r"tensors\[1\]\.dtype: unknown dtype 'float64'; known: float32, float16, bfloat16",
    ):
        tensor_geometry(bad, "tensors[1]")
