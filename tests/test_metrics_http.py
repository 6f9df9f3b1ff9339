"""The /metrics endpoint: address parsing, the HTTP listener, a real daemon scraped over HTTP."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvd.client import ShmCache
from kvd.daemon.config import ConfigError, load_config
from kvd.daemon.metrics_http import CONTENT_TYPE, MetricsServer, parse_metrics_addr
from kvd.daemon_process import DaemonProcess
from kvd.protocol import Ready
from tests.daemon_helpers import EventTap, wait_for


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("9400", ("127.0.0.1", 9400)),
        (":9400", ("127.0.0.1", 9400)),
        ("0.0.0.0:9400", ("0.0.0.0", 9400)),
        ("metrics.local:0", ("metrics.local", 0)),
        ("[::1]:9400", ("::1", 9400)),
        ("[::]:1", ("::", 1)),
    ],
)
def test_metrics_addr_forms(spec: str, want: tuple[str, int]) -> None:
    assert parse_metrics_addr(spec) == want


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("host", "is not HOST:PORT"),
        ("::1:9400", "in brackets"),
        ("host:http", "is not HOST:PORT"),
        ("host:70000", "outside 0..65535"),
    ],
)
def test_bad_metrics_addr_is_a_config_error(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"--metrics-addr=.*metrics_addr: .*{message}"):
        load_config(environ={}, overrides={"metrics_addr": spec})
    with pytest.raises(ConfigError, match=r"KVD_METRICS_ADDR=.*metrics_addr"):
        load_config(environ={"KVD_METRICS_ADDR": spec})


def test_drain_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"--drain-timeout-s='0': Expected `float` > 0"):
        load_config(environ={}, overrides={"drain_timeout_s": "0"})
    assert load_config(environ={"KVD_DRAIN_TIMEOUT_S": "2.5"}).drain_timeout_s == 2.5


async def http(url: str, method: str = "GET") -> tuple[int, dict[str, str], str]:
    def call() -> tuple[int, dict[str, str], str]:
        request = urllib.request.Request(url, method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, dict(reply.headers), reply.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read().decode()

    return await asyncio.to_thread(call)


async def test_listener_serves_only_get_metrics() -> None:
    server = MetricsServer(lambda: b"kvd_up 1\n")
    url = await server.start("127.0.0.1", 0)
    try:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url)
        status, headers, body = await http(url)
        assert (status, headers["Content-Type"], body) == (200, CONTENT_TYPE, "kvd_up 1\n")
        assert (await http(url + "?x=1"))[0] == 200
        assert (await http(url.replace("/metrics", "/")))[0] == 404
        assert (await http(url, method="POST"))[0] == 405
        # A client that goes away mid-request costs nothing; the next scrape still works.
        host, port = url.removeprefix("http://").split("/")[0].split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /metr")
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        assert (await http(url))[0] == 200
    finally:
        await server.close()


def scrape(url: str) -> dict[str, float]:
    """Samples by name with labels, e.g. ``kvd_requests_total{outcome="ready"}``."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.headers["Content-Type"] == CONTENT_TYPE
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_daemon_metrics_move_as_requests_flow() -> None:
    with (
        DaemonProcess("--metrics-addr", "127.0.0.1:0", "--batch-window-us", "1000000") as d,
        d.client() as client,
    ):
        url = d.endpoints().metrics
        assert url.startswith("http://127.0.0.1:")
        start = scrape(url)
        assert start["kvd_attached_caches"] == 0
        assert start["kvd_in_flight_requests"] == 0
        assert start["kvd_batch_window_seconds"] == 1.0
        assert start['kvd_requests_total{outcome="ready"}'] == 0
        assert 'kvd_queue_wait_seconds_bucket{le="1e-05"}' in start, "microsecond buckets"

        cache = ShmCache.create(num_layers=2, num_blocks=16, block_size=8, num_heads=2, head_dim=4)
        try:
            client.attach("m", cache.specs)
            assert scrape(url)["kvd_attached_caches"] == 1
            with EventTap(client, "m") as tap:
                base = scrape(url)
                for i in range(4):
                    client.read_done(
                        f"m{i}", "m", [2 * i, 2 * i + 1], remote_layout="HND", block_size_ratio=2
                    )
                # The 1 s window holds them in flight until then.
                wait_for(lambda: scrape(url)["kvd_in_flight_requests"] == 4)
                client.read_done("m-bad", "m", [99], remote_layout="HND", block_size_ratio=2)
                events = tap.events(5)
            assert sum(isinstance(e, Ready) for e in events) == 4

            wait_for(lambda: scrape(url)["kvd_in_flight_requests"] == 0)
            end = scrape(url)
        finally:
            cache.close()

    def moved(name: str) -> float:
        return end[name] - base.get(name, 0)

    assert moved('kvd_requests_total{outcome="ready"}') == 4
    # A rejected notification is answered (an event) and counted by its reason, not as a request.
    assert moved('kvd_requests_total{outcome="failed"}') == 0
    assert moved('kvd_rejections_total{reason="block_out_of_range"}') == 1
    assert moved("kvd_events_published_total") == 5
    assert moved("kvd_blocks_processed_total") == 8
    block_bytes = 2 * 2 * 8 * 2 * 4 * 2  # layers, K and V, tokens, heads, head_dim, bf16
    assert moved("kvd_bytes_processed_total") == 8 * block_bytes
    assert moved("kvd_batches_total") == 1
    assert moved("kvd_queue_wait_seconds_count") == 4
    assert moved("kvd_read_done_to_ready_seconds_count") == 4
    assert moved("kvd_transform_seconds_count") == 1
    assert moved("kvd_batch_blocks_count") == 1 and moved("kvd_batch_blocks_sum") == 8
    # The window held them about a second: queue wait lands in the top buckets, not below 1 ms.
    assert moved('kvd_queue_wait_seconds_bucket{le="0.001"}') == 0
    assert moved('kvd_queue_wait_seconds_bucket{le="+Inf"}') == 4


def test_metrics_addr_in_use_is_a_startup_error(short_tmp: Path) -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        result = subprocess.run(
            [
                *(sys.executable, "-m", "kvd", "serve", "--runtime-dir", str(short_tmp)),
                *("--metrics-addr", f"127.0.0.1:{port}"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        taken.close()
    assert result.returncode == 2, result.stderr
    assert f"cannot start: metrics_addr: cannot listen on '127.0.0.1:{port}'" in result.stderr
