"""A real vLLM 0.32 prefill/decode pair on CPU, with kvd as the decode side's post-process.

vLLM's own P/D accuracy check, run the way its exact-match test does it (greedy tokens of the
disaggregated pair equal a single instance's), with the offline API: prefill and decode are
separate vLLM processes moving KV over NIXL (UCX, loopback), ``kvd serve`` a third. The model is
a tiny Llama with seeded random weights, so a wrong block changes tokens from the first one on;
a control request (other prompt tokens, the first prompt's transferred KV) proves the decode side
used what it received. Skipped when vllm cannot be imported (``.ci/run`` installs it).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install -e '.[vllm]')")

from kvd.bench.vllm import KVD_CORE, Prefill, equal_to_baseline, pinned_daemon, run_decode
from kvd.bench.vllm_engine import make_model, prompts
from kvd.bench.vllm_report import mode_report
from kvd.client import Client
from kvd.daemon_process import DaemonError, DaemonProcess

MAX_TOKENS = 16
RESTART_S = 300.0
"""How long a kvd may take to start, and how long the connector waits for a restarted one
(``kvd_down_timeout_s``) in the restart test: far above any start here (READY took up to 22 s
on a busy 2-CPU machine while it still imported torch first, and re-attaching still waits for
torch), so the restarted kvd answers the requests, never a timeout; vLLM's runs stop at 600 s."""


@dataclass
class Setup:
    """What every decode run uses: the work dir, the model, the prefill servers, the baseline."""

    work: Path
    model: Path
    prefills: dict[str, Prefill]
    baseline: list[dict[str, Any]]

    def decode(self, prefill: str, block_size: int, **config: Any) -> dict[str, Any]:
        return run_decode(
            self.work,
            self.model,
            self.prefills[prefill],
            block_size,
            max_tokens=MAX_TOKENS,
            **config,
        )

    def mismatches(self, result: dict[str, Any], *, control: bool = True) -> list[str]:
        """Requests whose tokens differ from the baseline. The last one is the control, which
        continues prompt 1 only when prompt 1's transferred KV was used; a recomputed control
        continues its own tokens, so ``control=False`` leaves it out."""
        expected = [*self.baseline, self.baseline[1]]
        decoded = result["decode"] if control else result["decode"][:-1]
        return [
            f"request {i}: {got['token_ids'][:6]}... != {want['token_ids'][:6]}..."
            for i, (want, got) in enumerate(zip(expected, decoded, strict=False))
            if want["token_ids"] != got["token_ids"]
        ]


@contextlib.contextmanager
def stock_prefills(
    work: Path, model: Path, block_sizes: tuple[int, ...], baseline_from: int
) -> Iterator[Setup]:
    """Stock prefill instances, one per block size (named by it), and the single-instance
    baseline from the one of ``baseline_from`` (the same at any block size)."""
    prefills = {str(n): Prefill(work, model, "NixlConnector", None, n) for n in block_sizes}
    try:
        for server in prefills.values():
            server.wait_ready()
        request = {"op": "baseline", "prompts": prompts(), "max_tokens": MAX_TOKENS}
        yield Setup(work, model, prefills, prefills[str(baseline_from)].call(request))
    finally:
        for server in prefills.values():
            server.kill()


def counters(kvd: DaemonProcess) -> dict[str, int]:
    with Client(kvd.runtime_dir) as client:
        return client.status().counters


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """A stock prefill instance and one loaded with KvdConnector (its prefill side is stock),
    and the single-instance baseline."""
    work = tmp_path_factory.mktemp("vllm")
    model = make_model(work / "tiny-llama")
    prefills = {
        "stock": Prefill(work, model, "NixlConnector", None, 32),
        "kvd": Prefill(work, model, "KvdConnector", "kvd.vllm", 32),
    }
    try:
        for server in prefills.values():
            server.wait_ready()
        request = {"op": "baseline", "prompts": prompts(), "max_tokens": MAX_TOKENS}
        yield Setup(work, model, prefills, prefills["stock"].call(request))
    finally:
        for server in prefills.values():
            server.kill()


