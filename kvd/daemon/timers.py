"""Timers on the event loop: a periodic callback, and a deadline finer than the loop's clock."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable


class Every:
    """Calls ``callback`` every ``interval_s`` seconds from the event loop.

    A chain of ``call_later``: each run schedules the next, so a loop that stops running stops
    calling, which is the point for watchdog pings.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, interval_s: float, callback: Callable[[], object]
    ) -> None:
        self._loop = loop
        self._interval = interval_s
        self._callback = callback
        self._handle: asyncio.TimerHandle | None = loop.call_later(interval_s, self._run)

    def _run(self) -> None:
        self._handle = self._loop.call_later(self._interval, self._run)
        self._callback()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class WindowTimer:
    """Calls ``callback`` on the loop at a monotonic deadline, with sub-millisecond precision.

    asyncio and uvloop timers round to whole milliseconds, far coarser than a batching window of
    tens of microseconds, so a helper thread waits for the deadline and wakes the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        self._loop = loop
        self._callback = callback
        self._cond = threading.Condition()
        self._deadline_ns: int | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvd-window", daemon=True)
        self._thread.start()

    def arm(self, deadline_ns: int) -> None:
        with self._cond:
            if self._deadline_ns is None or deadline_ns < self._deadline_ns:
                self._deadline_ns = deadline_ns
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._deadline_ns is None:
                    self._cond.wait()
                    continue
                remaining = self._deadline_ns - time.monotonic_ns()
                if remaining > 0:
                    self._cond.wait(remaining / 1e9)
                    continue
                self._deadline_ns = None
                self._loop.call_soon_threadsafe(self._callback)
