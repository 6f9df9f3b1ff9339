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
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvd import cudaipc
from kvd.client import Client, KvdError, ShmCache, read_done_message
from kvd.cudaipc import CudaIpcError, IpcMapping, export_tensor
from kvd.daemon.attach import open_cache, warm_up
from kvd.daemon.executor import CudaExecutor, Job, WorkItem
from kvd.daemon.journal import Journal
from kvd.daemon.metrics import Metrics
from kvd.daemon.pipeline import Pipeline
from kvd.daemon.registry import AttachedCache, Owner, Registry
from kvd.daemon.server import EXIT_DEVICE_FAILED
from kvd.daemon_process import DaemonProcess
from kvd.kernels import device
from kvd.kernels.device import IdRing, Lane
from kvd.layout.formats import PRESETS, PageSizes
from kvd.layout.planner import plan
from kvd.protocol import Attach, CudaIpcRef, Failed, Ready, TensorSpec
from tests.daemon_helpers import EventTap, by_req, collect, wait_for
from tests.fake_cuda import (
    CUDA_ERROR_INVALID_VALUE,
    EngineCuda,
    FakeDriver,
    FakeRuntime,
    HostCuda,
)
from tests.kernel_cases import check_cache, make_cache
from tests.link_double import StepLink
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

    group = -1  # every group's blocks, as a cache attached as one

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


class FailingRewrite:
    """A kernel pass whose launch raises, as a CUDA call does once the context is broken."""

    group = -1

    def apply(self, requests: list[tuple[list[int], int]]) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


async def test_an_asynchronous_cuda_error_stops_the_executor_without_answers() -> None:
    """A sticky error (an illegal address) leaves the context broken and the blocks of every
    job after the last completed one undefined: those jobs are never reported (the journal
    answers them at the next start), the executor takes no more work, kvd is told to exit."""
    api = HostCuda()
    lane = Lane(GPU3, api=api)
    loop = asyncio.get_running_loop()
    fatal: list[str] = []
    executor = CudaExecutor(loop, lambda job: None, lane, on_fatal=fatal.append)
    first, second = (
        Job([work_item(NotingRewrite(api), [1])]),
        Job([work_item(NotingRewrite(api), [2])]),
    )
    try:
        executor.submit(first)
        done: asyncio.Future[Job] = loop.create_future()
        executor._on_done = done.set_result
        await asyncio.wait_for(done, 10)
        reported: list[Job] = []
        executor._on_done = reported.append
        api.fail_next_event = RuntimeError("CUDA error: an illegal memory access was encountered")
        executor.submit(second)
        await poll(lambda: bool(fatal))
        await asyncio.sleep(0.1)  # a late report would come now
        assert reported == []
        assert "illegal memory access" in fatal[0]
        assert not executor.has_capacity()
    finally:
        executor.close(timeout=10)


async def test_a_launch_failing_on_a_broken_context_stops_the_executor() -> None:
    api = HostCuda()
    api.broken_reason = "CUDA error: an illegal memory access was encountered"
    loop = asyncio.get_running_loop()
    fatal: list[str] = []
    reported: list[Job] = []
    executor = CudaExecutor(loop, reported.append, Lane(GPU3, api=api), on_fatal=fatal.append)
    try:
        executor.submit(Job([work_item(FailingRewrite(), [1])]))
        await poll(lambda: bool(fatal))
        await asyncio.sleep(0.1)
        assert reported == [] and "illegal memory access" in fatal[0]
        assert ("kvd-executor", 3, "kvd3") in api.noted("broken")
    finally:
        executor.close(timeout=10)


async def test_a_launch_failing_on_a_healthy_context_fails_only_its_requests() -> None:
    """Not sticky (the context still works): the job's requests fail, kvd goes on."""
    api = HostCuda()
    loop = asyncio.get_running_loop()
    fatal: list[str] = []
    done: asyncio.Future[Job] = loop.create_future()
    executor = CudaExecutor(loop, done.set_result, Lane(GPU3, api=api), on_fatal=fatal.append)
    try:
        executor.submit(Job([work_item(FailingRewrite(), [1])]))
        job = await asyncio.wait_for(done, 10)
        assert job.items[0].error and not fatal and executor.has_capacity()
    finally:
        executor.close(timeout=10)


