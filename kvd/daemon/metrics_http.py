"""kvd's HTTP listener: ``/metrics`` for Prometheus, ``/healthz`` and ``/readyz`` for probes.

The metrics body is ``prometheus_client``'s text exposition (``Metrics.render``); the listener
stays on kvd's own event loop instead of ``prometheus_client``'s server thread, so a scrape reads
the metrics on the thread that updates them, and a probe's answer shows that the loop answers.
A probe gets 200 or 503 and a one-line reason (``kvd.daemon.health``), computed from flags
without waiting on anything. Each connection gets one response and is closed; a request is one
small head, so there is no keep-alive, no chunking and nothing that could block the loop. Slow or
silent clients are cut off after ``REQUEST_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Mapping

from kvd.daemon.health import Verdict

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# What prometheus_client's generate_latest writes (its CONTENT_TYPE_PLAIN_0_0_4), spelled out:
# this module is imported by the configuration, and prometheus_client takes ~0.1 s to import.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PROBE_CONTENT_TYPE = "text/plain; charset=utf-8"
HEALTH_PATH = "/healthz"
READY_PATH = "/readyz"
REQUEST_TIMEOUT_S = 10.0
_HEAD_LIMIT = 16 * 1024
_BRACKETED = re.compile(r"^\[(?P<host>[^\]]+)\]:(?P<port>\d+)$")


def parse_metrics_addr(spec: str) -> tuple[str, int]:
    """(host, port) from ``HOST:PORT``, ``:PORT``, ``PORT`` (loopback) or ``[V6ADDR]:PORT``.

    Raises ``ValueError`` with a message that names the ``metrics_addr`` setting.
    """
    text = spec.strip()
    host, port = LOOPBACK, ""
    if text.isdigit():
        port = text
    elif match := _BRACKETED.match(text):
        host, port = match["host"], match["port"]
    else:
        name, sep, port = text.rpartition(":")
        if not sep or ":" in name or not port.isdigit():
            raise ValueError(
                f"metrics_addr: {spec!r} is not HOST:PORT, :PORT or PORT "
                "(an IPv6 address goes in brackets: [::1]:9400)"
            )
        host = name or LOOPBACK
    number = int(port)
    if number > 65535:
        raise ValueError(f"metrics_addr: port {number} is outside 0..65535")
    return host, number


def metrics_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"


Probe = Callable[[], Verdict]


class MetricsServer:
    """Answers ``GET /metrics`` with ``render()`` and ``GET <path>`` of each probe with its
    verdict (200 or 503); other paths get 404, other methods 405."""

    def __init__(
        self, render: Callable[[], bytes], probes: Mapping[str, Probe] | None = None
    ) -> None:
        self._render = render
        self._probes = {path.encode(): probe for path, probe in (probes or {}).items()}
        self._not_found = ", ".join(["/metrics", *(probes or {})]).encode()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self.url = ""

    async def start(self, host: str, port: int) -> str:
        """Listen on (host, port); returns the URL actually bound (port 0 picks one).

        Raises ``OSError`` when the address cannot be bound.
        """
        self._server = await asyncio.start_server(self._serve, host, port, limit=_HEAD_LIMIT)
        bound_host, bound_port = self._server.sockets[0].getsockname()[:2]
        self.url = metrics_url(bound_host, bound_port)
        return self.url

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._connections):
            writer.close()
        await self._server.wait_closed()
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            writer.write(self._answer(head))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass  # a scraper that went away or never finished its request: nothing to answer
        except OSError as exc:
            log.debug("metrics connection failed: %s", exc)
        finally:
            self._connections.discard(writer)
            writer.close()

    def _answer(self, head: bytes) -> bytes:
        method, _, rest = head.partition(b" ")
        target = rest.partition(b" ")[0].partition(b"?")[0]
        if method != b"GET":
            return _response("405 Method Not Allowed", b"only GET is served\n")
        if target == b"/metrics":
            return _response("200 OK", self._render(), CONTENT_TYPE)
        if (probe := self._probes.get(target)) is not None:
            verdict = probe()
            status = "200 OK" if verdict.ok else "503 Service Unavailable"
            return _response(status, f"{verdict.reason}\n".encode())
        return _response("404 Not Found", b"served: " + self._not_found + b"\n")


def _response(status: str, body: bytes, content_type: str = PROBE_CONTENT_TYPE) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body
