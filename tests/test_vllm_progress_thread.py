"""``kvd_nixl_progress_thread``: on CPU a NIXL agent whose progress thread waits for UCX's
events, instead of NIXL's, which polls with no pause on the core kvd runs on (and instead of
none, which leaves an idle prefill's READs unserved: ``tests/test_nixl_progress.py``)."""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture(scope="module")
def vllm_nixl() -> tuple[ModuleType, Any]:
    """vLLM's NIXL worker module and kvd's connector module, or a skip where vLLM is not."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # vLLM's import warns (torch deprecations)
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

            from kvd.vllm import connector
    except Exception as exc:  # noqa: BLE001 (any failure to load vLLM means: not here)
        pytest.skip(f"vLLM is not importable: {type(exc).__name__}: {exc}")
    return base_worker, connector


def test_the_setting_waits_on_cpu_by_default_and_says_what_it_takes(
    vllm_nixl: tuple[ModuleType, Any],
) -> None:
    _, connector = vllm_nixl
    assert connector.nixl_progress_thread("auto", "cpu") == "waits"
    assert connector.nixl_progress_thread("auto", "cuda") == "busy"
    assert connector.nixl_progress_thread(True, "cpu") == "busy"
    assert connector.nixl_progress_thread("false", "cuda") == "off"
    assert connector.nixl_progress_thread("Waits", "cuda") == "waits"
    with pytest.raises(connector.KvdConnectorError, match="kvd_nixl_progress_thread: 'sometimes'"):
        connector.nixl_progress_thread("sometimes", "cpu")


def test_the_worker_builds_its_agent_as_the_setting_says_and_nothing_else_changes(
    vllm_nixl: tuple[ModuleType, Any],
) -> None:
    base_worker, connector = vllm_nixl
    from kvd.nixl.agent import nixl_api

    original = base_worker.nixl_agent_config
    with connector.nixl_agents(connector.KvdWorker, progress_thread="off"):
        config = base_worker.nixl_agent_config(num_threads=4, capture_telemetry=True)
        assert config.enable_pthread is False
        assert config.num_threads == 4  # vLLM's own options still go through
    assert base_worker.nixl_agent_config is original
    with connector.nixl_agents(connector.KvdWorker, progress_thread="busy"):
        assert base_worker.nixl_agent_config is original
    assert base_worker.nixl_agent_config().enable_pthread is True
    bindings = nixl_api().nixlBind
    with connector.nixl_agents(connector.KvdWorker, progress_thread="waits"):
        assert base_worker.nixl_agent_config is original  # the thread stays on ...
        assert nixl_api().nixlBind is not bindings  # ... made with a wait (kvd.nixl.agent)
    assert nixl_api().nixlBind is bindings
