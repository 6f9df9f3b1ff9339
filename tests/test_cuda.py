"""The CUDA path: its thread, error and lifetime discipline with the CUDA calls faked (runs
anywhere), and on a real GPU the Triton kernel's exactness, CUDA IPC attach and the stream.

Tests marked ``cuda`` are skipped without a CUDA device; `.ci/device-check` runs this whole file
on a GPU machine.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvd import cudaipc
from kvd.client import Client, KvdError
from kvd.cudaipc import CudaIpcError, IpcMapping, export_tensor
from kvd.daemon.attach import warm_up
from kvd.daemon.executor import CudaExecutor, Job, WorkItem
from kvd.daemon.registry import AttachedCache, Owner
from kvd.daemon_process import DaemonProcess
from kvd.kernels import device
from kvd.kernels.device import IdRing, Lane
from kvd.layout.formats import PRESETS, PageSizes
from kvd.layout.planner import plan
from kvd.protocol import CudaIpcRef, TensorSpec
from tests.daemon_helpers import by_req, collect, wait_for
from tests.fake_cuda import CUDA_ERROR_INVALID_VALUE, FakeDriver, FakeRuntime, HostCuda
from tests.kernel_cases import check_cache, make_cache
from tests.reference import expected_block, random_bytes, same_bytes

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
"""With ``pytest.mark.cuda``: a test that needs a real GPU."""

GPU3 = torch.device("cuda", 3)


# -- without a GPU: the CUDA calls faked ----------------------------------------------------------


@pytest.fixture
def fake_runtime(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeRuntime, FakeDriver]:
    runtime = FakeRuntime()
    driver = FakeDriver(runtime)
    monkeypatch.setattr(cudaipc, "_runtime", lambda: runtime)
    monkeypatch.setattr(cudaipc, "_driver", lambda: driver)
    return runtime, driver


def test_an_allocation_of_unknown_size_is_refused(fake_runtime) -> None:
    """Without the allocation's size the tensor's bounds cannot be checked: fail closed."""
    runtime, driver = fake_runtime
    driver.fail = CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaIpcError, match="cuMemGetAddressRange failed"):
        IpcMapping(CudaIpcRef(handle=bytes(64)), GPU3)
    assert runtime.open_handles == {}, "the handle opened before the failure was not closed"


def test_a_tensor_past_the_end_of_its_allocation_is_refused(fake_runtime) -> None:
    _, driver = fake_runtime
    driver.size = 4096
    mapping = IpcMapping(CudaIpcRef(handle=bytes(64)), GPU3)
    with pytest.raises(CudaIpcError, match="holds 4096 bytes"):
        mapping.tensor(1024, 4096)


def test_a_mapping_is_closed_off_the_thread_that_drops_it(fake_runtime) -> None:
    """The last reference may go on the event loop (a Detach): closing must not block there."""
    runtime, _ = fake_runtime
    mapping = IpcMapping(CudaIpcRef(handle=bytes(64)), GPU3)
    address = mapping.ptr
    del mapping
    wait_for(lambda: address in runtime.closed)
    me = threading.current_thread().name
    blocking = ("cudaDeviceSynchronize", "cudaIpcCloseMemHandle")
    assert all(thread != me for name in blocking for thread, _ in runtime.called(name))
    ((thread, device),) = runtime.called("cudaIpcCloseMemHandle")
    assert device == 3, "closed on a thread whose current device is not the mapping's"
    assert (thread, 3) in runtime.called("cudaDeviceSynchronize"), "closed before kvd was idle"


class NotingRewrite:
    """A kernel pass that notes which device and stream its thread has current."""

    def __init__(self, api: HostCuda) -> None:
        self.api = api

    def apply(self, requests: list[tuple[list[int], int]]) -> None:
        self.api.note("apply")


def work_item(rewrite: object, blocks: list[int]) -> WorkItem:
    return WorkItem(batch=None, rewrites=[rewrite], requests=[(blocks, 0)], nbytes=0)  # type: ignore[arg-type, list-item]


async def test_the_executor_threads_set_the_lanes_device() -> None:
    """A thread's current device starts at 0, whatever the main thread chose (kvd serve
    --device cuda:3): the executor's and the waiter's threads must set the lane's."""
    api = HostCuda()
    lane = Lane(GPU3, api=api)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Job] = loop.create_future()
    executor = CudaExecutor(loop, done.set_result, lane)
    try:
        executor.submit(Job([work_item(NotingRewrite(api), [1, 2])]))
        job = await asyncio.wait_for(done, 10)
    finally:
        assert executor.close(timeout=10)
    assert job.items[0].error is None
    assert api.noted("apply") == [("kvd-executor", 3, "kvd3")]
    assert [(t, d) for t, d, _ in api.noted("event.synchronize")] == [("kvd-cuda-wait", 3)]


