"""A real vLLM 0.32 prefill/decode pair on CPU where the prefill's blocks are larger than the
decode's (nP > nD): 64 -> 32 and 128 -> 32. Stock vLLM refuses these at the handshake; kvd.vllm
reads each remote block across nP / nD local blocks and kvd splits it (``kvd.vllm.split``).

The prompts (40, 100, 300 tokens, the control 100) cover each case of a request's last remote
block: at 64 -> 32 every one fills whole groups of 2 local blocks; at 128 -> 32 the 100-token
ones fill one group of 4, the 300-token one two groups and 44 tokens that vLLM recomputes, and
the 40-token one no group (recomputed whole).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install -e '.[vllm]')")

from kvd.bench.vllm import Prefill
from kvd.bench.vllm_engine import make_model, prompts
from kvd.client import Client
from kvd.daemon_process import DaemonProcess
from tests.vllm.test_pd import MAX_TOKENS, Setup

REFUSAL = "Local block size 32 is not divisible by remote block size 64 or vice versa"


@pytest.fixture(scope="module")
def larger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """Stock prefill instances with blocks of 64 and 128 tokens, and the single-instance
    baseline (the same at any block size)."""
    work = tmp_path_factory.mktemp("vllm-larger")
    model = make_model(work / "tiny-llama")
    prefills = {str(n): Prefill(work, model, "NixlConnector", None, n) for n in (64, 128)}
    try:
        for server in prefills.values():
            server.wait_ready()
        request = {"op": "baseline", "prompts": prompts(), "max_tokens": MAX_TOKENS}
        yield Setup(work, model, prefills, prefills["64"].call(request))
    finally:
        for server in prefills.values():
            server.kill()


@pytest.fixture(scope="module")
def kvd() -> Iterator[DaemonProcess]:
    with DaemonProcess() as daemon:
        yield daemon


@pytest.mark.parametrize("prefill_block_size", [64, 128])
def test_kvd_splits_larger_prefill_blocks_like_the_single_instance(
    larger: Setup, kvd: DaemonProcess, prefill_block_size: int
) -> None:
    with Client(kvd.runtime_dir) as client:
        before = client.status().counters
    extra = {"kvd_runtime_dir": str(kvd.runtime_dir)}
    result = larger.decode(str(prefill_block_size), 32, extra=extra)
    assert larger.mismatches(result) == [], result["log"]
    with Client(kvd.runtime_dir) as client:
        after = client.status().counters
    # 64: all four requests read and split; 128: three (the 40-token one reads no group).
    read = 4 if prefill_block_size == 64 else 3
    assert after["ready"] - before["ready"] >= read, "kvd did not answer the decode's requests"
    assert after["blocks_processed"] > before["blocks_processed"], "kvd split no block"
    assert after["failed"] == before["failed"]
    recomputed = "Recovered from KV load failure" in result["log"]
    assert recomputed == (prefill_block_size == 128), result["log"]


def test_stock_vllm_refuses_larger_prefill_blocks(larger: Setup) -> None:
    """vLLM 0.32 refuses 64 -> 32 at the handshake; with kv_load_failure_policy="recompute"
    every request is recomputed, so the control request decodes its own tokens. If this
    fails, a newer vLLM reads nP > nD itself: README.md's table of real vLLM runs must change."""
    result = larger.decode("64", 32, connector="NixlConnector", module=None)
    assert REFUSAL in result["log"], "stock vLLM no longer refuses prefill blocks of 64 into 32"
    assert larger.mismatches(result, control=False) == [], result["log"]
    assert len(larger.mismatches(result)) == 1, "the control request used the transferred KV"
