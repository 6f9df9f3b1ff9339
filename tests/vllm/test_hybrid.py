"""A hybrid model (a sliding-window and a full-attention layer: two KV cache groups) through a
real vLLM 0.32 prefill/decode pair on CPU, kvd and stock side by side.

The model is the tiny seeded Llama with ``layer_types`` (window 32 tokens), as Gemma 3 and
gpt-oss name their layers; vLLM gives it two KV cache groups on one shared tensor. Each decode
request's ReadDone carries both groups (``groups``), and kvd rewrites each with its own
coverage: at 32 -> 64 the window group reads one local block from two remote ones, the full
group up to five from ten. A request whose window vLLM paired from different first tokens would
be recomputed (``kvd.vllm.groups``); none is here. At 64 -> 32, which vLLM refuses, each group's
remote pages are read whole into pairs of local blocks and split by kvd (``kvd.vllm.split``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install -e '.[vllm]')")

from kvd.bench.vllm_engine import make_model, prompts
from kvd.daemon_process import DaemonProcess
from tests.vllm.test_larger_prefill_blocks import REFUSAL, recomputed
from tests.vllm.test_pd import MAX_TOKENS, Setup, counters, stock_prefills

WINDOW = 32
PAIRED_APART = re.compile(r"\(sliding window\): vLLM paired")
SPLIT_RECOMPUTED = re.compile(r"is recomputed: group \d: 1 local blocks hold part of a remote")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """Stock prefill instances with blocks of 32 and 64, and the single-instance baseline."""
    work = tmp_path_factory.mktemp("vllm-hybrid")
    model = make_model(work / "tiny-hybrid", sliding_window=WINDOW)
    with stock_prefills(work, model, (32, 64), baseline_from=32) as setup:
        yield setup


def test_kvd_decodes_a_hybrid_model_like_the_single_instance_at_equal_blocks(
    hybrid: Setup, kvd: DaemonProcess
) -> None:
    """32 -> 32: every request's two groups in one ReadDone each, all Ready, no recompute."""
    before = counters(kvd)
    result = hybrid.decode("32", 32, extra={"kvd_runtime_dir": str(kvd.runtime_dir)})
    assert hybrid.mismatches(result) == [], result["log"]
    after = counters(kvd)
    assert after["ready"] - before["ready"] >= 4, "kvd did not answer the decode's requests"
    assert after["failed"] == before["failed"]
    assert recomputed(Path(result["log_file"]).read_text()) == (0, 0)


def test_kvd_merges_a_hybrid_model_like_the_single_instance(
    hybrid: Setup, kvd: DaemonProcess
) -> None:
    """32 -> 64: kvd merges both groups' pages, each zeroed past its own coverage; every
    request and the control decode the single instance's tokens, none is recomputed."""
    before = counters(kvd)
    result = hybrid.decode("32", 64, extra={"kvd_runtime_dir": str(kvd.runtime_dir)})
    log = Path(result["log_file"]).read_text()
    assert hybrid.mismatches(result) == [], result["log"]
    after = counters(kvd)
    assert after["ready"] - before["ready"] >= 4, "kvd did not answer the decode's requests"
    assert after["blocks_processed"] > before["blocks_processed"], "kvd merged no block"
    assert not PAIRED_APART.findall(log) and recomputed(log) == (0, 0), result["log"]


def test_kvd_splits_larger_prefill_blocks_of_a_hybrid_model(
    hybrid: Setup, kvd: DaemonProcess
) -> None:
    """64 -> 32: each group's pages read whole and split by kvd. Prompts of 40, 100 and 300
    tokens (and the control) end in remote blocks holding more than one local block's tokens:
    they decode the single instance's tokens from the transferred KV. An 80-token prompt's last
    remote block holds 16 tokens, half a local pair: vLLM takes no failed blocks from a model
    of several groups, so that request is recomputed whole, and still decodes its tokens."""
    assert_splits_with_one_recomputed(
        hybrid, kvd, ("64", 32), lengths=(40, 100, 300, 80), baseline_from="32"
    )


def assert_splits_with_one_recomputed(
    setup: Setup,
    kvd: DaemonProcess,
    pair: tuple[str, int],
    *,
    lengths: tuple[int, ...],
    baseline_from: str,
) -> None:
    """A kvd decode at ``pair`` (prefill instance, decode block size) of prompts of ``lengths``
    tokens and the control: tokens equal to the single instance's (from the ``baseline_from``
    instance), kvd split blocks and failed none, and exactly one request recomputed whole."""
    request = {"op": "baseline", "prompts": prompts(lengths), "max_tokens": MAX_TOKENS}
    baseline = setup.prefills[baseline_from].call(request)
    before = counters(kvd)
    prefill, block_size = pair
    result = setup.decode(
        prefill, block_size, extra={"kvd_runtime_dir": str(kvd.runtime_dir)}, prompt_lengths=lengths
    )
    log = Path(result["log_file"]).read_text()
    expected = [*baseline, baseline[1]]  # the last request: the control, from prompt 1's KV
    assert [r["token_ids"] for r in result["decode"]] == [r["token_ids"] for r in expected], result[
        "log"
    ]
    after = counters(kvd)
    assert after["ready"] - before["ready"] >= 4, "kvd did not answer the decode's requests"
    assert after["blocks_processed"] > before["blocks_processed"], "kvd split no block"
    assert after["failed"] == before["failed"]
    assert len(SPLIT_RECOMPUTED.findall(log)) == 1, result["log"]


def test_stock_vllm_on_the_hybrid_model(hybrid: Setup) -> None:
    """Stock vLLM 0.32, recorded for docs/vllm.md's table: right at 32 -> 32, every token
    wrong at 32 -> 64 (no error), 64 -> 32 refused at the handshake and recomputed (so the
    control request decodes its own tokens)."""
    same = hybrid.decode("32", 32, connector="NixlConnector", module=None)
    assert hybrid.mismatches(same) == [], same["log"]
    merged = hybrid.decode("32", 64, connector="NixlConnector", module=None)
    assert len(hybrid.mismatches(merged)) == 4, "stock vLLM's hybrid 32 -> 64 is now right"
    larger = hybrid.decode("64", 32, connector="NixlConnector", module=None)
    assert REFUSAL in Path(larger["log_file"]).read_text()
    assert hybrid.mismatches(larger, control=False) == [], larger["log"]
