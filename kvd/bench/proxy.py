"""A P/D proxy for OpenAI completions: ``python -m kvd.bench.proxy --prefill URL --decode URL``.

The pattern of vLLM's ``toy_proxy_server.py``, which P/D deployments and vLLM's own NIXL CI put
in front of a prefill and a decode server: each request goes to the prefill with
``max_tokens=1``, no streaming and ``do_remote_decode``, then, with the ``kv_transfer_params`` the
prefill returned, to the decode, whose answer (streamed or not) is passed through as it comes.

With ``--timings FILE`` it appends one JSON line per request: when it came, how long the prefill
leg took, how long the decode took to its first byte and to its end (seconds), so a slow request
can be placed on one leg. ``POST /decode`` switches the decode server (``{"url": ...}``) between
runs without a restart. Needs aiohttp (vLLM depends on it).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Any

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
TIMEOUT = ClientTimeout(total=None, sock_connect=10)
"""No total limit: a request may decode for long; a server that does not accept fails fast."""


class Proxy:
    def __init__(self, prefill: str, decode: str, timings: str | None) -> None:
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")
        self.timings = open(timings, "a", buffering=1) if timings else None  # noqa: SIM115
        self.session: ClientSession | None = None

    async def start(self, _app: web.Application) -> None:
        # No connection limit: the load client's concurrency is the one that counts.
        self.session = ClientSession(connector=TCPConnector(limit=0), timeout=TIMEOUT)

    async def stop(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()
        if self.timings is not None:
            self.timings.close()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        came = time.time()  # wall clock: the bench matches it with its own runs
        body: dict[str, Any] = await request.json()
        prefill_body = copy.deepcopy(body)
        prefill_body.update(max_tokens=1, stream=False, kv_transfer_params=REMOTE_DECODE)
        prefill_body.pop("stream_options", None)
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        async with self.session.post(self.prefill + request.path_qs, json=prefill_body) as r:
            if r.status != 200:
                return web.Response(
                    status=r.status, body=await r.read(), content_type="application/json"
                )
            prefilled = await r.json()
        prefill_s = time.time() - came
        body["kv_transfer_params"] = prefilled.get("kv_transfer_params")
        first_byte_s: float | None = None
        async with self.session.post(self.decode + request.path_qs, json=body) as r:
            response = web.StreamResponse(status=r.status)
            response.content_type = r.content_type
            await response.prepare(request)
            # Chunk by chunk as the decode sent them: each is one server-sent event.
            async for chunk, _ in r.content.iter_chunks():
                if first_byte_s is None:
                    first_byte_s = time.time() - came - prefill_s
                await response.write(chunk)
            await response.write_eof()
        if self.timings is not None:
            self.timings.write(
                json.dumps(
                    {
                        "came": came,
                        "prefill_s": prefill_s,
                        "decode_first_byte_s": first_byte_s,
                        "decode_s": time.time() - came - prefill_s,
                    }
                )
                + "\n"
            )
        return response

    async def passthrough(self, request: web.Request) -> web.Response:
        assert self.session is not None
        async with self.session.get(self.decode + request.path_qs) as r:
            return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)

    async def switch_decode(self, request: web.Request) -> web.Response:
        self.decode = str((await request.json())["url"]).rstrip("/")
        return web.json_response({"decode": self.decode})


def app(prefill: str, decode: str, timings: str | None = None) -> web.Application:
    proxy = Proxy(prefill, decode, timings)
    application = web.Application(client_max_size=64 * 2**20)
    application.on_startup.append(proxy.start)
    application.on_cleanup.append(proxy.stop)
    application.router.add_post("/v1/completions", proxy.completions)
    application.router.add_post("/v1/chat/completions", proxy.completions)
    application.router.add_get("/v1/models", proxy.passthrough)
    application.router.add_get("/health", proxy.passthrough)
    application.router.add_post("/decode", proxy.switch_decode)
    return application


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kvd.bench.proxy", description=__doc__)
    parser.add_argument("--prefill", required=True, help="the prefill server's base URL")
    parser.add_argument("--decode", required=True, help="the decode server's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timings", help="append one JSON line of leg timings per request")
    args = parser.parse_args()
    web.run_app(
        app(args.prefill, args.decode, args.timings),
        host=args.host,
        port=args.port,
        print=lambda *_: print("READY", flush=True),
    )


if __name__ == "__main__":
    main()
