"""Exactness of the post-process against the independent reference in tests/reference.py."""

from __future__ import annotations

import random

import pytest
import torch

from kvd.kernels import cpu as kernels_cpu
from kvd.postprocess import block_rows, postprocess_blocks, postprocess_tensors, row_plan
from tests.reference import expected_block, random_bytes, same_bytes

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint8,
    torch.int8,
]
LAYOUTS = ["NHD", "HND"]


def _block_shape(layout: str, block_size: int, heads: int, head_dim: int) -> list[int]:
    return [block_size, heads, head_dim] if layout == "NHD" else [heads, block_size, head_dim]


def _pick_ids(rng: random.Random, num_blocks: int) -> list[int]:
    kind = rng.choice(["random", "contiguous", "all", "one", "reversed"])
    if kind == "contiguous":
        start = rng.randrange(num_blocks)
        return list(range(start, rng.randint(start + 1, num_blocks)))
    if kind == "all":
        return list(range(num_blocks))
    if kind == "one":
        return [rng.randrange(num_blocks)]
    if kind == "reversed":
        return list(range(num_blocks - 1, -1, -2))
    return rng.sample(range(num_blocks), rng.randint(1, num_blocks))


def _check(
    cache: torch.Tensor, ids: list[int], expect: dict[int, torch.Tensor], before: torch.Tensor
) -> None:
    for b in range(cache.shape[0]):
        want = expect.get(b, before[b])
        assert same_bytes(cache[b], want), f"block {b} ({'listed' if b in expect else 'unlisted'})"


BACKENDS = ["kernel", "torch"] if kernels_cpu.available() else ["torch"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(40))
def test_single_tensor_matches_reference(seed: int, backend: str) -> None:
    rng = random.Random(seed)
    ratio = rng.choice([1, 2, 3, 4, 8, 16])
    block_size = ratio * rng.choice([1, 2, 3, 4])
    heads, head_dim = rng.randint(1, 5), rng.choice([1, 3, 5, 8, 64, 13])
    dtype = rng.choice(DTYPES)
    remote, local = rng.choice(LAYOUTS), rng.choice(LAYOUTS)
    num_blocks = rng.randint(1, 12)
    shape = [num_blocks, *_block_shape(local, block_size, heads, head_dim)]
    cache = random_bytes(shape, dtype, seed)
    before = cache.clone()
    ids = _pick_ids(rng, num_blocks)
    expect = {
        b: expected_block(
            before[b],
            kv_parts=1,
            block_size=block_size,
            heads=heads,
            ratio=ratio,
            remote_layout=remote,
            local_layout=local,
        )
        for b in ids
    }
    block_ids = torch.tensor(ids) if seed % 2 else ids
    view = block_rows(cache, layout=local, block_size=block_size, num_heads=heads)
    postprocess_tensors([view], block_ids, ratio=ratio, remote_layout=remote, backend=backend)
    _check(cache, ids, expect, before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(24))
@pytest.mark.parametrize("arrangement", ["split", "blocks_first"])
def test_cache_tensors_match_reference(seed: int, arrangement: str, backend: str) -> None:
    """Split (2, nb, ...) and blocks-first (nb, 2, ...) tensors of several layers at once."""
    rng = random.Random(1000 + seed)
    ratio = rng.choice([1, 2, 4, 8, 16])
    block_size = ratio * rng.choice([1, 2, 4])
    heads, head_dim = rng.randint(1, 4), rng.choice([2, 7, 16, 128])
    dtype = rng.choice(DTYPES)
    remote, local = rng.choice(LAYOUTS), rng.choice(LAYOUTS)
    num_blocks = rng.randint(2, 9)
    block = _block_shape(local, block_size, heads, head_dim)
    layers = []
    for layer in range(rng.randint(1, 3)):
        shape = [2, num_blocks, *block] if arrangement == "split" else [num_blocks, 2, *block]
        layers.append(random_bytes(shape, dtype, seed * 10 + layer))
    befores = [t.clone() for t in layers]
    views = []
    for t in layers:
        if arrangement == "split":
            views += [
                block_rows(t[kv], layout=local, block_size=block_size, num_heads=heads)
                for kv in range(2)
            ]
        else:
            views.append(
                block_rows(t, layout=local, block_size=block_size, num_heads=heads, kv_parts=2)
            )
    ids = _pick_ids(rng, num_blocks)
    postprocess_tensors(views, ids, ratio=ratio, remote_layout=remote, backend=backend)
    for t, before in zip(layers, befores, strict=True):
        parts = (
            [(t[kv], before[kv], 1) for kv in range(2)]
            if arrangement == "split"
            else [(t, before, 2)]
        )
        for now, was, kv_parts in parts:
            expect = {
                b: expected_block(
                    was[b],
                    kv_parts=kv_parts,
                    block_size=block_size,
                    heads=heads,
                    ratio=ratio,
                    remote_layout=remote,
                    local_layout=local,
                )
                for b in ids
            }
            _check(now, ids, expect, was)


