"""KV cache groups of block sizes of their own, through a real vLLM 0.32 prefill/decode pair on
CPU, kvd and stock side by side.

The model is a tiny Gemma 4 text model built here from a fixed seed: a sliding-window layer
(window 32) of head_dim 64 and a full-attention layer of head_dim 128, as Gemma 4 sizes its
layers apart. vLLM keeps one page size for every group, so it gives the window group blocks of
twice the tokens (64 and 32 at block size 32) and lays both groups' views over one memory: kvd
attaches each group's views apart (``TensorSpec.group``) and rewrites each group's blocks in
its own format. Stock vLLM decodes garbage at 32 -> 64, without an error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install -e '.[vllm]')")

from kvd.daemon_process import DaemonProcess
from tests.vllm.test_hybrid import PAIRED_APART
from tests.vllm.test_larger_prefill_blocks import recomputed
from tests.vllm.test_pd import Setup, counters, stock_prefills

APART_REFUSAL = re.compile(
    r"blocks of 128 tokens in its largest group, larger than this engine's 64; kvd reads"
)


def make_two_head_size_model(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Gemma 4 text model (4 heads, 2 KV heads, vocabulary 4096), seeded weights: its
    sliding-window layer has head_dim 64, its full-attention layer 128. Untied, spread output
    weights and sharp attention: a wrong block changes the first token."""
    import torch
    import transformers

    config = transformers.Gemma4TextConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=32,
        per_layer_config={"01": {"head_dim": 128}},
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=4096,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        final_logit_softcapping=None,
    )
    config.architectures = ["Gemma4ForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() < 2:
                continue
            gain = 3.0 if "lm_head" in name else 2.0 if "q_proj" in name or "k_proj" in name else 1
            weight.normal_(0, gain / math.sqrt(weight.shape[-1]))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def head_sizes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """Stock prefill instances with blocks of 32 and 64, and the single-instance baseline."""
    work = tmp_path_factory.mktemp("vllm-head-sizes")
    model = make_two_head_size_model(work / "tiny-gemma4")
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
