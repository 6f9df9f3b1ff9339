"""Reading a ZMQ socket from the asyncio event loop without blocking it."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

import zmq

from kvd.daemon.logs import RateLimitedLog
from kvd.daemon.zmq_io import EVENTS, NOBLOCK, POLLIN, raw_get, raw_recv

log = logging.getLogger(__name__)


class SocketReader:
    """Calls ``handle(frames)`` for each message on ``sock`` from the event loop, never blocking.

    ZMQ's FD is edge-triggered: after a wake-up the socket is read until it is empty (or the
    budget is spent, then the rest is read on the next loop iteration so other work can run),
    and ``EVENTS`` is checked again because sending on the socket can consume the edge.

    ``sends=False`` says neither ``handle`` nor ``after`` sends on this socket, so the EVENTS
    query that ended the read still holds and is not repeated.

    ``copy=False`` hands over ``zmq.Frame`` objects instead of bytes (multipart only).

    With ``multipart=False`` every frame is handed over as a message of its own: the ingest
    socket's protocol is one frame per message, and skipping the RCVMORE query per frame halves
    the cost of a read.

    A failure while handling one message is contained: logged, passed to ``on_error`` (for
    counting), and the reader goes on with the next message.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: zmq.Socket[bytes],
        handle: Callable[[list[Any]], None],
        *,
        after: Callable[[], None] | None = None,
        budget: int = 512,
        multipart: bool = True,
        sends: bool = True,
        on_error: Callable[[BaseException], None] | None = None,
        copy: bool = True,
    ) -> None:
        self._loop = loop
        self._sock = sock
        self._handle = handle
        self._after = after
        self._budget = budget
        self._multipart = multipart
        self._sends = sends
        self._on_error = on_error
        self._error_log = RateLimitedLog(log)
        self._recv: Callable[[], list[Any]] = (
            functools.partial(sock.recv_multipart, NOBLOCK, copy=copy)
            if multipart
            else lambda: [raw_recv(sock, NOBLOCK)]
        )
        self._fd = int(raw_get(sock, zmq.FD))
        self._scheduled = False
        self._closed = False
        loop.add_reader(self._fd, self._ready)
        self._schedule()  # messages may have arrived before the reader was added

    def flush(self) -> None:
        """Handle every message already queued on the socket now (before the socket closes)."""
        while not self._closed and int(raw_get(self._sock, EVENTS)) & POLLIN:
            self._ready()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self._fd)

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._ready)

    def poke(self) -> None:
        """Read again if messages wait: call after sending on this socket outside ``handle``.

        A send processes ZMQ's pending commands, which can consume the FD's edge while a message
        is queued; without this check the loop would not wake for it until the next one arrived.
        """
        if not self._closed and int(raw_get(self._sock, EVENTS)) & POLLIN:
            self._schedule()

    def _ready(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        sock = self._sock
        handle = self._handle
        # A wake-up nearly always means one message: receive it, then ask EVENTS whether more
        # wait, since ending on zmq.Again costs more than the query. In a burst, receiving until
        # zmq.Again is cheaper than a query per message.
        recv = self._recv
        try:
            frames = recv()
            try:
                handle(frames)
            except Exception as exc:  # noqa: BLE001 (contained: one message, not the reader)
                self._failed(exc)
            if int(raw_get(sock, EVENTS)) & POLLIN:
                for _ in range(self._budget - 1):
                    frames = recv()
                    try:
                        handle(frames)
                    except Exception as exc:  # noqa: BLE001 (as above)
                        self._failed(exc)
                self._schedule()  # budget spent: continue after other callbacks had a turn
        except zmq.Again:
            pass
        if self._after is not None:
            try:
                self._after()
            except Exception as exc:  # noqa: BLE001 (as above)
                self._failed(exc)
        if self._sends:
            self.poke()  # the handler replied on this socket, which can consume the edge

    def _failed(self, exc: BaseException) -> None:
        """One message's handling raised: log it, count it, and keep reading."""
        self._error_log.warning(
            type(exc).__name__, "handling a message failed: %s: %.500s", type(exc).__name__, exc
        )
        log.debug("the failure", exc_info=exc)
        if self._on_error is not None:
            self._on_error(exc)
