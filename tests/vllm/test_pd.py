"""A real vLLM 0.32 prefill/decode pair on CPU, with kvd as the decode side's post-process.

vLLM's own P/D accuracy check, run the way its exact-match test does it (greedy tokens of the
disaggregated pair equal a single instance's), with the offline API: prefill and decode are
separate vLLM processes moving KV over NIXL (UCX, loopback), ``kvd serve`` a third. The model is
a tiny Llama with seeded random weights, so a wrong block changes tokens from the first one on;
a control request (other prompt tokens, the first prompt's transferred KV) proves the decode side
used what it received. Skipped when vllm cannot be imported (``.ci/run`` installs it).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install -e '.[vllm]')")

from kvd.client import Client
from kvd.daemon_process import DaemonProcess
from tests.vllm.engine import MAX_TOKENS, make_model, prompts

ROOT = Path(__file__).resolve().parents[2]
STARTUP_S = 420
_ports = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Engine:
    """One ``tests.vllm.engine`` process."""

    def __init__(self, work: Path, role: str, config: dict[str, Any], core: int) -> None:
        self.name = f"{role}-{next(_ports)}"
        self.log = work / f"{self.name}.log"
        path = work / f"{self.name}.json"
        path.write_text(json.dumps(config))
        env = {
            **os.environ,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            "VLLM_LOGGING_LEVEL": "INFO",
        }
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.vllm.engine", role, str(path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while "READY" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not start:\n{self.tail()}")
            time.sleep(0.5)

    def wait(self, timeout: float = STARTUP_S) -> None:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} did not finish:\n{self.tail()}") from None
        assert code == 0, f"{self.name} exited with {code}:\n{self.tail()}"

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class Prefill(Engine):
    def __init__(self, work: Path, model: Path, connector: str, module: str | None) -> None:
        self.endpoint = f"ipc://{work}/prefill-{next(_ports)}.sock"
        config = {
            "role": "kv_producer",
            "model": str(model),
            "block_size": 32,
            "connector": connector,
            "module": module,
            "engine_id": f"prefill-{connector.lower()}",
            "endpoint": self.endpoint,
        }
        super().__init__(work, "prefill", config, core=0)

    def call(self, request: dict[str, Any]) -> Any:
        import msgspec
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        try:
            sock.send(msgspec.msgpack.encode(request))
            assert sock.poll(STARTUP_S * 1000), f"prefill server did not answer:\n{self.tail()}"
            return msgspec.msgpack.decode(sock.recv())
        finally:
            sock.close()
            ctx.term()


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    return make_model(work / "tiny-llama")


@pytest.fixture(scope="module")
def prefills(work: Path, model: Path) -> Iterator[dict[str, Prefill]]:
    """A stock prefill instance and one loaded with KvdConnector (its prefill side is stock)."""
    servers = {
        "stock": Prefill(work, model, "NixlConnector", None),
        "kvd": Prefill(work, model, "KvdConnector", "kvd.vllm"),
    }
    try:
        for server in servers.values():
            server.wait_ready()
        yield servers
    finally:
        for server in servers.values():
            server.kill()


@pytest.fixture(scope="module")
def baseline(prefills: dict[str, Prefill]) -> list[dict[str, Any]]:
    """Greedy tokens of a single instance: the reference every P/D run must equal."""
    return prefills["stock"].call(
        {"op": "baseline", "prompts": prompts(), "max_tokens": MAX_TOKENS}
    )


@pytest.fixture(scope="module")
def kvd() -> Iterator[DaemonProcess]:
    with DaemonProcess() as daemon:
        yield daemon


@dataclass
class Setup:
    """What every decode run uses: the work dir, the model, the prefill servers, the baseline."""

    work: Path
    model: Path
    prefills: dict[str, Prefill]
    baseline: list[dict[str, Any]]


@pytest.fixture(scope="module")
def setup(
    work: Path, model: Path, prefills: dict[str, Prefill], baseline: list[dict[str, Any]]
) -> Setup:
    return Setup(work, model, prefills, baseline)


def run_decode(
    setup: Setup,
    prefill: str,
    block_size: int,
    *,
    connector: str = "KvdConnector",
    module: str | None = "kvd.vllm",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    out = setup.work / f"decode-{next(_ports)}.json"
    config = {
        "role": "kv_consumer",
        "model": str(setup.model),
        "block_size": block_size,
        "connector": connector,
        "module": module,
        "engine_id": f"decode-{block_size}-{next(_ports)}",
        "prefill": setup.prefills[prefill].endpoint,
        "out": str(out),
        "extra": extra or {},
    }
    engine = Engine(setup.work, "decode", config, core=1)
    engine.wait()
    result: dict[str, Any] = json.loads(out.read_text())
    result["log"] = engine.tail(200)
    return result


def mismatches(setup: Setup, result: dict[str, Any]) -> list[str]:
    """Requests whose tokens differ from the baseline; the last request is the control, which
    must continue prompt 1 (its KV was transferred)."""
    decoded = result["decode"]
    expected = [*setup.baseline, setup.baseline[1]]
    bad = []
    for i, (want, got) in enumerate(zip(expected, decoded, strict=True)):
        if want["token_ids"] != got["token_ids"]:
            bad.append(f"request {i}: {got['token_ids'][:6]}... != {want['token_ids'][:6]}...")
    return bad


def kvd_config(daemon: DaemonProcess, **extra: Any) -> dict[str, Any]:
    return {"kvd_runtime_dir": str(daemon.runtime_dir), **extra}


@pytest.mark.parametrize("block_size", [32, 64, 128])
def test_kvd_decode_equals_the_single_instance(
    setup: Setup, kvd: DaemonProcess, block_size: int
) -> None:
    with Client(kvd.runtime_dir) as client:
        before = client.status().counters
    stats = setup.work / f"stats-{block_size}.json"
    extra = kvd_config(kvd, kvd_stats_path=str(stats))
    result = run_decode(setup, "stock", block_size, extra=extra)
    assert mismatches(setup, result) == [], result["log"]
    with Client(kvd.runtime_dir) as client:
        after = client.status().counters
    assert after["ready"] - before["ready"] >= 4, "kvd did not answer the decode's requests"
    if block_size > 32:  # pages merged by kvd, from the CPU attention format
        assert after["blocks_processed"] > before["blocks_processed"]
    figures = json.loads(stats.read_text())
    assert figures["requests"] == 4 and figures["failed"] == 0


def test_a_stock_decode_reads_a_kvd_prefill(setup: Setup) -> None:
    result = run_decode(setup, "kvd", 32, connector="NixlConnector", module=None)
    assert mismatches(setup, result) == [], result["log"]


def test_stock_vllm_merges_cpu_pages_wrong(setup: Setup) -> None:
    """vLLM 0.32's own 32 -> 64 merge scrambles CPU attention pages: the first reason to run
    kvd. If this fails, a newer vLLM fixed it: README.md's "Running with vLLM" must change."""
    result = run_decode(setup, "stock", 64, connector="NixlConnector", module=None)
    assert len(mismatches(setup, result)) == 4, "stock vLLM's CPU block merge is now right"


