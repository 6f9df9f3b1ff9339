"""Page formats: presets, checks, derived properties, the legacy mapping."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given

from kvd.layout import formats
from kvd.layout.formats import (
    PRESETS,
    FormatError,
    PageSizes,
    axes,
    element_offset,
    has_heads,
    head_slices_are_pages,
    heads_tokens_order,
    legacy_format,
    legacy_remote_format,
    resolve,
)
from kvd.protocol import PageFormat
from tests.reference import element_index, region_page
from tests.strategies import Case, cases

SIZES = PageSizes(num_layers=3, num_heads=4, block_size=16, head_dim=8, itemsize=2)


def test_every_preset_is_valid_and_resolves_by_name() -> None:
    for name, fmt in PRESETS.items():
        assert resolve(name) is fmt
        assert resolve(fmt) is fmt


@pytest.mark.parametrize(
    ("name", "parts", "cross_layer", "heads", "regions"),
    [
        ("NHD", 1, False, True, 2),
        ("blocks_first_HND", 2, False, True, 1),
        ("single_NHD", 1, False, True, 1),
        ("mla", 1, False, False, 1),
        ("cpu_attn_vec", 2, False, True, 1),
        ("LBHNC", 2, False, True, 1),
        ("LHBNC", 2, False, True, 4),
        ("BLHNC", 2, True, True, 1),
        ("BHLNC", 2, True, True, 1),
    ],
)
def test_derived_properties(name, parts, cross_layer, heads, regions) -> None:
    fmt = PRESETS[name]
    assert formats.parts(fmt) == parts
    assert formats.is_cross_layer(fmt) == cross_layer
    assert formats.has_heads(fmt) == heads
    assert formats.num_regions(fmt, SIZES.num_heads) == regions


def test_page_bytes() -> None:
    assert formats.page_bytes(PRESETS["HND"], SIZES) == 4 * 16 * 8 * 2
    assert formats.page_bytes(PRESETS["cpu_attn_vec"], SIZES) == 2 * 4 * 16 * 8 * 2
    assert formats.page_bytes(PRESETS["BLHNC"], SIZES) == 3 * 2 * 4 * 16 * 8 * 2
    assert formats.page_bytes(PRESETS["LHBNC"], SIZES) == 2 * 16 * 8 * 2
    assert formats.page_bytes(PRESETS["mla"], SIZES, block_size=4) == 4 * 8 * 2


def test_element_offsets_of_presets() -> None:
    """Spot checks against what the formats mean in vLLM."""
    # cpu_attn_vec: per head, K as [head_dim][block_size], then V as [block_size][head_dim].
    per_head = 2 * 16 * 8
    assert element_offset(PRESETS["cpu_attn_vec"], SIZES, kv="k", head=2, token=5, channel=3) == (
        0,
        2 * per_head + 3 * 16 + 5,
    )
    assert element_offset(PRESETS["cpu_attn_vec"], SIZES, kv="v", head=2, token=5, channel=3) == (
        0,
        2 * per_head + 16 * 8 + 5 * 8 + 3,
    )
    # LBHNC: [H, N, K|V] with the content dim holding K then V.
    assert element_offset(PRESETS["LBHNC"], SIZES, kv="v", head=1, token=2, channel=3) == (
        0,
        (1 * 16 + 2) * 16 + 8 + 3,
    )
    # A split cache: the V region, HND.
    assert element_offset(PRESETS["HND"], SIZES, kv="v", head=1, token=2, channel=3) == (
        1,
        (1 * 16 + 2) * 8 + 3,
    )
    # LHBNC: a region per head.
    assert element_offset(PRESETS["LHBNC"], SIZES, kv="k", head=3, token=2, channel=1) == (
        3,
        2 * 16 + 1,
    )


@given(cases())
def test_element_offset_agrees_with_the_reference(case: Case) -> None:
    sizes = PageSizes(
        num_layers=case.sizes["L"],
        num_heads=case.sizes["H"],
        block_size=case.block_size,
        head_dim=case.sizes["C"],
        itemsize=1,
    )
    size = {**case.sizes, "N": case.block_size}
    outer, parts = region_page(case.local, case.kv)
    for kv in ("k", "v"):
        part = 1 if kv == "v" and len(parts) == 2 else 0
        if case.local.regions == "kv" and kv != case.kv:
            continue
        for values in itertools.product(*(range(size[a]) for a in "LHNC")):
            coords = dict(zip("LHNC", values, strict=True))
            _, offset = element_offset(
                case.local,
                sizes,
                kv=kv,  # type: ignore[arg-type]
                layer=coords["L"],
                head=coords["H"],
                token=coords["N"],
                channel=coords["C"],
            )
            assert offset == element_index(outer, parts, size, part, coords)


@pytest.mark.parametrize(
    ("fmt", "message"),
    [
        (PageFormat(k=("N", "H", "N", "C")), r"fmt\.k: axis 'N' appears twice"),
        (PageFormat(k=("N", "X", "C")), r"fmt\.k: unknown axis 'X'"),  # type: ignore[arg-type]
        (PageFormat(k=()), r"fmt\.k: must name the axes"),
        (PageFormat(k=("N", "C"), v=("N", "C")), r"fmt\.k: axes \['H'\] missing"),
        (PageFormat(k=("H", "N", "C"), v=("N", "C")), r"fmt\.v: axes \['H'\] missing"),
        (PageFormat(outer=("H",), k=("H", "N", "C")), r"fmt\.k: axis 'H' appears twice"),
        (PageFormat(outer=("H",), k=("N", "C"), regions="kv"), r"fmt\.outer: .*must be empty"),
        (PageFormat(k=("N", "C"), regions="kv"), r"fmt\.k: axes \['H'\] missing"),
        (PageFormat(k=("H", "N", "C"), regions="head"), r"fmt\.k: axis 'H' cannot be"),
        (PageFormat(k=("L", "H", "N", "C"), v=("H", "N", "C")), r"fmt\.v: axes \['L'\] missing"),
        (PageFormat(k=("N", "H", "C"), regions="rows"), r"fmt\.regions: must be"),  # type: ignore[arg-type]
    ],
)
def test_invalid_formats_name_the_field(fmt, message) -> None:
    with pytest.raises(FormatError, match=message):
        resolve(fmt, "fmt")


def test_unknown_presets_list_the_known_ones() -> None:
    with pytest.raises(FormatError, match=r"tensors\[2\]\.page_format: unknown preset 'nhd'"):
        resolve("nhd", "tensors[2].page_format")
    with pytest.raises(FormatError, match="known: NHD, HND, blocks_first_NHD"):
        resolve("nhd")


def test_legacy_descriptions_map_to_presets() -> None:
    assert legacy_format("split", "HND") is PRESETS["HND"]
    assert legacy_format("blocks_first", "NHD") is PRESETS["blocks_first_NHD"]
    assert legacy_format("single", "HND") is PRESETS["single_HND"]
    assert legacy_format("mla", "HND") is PRESETS["mla"]


def test_legacy_remote_format_swaps_heads_and_tokens() -> None:
    assert legacy_remote_format(PRESETS["NHD"], "HND") == PRESETS["HND"]
    assert legacy_remote_format(PRESETS["NHD"], "NHD") is PRESETS["NHD"]
    assert legacy_remote_format(PRESETS["blocks_first_HND"], "NHD") == PRESETS["blocks_first_NHD"]
    assert legacy_remote_format(PRESETS["LBNHC"], "HND") == PRESETS["LBHNC"]
    assert legacy_remote_format(PRESETS["BLHNC"], "NHD") == PRESETS["BLNHC"]
    assert heads_tokens_order(PRESETS["LBHNC"]) == "HND"
    with pytest.raises(FormatError, match="no H axis"):
        legacy_remote_format(PRESETS["mla"], "HND")
    with pytest.raises(FormatError, match="no H axis"):
        legacy_remote_format(PRESETS["LHBNC"], "HND")
    with pytest.raises(FormatError, match="different parts"):
        legacy_remote_format(PRESETS["cpu_attn_vec"], "NHD")
    with pytest.raises(FormatError, match="K and V order H and N differently"):
        legacy_remote_format(PageFormat(k=("H", "N", "C"), v=("N", "H", "C")), "NHD")
    with pytest.raises(FormatError, match=r"remote_layout: unknown layout 'XYZ'; known: NHD, HND"):
        legacy_remote_format(PRESETS["NHD"], "XYZ")  # type: ignore[arg-type]
    with pytest.raises(FormatError, match=r"layout: unknown layout 'nhd'; known: NHD, HND"):
        legacy_format("split", "nhd")  # type: ignore[arg-type]
    with pytest.raises(FormatError, match=r"kv_arrangement: unknown kv_arrangement 'flat'; known"):
        legacy_format("flat", "NHD")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_head_range_of_a_page_is_a_page_exactly_where_heads_are_outermost(name: str) -> None:
    """Checked against ``element_offset``: heads [1, 3) of a 4-head page, wherever they sit,
    are one contiguous range holding a 2-head page of the same format element for element."""
    fmt = PRESETS[name]
    if not has_heads(fmt) or fmt.regions == "head" or "L" in axes(fmt):
        assert not head_slices_are_pages(fmt)
        return
    whole = PageSizes(num_layers=1, num_heads=4, block_size=3, head_dim=2, itemsize=1)
    part = PageSizes(num_layers=1, num_heads=2, block_size=3, head_dim=2, itemsize=1)
    kvs = ("k", "v") if fmt.v or fmt.regions == "kv" else ("k",)
    moved = {}
    for kv in kvs:
        for head in (1, 2):
            for token in range(3):
                for channel in range(2):
                    coords = {"kv": kv, "token": token, "channel": channel}
                    region, at = element_offset(fmt, whole, head=head, **coords)
                    _, want = element_offset(fmt, part, head=head - 1, **coords)
                    moved[(region, at)] = want
    starts = {r: min(a for (rr, a) in moved if rr == r) for (r, _) in moved}
    is_page = all(at - starts[r] == want for (r, at), want in moved.items())
    assert head_slices_are_pages(fmt) == is_page, name