@pytest.mark.parametrize("block_size", [32, 64, 128])
def test_kvd_decode_equals_the_single_instance(
    setup: Setup, kvd: DaemonProcess, block_size: int
) -> None:
    with Client(kvd.runtime_dir) as client:
        before = client.status().counters
    stats = setup.work / f"stats-{block_size}.json"
    extra = {"kvd_runtime_dir": str(kvd.runtime_dir), "kvd_stats_path": str(stats)}
    result = setup.decode("stock", block_size, extra=extra)
    assert setup.mismatches(result) == [], result["log"]
    with Client(kvd.runtime_dir) as client:
        after = client.status().counters
    assert after["ready"] - before["ready"] >= 4, "kvd did not answer the decode's requests"
    if block_size > 32:  # pages merged by kvd, from the CPU attention format
        assert after["blocks_processed"] > before["blocks_processed"]
    figures = json.loads(stats.read_text())
    assert figures["requests"] == 4 and figures["failed"] == 0
    # Whether a READ lands before the next step's forward (kvd told early, ``hand_off_landed``)
    # or after it is timing: a starved CI machine saw none early. tests/test_vllm_handles.py
    # holds both paths to their contract with real NIXL handles.
    assert 0 <= figures["early"] <= figures["requests"], figures
    # Every READ is posted before its step's forward (vLLM posts them after it), so one that
    # lands at once is handed to kvd before the forward and released at its end, with stock's.
    # (A request vLLM lists to load may need no READ: a whole local prefix hit.)
    assert figures["reads_before_forward"] >= figures["requests"] == 4, figures


def test_a_stock_decode_reads_a_kvd_prefill(setup: Setup) -> None:
    result = setup.decode("kvd", 32, connector="NixlConnector", module=None)
    assert setup.mismatches(result) == [], result["log"]


def test_stock_vllm_merges_cpu_pages_wrong(setup: Setup) -> None:
    """vLLM 0.32's own 32 -> 64 merge scrambles CPU attention pages: the first reason to run
    kvd. If this fails, a newer vLLM fixed it: README.md's "Why" and docs/vllm.md must change."""
    result = setup.decode("stock", 64, connector="NixlConnector", module=None)
    assert len(setup.mismatches(result)) == 4, "stock vLLM's CPU block merge is now right"


def test_a_kvd_restart_mid_run_recomputes_and_nothing_hangs(setup: Setup, short_tmp: Path) -> None:
    """kvd kills itself right after its first transform, before the event leaves; a new kvd
    on the same runtime directory answers from the journal (interrupted), and the connector
    turns that into a recompute. Ordered by conditions only: the restart waits for the crash,
    and the connector waits for the restarted kvd (its down timeout is out of reach)."""
    crashing = DaemonProcess(runtime_dir=short_tmp, env={"KVD_TEST_CRASH_AT": "after_transform"})
    crashing.start(timeout=RESTART_S)
    restarted: list[DaemonProcess] = []
    errors: list[BaseException] = []

    def restart() -> None:
        assert crashing.proc is not None
        crashing.proc.wait()
        daemon = DaemonProcess(runtime_dir=short_tmp)
        restarted.append(daemon)
        try:
            daemon.start(timeout=RESTART_S)
        except DaemonError as exc:
            errors.append(exc)

    watcher = threading.Thread(target=restart, daemon=True)
    watcher.start()
    stats = setup.work / "stats-restart.json"
    try:
        extra = {
            "kvd_runtime_dir": str(short_tmp),
            "kvd_stats_path": str(stats),
            "kvd_down_timeout_s": RESTART_S,
        }
        result = setup.decode("stock", 64, extra=extra)
        assert crashing.proc is not None and crashing.proc.poll() is not None, (
            "kvd never crashed: no request needed a transform?"
        )
        # The decode is over: the restarted kvd answered it (or failed to start: ``errors``).
        watcher.join(RESTART_S)
        assert not watcher.is_alive() and not errors, errors
        # Recomputed from their prompts: every request but the control equals the baseline.
        assert setup.mismatches(result, control=False) == [], result["log"]
        figures = json.loads(stats.read_text())
        assert figures["failed"] >= 1, "the interrupted request was not recomputed"
        assert "interrupted" in result["log"]
    finally:
        crashing.kill()
        for daemon in restarted:
            daemon.close()


