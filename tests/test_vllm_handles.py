"""A request read from several prefill ranks (prefill TP > decode TP: one NIXL handle per
remote rank) is handed to kvd only once every handle of it is terminal.

Real NIXL agents (UCX over loopback): two prefill peers stand for two remote TP ranks, and
one request's READ from each is posted by a decode agent. The peer of the second rank is
stopped (SIGSTOP), so its READ stays in flight while the first one is done. ``KvdWorker``'s
step runs on vLLM 0.32's own ``get_transfer_results`` (its handle bookkeeping,
``_pop_done_transfers``); only what a step needs beside the handles (notifications, leases,
engine cleanup) is stubbed, and kvd's link is a recorder. No ReadDone may leave while the
stopped rank's READ is in flight, and one must once it finished.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from kvd.client import Client, KvdError
from kvd.daemon_process import DaemonProcess
from kvd.demo.prefill import PrefillSpec
from kvd.nixl.agent import nixl_errors
from kvd.nixl.reader import Reader
from kvd.protocol import ReadDone, Ready
from kvd.shm import ShmCache
from tests.link_double import StepLink
from tests.nixl_helpers import kill, spawn_prefill

pytest.importorskip("nixl")

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 2, 8, 16, 8


@pytest.fixture(scope="module")
def connector() -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from kvd.vllm import connector
    except Exception as exc:  # noqa: BLE001 (any failure to load vLLM means: not here)
        pytest.skip(f"vLLM is not importable: {type(exc).__name__}: {exc}")
    return connector


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess() as d:
        yield d


def decode_worker(connector: Any, agent: Any, link: StepLink) -> Any:
    """A ``KvdWorker`` whose vLLM state is what ``get_transfer_results`` reads of a decode
    rank at equal block sizes with one KV cache group; ``agent`` is its NIXL agent."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    from kvd.vllm.groups import Group
    from kvd.vllm.holding import Holding
    from kvd.vllm.stats import HandoffStats

    worker = object.__new__(connector.KvdWorker)
    worker.nixl_wrapper = agent
    worker.xfer_stats = NixlKVConnectorStats()
    worker.transfer_topo = SimpleNamespace(
        block_size_ratio=lambda remote_block_size: BLOCK_SIZE // remote_block_size,
        get_engine_info=lambda engine_id: SimpleNamespace(
            remote_block_size=BLOCK_SIZE, remote_physical_blocks_per_logical=1
        ),
    )
    worker._recving_transfers = defaultdict(list)
    worker._recving_metadata = {}
    worker._recv_failures = set()
    worker._failed_recv_reqs = queue.Queue()
    worker._replicated_pcp_done_sending = set()
    worker._pending_recv_notifs = {}
    worker._invalid_block_ids = queue.Queue()
    worker._physical_blocks_per_logical_kv_block = 1
    worker._is_hma_required = False
    worker._TRANSFER_MODE = "pull"
    worker._failed_remote_engines = set()
    worker.use_host_buffer = False
    worker.enable_permute_local_kv = False
    worker.enable_heterogeneous_attn_post_process = False
    worker.tp_rank = 0
    # Beside the handles: no prefill notifications to take, no leases, no engines to evict.
    worker._get_new_notifs = set
    worker._reap_expired_send_leases = lambda done_sending: None
    worker._cleanup_remote_engines = lambda: None
    worker._send_pending_recv_notifs = lambda req_id: None
    # kvd's side of the step.
    worker.cache_id, worker.block_size = "vllm.decode.0", BLOCK_SIZE
    worker._remotes, worker._ranks = {"prefill": ("cpu_attn_vec", BLOCK_SIZE)}, {}
    worker._groups = [Group("full", BLOCK_SIZE, ("layer.0",))]
    worker._first_block_size = 0  # one group attached
    worker._holding, worker._unsent, worker._split_reads, worker._metas = Holding(), [], {}, {}
    worker._markers, worker._step_marker = None, b""
    worker._landed_early, worker._fail_when_answered, worker._answered_early = set(), set(), {}
    worker._looked_at = 0.0
    worker._nixl_errors = nixl_errors()
    worker._link, worker.stats = link, HandoffStats()
    return worker


