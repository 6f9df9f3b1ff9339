"""The decode worker's link to kvd: a thread of the connector's own for everything that may wait.

The engine's thread (vLLM's step) must never wait on kvd. It sends each ReadDone with one
non-blocking send on a socket made at startup, and takes kvd's answers from ``inbox``, a deque it
pops without a lock. Everything else runs here, on the link's thread: the subscription's
blocking poll, its replays (each a round trip on a socket of its own), the liveness check that
reads kvd's lock and pid files, attaching again after a kvd restart, and writing the stats
file. The thread tells the engine's thread what to do through the same deque:

- an ``Event`` (Ready or Failed) of this worker's cache, in kvd's order;
- ``Resend``: kvd may not know every held request (events lost past its replay buffer, or kvd
  restarted and the cache is attached again): send them all again; kvd answers from its ledger
  or journal, and never rewrites a block twice;
- ``GiveUp``: kvd is gone and stayed gone for the down timeout: fail every held request (a dead
  kvd writes nothing, and a kvd that starts later is never sent them again).

``state`` says whether a ReadDone may be sent now (``UP``), must wait for kvd (``DOWN``), or is
failed at once (``GONE``).

ZMQ's I/O thread, which each send wakes, runs on kvd's CPUs when kvd has CPUs of its own, apart
from the engine thread's (``io_thread_cpus``): on the engine's core, each hand-off made it preempt
the engine there. The link's thread stays with the engine: it takes the GIL for every event, and
from another core each of those hand-overs cost the engine more than the wake-up saved.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from kvd.client import Client, EventsLost, KvdError, KvdTimeout, KvdUnavailable, Subscription
from kvd.cpus import CpuListError, format_cpus, parse_cpus
from kvd.endpoints import daemon_alive
from kvd.protocol import Event, TensorSpec
from kvd.subscription import ReplayError
from kvd.vllm.stats import HandoffStats

log = logging.getLogger("vllm.kvd")

POLL_S = 0.05
"""The link's longest wait on the subscription: how soon it sees a stop or a due check."""
CHECK_S = 1.0
"""Silence after which the link asks whether kvd still runs (file reads, off the engine)."""
STATS_QUIET_S = 0.2
"""The stats file is rewritten once the engine has handed off and released nothing for this
long: writing it holds the GIL, which the engine's thread then waits for."""
STATS_BUSY_S = 5.0
"""While requests keep flowing, the stats file is rewritten at most this often."""
_STATS_ENCODER = msgspec.json.Encoder()


IO_CPUS_DEFAULT = "kvd"
"""``kvd_io_cpus``: ``kvd`` (kvd's CPUs, when apart from the engine thread's), ``engine`` (the
engine thread's), or a CPU list such as ``7`` or ``6-7``."""


def parse_io_cpus(setting: str, name: str = "kvd_io_cpus") -> str | frozenset[int]:
    """``kvd_io_cpus`` as given: ``kvd``, ``engine`` or CPUs; ``CpuListError`` naming it as
    ``name`` (a command's option, where it is one)."""
    if setting in ("kvd", "engine"):
        return setting
    try:
        return parse_cpus(setting)
    except CpuListError as exc:
        raise CpuListError(f"{name}: {exc}; or kvd, or engine") from None


def io_thread_cpus(
    setting: str | frozenset[int], kvd_cpus: list[int], engine_cpus: frozenset[int]
) -> tuple[frozenset[int] | None, str]:
    """Where the link's ZMQ I/O thread runs (None: the engine thread's CPUs, which it inherits),
    and why, for the startup log. ``kvd_cpus``: from kvd's Status (empty from a kvd too old to
    say); ``engine_cpus``: the engine thread's."""
    engine = format_cpus(engine_cpus)
    if setting == "engine":
        return None, f"on the engine thread's CPUs {engine} (kvd_io_cpus = engine)"
    if isinstance(setting, frozenset):
        placed = format_cpus(setting)
        return setting, f"on CPUs {placed} (kvd_io_cpus), the engine thread on {engine}"
    if not kvd_cpus:
        return None, (
            f"on the engine thread's CPUs {engine}: this kvd does not say which CPUs it runs on"
        )
    cpus = frozenset(kvd_cpus)
    if cpus & engine_cpus:
        return None, (
            f"on the engine thread's CPUs {engine}: kvd's ({format_cpus(cpus)}) are not apart "
            "from them"
        )
    return cpus, f"on kvd's CPUs {format_cpus(cpus)}, apart from the engine thread's ({engine})"


