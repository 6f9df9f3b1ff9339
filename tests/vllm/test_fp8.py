"""A real vLLM 0.32 prefill/decode pair on CPU with an fp8 KV cache, kvd as the decode side's
post-process: the pages hold 1-byte elements with static per-layer scales, laid out as the
unquantized ``cpu_attn_vec`` pages (``tests/test_vllm_cpu_attn.py`` checks that against vLLM's
write kernel). Skipped where vLLM cannot run an fp8 cache on this CPU (it needs AVX-512 or AMX),
with vLLM's reason.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install -e '.[vllm]')")

from kvd.bench.vllm import Prefill
from kvd.bench.vllm_engine import make_model, prompts
from kvd.client import Client
from kvd.daemon_process import DaemonProcess
from tests.vllm.test_pd import MAX_TOKENS, Setup

KV_CACHE_DTYPE = "fp8"
"""vLLM's "fp8" is fp8_e4m3; the kernel test covers fp8_e4m3 and fp8_e5m2 byte for byte."""


def _fp8_refusal() -> str | None:
    """vLLM's reason not to run an fp8 cache on this CPU, or None."""
    import torch

    with warnings.catch_warnings():  # vLLM's imports warn (deprecations): not this test's
        warnings.simplefilter("ignore")
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        _get_attn_isa(torch.float32, 32, 64, KV_CACHE_DTYPE)
    except NotImplementedError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """A stock prefill instance with an fp8 cache (block 32), and its single-instance baseline."""
    refusal = _fp8_refusal()
    if refusal is not None:
        pytest.skip(refusal)
    work = tmp_path_factory.mktemp("vllm-fp8")
    model = make_model(work / "tiny-llama")
    prefill = Prefill(work, model, "NixlConnector", None, 32, kv_cache_dtype=KV_CACHE_DTYPE)
    try:
        prefill.wait_ready()
        request = {"op": "baseline", "prompts": prompts(), "max_tokens": MAX_TOKENS}
        yield Setup(work, model, {"fp8": prefill}, prefill.call(request))
    finally:
        prefill.kill()


def test_kvd_decodes_an_fp8_cache_like_the_single_instance(fp8: Setup, kvd: DaemonProcess) -> None:
    """32 -> 64: kvd merges two 1-byte pages into each decode page; the tokens are the fp8
    single instance's, control request included."""
    with Client(kvd.runtime_dir) as client:
        before = client.status().counters
    extra = {"kvd_runtime_dir": str(kvd.runtime_dir)}
    result = fp8.decode("fp8", 64, extra=extra, kv_cache_dtype=KV_CACHE_DTYPE)
    assert fp8.mismatches(result) == [], result["log"]
    with Client(kvd.runtime_dir) as client:
        after = client.status().counters
    assert after["ready"] - before["ready"] >= 4, "kvd did not answer the decode's requests"
    assert after["blocks_processed"] > before["blocks_processed"], "kvd merged no pages"


def test_stock_vllm_merges_fp8_cpu_pages_wrong(fp8: Setup) -> None:
    """vLLM 0.32's own 32 -> 64 merge of the same fp8 pages. If this fails, a newer vLLM
    changed it: docs/vllm.md's table of real vLLM runs must change."""
    result = fp8.decode("fp8", 64, connector="NixlConnector", module=None, kv_cache_dtype="fp8")
    assert len(fp8.mismatches(result)) == 4, "stock vLLM's fp8 CPU block merge is now right"