def telemetry_agent(name: str, backend: str = "UCX") -> Any:
    """A NIXL agent configured as vLLM's worker configures its own (telemetry captured: its
    step reads each finished handle's), without NIXL's progress thread."""
    from kvd.nixl.agent import nixl_api

    api = nixl_api()
    config = api.nixl_agent_config(
        enable_prog_thread=False, backends=[backend], capture_telemetry=True
    )
    return api.nixl_agent(name, config)


def post(reader: Reader, req_id: str, engine_id: str, remote: list[int], local: list[int]) -> Any:
    """Post one READ with ``reader``'s agent and take its handle, for vLLM's bookkeeping to
    poll (the reader forgets it); None when it was done at once."""
    reader.read(req_id, engine_id, "decode", remote, local)
    if not reader._pending:
        return None
    handle = reader._pending.pop().handle
    return handle


@dataclass
class DecodeSide:
    worker: Any
    reader: Reader
    link: StepLink
    peers: list[Any]
    local: list[int]

    def post(self, rank: int) -> Any:
        """Post the request's READ from prefill rank ``rank`` and track its handle as vLLM
        does; None when it was done at once."""
        handle = post(self.reader, "req", f"prefill-rank{rank}", [3, 4], self.local)
        if handle is not None:
            self.worker._recving_transfers["req"].append(handle)
        return handle

    def wait_done(self, handle: Any) -> None:
        deadline = time.monotonic() + 5.0
        while handle is not None and self.reader.agent.check_xfer_state(handle) == "PROC":
            assert time.monotonic() < deadline, "a READ from a running peer did not finish"
            time.sleep(0.001)

    def answer(self) -> None:
        """kvd's Ready for the request, as the link's thread queues it."""
        self.link.inbox.append(
            (Ready(req_id="req", cache_id="decode", physical_block_ids=[]), 0, 0.0)
        )

    def read_dones(self) -> list[ReadDone]:
        return [msgspec.msgpack.decode(f, type=ReadDone) for f in self.link.sent]


