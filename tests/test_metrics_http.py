"""The /metrics endpoint: address parsing and the HTTP listener."""

from __future__ import annotations

import asyncio
import re
import urllib.error
import urllib.request

import pytest

from kvd.config import ConfigError, load_config
from kvd.metrics_http import CONTENT_TYPE, MetricsServer, parse_metrics_addr


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
    server = MetricsServer(lambda: "kvd_up 1\n")
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
