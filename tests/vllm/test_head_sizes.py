"""KV cache groups of block sizes of their own, through a real vLLM 0.32 prefill/decode pair on
CPU, kvd and stock side by side.

The model is a tiny Gemma 4 text model from a fixed seed (``make_head_sizes_model``): a window layer
(window 32) of head_dim 64 and a full-attention layer of head_dim 128, as Gemma 4 sizes its
layers apart. vLLM keeps one page size for every group, so it gives the window group blocks of
twice the tokens (64 and 32 at block size 32) and lays both groups' views over one memory: kvd
attaches each group's views apart (``TensorSpec.group``) and rewrites each group's blocks in
its own format. Stock vLLM decodes garbage at 32 -> 64, without an error.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install -e '.[vllm]')")

from kvd.bench.vllm_engine import make_head_sizes_model
from kvd.daemon_process import DaemonProcess
from tests.vllm.test_hybrid import PAIRED_APART
from tests.vllm.test_larger_prefill_blocks import recomputed
from tests.vllm.test_pd import Setup, counters, stock_prefills

APART_REFUSAL = re.compile(
    r"blocks of 128 tokens in its largest group, larger than this engine's 64; kvd reads"
)


@pytest.fixture(scope="module")
def head_sizes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """Stock prefill instances with blocks of 32 and 64, and the single-instance baseline."""
    work = tmp_path_factory.mktemp("vllm-head-sizes")
    model = make_head_sizes_model(work / "tiny-gemma4")
    with stock_prefills(work, model, (32, 64), baseline_from=32) as setup:
        yield setup


def test_kvd_decodes_groups_of_their_own_block_sizes_like_the_single_instance(
    head_sizes: Setup, kvd: DaemonProcess
) -> None:
    """32 -> 32 and 32 -> 64: every request and the control decode the single instance's
    tokens. At 32 -> 64 kvd merges each group's pages in its own format (the window group's
    blocks of 64 tokens into 128, the full group's 32 into 64); the 300-token prompt, whose
    window vLLM pairs from different first tokens, is recomputed, as kvd.vllm.groups says."""
    extra = {"kvd_runtime_dir": str(kvd.runtime_dir)}
    before = counters(kvd)
    same = head_sizes.decode("32", 32, extra=extra)
    assert head_sizes.mismatches(same) == [], same["log"]
    assert recomputed(Path(same["log_file"]).read_text()) == (0, 0), same["log"]
    middle = counters(kvd)
    assert middle["ready"] - before["ready"] >= 4, "kvd did not answer the decode's requests"
    merged = head_sizes.decode("32", 64, extra=extra)
    log = Path(merged["log_file"]).read_text()
    assert head_sizes.mismatches(merged) == [], merged["log"]
    after = counters(kvd)
    assert after["blocks_processed"] > middle["blocks_processed"], "kvd merged no block"
    assert after["failed"] == before["failed"]
    assert len(PAIRED_APART.findall(log)) == 1, merged["log"]


def test_kvd_refuses_larger_prefill_blocks_for_groups_of_their_own_block_sizes(
    head_sizes: Setup, kvd: DaemonProcess
) -> None:
    """64 -> 32 is not proven for such groups: the handshake is refused by name and every
    request recomputed (so the control decodes its own tokens)."""
    larger = head_sizes.decode("64", 32, extra={"kvd_runtime_dir": str(kvd.runtime_dir)})
    assert APART_REFUSAL.search(Path(larger["log_file"]).read_text()), larger["log"]
    assert head_sizes.mismatches(larger, control=False) == [], larger["log"]


def test_stock_vllm_on_groups_of_their_own_block_sizes(head_sizes: Setup) -> None:
    """Stock vLLM 0.32, recorded for docs/vllm.md's table: right at 32 -> 32, every token wrong
    at 32 -> 64, without an error."""
    same = head_sizes.decode("32", 32, connector="NixlConnector", module=None)
    assert head_sizes.mismatches(same) == [], same["log"]
    merged = head_sizes.decode("32", 64, connector="NixlConnector", module=None)
    assert len(head_sizes.mismatches(merged)) == 4, "stock vLLM's 32 -> 64 here is now right"
