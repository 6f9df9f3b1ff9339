"""/healthz and /readyz: the verdicts, the listener, and a real ``kvd serve`` probed over HTTP
while it serves, while its executor hangs, and while it drains."""

from __future__ import annotations

import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvd.client import ShmCache
from kvd.daemon.config import ConfigError, load_config
from kvd.daemon.health import Verdict, liveness, readiness
from kvd.daemon.metrics_http import PROBE_CONTENT_TYPE, MetricsServer
from kvd.daemon_process import DaemonProcess
from tests.daemon_helpers import wait_for
from tests.test_metrics_http import http

ALIVE = Verdict(True, "alive")


def test_liveness_fails_only_for_what_a_restart_mends() -> None:
    assert liveness(None, 0.0, 60.0) == ALIVE
    assert liveness(None, 59.0, 60.0).ok, "a long job within the bound"
    assert liveness(None, 1e6, 0.0).ok, "0: no bound"
    stalled = liveness(None, 61.0, 60.0)
    assert not stalled.ok and "executor stalled" in stalled.reason
    assert "executor_watchdog_s = 60" in stalled.reason
    failed = liveness("illegal address", 0.0, 60.0)
    assert failed == Verdict(False, "device failed: illegal address")


def test_the_watchdog_bound_is_a_setting() -> None:
    assert load_config(environ={}).executor_watchdog_s == 60.0
    assert load_config(environ={"KVD_EXECUTOR_WATCHDOG_S": "0"}).executor_watchdog_s == 0
    with pytest.raises(ConfigError, match=r"--executor-watchdog-s='-1': Expected `float` >= 0"):
        load_config(environ={}, overrides={"executor_watchdog_s": "-1"})


def test_readiness_needs_startup_accepting_and_life() -> None:
    assert readiness(True, True, ALIVE) == Verdict(True, "ready")
    assert readiness(False, True, ALIVE) == Verdict(False, "starting")
    draining = readiness(True, False, ALIVE)
    assert not draining.ok and draining.reason.startswith("draining")
    dead = Verdict(False, "device failed: x")
    assert readiness(True, True, dead) == dead


async def test_listener_answers_probes_with_their_verdicts() -> None:
    verdicts = {"ready": Verdict(True, "ready")}
    server = MetricsServer(
        lambda: b"kvd_up 1\n", {"/healthz": lambda: ALIVE, "/readyz": lambda: verdicts["ready"]}
    )
    url = (await server.start("127.0.0.1", 0)).removesuffix("/metrics")
    try:
        status, headers, body = await http(url + "/healthz")
        assert (status, headers["Content-Type"], body) == (200, PROBE_CONTENT_TYPE, "alive\n")
        assert (await http(url + "/readyz?verbose"))[::2] == (200, "ready\n")
        verdicts["ready"] = Verdict(False, "draining")
        assert (await http(url + "/readyz"))[::2] == (503, "draining\n")
        assert (await http(url + "/metrics"))[0] == 200
        status, _, body = await http(url + "/livez")
        assert (status, body) == (404, "served: /metrics, /healthz, /readyz\n")
        assert (await http(url + "/healthz", method="HEAD"))[0] == 405
    finally:
        await server.close()


def probe(base: str, path: str) -> tuple[int, str]:
    """(status, body) of ``GET base+path``; raises ``URLError`` when nothing listens."""
    try:
        with urllib.request.urlopen(base + path, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def answers_until_gone(base: str, path: str, timeout: float = 30.0) -> list[tuple[int, str]]:
    """Every answer to ``path``, asked again and again until nothing listens any more."""
    answers = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            answers.append(probe(base, path))
        except OSError:  # refused, or cut off by the listener closing
            return answers
    raise AssertionError(f"{base}{path} still answers after {timeout}s")


def probe_base(daemon: DaemonProcess) -> str:
    return daemon.endpoints().metrics.removesuffix("/metrics")


@contextmanager
def hung_job(daemon: DaemonProcess) -> Iterator[None]:
    """One request sent to a daemon whose executor never completes a job
    (``KVD_TEST_CRASH_AT=executor_stall``): it stays in flight until the daemon exits."""
    cache = ShmCache.create(num_layers=2, num_blocks=16, block_size=8, num_heads=2, head_dim=4)
    try:
        with daemon.client() as client:
            client.attach("m", cache.specs)
            client.read_done("r0", "m", [0, 1], remote_layout="HND", block_size_ratio=2)
            wait_for(lambda: client.status().in_flight == 1)
            yield
    finally:
        cache.close()


STALLS = {"KVD_TEST_CRASH_AT": "executor_stall"}


def test_a_serving_daemon_is_alive_and_ready() -> None:
    with DaemonProcess("--metrics-addr", "127.0.0.1:0") as daemon:
        base = probe_base(daemon)
        assert probe(base, "/healthz") == (200, "alive\n")
        assert probe(base, "/readyz") == (200, "ready\n")


def test_a_hung_executor_fails_both_probes() -> None:
    daemon = DaemonProcess(
        *("--metrics-addr", "127.0.0.1:0", "--executor-watchdog-s", "0.05"), env=STALLS
    )
    try:
        daemon.start()
        base = probe_base(daemon)
        assert probe(base, "/healthz")[0] == 200, "idle: nothing outstanding"
        with hung_job(daemon):
            wait_for(lambda: probe(base, "/healthz")[0] == 503)
            status, body = probe(base, "/healthz")
            assert "executor stalled" in body and "executor_watchdog_s = 0.05" in body, body
            assert probe(base, "/readyz") == (status, body)
    finally:
        daemon.kill()


def test_draining_is_unready_and_alive_until_the_exit() -> None:
    """SIGTERM with a job that never completes: the drain lasts until the second signal, so
    the probes see it for as long as they look, without any race on its length."""
    daemon = DaemonProcess(
        *("--metrics-addr", "127.0.0.1:0", "--drain-timeout-s", "600"),
        *("--executor-watchdog-s", "0"),
        env=STALLS,
    )
    try:
        daemon.start()
        base = probe_base(daemon)
        with hung_job(daemon):
            assert probe(base, "/readyz") == (200, "ready\n")
            daemon.signal(signal.SIGTERM)
            wait_for(lambda: probe(base, "/readyz")[0] == 503)
            assert probe(base, "/readyz")[1].startswith("draining"), "unready: draining"
            assert probe(base, "/healthz") == (200, "alive\n"), "alive while draining"
            daemon.signal(signal.SIGINT)  # forced exit: the hung job is left to the journal
            answers = answers_until_gone(base, "/healthz")
            assert set(answers) <= {(200, "alive\n")}, answers
            assert daemon.wait() == 1, daemon.log_tail()
    finally:
        daemon.kill()