def test_strided_blocks_are_supported() -> None:
    """A K half of a blocks-first tensor has a block stride twice its block size."""
    full = random_bytes([6, 2, 3, 4, 8], torch.bfloat16, 7)  # (nb, kv, heads, tokens, dim): HND
    before = full.clone()
    k = full[:, 0]
    postprocess_blocks(k, [1, 4], ratio=2, remote_layout="NHD", local_layout="HND")
    for b in range(6):
        if b in (1, 4):
            want = expected_block(
                before[b, 0],
                kv_parts=1,
                block_size=4,
                heads=3,
                ratio=2,
                remote_layout="NHD",
                local_layout="HND",
            )
            assert same_bytes(full[b, 0], want)
        else:
            assert same_bytes(full[b, 0], before[b, 0])
        assert same_bytes(full[b, 1], before[b, 1]), "V halves are never touched"


def test_nothing_to_do_pairs() -> None:
    for ratio in (1, 2, 4):
        assert (
            row_plan(
                kv_parts=1,
                block_size=8,
                num_heads=4,
                ratio=ratio,
                remote_layout="NHD",
                local_layout="NHD",
            )
            is None
        )
    assert (
        row_plan(
            kv_parts=1, block_size=8, num_heads=4, ratio=1, remote_layout="HND", local_layout="HND"
        )
        is None
    )
    assert (
        row_plan(
            kv_parts=1, block_size=8, num_heads=4, ratio=2, remote_layout="HND", local_layout="HND"
        )
        is not None
    )
    assert (
        row_plan(
            kv_parts=1, block_size=8, num_heads=1, ratio=4, remote_layout="HND", local_layout="NHD"
        )
        is None
    ), "one head: MLA-like"


@pytest.mark.parametrize(
    ("ids", "kwargs", "message"),
    [
        ([0, 4], {}, r"outside \[0, 4\)"),
        ([-1], {}, r"outside \[0, 4\)"),
        ([1, 2, 1], {}, "listed twice"),
        ([0], {"ratio": 0}, "must be >= 1"),
        ([0], {"ratio": 3}, "does not divide"),
        ([0], {"remote_layout": "XYZ"}, "remote_layout must be one of"),
        ([0], {"local_layout": "nhd"}, "local_layout must be one of"),
        ([0.5], {}, "must be integers"),
        (torch.tensor([[0]]), {}, "must be 1-D"),
        (torch.tensor([0.0]), {}, "must be integers"),
    ],
)
def test_bad_input_raises_before_any_write(ids, kwargs, message) -> None:
    cache = random_bytes([4, 8, 2, 4], torch.float16, 3)
    before = cache.clone()
    args = {"ratio": 2, "remote_layout": "HND", "local_layout": "NHD", **kwargs}
    with pytest.raises(ValueError, match=message):
        postprocess_blocks(cache, ids, **args)
    assert same_bytes(cache, before)


def test_empty_id_list_is_a_no_op() -> None:
    cache = random_bytes([3, 8, 2, 4], torch.float16, 4)
    before = cache.clone()
    postprocess_blocks(cache, [], ratio=2, remote_layout="HND", local_layout="NHD")
    assert same_bytes(cache, before)


def test_reference_agrees_with_a_semantic_round_trip() -> None:
    """Independent of both implementations: build what NIXL would deliver from known tokens."""
    nP, ratio, heads, dim = 4, 3, 2, 5
    block_size = nP * ratio
    tokens = torch.arange(block_size * heads * dim, dtype=torch.float32).view(
        block_size, heads, dim
    )
    # The prefill side holds sub-block s as HND (heads, nP, dim); NIXL copies them back to back.
    received = torch.cat(
        [tokens[s * nP : (s + 1) * nP].permute(1, 0, 2).reshape(-1) for s in range(ratio)]
    ).view(1, block_size, heads, dim)
    postprocess_blocks(received, [0], ratio=ratio, remote_layout="HND", local_layout="NHD")
    assert torch.equal(received[0], tokens)