def test_a_kvd_restart_mid_run_recomputes_and_nothing_hangs(setup: Setup, short_tmp: Path) -> None:
    """kvd kills itself right after its first transform, before the event leaves; a new kvd
    on the same runtime directory answers from the journal (interrupted), and the connector
    turns that into a recompute."""
    crashing = DaemonProcess(runtime_dir=short_tmp, env={"KVD_TEST_CRASH_AT": "after_transform"})
    crashing.start()
    restarted: list[DaemonProcess] = []

    def restart() -> None:
        assert crashing.proc is not None
        crashing.proc.wait()
        restarted.append(DaemonProcess(runtime_dir=short_tmp).start())

    watcher = threading.Thread(target=restart, daemon=True)
    watcher.start()
    stats = setup.work / "stats-restart.json"
    try:
        extra = {"kvd_runtime_dir": str(short_tmp), "kvd_stats_path": str(stats)}
        result = run_decode(setup, "stock", 64, extra=extra)
        watcher.join(60)
        assert restarted, "kvd never crashed: no request needed a transform?"
        assert mismatches(setup, result) == [], result["log"]
        figures = json.loads(stats.read_text())
        assert figures["failed"] >= 1, "the interrupted request was not recomputed"
        assert "interrupted" in result["log"]
    finally:
        crashing.kill()
        for daemon in restarted:
            daemon.stop()