@pytest.fixture
def decode_side(
    connector: Any, daemon: DaemonProcess, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[DecodeSide]:
    """A decode rank's ``KvdWorker`` with one request (local blocks 1, 2) to read from two
    prefill ranks (real peers, real NIXL agents), none of it posted yet."""
    monkeypatch.setattr("kvd.nixl.agent.make_agent", telemetry_agent)
    peers = []
    for rank in range(2):
        spec = PrefillSpec(
            engine_id=f"prefill-rank{rank}",
            block_size=BLOCK_SIZE,
            layout="HND",
            seed=rank,
            num_blocks=NUM_BLOCKS,
            layers=LAYERS,
            heads=HEADS,
            head_dim=HEAD_DIM,
            endpoint=f"ipc://{short_tmp}/rank{rank}.sock",
        )
        peers.append(spawn_prefill(spec))
    cache = ShmCache.create(
        num_layers=LAYERS,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        layout="HND",
    )
    client = Client(daemon.runtime_dir)
    reader = Reader("decode", client)
    link = StepLink()
    try:
        client.attach("decode", cache.specs)
        reader.add_cache("decode", cache.tensors, cache.specs)
        for _, endpoint in peers:
            reader.connect(endpoint)
        worker = decode_worker(connector, reader.agent, link)
        local = [1, 2]
        meta = SimpleNamespace(
            remote=SimpleNamespace(engine_id="prefill", block_ids=[[3, 4]]),
            local_physical_block_ids=[local],
            local_block_ids=[local],
            region_blocks_to_zero=None,
        )
        worker._metas["req"] = worker._recving_metadata["req"] = meta
        yield DecodeSide(worker, reader, link, peers, local)
    finally:
        for proc, _ in peers:
            kill(proc)
        reader.close()
        with contextlib.suppress(KvdError):
            client.detach("decode")
        client.close()
        cache.close()


def test_a_request_is_handed_to_kvd_only_when_every_remote_ranks_read_is_terminal(
    decode_side: DecodeSide,
) -> None:
    side, worker, link = decode_side, decode_side.worker, decode_side.link
    # Rank 0's READ lands; rank 1's peer no longer progresses, so its READ stays in flight.
    done = side.post(0)
    os.kill(side.peers[1][0].pid, signal.SIGSTOP)
    in_flight = side.post(1)
    assert in_flight is not None, "a READ from a stopped peer finished"
    side.wait_done(done)

    for _ in range(20):
        worker.hand_off_landed()  # a step's start
        results = worker.get_transfer_results()  # its end
        assert "req" not in results.finished_recving | results.failed_recving
        assert link.sent == [], "handed to kvd while rank 1's READ is in flight"
    assert worker._recving_transfers["req"] == [in_flight]

    os.kill(side.peers[1][0].pid, signal.SIGCONT)
    deadline = time.monotonic() + 10.0
    while not link.sent:
        assert time.monotonic() < deadline, "never handed to kvd after rank 1's READ ended"
        results = worker.get_transfer_results()
        assert "req" not in results.failed_recving
        time.sleep(0.001)
    assert "req" not in worker._recving_transfers
    (read_done,) = side.read_dones()
    assert read_done.req_id == "req" and list(read_done.physical_block_ids) == side.local


def test_a_request_landed_before_a_step_is_handed_off_at_its_start_and_released_at_its_end(
    decode_side: DecodeSide,
) -> None:
    """kvd is told before the forward, answers during it, and the step's end releases the
    request: the step in which stock vLLM would release it, not one later."""
    side, worker = decode_side, decode_side.worker
    side.wait_done(side.post(0))
    worker.hand_off_landed()
    worker.stats.absorb()  # the link's thread folds in the engine's records
    assert [r.req_id for r in side.read_dones()] == ["req"] and worker.stats.early == 1
    worker.hand_off_landed()  # a step without a forward: told once
    side.answer()
    results = worker.get_transfer_results()
    assert "req" in results.finished_recving and "req" not in results.failed_recving
    assert len(side.link.sent) == 1 and "req" not in worker._recving_transfers


def test_a_read_that_lands_during_the_forward_is_handed_off_at_an_attention_layer(
    connector: Any, decode_side: DecodeSide
) -> None:
    """On CPU a step's READs are posted before its forward; one still in flight then may land
    during it. vLLM calls ``wait_for_layer_load`` at each attention layer's start: kvd is told
    there, and an answer before the step's end releases the request at that end, as stock's
    inline merge would, not a step later."""
    side, worker = decode_side, decode_side.worker
    worker.device_type = "cpu"
    decode = object.__new__(connector.KvdConnector)
    decode.connector_worker = worker
    os.kill(side.peers[0][0].pid, signal.SIGSTOP)
    in_flight = side.post(0)
    assert in_flight is not None, "a READ from a stopped peer finished"
    worker.hand_off_landed()  # the step's start: still in flight
    decode.wait_for_layer_load("layer.0")  # the forward's first layer: still in flight
    assert side.link.sent == []
    os.kill(side.peers[0][0].pid, signal.SIGCONT)
    side.wait_done(in_flight)
    time.sleep(connector.LOOK_S)
    decode.wait_for_layer_load("layer.1")  # a later layer: landed
    assert [r.req_id for r in side.read_dones()] == ["req"]
    worker.stats.absorb()
    assert (worker.stats.early, worker.stats.during_forward) == (1, 1)
    side.answer()
    results = worker.get_transfer_results()  # the step's end
    assert "req" in results.finished_recving and "req" not in results.failed_recving
    assert len(side.link.sent) == 1 and "req" not in worker._recving_transfers


def test_a_request_handed_off_early_that_vllm_fails_is_held_until_kvd_answers(
    decode_side: DecodeSide,
) -> None:
    """vLLM may fail a request whose READs landed (a notification failed): kvd may be
    writing its blocks by then, so it is reported failed only once kvd answered."""
    side, worker = decode_side, decode_side.worker
    side.wait_done(side.post(0))
    worker.hand_off_landed()
    worker._failed_recv_reqs.put("req")  # as vLLM's notification thread reports one
    results = worker.get_transfer_results()
    assert "req" not in results.finished_recving | results.failed_recving
    side.answer()
    results = worker.get_transfer_results()
    assert "req" in results.finished_recving and "req" in results.failed_recving
