"""A batch-window sweep, the engine of ``kvd tune`` and ``kvd bench pipeline --windows``.

One ``kvd serve`` serves every run, with one shared-memory cache attached, and the window is
set live before each run with ``Configure`` (as ``kvd set batch-window-us`` does), so runs
differ in the window only. ``schedule`` visits every window in each round, in alternating
order, so that a slow drift of the machine's load (it may be shared) hits every window alike.
Each run is ``drive`` with a request mix whose notifications name blocks of their own.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import zmq

from kvd.bench.pipeline import Figures, Mix, Target, drive, probe_messages, slot_messages
from kvd.client import Client
from kvd.daemon_process import DaemonProcess
from kvd.protocol import BatchWindow, Layout
from kvd.shm import ShmCache

CACHE_ID = "sweep"
W = TypeVar("W", bound=BatchWindow)


@dataclass(frozen=True)
class Load:
    """How notifications arrive: a closed loop at ``concurrency``, or an open loop at ``rate``
    per second; ``slots``: the block slots the run cycles through (in flight at most)."""

    concurrency: int = 0
    rate: float = 0.0
    slots: int = 1

    @property
    def name(self) -> str:
        return f"{self.rate:,.0f}/s" if self.rate else f"{self.concurrency} in flight"


@dataclass(frozen=True)
class Run:
    figures: Figures
    latencies: list[float]
    """Every timed latency of the run (us, sorted), for pooling runs."""
    chose_us: int | None
    """With ``auto``: the window kvd had chosen at the end of the run."""


def schedule(loads: Sequence[Load], windows: Sequence[W], rounds: int) -> Iterator[tuple[Load, W]]:
    """Each load in turn; per load, ``rounds`` rounds of every window, in alternating order."""
    for load in loads:
        for r in range(rounds):
            yield from ((load, window) for window in (windows if r % 2 == 0 else windows[::-1]))


class Sweep:
    """``kvd serve`` with ``cache`` (of ``layout``) attached, sent notifications of ``blocks``
    blocks each from ``remote_layout`` at ``ratio``. A context manager: ``DaemonError`` or
    ``MixError`` when kvd does not start or does not answer."""

    def __init__(
        self, cache: ShmCache, layout: Layout, *, blocks: int, remote_layout: Layout, ratio: int
    ) -> None:
        self.cache = cache
        self.layout = layout
        self.make = slot_messages(CACHE_ID, blocks, remote_layout, ratio)
        self._runs = itertools.count()
        self._work: tempfile.TemporaryDirectory[str] | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._daemon: DaemonProcess | None = None
        self._client: Client | None = None
        self._target: Target | None = None

    def __enter__(self) -> Sweep:
        try:
            self._work = tempfile.TemporaryDirectory(prefix="kvd-sweep-")
            self._ctx = zmq.Context()
            self._daemon = DaemonProcess("--log-level", "warning", runtime_dir=self._work.name)
            self._daemon.start()
            # Open for the whole sweep: the cache is held by this connection (engine_lease_s).
            self._client = self._daemon.client()
            self._client.attach(CACHE_ID, self.cache.specs)
            endpoints = self._daemon.endpoints()
            self._target = Target(self._ctx, endpoints.ingest, endpoints.events, topic=CACHE_ID)
            self._target.warm_up(probe_messages(CACHE_ID, self.layout))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(
        self,
        load: Load,
        window: BatchWindow,
        *,
        messages: int,
        warmup: int,
        progress: Callable[[int], object] | None = None,
    ) -> Run:
        """Set ``window`` and time ``messages`` notifications after ``warmup`` untimed ones."""
        assert self._client is not None and self._target is not None, "used outside its with"
        self._client.configure(batch_window_us=window)
        latencies: list[float] = []
        mix = Mix(messages, concurrency=load.concurrency or 1, rate=load.rate, warmup=warmup)
        figures = drive(
            self._target,
            self.make,
            slots=load.slots,
            mix=mix,
            # Every run its own req_ids: kvd answers a req_id it has seen from its record.
            prefix=f"run{next(self._runs)}-{window}",
            progress=progress,
            latencies_out=latencies,
        )
        chose = self._client.configure().batch_window_us if window == "auto" else None
        return Run(figures, latencies, chose)

    def close(self) -> None:
        """Close the sockets before the context, then stop kvd (killed if it does not stop)."""
        if self._target is not None:
            self._target.close()
        if self._client is not None:
            self._client.close()
        if self._ctx is not None:
            self._ctx.term()
        if self._daemon is not None:
            self._daemon.close()
        if self._work is not None:
            self._work.cleanup()
        self._target = self._client = self._ctx = self._daemon = self._work = None