def test_warm_up_sets_the_device_of_the_attach_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """``open_cache`` and ``warm_up`` run in a worker thread (asyncio.to_thread)."""
    api = HostCuda()
    monkeypatch.setitem(device._lanes, GPU3, Lane(GPU3, api=api))

    class NotingPostProcess:
        def warm_up(self, remote: object, remote_block_size: int) -> None:
            api.note("warm_up")

    cache = AttachedCache(
        cache_id="c",
        tensors=[],
        num_blocks=4,
        block_size=16,
        device=GPU3,
        owner=Owner(b"", ""),
        postprocesses={PRESETS["NHD"]: NotingPostProcess()},  # type: ignore[dict-item]
    )
    worker = threading.Thread(target=warm_up, args=(cache,), name="attach-worker")
    worker.start()
    worker.join()
    assert [d for _, d, _ in api.noted("warm_up")] == [3, 3]
    assert ("attach-worker", 3, "default") in api.noted("synchronize")


def test_launches_go_to_the_lanes_device_and_stream_from_any_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Triton launches on the calling thread's current device and stream: the post-process
    makes the lane's current around its launches and uploads, on whatever thread."""
    from kvd.kernels import gpu

    api = HostCuda()
    lane = Lane(GPU3, api=api)
    monkeypatch.setattr(gpu, "apply_runs", lambda *args: api.note("launch"))
    cache = make_cache("NHD", dtype="bfloat16", block_size=8, num_blocks=6)
    post = cache.postprocess(lane=lane)
    post.backend = "triton"

    def attach_and_serve() -> None:
        post.warm_up("HND", 8)
        post.apply([([1, 4], 0), ([2], 1)], "HND", 4)

    worker = threading.Thread(target=attach_and_serve, name="some-thread")
    worker.start()
    worker.join()
    calls = [n for n in api.notes if n[0] in ("launch", "upload", "copy_async")]
    assert {c for c, *_ in calls} >= {"launch", "upload"}
    assert {(t, d, s) for _, t, d, s in calls} == {("some-thread", 3, "kvd3")}


def test_block_ids_travel_through_a_reused_pinned_ring() -> None:
    api = HostCuda()
    lane = Lane(GPU3, api=api)
    lane.ids = IdRing(lane, slots=2, slot_ids=4)
    for n in range(5):
        ids = np.arange(3, dtype=np.int32) + n
        with lane.launching(), lane.ids.slot(ids) as on_device:
            assert on_device.tolist() == ids.tolist()
            api.note("launch")
    assert api.pinned_bytes == 2 * 4 * 4, "pinned memory allocated per launch"
    # Each slot's event is recorded after its launches, and waited for before the slot is
    # written again (uses 3, 4 and 5 reuse slots 0, 1, 0).
    calls = [c for c, *_ in api.notes if c in ("launch", "record", "event.synchronize")]
    assert calls == ["launch", "record"] * 2 + ["event.synchronize", "launch", "record"] * 3
    with pytest.raises(ValueError, match="do not fit"), lane.ids.slot(np.arange(5, dtype=np.int32)):
        pass


def test_the_benchmark_page_is_rewritten_in_place_in_tiles_that_fit_registers() -> None:
    """64 tokens x 8 heads x 128 head_dim bf16: a 128 KiB page, one pass, no scratch."""
    from kvd.kernels import gpu

    sizes = PageSizes(num_layers=1, num_heads=8, block_size=64, head_dim=128, itemsize=2)
    for nP in (64, 16):
        prepared = gpu.prepare(
            plan(PRESETS["HND"], PRESETS["NHD"], sizes, nP), Lane(GPU3, api=HostCuda()), 16
        )
        assert prepared.in_place
        assert prepared.tile_words * prepared.width <= 64 * 1024
        assert prepared.tile_words <= prepared.num_warps * 32 * gpu.WORDS_PER_THREAD
        assert prepared.slice_words * prepared.width == 128, "a program moves whole lines"


# -- on a GPU -------------------------------------------------------------------------------------