async def poll(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_a_broken_device_stops_kvd_and_the_next_start_answers(short_tmp: Path) -> None:
    """End to end, on the CPU: the executor reports the device broken (a test hook stands in
    for a sticky CUDA error); kvd publishes nothing for the launched request, exits with
    status 3 so that systemd restarts it, and the next start answers Failed(interrupted)."""
    cache = ShmCache.create(num_layers=1, num_blocks=8, block_size=8, num_heads=2, head_dim=8)
    try:
        hooked = {"KVD_TEST_CRASH_AT": "device_failure"}
        first = DaemonProcess(runtime_dir=short_tmp, env=hooked).start()
        with first.client() as client:
            client.attach("gpu", cache.specs)
            with EventTap(client, "gpu") as tap:
                client.read_done("doomed", "gpu", [1, 2], remote_layout="HND", block_size_ratio=1)
                assert first.wait(timeout=20) == EXIT_DEVICE_FAILED, first.log_tail()
                assert tap.already_delivered() == []
        assert "the device failed" in first.log_tail()
        with DaemonProcess(runtime_dir=short_tmp) as second, second.client() as client:
            with client.subscribe(["gpu"], from_seq=1) as sub:
                (delivery,) = collect(sub, 1)
            assert isinstance(delivery.event, Failed), delivery.event
            assert delivery.event.code == "interrupted" and delivery.event.req_id == "doomed"
    finally:
        cache.close()


class Published:
    """The pipeline's publisher, as a list of what it published."""

    epoch = 1

    def __init__(self) -> None:
        self.events: list[Ready | Failed] = []

    def publish(self, topic: str, event: Ready | Failed) -> None:
        self.events.append(event)


async def test_ready_with_a_cuda_event_goes_out_at_launch_and_is_journaled_at_completion(
    short_tmp: Path,
) -> None:
    """``ready_cuda_event``: the Ready leaves as soon as the launch is enqueued, carrying the
    IPC event recorded behind it; the outcome is journaled only once the work completed, so a
    crash in between is answered Failed(interrupted) by the next start. (The CPU kernel does
    the work here; the lane's CUDA calls are faked, and the job's completion held back.)"""
    api = HostCuda()
    api.hold_completion = threading.Event()
    shm = ShmCache.create(num_layers=1, num_blocks=8, block_size=8, num_heads=2, head_dim=8)
    before = [t.clone() for t in shm.tensors]
    registry = Registry("cpu")
    registry.add(open_cache(Attach(cache_id="gpu", tensors=shm.specs), "cpu", Owner(b"", "")))
    journal = Journal(short_tmp, 1 << 20)
    journal.recover()
    journal.open()
    publisher = Published()
    pipeline = Pipeline(
        asyncio.get_running_loop(),
        registry,
        publisher,  # type: ignore[arg-type]
        Metrics(),
        journal,
        batch_window_us=0,
        max_batch_blocks=64,
        max_message_bytes=1 << 20,
        executor_factory=lambda loop, done: CudaExecutor(
            loop, done, Lane(GPU3, api=api), ready_events=True
        ),
    )
    pipeline.executor.on_launched = pipeline.job_launched  # type: ignore[attr-defined]

    def notify(req_id: str, blocks: list[int]) -> None:
        frame = read_done_message(req_id, "gpu", blocks, remote_layout="HND", block_size_ratio=1)
        pipeline.on_ingest([frame])
        pipeline.kick()

    try:
        notify("r1", [1, 2])
        await poll(lambda: bool(publisher.events))
        (ready,) = publisher.events
        assert isinstance(ready, Ready) and ready.req_id == "r1"
        assert len(ready.cuda_event) == 64
        assert len(pipeline.ledger) == 1, "announced, but its work is still in flight"
        assert [launch.req_id for launch in Journal(short_tmp, 1 << 20).recover().interrupted] == [
            "r1"
        ], "the outcome was journaled before the work completed"
        api.hold_completion.set()
        await poll(lambda: not pipeline.ledger)
        recovered = Journal(short_tmp, 1 << 20).recover()
        assert recovered.interrupted == [] and recovered.outcomes[("gpu", "r1")].code == ""
        assert len(publisher.events) == 1, "a second event for one request"
        for kv in range(2):
            for b in (1, 2):
                want = expected_block(
                    before[0][kv, b],
                    kv_parts=1,
                    block_size=8,
                    heads=2,
                    ratio=1,
                    remote_layout="HND",
                    local_layout="NHD",
                )
                assert same_bytes(shm.tensors[0][kv, b], want)
        # The event's recording completed: the pool hands it out again.
        notify("r2", [3])
        await poll(lambda: len(publisher.events) == 2 and not pipeline.ledger)
        assert publisher.events[1].cuda_event == ready.cuda_event  # type: ignore[union-attr]
    finally:
        api.hold_completion.set()
        pipeline.close(timeout=10)
        journal.close()
        registry.remove("gpu")
        shm.close()


def test_ready_cuda_event_needs_a_cuda_device(short_tmp: Path) -> None:
    daemon = DaemonProcess("--ready-cuda-event", "true", runtime_dir=short_tmp)
    daemon.spawn()
    assert daemon.wait(timeout=60) == 2
    assert "ready_cuda_event: CUDA events need a daemon on a CUDA device" in daemon.log_tail()


def test_wait_event_opens_each_handle_once_and_waits_on_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opened: list[tuple[object, bytes]] = []

    class Stream:
        device_index = 0
        device = torch.device("cuda", 0)

        def __init__(self) -> None:
            self.waited: list[object] = []

        def wait_event(self, event: object) -> None:
            self.waited.append(event)

    def from_ipc_handle(device: object, handle: bytes) -> tuple[str, bytes]:
        opened.append((device, handle))
        return ("event", handle)

    monkeypatch.setattr(torch.cuda.Event, "from_ipc_handle", from_ipc_handle)
    cudaipc.forget_events()
    stream = Stream()
    one, two = bytes(64), bytes(range(64))
    for handle in (one, two, one):
        cudaipc.wait_event(handle, stream)  # type: ignore[arg-type]
    assert opened == [(Stream.device, one), (Stream.device, two)]
    assert stream.waited == [("event", one), ("event", two), ("event", one)]
    with pytest.raises(CudaIpcError, match="64-byte"):
        cudaipc.wait_event(b"short", stream)  # type: ignore[arg-type]
    cudaipc.forget_events()


def test_warm_up_sets_the_device_of_the_attach_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """``open_cache`` and ``warm_up`` run in a worker thread (asyncio.to_thread)."""
    api = HostCuda()
    monkeypatch.setitem(device._lanes, GPU3, Lane(GPU3, api=api))

    class NotingPostProcess:
        block_bytes = 0
        block_size = 16

        def warm_up(self, remote: object, remote_block_size: int) -> None:
            api.note("warm_up")

    cache = AttachedCache(
        cache_id="c",
        tensors=[],
        num_blocks=4,
        block_size=16,
        device=GPU3,
        owner=Owner(b"", ""),
        postprocesses={(0, PRESETS["NHD"]): NotingPostProcess()},  # type: ignore[dict-item]
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


def test_a_slot_held_by_one_thread_is_not_handed_to_another() -> None:
    """An attach worker's warm-up launch may take seconds (it compiles) while the executor
    keeps launching: the ring must go around it."""
    lane = Lane(GPU3, api=HostCuda())
    lane.ids = IdRing(lane, slots=3, slot_ids=4)
    held, release = threading.Event(), threading.Event()

    def warm_up() -> None:
        with lane.launching(), lane.ids.slot(np.array([7, 7], dtype=np.int32)) as ids:
            held.set()
            assert release.wait(10)
            assert ids.tolist() == [7, 7], "overwritten while its launch still read it"

    worker = threading.Thread(target=warm_up)
    worker.start()
    assert held.wait(10)
    for n in range(7):
        with lane.launching(), lane.ids.slot(np.array([n], dtype=np.int32)) as ids:
            assert ids.tolist() == [n]
    release.set()
    worker.join()


def test_the_benchmark_page_is_rewritten_in_place_in_tiles_that_fit_registers() -> None:
    """64 tokens x 8 heads x 128 head_dim bf16: a 128 KiB page, one pass, no scratch."""
    from kvd.kernels import gpu

    sizes = PageSizes(num_layers=1, num_heads=8, block_size=64, head_dim=128, itemsize=2)
    for nP in (64, 16):
        pair = plan(PRESETS["HND"], PRESETS["NHD"], sizes, nP)
        prepared = gpu.prepare(pair, Lane(GPU3, api=HostCuda()), 16)
        assert prepared.in_place
        assert prepared.tile_words * prepared.width <= 64 * 1024
        assert prepared.tile_words <= prepared.num_warps * 32 * gpu.WORDS_PER_THREAD
        assert prepared.slice_words * prepared.width >= 128, "a program moves whole lines"
        # The smaller tiles tune measures: more programs of fewer warps, slices of whole
        # 32-byte sectors at least.
        shapes = set()
        for tile in gpu.TILE_CHOICES:
            smaller = gpu.prepare(pair, Lane(GPU3, api=HostCuda()), 16, tile)
            assert smaller.in_place and smaller.tile_words * smaller.width <= tile
            assert smaller.tile_words <= smaller.num_warps * 32 * gpu.WORDS_PER_THREAD
            assert smaller.slice_words * smaller.width >= 32
            shapes.add(smaller.shape)
        assert len(shapes) == len(gpu.TILE_CHOICES)


def test_tuning_without_a_timer_chooses_nothing() -> None:
    """Under the host stand-in (Triton's interpreter) work cannot be timed: the default tile
    stays, and warm-up captures replays (which the interpreter check runs)."""
    from kvd.kernels import gpu

    sizes = PageSizes(num_layers=1, num_heads=8, block_size=64, head_dim=128, itemsize=2)
    pair = plan(PRESETS["NHD"], PRESETS["HND"], sizes, 64)
    assert gpu.tune(pair, Lane(GPU3, api=HostCuda()), 16) == {}
    assert gpu.tile_for(pair) == gpu.TILE_BYTES and "tile_bytes" not in gpu.choices(pair)


# -- the engine's marker: kvd's stream waits on it before writing (CUDA calls faked) -------------


class WaitNoting:
    """A kernel pass that notes its launch, after whatever the lane's stream waits on."""

    group = -1

    def __init__(self, api: HostCuda, name: str = "apply") -> None:
        self.api, self.name = api, name

    def apply(self, requests: list[tuple[list[int], int]]) -> None:
        self.api.note(self.name)


def marked_item(rewrite: object, blocks: list[int], markers: list[bytes]) -> WorkItem:
    item = work_item(rewrite, blocks)
    item.markers = markers
    return item


async def test_kvds_stream_waits_on_each_marker_before_the_items_first_write() -> None:
    """Each distinct marker of an item is waited on, on the lane's stream, before the item
    launches; a handle seen before is not opened again; the opened events live until the job
    that waited on them completed, even once the lane's cache let them go."""
    api = HostCuda()
    api.hold_completion = threading.Event()
    lane = Lane(GPU3, api=api)
    loop = asyncio.get_running_loop()
    done: list[Job] = []
    executor = CudaExecutor(loop, done.append, lane)
    one, two = bytes([1]) * 64, bytes([2]) * 64
    try:
        first = Job([marked_item(WaitNoting(api), [1], [one, two, one])])
        executor.submit(first)
        await poll(lambda: len(api.noted("apply")) == 1)
        calls = [c for c, *_ in api.notes if c in ("open_ipc_event", "wait_event", "apply")]
        assert calls == ["open_ipc_event", "wait_event"] * 2 + ["apply"]
        assert {(t, s) for t, _, s in api.noted("wait_event")} == {("kvd-executor", "kvd3")}
        assert [(s.name, e.handle) for s, e in api.waits] == [("kvd3", one), ("kvd3", two)]
        opened = [weakref.ref(e) for _, e in api.waits]
        lane._markers.clear()  # as if the cache of open markers had let them go
        api.waits.clear()
        import gc

        gc.collect()
        assert all(r() is not None for r in opened), "closed under a wait not yet consumed"
        api.hold_completion.set()
        await poll(lambda: len(done) == 1)
        gc.collect()
        assert all(r() is None for r in opened), "kept open after the job completed"
        second = Job([marked_item(WaitNoting(api), [2], [two])])
        executor.submit(second)
        await poll(lambda: len(done) == 2)
        assert len(api.noted("open_ipc_event")) == 3, "dropped from the cache: opened again"
        third = Job([marked_item(WaitNoting(api), [3], [two])])
        executor.submit(third)
        await poll(lambda: len(done) == 3)
        assert len(api.noted("open_ipc_event")) == 3 and len(api.noted("wait_event")) == 4
        assert all(item.error is None for job in done for item in job.items)
    finally:
        api.hold_completion.set()
        assert executor.close(timeout=10)


def test_the_lane_keeps_a_bounded_number_of_markers_open() -> None:
    api = HostCuda()
    lane = Lane(GPU3, api=api)
    handles = [n.to_bytes(2, "big") * 32 for n in range(device.MARKERS_OPEN + 10)]
    for handle in handles:
        lane.wait_for_markers([handle])
    assert len(lane._markers) == device.MARKERS_OPEN
    assert list(lane._markers) == handles[10:], "not the least recently used that left"


async def test_a_marker_that_cannot_be_opened_fails_its_item_untouched() -> None:
    """The engine that recorded it is gone: its item fails ``invalid_message`` without a
    launch; the job's other items run, and kvd goes on."""
    api = HostCuda()
    lost = bytes([9]) * 64
    api.unopenable.add(lost)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Job] = loop.create_future()
    fatal: list[str] = []
    executor = CudaExecutor(loop, done.set_result, Lane(GPU3, api=api), on_fatal=fatal.append)
    try:
        bad = marked_item(WaitNoting(api, "bad"), [1], [lost])
        good = marked_item(WaitNoting(api, "good"), [2], [bytes(64)])
        executor.submit(Job([bad, good]))
        job = await asyncio.wait_for(done, 10)
    finally:
        assert executor.close(timeout=10)
    assert job.items[0].code == "invalid_message"
    assert job.items[0].error is not None and job.items[0].error.startswith("cuda_event: ")
    assert "blocks are untouched" in job.items[0].error
    assert api.noted("bad") == [] and len(api.noted("good")) == 1
    assert job.items[1].error is None and not fatal and executor.has_capacity()


def test_a_marker_is_refused_for_a_cache_in_host_memory_or_of_the_wrong_size() -> None:
    from kvd.daemon.ledger import Ledger
    from kvd.daemon.validate import Rejection, validate_read_done
    from kvd.protocol import ReadDone

    registry = Registry("cpu")
    for cache_id, where in (("host", torch.device("cpu")), ("gpu", GPU3)):
        registry.add(
            AttachedCache(
                cache_id=cache_id,
                tensors=[],
                num_blocks=4,
                block_size=16,
                device=where,
                owner=Owner(b"", ""),
            )
        )
    ledger = Ledger()

    def verdict(cache_id: str, handle: bytes) -> object:
        msg = ReadDone(req_id="r", cache_id=cache_id, physical_block_ids=[1], cuda_event=handle)
        return validate_read_done(msg, registry, ledger)

    host = verdict("host", bytes(64))
    assert isinstance(host, Rejection) and host.code == "invalid_message"
    assert host.message.startswith("cuda_event: cache 'host' is in host memory")
    short = verdict("gpu", bytes(63))
    assert isinstance(short, Rejection) and short.code == "invalid_message"
    assert short.message == "cuda_event: must be a 64-byte cudaIpcEventHandle_t, got 63 bytes"
    # A good marker passes this check (and the route decides the rest).
    fine = verdict("gpu", bytes(64))
    assert not (isinstance(fine, Rejection) and fine.message.startswith("cuda_event"))


def test_a_cpu_kvd_answers_a_marker_with_failed_naming_the_field(short_tmp: Path) -> None:
    cache = ShmCache.create(num_layers=1, num_blocks=8, block_size=8, num_heads=2, head_dim=8)
    try:
        with DaemonProcess(runtime_dir=short_tmp) as d, d.client() as client:
            client.attach("host", cache.specs)
            with client.subscribe(["host"]) as sub:
                client.read_done("m1", "host", [1, 2], remote_layout="HND", cuda_event=bytes(64))
                (delivery,) = collect(sub, 1)
            failed = delivery.event
            assert isinstance(failed, Failed) and failed.code == "invalid_message"
            assert failed.message.startswith("cuda_event: "), failed.message
    finally:
        cache.close()


async def test_a_read_done_with_a_marker_is_rewritten_behind_its_wait(short_tmp: Path) -> None:
    """Through the pipeline: the ReadDone's marker reaches the executor, whose stream waits on
    it before the request's launch; the blocks are rewritten and the Ready goes out. (The CPU
    kernel does the work on a cache that says it is on the GPU; the lane's calls are faked.)"""
    api = HostCuda()
    shm = ShmCache.create(num_layers=1, num_blocks=8, block_size=8, num_heads=2, head_dim=8)
    before = [t.clone() for t in shm.tensors]
    registry = Registry("cpu")
    cache = open_cache(Attach(cache_id="gpu", tensors=shm.specs), "cpu", Owner(b"", ""))
    cache.device = GPU3  # what the marker check reads: a cache on a CUDA device
    registry.add(cache)
    journal = Journal(short_tmp, 1 << 20)
    journal.recover()
    journal.open()
    publisher = Published()
    pipeline = Pipeline(
        asyncio.get_running_loop(),
        registry,
        publisher,  # type: ignore[arg-type]
        Metrics(),
        journal,
        batch_window_us=0,
        max_batch_blocks=64,
        max_message_bytes=1 << 20,
        executor_factory=lambda loop, done: CudaExecutor(loop, done, Lane(GPU3, api=api)),
    )
    marker = bytes(range(64))
    try:
        frame = read_done_message(
            "r1", "gpu", [1, 2], remote_layout="HND", block_size_ratio=1, cuda_event=marker
        )
        pipeline.on_ingest([frame])
        pipeline.kick()
        await poll(lambda: bool(publisher.events) and not pipeline.ledger)
        (ready,) = publisher.events
        assert isinstance(ready, Ready) and ready.req_id == "r1"
        assert [e.handle for _, e in api.waits] == [marker]
        assert next(c for c, *_ in api.notes if c in ("wait_event", "record")) == "wait_event"
        for kv in range(2):
            for b in (1, 2):
                want = expected_block(
                    before[0][kv, b],
                    kv_parts=1,
                    block_size=8,
                    heads=2,
                    ratio=1,
                    remote_layout="HND",
                    local_layout="NHD",
                )
                assert same_bytes(shm.tensors[0][kv, b], want)
    finally:
        pipeline.close(timeout=10)
        journal.close()
        registry.remove("gpu")
        shm.close()


def test_the_engine_records_a_marker_again_only_once_no_request_carries_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = EngineCuda()
    engine.install(monkeypatch)
    markers = cudaipc.HandOffMarkers(limit=2)
    first = markers.record()
    assert first is not None
    markers.carry(first)
    markers.carry(first)  # two requests of one step share it
    second = markers.record()
    assert second is not None and second != first
    markers.carry(second)
    assert markers.record() is None, "more markers than the limit"
    markers.drop(first)
    assert markers.record() is None, "recorded again while a request still carries it"
    markers.drop(first)
    again = markers.record(stream="other-stream")
    assert again == first, "a free marker is reused, not a new event made"
    assert [(n, s) for _, n, s in engine.calls] == [
        (0, "compute-stream"),
        (1, "compute-stream"),
        (0, "other-stream"),
    ]
    assert len(engine.events) == 2 and markers.carried == 2


def test_kvd_vllm_hands_off_behind_one_marker_per_step_and_frees_it_when_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The connector's step on a CUDA cache: the requests handed off in one step carry one
    marker recorded on the engine's current stream; it is recorded again only after kvd
    answered every request that carried it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from kvd.vllm import connector
    except Exception as exc:  # noqa: BLE001 (any failure to load vLLM means: not here)
        pytest.skip(f"vLLM is not importable: {type(exc).__name__}: {exc}")
    from types import SimpleNamespace

    import msgspec

    from kvd.protocol import ReadDone
    from kvd.vllm.groups import Group
    from kvd.vllm.holding import Holding
    from kvd.vllm.stats import HandoffStats

    engine = EngineCuda()
    engine.install(monkeypatch)
    worker = object.__new__(connector.KvdWorker)
    link = StepLink()
    worker.cache_id, worker.block_size = "vllm.e.0", 16
    worker._remotes, worker._ranks = {"prefill": ("HND", 16)}, {}
    worker._groups = [Group("full", 16, ("layer.0",))]  # one KV cache group
    worker._first_block_size = 0
    worker._holding, worker._unsent, worker._split_reads = Holding(), [], {}
    worker._markers, worker._step_marker = cudaipc.HandOffMarkers(), b""
    worker._landed_early, worker._fail_when_answered, worker._answered_early = set(), set(), {}
    worker._looked_at = 0.0
    worker._link, worker.stats = link, HandoffStats()
    landed: set[str] = set()

    def vllms_results(self: object) -> SimpleNamespace:
        return SimpleNamespace(finished_recving=set(landed), failed_recving=set())

    monkeypatch.setattr(connector.NixlPullConnectorWorker, "get_transfer_results", vllms_results)

    def step(*req_ids: str) -> SimpleNamespace:
        landed.clear()
        for n, req_id in enumerate(req_ids):
            remote = SimpleNamespace(engine_id="prefill", block_ids=[[n, n + 10]])
            worker._metas[req_id] = SimpleNamespace(
                remote=remote, local_physical_block_ids=[[2 * n, 2 * n + 1]]
            )
            landed.add(req_id)
        return worker.get_transfer_results()

    worker._metas = {}
    decoder = msgspec.msgpack.Decoder(ReadDone)
    step("r1", "r2")
    step("r3")
    markers = {decoder.decode(f).req_id: decoder.decode(f).cuda_event for f in link.sent}
    assert markers["r1"] == markers["r2"] != markers["r3"]
    assert [(n, s) for _, n, s in engine.calls] == [(0, "compute-stream"), (1, "compute-stream")]
    for req_id in ("r1", "r2"):
        ready = Ready(req_id=req_id, cache_id="vllm.e.0", physical_block_ids=[])
        link.inbox.append((ready, 0, 0.0))
    released = step("r4")
    assert released.finished_recving >= {"r1", "r2"}
    engine.current = "another-stream"
    step("r5")
    sent = {decoder.decode(f).req_id: decoder.decode(f).cuda_event for f in link.sent}
    # r4 was handed off in the step whose answers freed r1's marker, before they were read:
    # a new event; r5 reuses the freed one.
    assert sent["r4"] not in (sent["r1"], sent["r3"]) and sent["r5"] == sent["r1"]
    assert [(n, s) for _, n, s in engine.calls][-1] == (0, "another-stream")
    assert len(engine.events) == 3


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


# Every case in bf16 on both paths, the other dtypes on the in-place path (each distinct tile
# shape costs a compilation of about a second: the device check has minutes).
KERNEL_PARAMS = [(case, "bfloat16", two_pass) for case in CASES for two_pass in (False, True)] + [
    (case, dtype, False) for case in CASES[:5] for dtype in ("float8_e4m3fn", "float32")
]


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize(("case", "dtype", "two_pass"), KERNEL_PARAMS)
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
            heads=rng.choice([1, 3, 8]),
            head_dim=rng.choice([64, 128]),
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


@pytest.mark.cuda
@gpu
def test_the_kernels_compile_without_spills() -> None:
    """The benchmark's geometry (128 KiB pages) in place, and the two-pass path."""
    from kvd.kernels import gpu

    cache = make_cache(
        "NHD", dtype="bfloat16", block_size=64, num_blocks=8, heads=8, head_dim=128, device="cuda"
    )
    cache.postprocess("kernel").apply([([1, 5, 2], 0)], "HND", 64)
    cache.postprocess("kernel").apply([([3, 4], 0)], "NHD", 16)
    torch.cuda.synchronize()
    stats = gpu.kernel_stats()
    print("kernel stats:", stats)
    assert stats and all(s["spills"] == 0 for s in stats.values()), stats
    assert any(name.startswith("in_place") for name in stats), stats


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
def test_ready_with_a_cuda_event_on_a_gpu(short_tmp: Path) -> None:
    """``ready_cuda_event``: the engine's stream waits on the event from the Ready, then reads
    the blocks, rewritten (kvd's handle opened in this, another, process)."""
    block_size, heads, head_dim = 16, 8, 128
    host = random_bytes([2, 64, block_size, heads, head_dim], torch.bfloat16, 7)
    tensor = host.cuda()
    torch.cuda.synchronize()
    args = ("--device", "cuda:0", "--ready-cuda-event", "true")
    with DaemonProcess(*args, runtime_dir=short_tmp) as d, Client(d.runtime_dir) as c:
        c.attach("gpu0", cuda_specs([tensor], "NHD", block_size))
        sub = c.subscribe(["gpu0"])
        ids = [5, 1, 9, 30]
        c.read_done("e1", "gpu0", ids, remote_layout="HND", block_size_ratio=1)
        (delivery,) = collect(sub, 1)
        ready = delivery.event
        assert isinstance(ready, Ready) and len(ready.cuda_event) == 64
        stream = torch.cuda.Stream()
        cudaipc.wait_event(ready.cuda_event, stream)
        with torch.cuda.stream(stream):
            now = tensor.clone()
        stream.synchronize()
        now = now.cpu()
        for kv in range(2):
            for b in ids:
                want = expected_block(
                    host[kv, b],
                    kv_parts=1,
                    block_size=block_size,
                    heads=heads,
                    ratio=1,
                    remote_layout="HND",
                    local_layout="NHD",
                )
                assert same_bytes(now[kv, b], want)
        wait_for(lambda: c.status().in_flight == 0)
        c.detach("gpu0")
        sub.close()
        cudaipc.forget_events()


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


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("tile", [64 * 1024, 32 * 1024, 16 * 1024])
def test_every_tile_size_matches_the_reference(tile: int, monkeypatch) -> None:
    """Each tile size ``gpu.tune`` may choose, on the benchmark's pages (slices of every unit)
    and on a block merge (whole components)."""
    from kvd.kernels import gpu

    assert tile in gpu.TILE_CHOICES
    monkeypatch.setattr(gpu, "TILE_BYTES", tile)
    monkeypatch.setattr(gpu, "_tiles", {})
    for remote, local, nP in (("HND", "NHD", 64), ("HND", "NHD", 16), ("NHD", "HND", 64)):
        cache = make_cache(
            local,
            dtype="bfloat16",
            block_size=64,
            num_blocks=24,
            heads=8,
            head_dim=128,
            device="cuda",
        )
        requests = [([3, 9, 1], 0), ([20, 4], 0 if nP == 64 else 5)]
        cache.postprocess("kernel").apply(requests, remote, nP)
        torch.cuda.synchronize()
        check_cache(cache, requests, remote, nP)
    # 4 KiB token runs: moved as whole components, in tiles of at most COMPONENT_TILE_BYTES.
    cache = make_cache(
        "HND",
        dtype="bfloat16",
        block_size=64,
        num_blocks=24,
        heads=8,
        head_dim=128,
        device="cuda",
    )
    requests = [([5, 2], 0), ([7], 3)]
    post = cache.postprocess("kernel")
    post.apply(requests, "HND", 16)
    torch.cuda.synchronize()
    check_cache(cache, requests, "HND", 16)
    prepared = [
        launch.prepared
        for launches in post._launches.values()
        for launch in launches
        if launch.prepared is not None and launch.prepared.in_place
    ]
    assert prepared and all(p.members is not None for p in prepared), "not by components"
    assert all(p.tile_words * p.width <= min(tile, gpu.COMPONENT_TILE_BYTES) for p in prepared)


@pytest.mark.cuda
@gpu
def test_warm_up_tunes_and_captures_and_requests_replay_exactly() -> None:
    """Warm-up times the tile sizes and the captured launch on scratch pages; then requests
    of 1 to 5 blocks (replays where they won, a direct launch past them) end as the
    reference says, and nothing unlisted changed."""
    from kvd.kernels import gpu

    cache = make_cache(
        "NHD",
        dtype="bfloat16",
        block_size=64,
        num_blocks=32,
        heads=8,
        head_dim=128,
        device="cuda",
    )
    post = cache.postprocess("kernel")
    post.warm_up("HND", 64)
    torch.cuda.synchronize()
    (launch,) = post._launches[("HND", 64, 0)]
    chosen = gpu.choices(launch.plan)
    print("warm-up measured and chose:", chosen)
    assert len(chosen["tile_gbps"]) >= 2 and chosen["tile_bytes"] in gpu.TILE_CHOICES
    assert launch.prepared is not None and launch.prepared.tile_bytes == chosen["tile_bytes"]
    assert chosen["replay_us"] > 0 and chosen["direct_us"] > 0
    assert bool(launch.replays) == chosen["replays"]
    free = random.Random(5).sample(range(32), 32)
    requests = []
    for size in (1, 2, 3, 4, 5):
        requests.append((free[:size], 0))
        free = free[size:]
    for request in requests:
        post.apply([request], "HND", 64)
    torch.cuda.synchronize()
    check_cache(cache, requests, "HND", 64)


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("with_marker", [True, False])
def test_kvds_writes_follow_the_engines_stream_through_the_marker(
    gpu_daemon: DaemonProcess, with_marker: bool
) -> None:
    """The engine's stream still writes the blocks when it hands them over (a 2 s GPU sleep,
    then the landed bytes). With the marker kvd's stream waits and rewrites those bytes; the
    control without it shows kvd would otherwise write first, and the engine's late write
    leaves the blocks in the remote layout."""
    block_size, heads, head_dim = 16, 8, 128
    old = random_bytes([2, 64, block_size, heads, head_dim], torch.bfloat16, 11)
    landed = random_bytes([2, 64, block_size, heads, head_dim], torch.bfloat16, 12)
    tensor = old.cuda()
    landed_on_gpu = landed.cuda()
    torch.cuda.synchronize()
    ids = [6, 2, 40]
    index = torch.tensor(ids, device="cuda")
    with Client(gpu_daemon.runtime_dir) as c:
        cache_id = f"marker-{with_marker}"
        c.attach(cache_id, cuda_specs([tensor], "NHD", block_size))
        sub = c.subscribe([cache_id])
        engine = torch.cuda.Stream()
        markers = cudaipc.HandOffMarkers()
        with torch.cuda.stream(engine):
            torch.cuda._sleep(2_000_000_000)  # about a second or two of GPU cycles
            tensor[:, index] = landed_on_gpu[:, index]
        marker = markers.record(engine)
        assert marker is not None
        markers.carry(marker)
        c.read_done(
            "w1",
            cache_id,
            ids,
            remote_layout="HND",
            block_size_ratio=1,
            cuda_event=marker if with_marker else b"",
        )
        (delivery,) = collect(sub, 1)
        assert isinstance(delivery.event, Ready), delivery.event
        markers.drop(marker)
        torch.cuda.synchronize()
        now = tensor.cpu()
        rewritten = all(
            same_bytes(
                now[kv, b],
                expected_block(
                    landed[kv, b],
                    kv_parts=1,
                    block_size=block_size,
                    heads=heads,
                    ratio=1,
                    remote_layout="HND",
                    local_layout="NHD",
                ),
            )
            for kv in range(2)
            for b in ids
        )
        assert rewritten == with_marker
        c.detach(cache_id)
        sub.close()


@pytest.mark.cuda
@gpu
def test_hand_off_markers_never_synchronize() -> None:
    """What kvd.vllm's step does on CUDA (records a marker, counts its carriers, frees it)
    under torch's sync debug mode "error", which vLLM's VLLM_GPU_SYNC_CHECK=error arms
    around each step: any synchronizing call raises."""
    markers = cudaipc.HandOffMarkers(limit=4)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)  # the engine's stream busy: a sync would wait here
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            handles = [markers.record(stream) for _ in range(4)]
            assert all(h is not None and len(h) == 64 for h in handles)
            for handle in handles:
                assert handle is not None
                markers.carry(handle)
            assert markers.record(stream) is None
            for handle in handles:
                assert handle is not None
                markers.drop(handle)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    stream.synchronize()
