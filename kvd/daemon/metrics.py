"""Counters, gauges and histograms, rendered in the Prometheus text format.

Updated only from the event loop thread, so no locks. ``Status`` replies and the ``/metrics``
endpoint read the same objects.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence

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


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class Counter:
    """A monotonically increasing value; hot paths do ``counter.value += n``."""

    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help = name, help_text
        self.value = 0

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        yield f"{self.name} {_number(self.value)}"


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

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        for value, n in self.values().items():
            yield f'{self.name}{{{self.label}="{_escape(value)}"}} {_number(n)}'


class Gauge:
    """A value read when rendered, so it can never drift from the state it reports."""

    def __init__(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self.name, self.help, self._read = name, help_text, read

    def value(self) -> float:
        return self._read()

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} gauge"
        yield f"{self.name} {_number(self.value())}"


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name, self.help = name, help_text
        self.bounds = tuple(sorted(buckets))
        self._counts = [0] * (len(self.bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        cumulative = 0
        for bound, n in zip((*self.bounds, math.inf), self._counts, strict=True):
            cumulative += n
            yield f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}'
        yield f"{self.name}_sum {_number(self.sum)}"
        yield f"{self.name}_count {self.count}"


class Metrics:
    """Everything kvd counts. Gauges are bound to live state by the daemon."""

    def __init__(self) -> None:
        self.requests = LabelledCounter(
            "kvd_requests_total", "Requests answered, by outcome (ready or failed).", "outcome"
        )
        self.ready = self.requests.labels("ready")
        self.failed = self.requests.labels("failed")
        self.rejections = LabelledCounter(
            "kvd_rejections_total",
            "Notifications and control requests rejected, by reason code.",
            "reason",
        )
        self.messages = Counter(
            "kvd_ingest_messages_total", "Messages received on the ingest socket."
        )
        self.blocks = Counter("kvd_blocks_processed_total", "Blocks post-processed.")
        self.bytes = Counter("kvd_bytes_processed_total", "Bytes of blocks post-processed.")
        self.batches = Counter("kvd_batches_total", "Batches launched on the executor.")
        self.events = Counter("kvd_events_published_total", "Events published.")
        self.repeats = Counter(
            "kvd_repeated_notifications_total",
            "Notifications kvd already knew (answered from the recorded outcome, or by the "
            "event of the one still in flight); none rewrites a block.",
        )
        self.handler_errors = LabelledCounter(
            "kvd_handler_errors_total",
            "Messages whose handling raised (a bug or hostile input); the reader went on.",
            "socket",
        )
        self.queue_wait = Histogram(
            "kvd_queue_wait_seconds", "Time from acceptance to launch.", LATENCY_BUCKETS
        )
        self.transform = Histogram(
            "kvd_transform_seconds", "Executor time of one job.", LATENCY_BUCKETS
        )
        self.read_done_to_ready = Histogram(
            "kvd_read_done_to_ready_seconds",
            "Time from receiving a ReadDone to publishing its event.",
            LATENCY_BUCKETS,
        )
        self.batch_blocks = Histogram(
            "kvd_batch_blocks", "Blocks per launched batch.", BATCH_BLOCK_BUCKETS
        )
        self.gauges: list[Gauge] = []

    def gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self.gauges.append(Gauge(name, help_text, read))

    def counters(self) -> dict[str, int]:
        """Unlabelled totals for Status replies."""
        out = {"ready": self.ready.value, "failed": self.failed.value}
        for c in (
            self.messages,
            self.blocks,
            self.bytes,
            self.batches,
            self.events,
            self.repeats,
        ):
            out[c.name.removeprefix("kvd_").removesuffix("_total")] = c.value
        return out

    def rejection_counts(self) -> dict[str, int]:
        return self.rejections.values()

    def render(self) -> str:
        families: list[Counter | LabelledCounter | Gauge | Histogram] = [
            self.requests,
            self.rejections,
            self.messages,
            self.blocks,
            self.bytes,
            self.batches,
            self.events,
            *self.gauges,
            self.queue_wait,
            self.transform,
            self.read_done_to_ready,
            self.batch_blocks,
        ]
        lines = [line for family in families for line in family.render()]
        return "\n".join(lines) + "\n"
