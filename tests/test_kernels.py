"""The kernels themselves: the C kernel's threads and its recovery from memory faults, the
torch fallback, and Triton in its interpreter."""

from __future__ import annotations

import ctypes
import importlib.util
import mmap
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvd.cudaipc import check_handle
from kvd.kernels import cpu
from kvd.kernels.faults import MemoryFault
from kvd.kernels.postprocess import CachePostProcess
from kvd.layout.formats import PRESETS, PageSizes
from kvd.layout.planner import plan
from kvd.protocol import CudaIpcRef
from tests.kernel_cases import Cache, check_cache, make_cache

ROOT = Path(__file__).resolve().parent.parent
needs_cpu_kernel = pytest.mark.skipif(not cpu.available(), reason="CPU kernel not built")
SIZES = PageSizes(num_layers=1, num_heads=4, block_size=8, head_dim=16, itemsize=2)


def hnd_to_nhd(cache: Cache, ids: list[int], ratio: int, threads: int) -> None:
    """Run the C kernel on ``ids`` of ``cache`` (HND pages landed in NHD ones), one page a group."""
    regions = cache.regions()
    bases = np.array([r.base for r in regions], dtype=np.int64)
    strides = np.array([r.block_stride for r in regions], dtype=np.int64)
    pages = cpu.page_table(bases, strides, np.array(ids, dtype=np.int64).reshape(-1, 1))
    cpu.apply_runs(pages, plan(PRESETS["HND"], PRESETS["NHD"], SIZES, ratio), threads=threads)


@needs_cpu_kernel
@pytest.mark.parametrize("threads", [1, 2, 3, 16])
def test_cpu_kernel_splits_work_across_threads(threads: int) -> None:
    cache = make_cache("NHD", dtype="bfloat16", block_size=8, num_blocks=9, heads=4, head_dim=16)
    ids = [8, 0, 5, 3]
    hnd_to_nhd(cache, ids, 4, threads)
    check_cache(cache, [(ids, 0)], "HND", 4)


@needs_cpu_kernel
@pytest.mark.parametrize("threads", [2, 3])
def test_cpu_kernel_threads_share_many_chunks_of_groups(threads: int) -> None:
    """Threads take chunks of groups from a shared counter: with 1 KiB pages a chunk is 256
    groups, so the 4,000 here (1,000 blocks in 4 regions) go in 16 chunks; each page is
    rewritten once."""
    cache = make_cache("NHD", dtype="bfloat16", block_size=8, num_blocks=1100, heads=4, head_dim=16)
    ids = np.random.default_rng(3).permutation(1100)[:1000].tolist()
    hnd_to_nhd(cache, ids, 1, threads)
    check_cache(cache, [(ids, 0)], "HND", 1)


BENCH_SIZES = PageSizes(num_layers=1, num_heads=8, block_size=64, head_dim=128, itemsize=2)


def test_the_gather_scatters_over_the_side_with_fewer_streams() -> None:
    """NHD -> HND read in destination order is 64 interleaved streams (one per token), in
    source order it writes 8 (one per head): source order. HND -> NHD the other way round."""
    to_hnd = plan(PRESETS["NHD"], PRESETS["HND"], BENCH_SIZES, 64)
    order = cpu.gather_order(to_hnd)
    source = order[:, 1] * to_hnd.page_bytes + order[:, 2]
    assert (np.diff(source) > 0).all(), "not in source order"
    assert sorted(map(tuple, order.tolist())) == sorted(map(tuple, to_hnd.moves.tolist()))
    to_nhd = plan(PRESETS["HND"], PRESETS["NHD"], BENCH_SIZES, 64)
    assert cpu.gather_order(to_nhd) is to_nhd.moves


@needs_cpu_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_gathers_in_source_order_exactly(threads: int) -> None:
    cache = make_cache("HND", dtype="bfloat16", block_size=64, num_blocks=6, heads=8, head_dim=128)
    ids = [4, 1, 3]
    regions = cache.regions()
    bases = np.array([r.base for r in regions], dtype=np.int64)
    strides = np.array([r.block_stride for r in regions], dtype=np.int64)
    pages = cpu.page_table(bases, strides, np.array(ids, dtype=np.int64).reshape(-1, 1))
    cpu.apply_runs(pages, plan(PRESETS["NHD"], PRESETS["HND"], BENCH_SIZES, 64), threads=threads)
    check_cache(cache, [(ids, 0)], "NHD", 64)


@needs_cpu_kernel
def test_cpu_kernel_checks_its_page_table() -> None:
    p = plan(PRESETS["HND"], PRESETS["NHD"], SIZES, 16)
    with pytest.raises(ValueError, match="rows of 2 page addresses"):
        cpu.apply_runs(np.zeros((3, 1), dtype=np.int64), p)
    with pytest.raises(ValueError, match="int64 rows"):
        cpu.apply_runs(np.zeros((3, 2), dtype=np.int32), p)


@pytest.fixture
def shm_file() -> Iterator[Path]:
    fd, name = tempfile.mkstemp(prefix="kvd-sigbus-", dir="/dev/shm")
    os.close(fd)
    path = Path(name)
    yield path
    path.unlink(missing_ok=True)