CASES = [
    # (remote, local, local block size, remote block sizes)
    ("HND", "NHD", 16, (1, 4, 16, 64)),
    ("HND", "HND", 16, (2, 8, 32)),
    ("NHD", "NHD", 16, (4, 32)),
    ("blocks_first_HND", "blocks_first_NHD", 16, (4, 16)),
    ("cpu_attn_vec", "cpu_attn_vec", 32, (8, 16, 64)),
    ("LBHNC", "LBNHC", 16, (4, 16, 32)),
    ("LBHNC", "LBHNC", 16, (4, 64)),
    ("BLHNC", "BLNHC", 16, (8,)),
    ("LHBNC", "LHBNC", 16, (4,)),
]


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("two_pass", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32"])
@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_matches_reference(case, dtype, two_pass, monkeypatch) -> None:
    from kvd.kernels import gpu

    remote, local, block_size, remote_block_sizes = case
    if two_pass:
        monkeypatch.setattr(gpu, "TILE_BYTES", 0)
    rng = random.Random(f"{remote}{local}{dtype}{two_pass}")
    for nP in remote_block_sizes:
        cache = make_cache(
            local,
            dtype=dtype,
            block_size=block_size,
            num_blocks=40,
            heads=rng.randint(1, 8),
            head_dim=rng.choice([16, 64, 128]),
            seed=rng.randrange(99),
            device="cuda",
        )
        pages = max(1, nP // block_size)
        remote_pages = max(1, block_size // nP)
        free = rng.sample(range(40), 40)
        requests = []
        for n in range(1, 4):
            ids, free = free[: n * pages], free[n * pages :]
            covered = rng.choice([0, n * remote_pages - 1]) if remote_pages > 1 else 0
            requests.append((ids, covered))
        cache.postprocess("kernel").apply(requests, remote, nP)
        torch.cuda.synchronize()
        check_cache(cache, requests, remote, nP)


@pytest.fixture(scope="module")
def gpu_daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess("--device", "cuda:0", "--stream-priority", "-1") as d:
        yield d


def cuda_specs(tensors: list[torch.Tensor], layout: str, block_size: int) -> list[TensorSpec]:
    return [
        TensorSpec(
            name=f"layer.{i}",
            shape=list(t.shape),
            dtype=str(t.dtype).removeprefix("torch."),
            layout=layout,
            kv_arrangement="split",
            block_size=block_size,
            memory=export_tensor(t),
        )
        for i, t in enumerate(tensors)
    ]


@pytest.mark.cuda
@gpu
def test_cuda_ipc_attach_and_post_process(gpu_daemon: DaemonProcess) -> None:
    block_size, heads, head_dim = 64, 8, 128
    host = [random_bytes([2, 64, block_size, heads, head_dim], torch.bfloat16, i) for i in range(4)]
    # One allocation for all layers, as vLLM does: every tensor is a view at an offset.
    pool = torch.empty(sum(t.numel() for t in host), dtype=torch.bfloat16, device="cuda")
    tensors, offset = [], 0
    for t in host:
        view = pool[offset : offset + t.numel()].view(t.shape)
        view.copy_(t.cuda())
        tensors.append(view)
        offset += t.numel()
    torch.cuda.synchronize()
    with Client(gpu_daemon.runtime_dir) as c:
        attached = c.attach("gpu0", cuda_specs(tensors, "NHD", block_size))
        assert attached.num_blocks == 64
        sub = c.subscribe(["gpu0"])
        plan = {"r1": ([3, 9, 1], 4), "r2": ([10, 11], 1), "r3": ([20], 16)}
        for req_id, (ids, ratio) in plan.items():
            c.read_done(req_id, "gpu0", ids, remote_layout="HND", block_size_ratio=ratio)
        events = by_req(collect(sub, len(plan)))
        assert {k: type(v).__name__ for k, v in events.items()} == dict.fromkeys(plan, "Ready")
        for on_gpu, was in zip(tensors, host, strict=True):
            now = on_gpu.cpu()
            for kv in range(2):
                for ids, ratio in plan.values():
                    for b in ids:
                        want = expected_block(
                            was[kv, b],
                            kv_parts=1,
                            block_size=block_size,
                            heads=heads,
                            ratio=ratio,
                            remote_layout="HND",
                            local_layout="NHD",
                        )
                        assert same_bytes(now[kv, b], want)
                assert same_bytes(now[kv, 0], was[kv, 0]), "an unlisted block changed"
        c.detach("gpu0")
        sub.close()


@pytest.mark.cuda
@gpu
def test_wrong_gpu_and_bad_handles_are_refused(gpu_daemon: DaemonProcess) -> None:
    t = torch.zeros(2, 4, 16, 2, 8, dtype=torch.float16, device="cuda")
    (spec,) = cuda_specs([t], "NHD", 16)
    import msgspec

    elsewhere = msgspec.structs.replace(
        spec, memory=msgspec.structs.replace(spec.memory, device_uuid="GPU-not-this-one")
    )
    expandable = msgspec.structs.replace(
        spec, memory=msgspec.structs.replace(spec.memory, handle=b"\x03e" + bytes(60))
    )
    with Client(gpu_daemon.runtime_dir) as c:
        with pytest.raises(KvdError, match=r"invalid_cache: .*device_uuid"):
            c.attach("wrong-gpu", [elsewhere])
        with pytest.raises(KvdError, match=r"invalid_cache: .*expandable"):
            c.attach("expandable", [expandable])
        with pytest.raises(KvdError, match="memory_unavailable"):
            bogus = msgspec.structs.replace(
                spec, memory=msgspec.structs.replace(spec.memory, handle=bytes(64))
            )
            c.attach("bogus", [bogus])
        assert c.ping().protocol_version == 1  # still serving


@pytest.mark.cuda
@gpu
def test_expandable_segments_cannot_be_exported() -> None:
    code = (
        "import torch\n"
        "from kvd.cudaipc import export_tensor, CudaIpcError\n"
        "t = torch.zeros(1 << 20, device='cuda')\n"
        "try:\n    export_tensor(t)\nexcept CudaIpcError as e:\n    print('refused:', e)\n"
        "else:\n    print('exported')\n"
    )
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.startswith("refused:") and "expandable_segments:False" in out
    assert CudaIpcError  # the error type is public for engines to catch
