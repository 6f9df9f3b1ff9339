"""A real vLLM 0.32 prefill/decode pair on CPU where the prefill's blocks are larger than the
decode's (nP > nD): 64 -> 32 and 128 -> 32. Stock vLLM refuses these at the handshake; kvd.vllm
reads each remote block across nP / nD local blocks and kvd splits it (``kvd.vllm.split``).

The prompts (40, 100, 300 tokens, the control 100) cover each case of a request's last remote
block: at 64 -> 32 every one fills whole groups of 2 local blocks; at 128 -> 32 the 100-token
ones fill one group of 4, the 300-token one two groups and 44 tokens that vLLM recomputes, and
the 40-token one no group (recomputed whole). One decode instance reads the requests from both
prefills in one batch: a decode instance costs more time here than anything it does.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install -e '.[vllm]')")

from kvd.bench.vllm_engine import make_model
from kvd.client import Client
from kvd.daemon_process import DaemonProcess
from tests.vllm.test_pd import Setup, stock_prefills

REFUSAL = "Local block size 32 is not divisible by remote block size 64 or vice versa"
RECOVERED = re.compile(
    r"Recovered from KV load failure: (\d+) request\(s\) rescheduled \((\d+) tokens affected\)"
)


@pytest.fixture(scope="module")
def larger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """Stock prefill instances with blocks of 64 and 128 tokens, and the single-instance
    baseline (the same at any block size)."""
    work = tmp_path_factory.mktemp("vllm-larger")
    model = make_model(work / "tiny-llama")
    with stock_prefills(work, model, (64, 128), baseline_from=64) as setup:
        yield setup


def recomputed(log: str) -> tuple[int, int]:
    """(requests, tokens) vLLM's scheduler recomputed after blocks failed to load."""
    found = [tuple(map(int, m)) for m in RECOVERED.findall(log)]
    return sum(r for r, _ in found), sum(t for _, t in found)


def test_kvd_splits_larger_prefill_blocks_like_the_single_instance(
    larger: Setup, kvd: DaemonProcess
) -> None:
    """One decode instance, block 32, reads the same 4 requests from the 64 and the 128
    prefill in one batch."""
    with Client(kvd.runtime_dir) as client:
        before = client.status().counters
    extra = {"kvd_runtime_dir": str(kvd.runtime_dir)}
    also = [larger.prefills["128"].endpoint]
    result = larger.decode("64", 32, extra=extra, also_prefill=also)
    decoded = result["decode"]
    assert len(decoded) == 8
    for name, part in (("64 -> 32", decoded[:4]), ("128 -> 32", decoded[4:])):
        assert larger.mismatches({"decode": part}) == [], f"{name}: {result['log']}"
    with Client(kvd.runtime_dir) as client:
        after = client.status().counters
    # 64: all four requests read and split; 128: three (the 40-token one reads no group).
    assert after["ready"] - before["ready"] >= 7, "kvd did not answer the decode's requests"
    assert after["blocks_processed"] > before["blocks_processed"], "kvd split no block"
    assert after["failed"] == before["failed"]
    # 128 -> 32 only: the 40-token prompt whole, the 300-token one's last 44 tokens.
    assert recomputed(result["log"]) == (2, 40 + 44), result["log"]


def test_stock_vllm_refuses_larger_prefill_blocks(larger: Setup) -> None:
    """vLLM 0.32 refuses 64 -> 32 at the handshake; with kv_load_failure_policy="recompute"
    every request is recomputed, so the control request decodes its own tokens. If this
    fails, a newer vLLM reads nP > nD itself: docs/vllm.md's table of real vLLM runs must change."""
    result = larger.decode("64", 32, connector="NixlConnector", module=None)
    log = Path(result["log_file"]).read_text(errors="replace")
    assert REFUSAL in log, "stock vLLM no longer refuses prefill blocks of 64 into 32"
    assert larger.mismatches(result, control=False) == [], result["log"]
    assert len(larger.mismatches(result)) == 1, "the control request used the transferred KV"
