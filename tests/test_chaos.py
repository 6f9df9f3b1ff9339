"""Exactly once under crashes: random SIGKILLs of a real ``kvd serve`` while an engine streams
requests (``kvd bench chaos``), and a kill between a finished transform and its event.

Blocks are checked byte for byte against ``tests/reference.py``, never against kvd's planner.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from kvd.bench import chaos
from kvd.client import ShmCache
from kvd.daemon_process import DaemonProcess
from kvd.protocol import Failed, Ready
from tests.daemon_helpers import collect
from tests.reference import expected_block, random_bytes, same_bytes


def test_the_chaos_expectation_agrees_with_the_reference() -> None:
    content = chaos.Content(seed=3, max_blocks=2)
    for ratio in chaos.RATIOS:
        want = content.expected(f"r{ratio}", 0, 2)
        pages = chaos.landed(want, ratio)
        for layer, part, block in [(0, 0, 0), (3, 1, 1)]:
            rewritten = expected_block(
                pages[layer, part, block],
                kv_parts=1,
                block_size=chaos.BLOCK_SIZE,
                heads=chaos.HEADS,
                ratio=ratio,
                remote_layout="HND",
                local_layout="NHD",
            )
            assert same_bytes(rewritten, want[layer, part, block])
            assert not same_bytes(pages[layer, part, block], want[layer, part, block])


@pytest.mark.slow
def test_random_kills_never_corrupt_a_block_and_every_request_is_answered() -> None:
    # With this seed every cycle kills right after a 128-block request is seen launched (the
    # third one also kills the next kvd while it starts): that rewrite takes tens of
    # milliseconds, so the kill lands in it and the next kvd reports it interrupted.
    tally = chaos.run_chaos(cycles=3, requests=12, seed=3)
    assert tally.blocks_corrupt == 0, tally
    assert tally.unanswered == 0 and tally.contradictions == 0, tally
    assert not tally.error, tally.error
    assert tally.cycles == 3 and tally.kills >= 3, tally
    assert tally.launched_kills >= 1 and tally.interrupted >= 1, tally
    assert tally.blocks_verified > 0, tally


# -- the transform finished, its event never left ------------------------------------------------

BLOCK_SIZE, HEADS, RATIO = 16, 4, 2


def land(cache: ShmCache, blocks: list[int], seed: int) -> dict[tuple[int, int, int], torch.Tensor]:
    """Random bytes in every page of ``blocks`` (what a READ lands); returns them by
    (layer, part, block)."""
    pages = {}
    for layer, tensor in enumerate(cache.tensors):
        for part in range(2):
            for b in blocks:
                page = random_bytes(tensor[part, b].shape, tensor.dtype, seed * 1000 + b)
                tensor[part, b].copy_(page)
                pages[layer, part, b] = page
    return pages


def check_rewritten(cache: ShmCache, pages: dict[tuple[int, int, int], torch.Tensor]) -> None:
    for (layer, part, b), page in pages.items():
        want = expected_block(
            page,
            kv_parts=1,
            block_size=BLOCK_SIZE,
            heads=HEADS,
            ratio=RATIO,
            remote_layout="HND",
            local_layout="NHD",
        )
        assert same_bytes(cache.tensors[layer][part, b], want), (layer, part, b)


def test_a_transform_whose_event_never_left_kvd_is_answered_interrupted(short_tmp: Path) -> None:
    cache = ShmCache.create(
        num_layers=2, num_blocks=16, block_size=BLOCK_SIZE, num_heads=HEADS, head_dim=32
    )
    blocks = [3, 7, 11, 12]
    notify = {"remote_layout": "HND", "block_size_ratio": RATIO}
    try:
        first = land(cache, blocks, seed=1)
        crashing = DaemonProcess(
            env={"KVD_TEST_CRASH_AT": "after_transform"}, runtime_dir=short_tmp
        )
        with crashing.start().client() as client:
            client.attach("crash", cache.specs)
            client.read_done("req", "crash", blocks, **notify)
        assert crashing.wait(timeout=30) == -signal.SIGKILL
        check_rewritten(cache, first)  # the rewrite did finish: only its event is missing

        with (
            DaemonProcess(runtime_dir=short_tmp) as again,
            again.client() as client,
            client.subscribe(["crash"], from_seq=1) as sub,
        ):
            (answer,) = collect(sub, 1)
            event = answer.event
            assert isinstance(event, Failed) and event.code == "interrupted", event
            assert event.invalid_block_ids == blocks and event.generation == 0
            assert client.request_status("req", "crash").code == "interrupted"

            client.attach("crash", cache.specs)
            before = [t.clone() for t in cache.tensors]
            client.read_done("req", "crash", blocks, **notify)  # a re-send: same generation
            (repeat,) = collect(sub, 1)
            assert isinstance(repeat.event, Failed) and repeat.event.code == "interrupted"
            assert repeat.event.invalid_block_ids == blocks
            assert all(same_bytes(a, b) for a, b in zip(cache.tensors, before, strict=True))

            second = land(cache, blocks, seed=2)  # read again, then the next generation
            client.read_done("req", "crash", blocks, generation=1, **notify)
            (ready,) = collect(sub, 1)
            assert isinstance(ready.event, Ready) and ready.event.generation == 1, ready
            assert ready.event.physical_block_ids == blocks
            check_rewritten(cache, second)
            others = [b for b in range(16) if b not in blocks]
            for tensor, was in zip(cache.tensors, before, strict=True):
                assert same_bytes(tensor[:, others], was[:, others])
    finally:
        cache.close()