def mapped_cache(path: Path, p_bytes: int, blocks: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A file-backed (blocks, page) uint8 tensor, as kvd maps an engine's shared memory."""
    with open(path, "r+b") as f:
        f.truncate(blocks * p_bytes)
        mapping = mmap.mmap(f.fileno(), blocks * p_bytes)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8).view(blocks, p_bytes)
    tensor.random_(0, 256)
    return mapping, tensor


@needs_cpu_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_a_truncated_shared_memory_file_raises_memory_fault(shm_file: Path, threads) -> None:
    """The engine may truncate a file kvd maps: the kernel's touch raises SIGBUS, which must
    end the call with MemoryFault, not the process; the kernel keeps working afterwards."""
    p = plan(PRESETS["HND"], PRESETS["NHD"], SIZES, 4)
    mapping, tensor = mapped_cache(shm_file, p.page_bytes, 8)
    base = tensor.data_ptr()
    os.truncate(shm_file, 0)
    pages = np.array([[base + b * p.page_bytes] for b in range(8)], dtype=np.int64)
    with pytest.raises(MemoryFault, match="SIGBUS at address 0x") as fault:
        cpu.apply_runs(pages, p, threads=threads)
    assert base <= fault.value.address < base + 8 * p.page_bytes
    # Still alive, and the kernel works on other memory.
    cache = make_cache("NHD", dtype="bfloat16", block_size=8, num_blocks=4, heads=4, head_dim=16)
    cache.postprocess().apply([([2, 1], 0)], "HND", 4)
    check_cache(cache, [([2, 1], 0)], "HND", 4)
    del tensor
    mapping.close()


@needs_cpu_kernel
def test_unmapped_memory_raises_memory_fault() -> None:
    p = plan(PRESETS["HND"], PRESETS["NHD"], SIZES, 4)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = 2 * p.page_bytes
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    address = libc.mmap(None, size, 0, flags, -1, 0)  # PROT_NONE
    assert address not in (None, ctypes.c_void_p(-1).value)
    try:
        pages = np.array([[address], [address + p.page_bytes]], dtype=np.int64)
        with pytest.raises(MemoryFault, match="SIGSEGV") as fault:
            cpu.apply_runs(pages, p)
        assert address <= fault.value.address < address + size
    finally:
        libc.munmap(address, size)


@needs_cpu_kernel
def test_a_fault_outside_the_kernel_still_kills() -> None:
    """The handler hands faults it does not own to the one installed before it (here Python's
    faulthandler, which then reports and dies by the signal)."""
    code = (
        "import faulthandler, ctypes, numpy as np\n"
        "faulthandler.enable()\n"
        "from kvd.kernels import cpu\n"
        "from kvd.layout.formats import PRESETS, PageSizes\n"
        "from kvd.layout.planner import plan\n"
        "s = PageSizes(1, 2, 4, 4, 1)\n"
        "p = plan(PRESETS['HND'], PRESETS['NHD'], s, 2)\n"
        "buf = np.zeros(p.page_bytes, dtype=np.uint8)\n"
        "cpu.apply_runs(np.array([[buf.ctypes.data]], dtype=np.int64), p)\n"
        "print('kernel ran', flush=True)\n"
        "ctypes.string_at(1)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.stdout == "kernel ran\n"
    assert result.returncode == -11, result.stderr
    assert "Fatal Python error: Segmentation fault" in result.stderr


def test_the_torch_fallback_runs_the_same_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "_runs", None)
    cache = make_cache("cpu_attn_vec", dtype="bfloat16", block_size=8, num_blocks=6)
    with pytest.raises(RuntimeError, match="no post-process kernel"):
        cache.postprocess("kernel")
    post = cache.postprocess()  # auto falls back to torch
    assert post.backend == "torch"
    requests = [([4, 1], 3)]
    post.apply(requests, "cpu_attn_vec", 2)
    check_cache(cache, requests, "cpu_attn_vec", 2)


def test_cache_post_process_refuses_regions_on_another_device() -> None:
    cache = make_cache("NHD", dtype="bfloat16", block_size=8, num_blocks=2)
    with pytest.raises(ValueError, match="not meta"):
        CachePostProcess(cache.regions(), "meta")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernels_in_the_interpreter() -> None:
    """The CUDA kernels' code, run by Triton's CPU interpreter against the reference."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.triton_interpreter_check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) >= 20 and all(line.endswith(": ok") for line in lines), result.stdout
    assert any("two_pass=True" in line for line in lines), "the two-pass path was exercised"
    assert any("pages=4" in line for line in lines), "remote pages larger than local ones"


def test_cuda_ipc_handles_are_checked_without_a_gpu() -> None:
    assert check_handle(CudaIpcRef(handle=bytes(64)), "tensors[0]") is None
    expandable = CudaIpcRef(handle=b"\x03e" + bytes(40))
    assert "expandable" in (check_handle(expandable, "tensors[0]") or "")
    assert "64-byte" in (check_handle(CudaIpcRef(handle=b"\x01"), "tensors[1]") or "")