def test_a_kvd_gone_for_the_down_timeout_fails_what_is_held(setup: Setup, short_tmp: Path) -> None:
    """The same crash with no kvd started again: once ``kvd_down_timeout_s`` has passed the
    connector fails every request it holds, vLLM recomputes them, and nothing hangs. Nothing
    else can answer them, so this path does not race either."""
    crashing = DaemonProcess(runtime_dir=short_tmp, env={"KVD_TEST_CRASH_AT": "after_transform"})
    crashing.start(timeout=RESTART_S)
    stats = setup.work / "stats-gone.json"
    try:
        extra = {
            "kvd_runtime_dir": str(short_tmp),
            "kvd_stats_path": str(stats),
            "kvd_down_timeout_s": 1.0,
        }
        result = setup.decode("stock", 64, extra=extra)
        assert crashing.proc is not None and crashing.proc.poll() is not None, (
            "kvd never crashed: no request needed a transform?"
        )
        assert setup.mismatches(result, control=False) == [], result["log"]
        figures = json.loads(stats.read_text())
        assert figures["failed"] >= 1, "no request was failed after the down timeout"
    finally:
        crashing.kill()


def test_under_load_both_connectors_are_timed_and_kvd_decodes_the_single_instance(
    setup: Setup,
) -> None:
    """``kvd bench vllm``'s load run, small: 2 requests decode while 2 more of 200 tokens
    arrive, 32 -> 128 (kvd merges the pages). kvd's tokens equal a single instance's; stock's
    are not checked (its CPU merge is wrong); every figure of the report is there. kvd runs
    where the bench runs it, on a core apart from the decode engine's: the connector's ZMQ I/O
    thread joins it there."""
    load = {
        "running": prompts((60, 59), seed=1),
        "running_tokens": 8,
        "arrivals": prompts((200, 199), seed=2),
        "arrival_tokens": 4,
    }
    baseline = setup.prefills["stock"].call(
        {"op": "baseline", "prompts": [*load["running"], *load["arrivals"]], "max_tokens": 8}
    )
    with pinned_daemon(KVD_CORE) as kvd:
        runs = {
            name: setup.decode(
                "stock",
                128,
                connector=connector,
                module="kvd.bench.vllm_connectors",
                extra={"kvd_runtime_dir": str(kvd.runtime_dir)},
                modes=["load"],
                load=load,
                timed=True,
            )
            for name, connector in (("stock", "TimedNixlConnector"), ("kvd", "TimedKvdConnector"))
        }
    log = Path(runs["kvd"]["log_file"]).read_text()
    assert f"ZMQ's I/O thread on kvd's CPUs {KVD_CORE}, apart" in log, runs["kvd"]["log"]
    requests = runs["kvd"]["load"]["requests"].values()
    assert sorted(len(r["token_ids"]) for r in requests) == [4, 4, 8, 8]
    equal = equal_to_baseline("load", runs, baseline)
    assert equal["kvd"] == [True] * 4, runs["kvd"]["log"]
    timings = {name: run["load_connector"] for name, run in runs.items()}
    assert timings["kvd"]["failed"] == 0 and timings["kvd"]["held"] == 0
    assert len(timings["kvd"]["landed_to_released_s"]) == 4, "a request was not seen landing"
    assert sum(timings["stock"]["inline_s"]) > 0, "stock's inline post-process was not timed"
    assert sum(timings["kvd"]["inline_s"]) == 0, "kvd's worker ran vLLM's post-process"
    report = mode_report("load", runs, equal)
    assert len(report["targets"]) == 5
    for figures in report["figures"].values():
        assert len(figures["running_inter_token"]) == 3 and figures["arrivals"] == 2