class State(enum.Enum):
    UP = "up"
    DOWN = "down"
    GONE = "gone"


@dataclass(frozen=True, slots=True)
class Resend:
    reason: str


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: str


Notice = Event | Resend | GiveUp


@dataclass(frozen=True, slots=True)
class Attachment:
    """What attaching this worker's cache takes, again after every kvd restart."""

    cache_id: str
    specs: list[TensorSpec]
    engine_id: str
    timeout_s: float


class KvdLink:
    """kvd as the engine's thread sees it: ``send``, ``state`` and ``inbox``; see the module."""

    def __init__(
        self,
        client: Client,
        attachment: Attachment,
        *,
        down_timeout_s: float,
        stats: HandoffStats,
        stats_path: str | None = None,
    ) -> None:
        self.client = client
        self.attachment = attachment
        self.down_timeout_s = down_timeout_s
        self.inbox: deque[tuple[Notice, int, float]] = deque()
        """Notices, each with the engine's ``steps`` when it was queued."""
        self.steps = 0
        """Engine steps so far: the engine's thread counts them, the link stamps notices."""
        self.state = State.UP
        self.stats = stats
        self._stats_path = Path(stats_path) if stats_path else None
        self._stats_written = -1
        self._stats_written_at = time.monotonic()
        self._stats_seen = -1
        self._stats_changed_at = 0.0
        self._events: Subscription | None = None
        self._push: zmq.Socket[bytes] | None = None
        self._down_since = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvd-link", daemon=True)

    # -- the engine's thread ---------------------------------------------------------------------

    def start(self) -> None:
        """Attach and subscribe (at startup, on the caller's thread: errors are startup
        errors), make the engine's ingest socket, then hand the rest to the link's thread."""
        deadline = time.monotonic() + self.attachment.timeout_s
        while True:
            try:
                self._attach()
                break
            except ReplayError as exc:
                # kvd answered the Attach, so it is there: a kvd still busy starting (or a
                # loaded machine) answers the subscription's first replays late.
                if time.monotonic() > deadline:
                    raise
                log.warning("kvd: %s at startup; subscribing again", exc)
        self._push = self.client.ingest_socket(linger_s=0)
        self._thread.start()

    def send(self, frame: bytes) -> bool:
        """One non-blocking send; False when it could not go now (the request stays held and
        goes with the next ``Resend``)."""
        assert self._push is not None, "start() first"
        try:
            self._push.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        """Stop the link's thread, write the stats a last time, detach the cache, close every
        socket.

        Detaching lets kvd release its mapping of the cache now. Otherwise kvd keeps it until
        the engine's lease ends (``engine_lease_s`` after the connection closed, 30 s by
        default) and releases it then, under whatever the machine runs at that moment (in
        ``kvd bench vllm``, the next decode instance's timed steps)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._write_stats(force=True)
        if self.state is State.UP and not self._thread.is_alive():
            self._detach()
        if self._events is not None:
            self._events.close()
        self.client.close()

    def _detach(self) -> None:
        a = self.attachment
        try:
            self.client.detach(a.cache_id, engine_id=a.engine_id)
        except (KvdError, KvdTimeout, KvdUnavailable) as exc:
            log.warning(
                "kvd: detaching cache %r at shutdown: %s (kvd releases it when the engine's "
                "lease ends)",
                a.cache_id,
                exc,
            )

    # -- the link's thread -----------------------------------------------------------------------

    def _run(self) -> None:
        checked = time.monotonic()
        while not self._stop.is_set():
            try:
                if self.state is State.UP:
                    if self._listen():
                        checked = time.monotonic()
                    elif time.monotonic() - checked >= CHECK_S:
                        checked = time.monotonic()
                        self._check_alive()
                else:
                    self._stop.wait(POLL_S)
                    self._recover()
                self._write_stats()
            except Exception:
                # The link must outlive any one failure: held requests depend on it.
                log.exception("kvd link: unexpected error; going on")
                self._stop.wait(POLL_S)

    def _listen(self) -> bool:
        """Wait up to ``POLL_S`` for kvd's next event; True if something came."""
        assert self._events is not None
        cache_id = self.attachment.cache_id
        try:
            delivery = self._events.poll(POLL_S)
        except EventsLost as lost:
            if lost.restarted:
                self._went_down("kvd restarted")
                self._recover()
            else:
                log.warning("kvd events lost (%s): re-sending what is held", lost)
                self._post(Resend(str(lost)))
            return True
        except (ReplayError, KvdError, KvdTimeout, KvdUnavailable) as exc:
            log.warning("kvd: %s", exc)
            self._check_alive()
            return False
        if delivery is None:
            return False
        # The refusals topic carries other engines' requests too: only this cache's reach the
        # engine, so the deque holds at most one event per request this worker sent.
        if delivery.event.cache_id == cache_id:
            self._post(delivery.event)
        return True

    def _post(self, notice: Notice) -> None:
        self.inbox.append((notice, self.steps, time.monotonic()))

    def _check_alive(self) -> None:
        assert self.client.runtime_dir is not None
        if not daemon_alive(self.client.runtime_dir):
            self._went_down("kvd is not running")

    def _went_down(self, why: str) -> None:
        if self.state is State.UP:
            log.error("%s at %s: held requests wait for it", why, self.client.runtime_dir)
            self.state = State.DOWN
            self._down_since = time.monotonic()

    def _recover(self) -> None:
        """Attach again if kvd is back; fail what is held once it has been gone too long."""
        assert self.client.runtime_dir is not None
        if daemon_alive(self.client.runtime_dir):
            try:
                self._attach()
            except (KvdTimeout, KvdUnavailable, KvdError, ReplayError) as exc:
                log.warning("kvd: attaching again failed (%s); trying again", exc)
            else:
                log.warning("kvd is back at %s: attached again", self.client.runtime_dir)
                # Resend before UP: a ReadDone the engine sends once UP is never lost behind it.
                self._post(Resend("kvd attached again"))
                self.state = State.UP
                return
        if self.state is State.DOWN and time.monotonic() - self._down_since > self.down_timeout_s:
            log.error(
                "kvd gone for %gs: failing held requests (vLLM recomputes them)",
                self.down_timeout_s,
            )
            self.state = State.GONE
            self._post(GiveUp("kvd gone"))

    def _attach(self) -> None:
        a = self.attachment
        # Mapping a large cache takes a while (kvd fills in its page tables): a longer wait.
        timeout, self.client.timeout = self.client.timeout, a.timeout_s
        try:
            # The cache is this process's /dev/shm file (or its GPU memory): when the process is
            # killed (``vllm serve`` SIGKILLs its worker on SIGTERM), kvd releases it at once.
            self.client.attach(
                a.cache_id, a.specs, engine_id=a.engine_id, release_with_process=True
            )
        finally:
            self.client.timeout = timeout
        if self._events is not None:
            self._events.close()
        self._events = self.client.subscribe([a.cache_id])

    def _write_stats(self, *, force: bool = False) -> None:
        version = self.stats.absorb()  # always: the engine's records must not pile up
        now = time.monotonic()
        if version != self._stats_seen:
            self._stats_seen, self._stats_changed_at = version, now
        if self._stats_path is None or version == self._stats_written:
            return
        if not (force or stats_due(now, self._stats_changed_at, self._stats_written_at)):
            return
        # Encoded with msgspec (a report of 30,000 samples: 1.8-2.4 ms with the GIL held on a
        # busy 2-core VM, json's 6-34) and replaced whole, so a reader never sees half a file.
        staged = self._stats_path.with_name(f"{self._stats_path.name}.{os.getpid()}.tmp")
        staged.write_bytes(_STATS_ENCODER.encode(self.stats.report()))
        staged.replace(self._stats_path)
        self._stats_written_at = time.monotonic()
        self._stats_written = version


def stats_due(now: float, changed_at: float, written_at: float) -> bool:
    """Whether the stats file, behind the engine's records since ``changed_at``, is rewritten
    now: once the engine has been quiet for ``STATS_QUIET_S``, or ``STATS_BUSY_S`` after the
    last write while requests keep flowing: each write holds the GIL, and a step that waits for
    it is a late token for every running request."""
    return now - changed_at >= STATS_QUIET_S or now - written_at >= STATS_BUSY_S
