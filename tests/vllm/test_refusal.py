"""A real vLLM decode instance that kvd cannot serve stops at startup, saying why and what to
change. On a CPU with AMX tiles vLLM's CPU attention picks ISA ``amx`` for bfloat16, a page
format kvd has not verified (skipped on a CPU without AMX). Skipped when vllm cannot be
imported."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install -e '.[vllm]')")

import torch

from kvd.bench.vllm import Engine
from kvd.bench.vllm_engine import make_model
from kvd.daemon_process import DaemonProcess
from kvd.vllm.formats import NO_GUESS


def test_a_bfloat16_decode_on_an_amx_cpu_stops_at_startup_naming_amx(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    isa = _get_attn_isa(torch.bfloat16, 32, 64)
    if isa != "amx":
        pytest.skip(f"vLLM picks ISA {isa!r} for bfloat16 on this CPU, not 'amx'")
    config = {
        "role": "kv_consumer",
        "model": str(make_model(tmp_path / "tiny-llama")),
        "dtype": "bfloat16",
        "block_size": 32,
        "connector": "KvdConnector",
        "module": "kvd.vllm",
        "engine_id": "decode-amx",
        "prefill": "tcp://127.0.0.1:9",  # never reached: the engine does not start
        "out": str(tmp_path / "out.json"),
        "extra": {"kvd_runtime_dir": str(tmp_path / "no-kvd")},
    }
    engine = Engine(tmp_path, "decode", config, core=1)
    with pytest.raises(RuntimeError, match="exited with"):
        engine.wait()
    log = engine.log.read_text(errors="replace")
    assert "kvd cannot post-process this engine's KV cache: CPU_ATTN with ISA 'amx'" in log
    assert NO_GUESS in log
    assert "To avoid it: run the model in float16 or float32" in log
    assert not (tmp_path / "out.json").exists()


def test_kvd_io_cpus_the_engine_may_not_use_stop_it_at_startup(tmp_path: Path) -> None:
    """libzmq would abort the engine at its first socket; the connector says what is wrong."""
    config = {
        "role": "kv_consumer",
        "model": str(make_model(tmp_path / "tiny-llama")),
        "block_size": 32,
        "connector": "KvdConnector",
        "module": "kvd.vllm",
        "engine_id": "decode-io-cpus",
        "prefill": "tcp://127.0.0.1:9",
        "out": str(tmp_path / "out.json"),
    }
    with DaemonProcess() as kvd:
        config["extra"] = {"kvd_runtime_dir": str(kvd.runtime_dir), "kvd_io_cpus": "1000"}
        engine = Engine(tmp_path, "decode", config, core=1)
        with pytest.raises(RuntimeError, match="exited with"):
            engine.wait()
    log = engine.log.read_text(errors="replace")
    assert "kvd_io_cpus: this process may not run on CPUs 1000: Invalid argument" in log
    assert not (tmp_path / "out.json").exists()
