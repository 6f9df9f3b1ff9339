"""``kvd demo`` at a small size, as a user runs it, and the content check it relies on."""

from __future__ import annotations

import json

import pytest
import torch

from kvd.demo.content import fill, request_tokens, token_rows
from tests.daemon_helpers import kvd

pytest.importorskip("nixl")


def test_demo_verifies_every_case_with_real_nixl() -> None:
    done = kvd("demo", "--requests", "3", "--json", "--quiet", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["verified"] is True and report["transport"] == "UCX"
    cases = report["cases"]
    assert len(cases) == 13 and all(c["verified"] and not c["failures"] for c in cases)
    for c in cases:
        assert c["requests"] == c["verified_requests"] == 3
        assert c["blocks"] > 0 and c["nixl_bytes"] > 0
        assert c["read_done_to_ready_us"]["samples"] == 3
    pairs = {
        (p["layout"], p["block_size"], c["decode_layout"], c["decode_block_size"])
        for c in cases
        for p in c["prefill"]
    }
    # The matrix the demo promises: 16 into 16/32/64, HND into NHD and HND, NHD into NHD, and
    # 64 into 16 (each prefill block across 4 decode blocks).
    assert {("HND", 16, "NHD", 16), ("HND", 16, "NHD", 32), ("HND", 16, "NHD", 64)} <= pairs
    assert ("HND", 16, "HND", 64) in pairs and ("NHD", 16, "NHD", 16) in pairs
    assert {("HND", 64, "NHD", 16), ("HND", 64, "HND", 16)} <= pairs
    mixed = [c for c in cases if len(c["prefill"]) == 2]
    assert [sorted(p["block_size"] for p in c["prefill"]) for c in mixed] == [[16, 32], [16, 64]]
    assert all(n > 0 for c in mixed for n in c["requests_by_engine"].values())
    assert [c["group_shapes"] for c in mixed] == [[[1, 2], [1, 4]], [[1, 1], [4, 1]]]
    larger = [c for c in cases if c["prefill"][0]["block_size"] == 64]
    assert larger and all(c["group_shapes"] == [[4, 1]] for c in larger)
    assert all(c["blocks"] % 4 == 0 for c in larger)  # whole groups of 4 decode blocks
    assert report["requests"] == 39 and report["blocks"] == sum(c["blocks"] for c in cases)
    assert all(n["received"] == n["expected"] > 0 for n in report["prefill_notifications"])


def test_demo_rejects_a_request_size_that_cannot_fit() -> None:
    done = kvd("demo", "--max-blocks", "100", "--num-blocks", "64", timeout=60)
    assert done.returncode == 2
    assert "--max-blocks must be in [1, --num-blocks / --concurrency = 8]" in done.stderr


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_content_check_sees_a_block_or_token_out_of_place(layout: str) -> None:
    """The demo's check is only as good as its content: misplaced bytes must show."""
    heads, head_dim, tokens = 3, 4, 8
    shape = (2, 6, tokens, heads, head_dim) if layout == "NHD" else (2, 6, heads, tokens, head_dim)
    cache = torch.empty(shape, dtype=torch.bfloat16)
    fill(cache, seed=5, region_base=0, layout=layout, heads=heads)
    raw = cache.view(torch.uint8)
    ids = [4, 1, 3]

    def matches() -> bool:
        got = request_tokens(raw[1], ids, layout=layout)
        want = token_rows(
            5, 1, torch.tensor(ids), tokens=tokens, heads=heads, row_bytes=head_dim * 2
        ).reshape(-1, heads, head_dim * 2)
        return torch.equal(got, want)

    assert matches()
    raw[1, [1, 3]] = raw[1, [3, 1]].clone()  # two blocks swapped
    assert not matches()
    raw[1, [1, 3]] = raw[1, [3, 1]].clone()
    assert matches()
    block = raw[1, 4]
    if layout == "NHD":
        block[2] = block[1]  # token 2 := token 1
    else:
        block[:, 2] = block[:, 1]
    assert not matches()
    # K and V differ too: region 0 content is not region 1 content.
    assert not torch.equal(raw[0, 4], raw[1, 4])
