"""Counters, gauges and histograms, exposed to Prometheus through ``prometheus_client``.

The hot path only does ``counter.value += n`` and ``histogram.observe(x)`` on plain Python
objects: no locks, no label lookups, no ``prometheus_client`` call. A custom collector turns
the live values into metric families when ``/metrics`` is scraped, and ``prometheus_client``
writes the text format. Everything is updated and scraped on the event loop thread, so a scrape
sees a consistent picture without locks; the one exception, ``kvd_replays_total``, has a single
writer (the replay thread), so it only ever reads a little behind. ``Status`` replies read the
same objects.

To count something new, add one line to ``Metrics.__init__``::

    self.timeouts = self.counter("kvd_timeouts_total", "Waits that timed out.")
    self.drops = self.labelled_counter("kvd_drops_total", "Events dropped, by cause.", "cause")

and bump it where it happens (``metrics.timeouts.value += 1``, ``metrics.drops.inc("hwm")``, or
bind ``drops.labels("hwm")`` once and bump its ``value``). Unlabelled counters also show up in
``kvd status`` under their name without ``kvd_`` and ``_total``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import CollectorRegistry

# Microsecond-scale buckets (in seconds): the post-process and pipeline hops live between
# tens of microseconds and a few milliseconds.
LATENCY_BUCKETS = (
    10e-6,
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    500e-3,
    1.0,
    2.5,
)
BATCH_BLOCK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Counter:
    """A monotonically increasing value; hot paths do ``counter.value += n``."""

    __slots__ = ("help", "name", "value")

    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text
        self.value = 0

    def family(self) -> Metric:
        return CounterMetricFamily(self.name, self.help, value=self.value)


class _Child:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


class LabelledCounter:
    """Counters that differ by one label; ``labels(v)`` returns a child to bind once and bump."""

    def __init__(self, name: str, help_text: str, label: str) -> None:
        self.name, self.help, self.label = name, help_text, label
        self._children: dict[str, _Child] = {}

    def labels(self, value: str) -> _Child:
        child = self._children.get(value)
        if child is None:
            child = self._children[value] = _Child()
        return child

    def inc(self, value: str, amount: int = 1) -> None:
        self.labels(value).value += amount

    def values(self) -> dict[str, int]:
        return {k: c.value for k, c in sorted(self._children.items())}

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.help, labels=[self.label])
        for value, n in self.values().items():
            family.add_metric([value], n)
        return family


class Gauge:
    """A value read when scraped, so it can never drift from the state it reports."""

    def __init__(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self.name, self.help, self._read = name, help_text, read

    def value(self) -> float:
        return self._read()

    def family(self) -> Metric:
        return GaugeMetricFamily(self.name, self.help, value=self.value())


class Histogram:
    """Counts of observations per bucket; ``observe`` is one bisect and three additions."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name, self.help = name, help_text
        self.bounds = tuple(sorted(buckets))
        # Bucket labels as prometheus_client writes them ("1e-05", "4.0", "+Inf"), made once.
        self._le = [*(repr(float(b)) for b in self.bounds), "+Inf"]
        self._counts = [0] * (len(self.bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def family(self) -> Metric:
        cumulative, buckets = 0, []
        for le, n in zip(self._le, self._counts, strict=True):
            cumulative += n
            buckets.append((le, float(cumulative)))
        return HistogramMetricFamily(self.name, self.help, buckets=buckets, sum_value=self.sum)


Family = Counter | LabelledCounter | Gauge | Histogram
_F = TypeVar("_F", Counter, LabelledCounter, Gauge, Histogram)


class _Collector:
    """The ``prometheus_client`` view of a ``Metrics``: families built from live values."""

    def __init__(self, families: list[Family]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return [f.family() for f in self._families]


class Metrics:
    """Everything kvd counts. Gauges are bound to live state by the daemon."""

    def __init__(self, *, process: bool = True) -> None:
        self._families: list[Family] = []
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self._families))
        if process:
            # process_cpu_seconds_total, process_resident_memory_bytes, open fds, start time.
            ProcessCollector(registry=self.registry)

        self.requests = self.labelled_counter(
            "kvd_requests_total", "Requests answered, by outcome (ready or failed).", "outcome"
        )
        self.ready = self.requests.labels("ready")
        self.failed = self.requests.labels("failed")
        self.rejections = self.labelled_counter(
            "kvd_rejections_total",
            "Notifications and control requests rejected, by reason code.",
            "reason",
        )
        self.messages = self.counter(
            "kvd_ingest_messages_total", "Messages received on the ingest socket."
        )
        self.ready_untouched = self.counter(
            "kvd_ready_untouched_total",
            "Requests answered Ready at once, no byte touched: the rewrite is the identity "
            "(e.g. MLA or NHD pages at any block sizes, all covered) or lists no block. "
            "Counted in kvd_requests_total{outcome=ready} too.",
        )
        self.blocks = self.counter("kvd_blocks_processed_total", "Blocks post-processed.")
        self.bytes = self.counter("kvd_bytes_processed_total", "Bytes of blocks post-processed.")
        self.batches = self.counter("kvd_batches_total", "Batches launched on the executor.")
        self.events = self.counter("kvd_events_published_total", "Events published.")
        self.repeats = self.counter(
            "kvd_repeated_notifications_total",
            "Notifications kvd already knew (answered from the recorded outcome, or by the "
            "event of the one still in flight); none rewrites a block.",
        )
        self.replays = self.counter(
            "kvd_replays_total",
            "Replay requests answered (counted by the replay thread, its only writer).",
        )
        self.replays_abandoned = self.counter(
            "kvd_replays_abandoned_total",
            "Replay answers given up on: the peer left, or read nothing for 5 s.",
        )
        self.replays_dropped = self.counter(
            "kvd_replays_dropped_total",
            "Replay requests dropped unanswered: 4 of the peer's, or 1,024 in all, in progress.",
        )
        self.leases_expired = self.counter(
            "kvd_leases_expired_total",
            "Caches detached because their engine was gone (connection closed or no heartbeat "
            "for engine_lease_s).",
        )
        self.journal_errors = self.counter(
            "kvd_journal_errors_total",
            "Journal writes that failed (a full runtime directory): the requests of a launch "
            "are refused with journal_unavailable, an outcome is written later.",
        )
        self.connections_refused = self.counter(
            "kvd_connections_refused_total",
            "Peer connections closed on arrival because max_connections were open.",
        )
        self.handler_errors = self.labelled_counter(
            "kvd_handler_errors_total",
            "Messages whose handling raised (a bug or hostile input); the reader went on.",
            "socket",
        )
        self.queue_wait = self.histogram(
            "kvd_queue_wait_seconds", "Time from acceptance to launch.", LATENCY_BUCKETS
        )
        self.transform = self.histogram(
            "kvd_transform_seconds", "Executor time of one job.", LATENCY_BUCKETS
        )
        self.read_done_to_ready = self.histogram(
            "kvd_read_done_to_ready_seconds",
            "Time from receiving a ReadDone to publishing its event.",
            LATENCY_BUCKETS,
        )
        self.batch_blocks = self.histogram(
            "kvd_batch_blocks", "Blocks per launched batch.", BATCH_BLOCK_BUCKETS
        )

    def _add(self, family: _F) -> _F:
        if any(f.name == family.name for f in self._families):
            raise ValueError(f"metric {family.name} is defined twice")
        self._families.append(family)
        return family

    def counter(self, name: str, help_text: str) -> Counter:
        """A new counter, exposed as ``name`` (which ends in ``_total``)."""
        return self._add(Counter(name, help_text))

    def labelled_counter(self, name: str, help_text: str, label: str) -> LabelledCounter:
        """A new family of counters that differ by the value of ``label``."""
        return self._add(LabelledCounter(name, help_text, label))

    def histogram(
        self, name: str, help_text: str, buckets: Sequence[float] = LATENCY_BUCKETS
    ) -> Histogram:
        """A new histogram; latency histograms are in seconds (``name`` ends in ``_seconds``)."""
        return self._add(Histogram(name, help_text, buckets))

    def gauge(self, name: str, help_text: str, read: Callable[[], float]) -> Gauge:
        """A gauge whose value is ``read()`` at scrape time."""
        return self._add(Gauge(name, help_text, read))

    def counters(self) -> dict[str, int]:
        """Unlabelled totals for Status replies: outcomes, then every plain counter."""
        out = {"ready": self.ready.value, "failed": self.failed.value}
        for c in self._families:
            if isinstance(c, Counter):
                out[c.name.removeprefix("kvd_").removesuffix("_total")] = c.value
        return out

    def rejection_counts(self) -> dict[str, int]:
        return self.rejections.values()

    def render(self) -> bytes:
        """The Prometheus text exposition (format 0.0.4) of every metric, as served."""
        return generate_latest(self.registry)
