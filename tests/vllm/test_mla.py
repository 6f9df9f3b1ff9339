"""A real vLLM 0.32 P/D pair on CPU with an MLA model, kvd as the decode side's post-process.

The model is a tiny DeepSeek-V2 with seeded random weights (``make_mla_model``): its KV cache
is one latent vector (kv_lora_rank 512 + rope 64) per token. On CPU vLLM runs it with CPU_MLA,
which forces block size 16 on both sides (``platforms/cpu.py``; on a CPU with AMX vLLM would
pick AMX_MLA, bf16 only, so the backend is pinned): 16 -> 16 is the one pair, and its rewrite
is the identity, so kvd answers Ready without touching a byte.

vLLM 0.32's own decode of such a pair differs from the single instance (measured 2026-12-04;
docs/vllm.md, "MLA (DeepSeek-style) caches"): the latent rows it received equal the prefill's
bit for bit, but the last prompt token, which decode recomputes, gets a different rotary part.
The test holds kvd to the baseline, and where kvd's tokens differ, checks that stock vLLM's
differ at the same geometry too (the fault is then vLLM's: kvd touched nothing) and reports it
as an xfail. Skipped when vllm cannot be imported.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install -e '.[vllm]')")

from kvd.bench.vllm import Prefill, run_decode
from kvd.bench.vllm_engine import make_mla_model, prompts
from kvd.client import Client
from kvd.daemon_process import DaemonProcess

MAX_TOKENS = 16
ENGINE = {"dtype": "float32", "attention_backend": "CPU_MLA"}
BLOCK_SIZE = 16
"""CPU_MLA's only block size: vLLM overrides any other."""


@dataclass
class Setup:
    work: Path
    model: Path
    prefill: Prefill
    baseline: list[dict[str, Any]]

    def decode(self, **config: Any) -> dict[str, Any]:
        return run_decode(
            self.work,
            self.model,
            self.prefill,
            BLOCK_SIZE,
            max_tokens=MAX_TOKENS,
            **ENGINE,
            **config,
        )

    def mismatches(self, result: dict[str, Any]) -> list[str]:
        """Requests whose tokens or logprobs differ from the baseline; the last is the control
        (prompt 1's transferred KV under other prompt tokens: it continues prompt 1 only when
        that KV was used)."""
        expected = [*self.baseline, self.baseline[1]]
        return [
            f"request {i}: {got['token_ids'][:6]}... != {want['token_ids'][:6]}..."
            for i, (want, got) in enumerate(zip(expected, result["decode"], strict=True))
            if (want["token_ids"], want["logprobs"]) != (got["token_ids"], got["logprobs"])
        ]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    work = tmp_path_factory.mktemp("vllm-mla")
    model = make_mla_model(work / "tiny-deepseek")
    prefill = Prefill(work, model, "NixlConnector", None, BLOCK_SIZE, **ENGINE)
    try:
        prefill.wait_ready()
        request = {"op": "baseline", "prompts": prompts(), "max_tokens": MAX_TOKENS}
        yield Setup(work, model, prefill, prefill.call(request))
    finally:
        prefill.kill()


def test_kvd_answers_mla_blocks_untouched_and_decodes_the_single_instance(
    setup: Setup,
) -> None:
    with DaemonProcess() as kvd, Client(kvd.runtime_dir) as client:
        before = client.status().counters
        stats = setup.work / "stats-mla.json"
        extra = {"kvd_runtime_dir": str(kvd.runtime_dir), "kvd_stats_path": str(stats)}
        result = setup.decode(extra=extra)
        after = client.status().counters
    assert after["ready"] - before["ready"] == 4, result["log"]
    assert after["ready_untouched"] - before["ready_untouched"] == 4, "kvd rewrote MLA pages"
    assert after["blocks_processed"] == before["blocks_processed"]
    figures = json.loads(stats.read_text())
    assert figures["requests"] == 4 and figures["failed"] == 0, "a request was recomputed"
    wrong = setup.mismatches(result)
    if wrong:
        stock = setup.decode(connector="NixlConnector", module=None)
        stock_wrong = setup.mismatches(stock)
        assert stock_wrong, f"stock vLLM decodes the baseline, kvd does not: {wrong}"
        pytest.xfail(
            f"vLLM 0.32's CPU MLA decode of a P/D pair differs from the single instance, "
            f"stock as with kvd (which touched nothing): kvd {wrong}; stock {stock_wrong}"
        )
