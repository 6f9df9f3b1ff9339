"""``kvd_nixl_progress_thread``: the decode worker's NIXL agent without NIXL's progress thread
on CPU, where it would poll with no pause on the core kvd runs on."""

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


def test_the_setting_is_off_on_cpu_by_default_and_says_what_it_takes(
    vllm_nixl: tuple[ModuleType, Any],
) -> None:
    _, connector = vllm_nixl
    assert connector.nixl_progress_thread("auto", "cpu") is False
    assert connector.nixl_progress_thread("auto", "cuda") is True
    assert connector.nixl_progress_thread(True, "cpu") is True
    assert connector.nixl_progress_thread("false", "cuda") is False
    with pytest.raises(connector.KvdConnectorError, match="kvd_nixl_progress_thread: 'sometimes'"):
        connector.nixl_progress_thread("sometimes", "cpu")


def test_the_worker_builds_its_agent_without_the_thread_and_nothing_else_changes(
    vllm_nixl: tuple[ModuleType, Any],
) -> None:
    base_worker, connector = vllm_nixl
    original = base_worker.nixl_agent_config
    with connector.nixl_agents(connector.KvdWorker, progress_thread=False):
        config = base_worker.nixl_agent_config(num_threads=4, capture_telemetry=True)
        assert config.enable_pthread is False
        assert config.num_threads == 4  # vLLM's own options still go through
    assert base_worker.nixl_agent_config is original
    with connector.nixl_agents(connector.KvdWorker, progress_thread=True):
        assert base_worker.nixl_agent_config is original
    assert base_worker.nixl_agent_config().enable_pthread is True
