"""The kernels themselves: the CPU kernel's checks and threads; Triton in its interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvd.cudaipc import check_handle
from kvd.kernels import cpu
from kvd.kernels.plan import RowPlan
from kvd.postprocess import block_rows, postprocess_tensors, row_plan
from kvd.protocol import CudaIpcRef
from tests.reference import expected_block, random_bytes, same_bytes

ROOT = Path(__file__).resolve().parent.parent
needs_cpu_kernel = pytest.mark.skipif(not cpu.available(), reason="CPU kernel not built")


@needs_cpu_kernel
@pytest.mark.parametrize("threads", [1, 2, 3, 16])
def test_cpu_kernel_splits_work_across_threads(threads: int) -> None:
    tensors = [random_bytes([9, 8, 4, 16], torch.bfloat16, seed) for seed in range(3)]
    before = [t.clone() for t in tensors]
    views = [block_rows(t, layout="NHD", block_size=8, num_heads=4) for t in tensors]
    plan = row_plan(
        kv_parts=1, block_size=8, num_heads=4, ratio=2, remote_layout="HND", local_layout="NHD"
    )
    assert plan is not None
    ids = [8, 0, 5, 3]
    cpu.permute_blocks([v.rows for v in views], ids, plan, threads=threads)
    for now, was in zip(tensors, before, strict=True):
        for b in range(9):
            want = was[b]
            if b in ids:
                want = expected_block(
                    was[b],
                    kv_parts=1,
                    block_size=8,
                    heads=4,
                    ratio=2,
                    remote_layout="HND",
                    local_layout="NHD",
                )
            assert same_bytes(now[b], want)


@needs_cpu_kernel
def test_cpu_kernel_checks_what_the_c_code_trusts() -> None:
    t = random_bytes([4, 8, 2, 4], torch.float16, 1)
    rows = block_rows(t, layout="NHD", block_size=8, num_heads=2).rows
    plan = RowPlan(torch.arange(16).flip(0))
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 4\)"):
        cpu.permute_blocks([rows], [4], plan)
    with pytest.raises(ValueError, match="permutation has 3 rows"):
        cpu.permute_blocks([rows], [0], RowPlan(torch.arange(3)))
    other = block_rows(
        random_bytes([5, 8, 2, 4], torch.float16, 2), layout="NHD", block_size=8, num_heads=2
    ).rows
    with pytest.raises(ValueError, match="share their geometry"):
        cpu.permute_blocks([rows, other], [0], plan)


def test_merges_move_long_runs() -> None:
    """HND -> HND at ratio 4 moves each head's sub-block as one run, not row by row."""
    plan = row_plan(
        kv_parts=1, block_size=64, num_heads=8, ratio=4, remote_layout="HND", local_layout="HND"
    )
    assert plan is not None
    assert plan.runs.shape[0] == 8 * 4 and set(plan.runs[:, 2].tolist()) == {16}
    one_row = row_plan(
        kv_parts=1, block_size=64, num_heads=8, ratio=1, remote_layout="HND", local_layout="NHD"
    )
    assert one_row is not None and one_row.runs.shape[0] == 64 * 8


def test_kernel_backend_refuses_devices_without_a_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "_rowperm", None)
    t = random_bytes([2, 4, 2, 4], torch.float16, 1)
    view = block_rows(t, layout="NHD", block_size=4, num_heads=2)
    with pytest.raises(RuntimeError, match="no post-process kernel"):
        postprocess_tensors([view], [0], ratio=2, remote_layout="HND", backend="kernel")
    postprocess_tensors([view], [0], ratio=2, remote_layout="HND")  # auto falls back to torch


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernels_in_the_interpreter() -> None:
    """The CUDA kernels' code, run by Triton's CPU interpreter against the reference."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.triton_interpreter_check", "40"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 40
    assert sum(line.endswith(": ok") for line in lines) >= 20
    assert any("big=True: ok" in line for line in lines), "the two-pass path was exercised"


def test_cuda_ipc_handles_are_checked_without_a_gpu() -> None:
    assert check_handle(CudaIpcRef(handle=bytes(64)), "tensors[0]") is None
    expandable = CudaIpcRef(handle=b"\x03e" + bytes(40))
    assert "expandable" in (check_handle(expandable, "tensors[0]") or "")
    assert "64-byte" in (check_handle(CudaIpcRef(handle=b"\x01"), "tensors[1]") or "")
