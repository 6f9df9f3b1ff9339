"""Who serves a READ of a process's memory over UCX on one host, with real NIXL agents.

A READ completes only once the target process progresses its UCX worker: a vLLM prefill
without NIXL's progress thread whose engine went idle (as after a burst, its blocks held for
the decodes) left a decode's READ unfinished until its next request. kvd's progress thread
waits for UCX's events instead of NIXL's, which polls with no pause: READs complete while the
target makes no NIXL call at all.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl", reason="nixl is not installed")

from kvd.nixl.agent import make_agent
from tests.nixl_idle_target import WORDS

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.nixl_idle_target", request.param, str(tmp_path)], cwd=ROOT
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "metadata").exists():
            assert proc.poll() is None, "the target exited"
            assert time.monotonic() < deadline, "the target did not start"
            time.sleep(0.05)
        yield tmp_path
    finally:
        proc.kill()
        proc.wait()


def read_once(directory: Path, wait_s: float) -> tuple[str, torch.Tensor]:
    """One READ of the target's buffer, polled (which progresses this side) for ``wait_s``."""
    agent = make_agent("initiator")
    name = agent.add_remote_agent((directory / "metadata").read_bytes())
    name = name.decode() if isinstance(name, bytes) else name
    address = int((directory / "address").read_text())
    local = torch.zeros(WORDS, dtype=torch.float32)
    agent.register_memory([(local.data_ptr(), WORDS * 4, 0, "")], "DRAM")
    chunk = WORDS * 4 // 4
    remote = agent.prep_xfer_dlist(
        name, [(address + i * chunk, chunk, 0) for i in range(4)], "DRAM"
    )
    mine = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", [(local.data_ptr() + i * chunk, chunk, 0) for i in range(4)], "DRAM"
    )
    handle = agent.make_prepped_xfer("READ", mine, [0, 1, 2, 3], remote, [0, 1, 2, 3], b"")
    state = agent.transfer(handle)
    deadline = time.monotonic() + wait_s
    while state != "DONE" and time.monotonic() < deadline:
        state = agent.check_xfer_state(handle)
        time.sleep(0.001)
    return state, local


@pytest.mark.parametrize("target", ["waits"], indirect=True)
def test_a_target_with_a_waiting_progress_thread_serves_reads_while_idle(target: Path) -> None:
    state, local = read_once(target, wait_s=60)
    assert state == "DONE"
    assert torch.equal(local, torch.arange(WORDS, dtype=torch.float32))


@pytest.mark.parametrize("target", ["none"], indirect=True)
def test_a_target_without_a_progress_thread_holds_reads_while_idle(target: Path) -> None:
    """If this fails, UCX serves such READs without the target: the waiting thread is then
    no longer needed for them (docs/vllm.md says why it is there)."""
    state, _ = read_once(target, wait_s=3)
    assert state == "PROC"


def test_the_bench_servers_keep_the_waiting_thread_for_their_life(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``kvd bench serve``'s stock servers: set at import, and still set once that import's
    objects are gone (a context entered and dropped undid it at once, leaving NIXL's busy
    thread in every stock server)."""
    import gc
    import importlib

    from kvd.bench import vllm_server
    from kvd.nixl.agent import nixl_api

    api = nixl_api()
    bindings = api.nixlBind
    monkeypatch.setenv(vllm_server.PROGRESS_THREAD_ENV, "waits")
    try:
        importlib.reload(vllm_server)
        gc.collect()
        assert api.nixlBind is not bindings
    finally:
        api.nixlBind = bindings
