"""``kvd bench pipeline``: kvd's notification path against bare ZMQ relays, in the same run.

Every target gets identical traffic from this process (PUSH to its ingest socket, SUB on its
events socket). The cache is NHD and the notifications say NHD, so the transform has no work and
the figures are the pipeline's own cost. Rounds alternate between the targets; each figure is
the median over rounds, each ratio the median of the per-round ratios.

``--groups N`` makes it a hybrid model's cache: every ReadDone (protocol v2) splits its blocks
across N KV cache groups, the same total per notification, so the figures at N groups against
those at 1 are the cost of the extra groups. The groups draw their blocks from one pool and
share the cache's tensors, as vLLM's hybrid groups do, so the cache attached is the same one;
the relays get the same notifications and do no work, as without groups.

``drive`` runs a request mix (closed loop at a concurrency, or open loop at a rate) against one
target and times every notification; ``kvd tune`` uses it with real transforms.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvd.bench.cores import (
    Placement,
    PlacementError,
    cpu_seconds,
    placement,
    read_cpu,
    spawning_on,
)
from kvd.client import Client, read_done_message
from kvd.cpus import format_cpus
from kvd.daemon_process import DaemonProcess
from kvd.progress import progress_bar
from kvd.protocol import Layout
from kvd.shm import ShmCache
from kvd.tables import format_table, quantile

CACHE_ID = "bench"
TARGET_P50 = 1.3
TARGET_THROUGHPUT = 0.9
TARGET_CPU = 1.2
"""kvd's CPU time per notification at most this times relay-api's."""
TARGET_BEYOND_KERNEL_US = 100.0
"""With work: kvd's p50 less its kernel time at most this far above relay-api's round trip."""


@dataclass
class Figures:
    throughput: float
    """Notifications per second, first sent to last event received."""
    p50_us: float
    p99_us: float
    failed: int
    """Failed events among them (a healthy run has none)."""
    cpu_us: float = 0.0
    """CPU time of the target's process (all its threads) per notification of the throughput
    run: unlike rates, barely moved by other work on the machine."""
    kernel_us: float = 0.0
    """kvd with work: the executor's own time per job of the latency run (one notification
    each), from its ``kvd_transform_seconds``; 0 for the relays."""


class _Kind(msgspec.Struct):
    type: str


_KIND = msgspec.msgpack.Decoder(_Kind)


class _Outcome(msgspec.Struct):
    type: str
    req_id: str = ""
    code: str = ""
    message: str = ""


_OUTCOME = msgspec.msgpack.Decoder(_Outcome)


class MixError(RuntimeError):
    """The target sent no events, failed a warm-up notification or stopped answering."""


def _next_event(target: Target, received: int, expected: int) -> bytes:
    """The next event's payload; ``MixError`` after ``EVENT_TIMEOUT_S`` of silence (an event
    the target dropped never comes: the run fails instead of waiting for ever)."""
    if not target.sub.poll(int(EVENT_TIMEOUT_S * 1e3)):
        raise MixError(
            f"no event within {EVENT_TIMEOUT_S:.0f}s after {received} of {expected}: the "
            "target dropped some (its queue for this subscriber overflowed?)"
        )
    return target.sub.recv_multipart()[2]


class Target:
    """Sockets to one system under test: PUSH to its ingest, SUB on its events."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        ingest: str,
        events: str,
        topic: str = CACHE_ID,
        pid: int = 0,
    ) -> None:
        self.pid = pid
        """The process under test, for its CPU time (0: not measured)."""
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(ingest)
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(events)

    def warm_up(self, make: Callable[[str], bytes]) -> None:
        """Send until events flow (SUB connections are established asynchronously)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            self.push.send(make("warmup"))
            if self.sub.poll(100):
                break
        else:
            raise MixError("no events from the target within 10s")
        time.sleep(0.2)
        while self.sub.poll(0):
            self.sub.recv_multipart()

    def close(self) -> None:
        self.push.close()
        self.sub.close()


# With --transform layout every notification of a run names its own blocks, so requests in
# flight at the same time never share one: 16 tokens x 4 heads x 64 head_dim bf16 (8 KiB).
LAYOUT_HEADS, LAYOUT_HEAD_DIM = 4, 64
MAX_LAYOUT_CACHE_BYTES = 4 << 30


def _windows(args: argparse.Namespace) -> int:
    # Every notification of the run, warm-ups (up to 100 per target) included.
    return int(args.rounds * (args.messages + args.latency_samples) + 200)


def group_split(blocks: int, groups: int) -> tuple[tuple[int, int], ...]:
    """``read_done_message``'s ``groups`` for ``blocks`` blocks in ``groups`` KV cache groups:
    (blocks, covered_sub_blocks) each, sizes as even as possible (earlier groups one larger),
    every group wholly landed (coverage 0); empty for one group, a plain v1 ReadDone.
    Requires ``1 <= groups <= blocks`` (no group without a block)."""
    if groups == 1:
        return ()
    size, extra = divmod(blocks, groups)
    return tuple((size + (g < extra), 0) for g in range(groups))


def _messages(
    prefix: str, blocks: int, transform: str, windows: int, groups: int = 1
) -> Callable[[str], bytes]:
    counter = iter(range(1 << 62))
    layout: Layout = "HND" if transform == "layout" else "NHD"
    split = group_split(blocks, groups)

    def make(tag: str) -> bytes:
        n = next(counter)
        first = (n % windows) * blocks if transform == "layout" else 0
        return read_done_message(
            f"{prefix}-{tag}-{n}",
            CACHE_ID,
            list(range(first, first + blocks)),
            groups=split,
            remote_layout=layout,
            block_size_ratio=1,
        )

    return make


def transform_seconds(metrics_url: str) -> tuple[float, int]:
    """(sum, count) of kvd's ``kvd_transform_seconds``: the executor's time per job."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    found = {"kvd_transform_seconds_sum": 0.0, "kvd_transform_seconds_count": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name] = sample.value
    return found["kvd_transform_seconds_sum"], int(found["kvd_transform_seconds_count"])


def measure(
    target: Target,
    make: Callable[[str], bytes],
    messages: int,
    samples: int,
    metrics_url: str = "",
) -> Figures:
    """Throughput over ``messages``, then latency one at a time over ``samples``; with
    ``metrics_url`` (kvd's), also the executor's mean time per job of the latency run."""
    # Throughput: one thread sends as fast as it can while this one counts events.
    frames = [make("tp") for _ in range(messages)]

    def send() -> None:
        for frame in frames:
            target.push.send(frame)

    sender = threading.Thread(target=send)
    cpu_before = read_cpu(target.pid) if target.pid else None
    start = time.perf_counter()
    sender.start()
    failed = 0
    for received in range(messages):
        failed += _KIND.decode(_next_event(target, received, messages)).type == "failed"
    elapsed = time.perf_counter() - start
    cpu_s = cpu_seconds(cpu_before, read_cpu(target.pid)) if cpu_before else 0.0
    sender.join()

    # Latency: one notification at a time, ReadDone sent to its event received.
    before = transform_seconds(metrics_url) if metrics_url else (0.0, 0)
    latencies = []
    for _ in range(samples):
        frame = make("lat")
        t0 = time.perf_counter_ns()
        target.push.send(frame)
        failed += _KIND.decode(_next_event(target, 0, 1)).type == "failed"
        latencies.append((time.perf_counter_ns() - t0) / 1000)
    kernel_us = 0.0
    if metrics_url:
        after = transform_seconds(metrics_url)
        jobs = after[1] - before[1]
        kernel_us = (after[0] - before[0]) / jobs * 1e6 if jobs else 0.0
    latencies.sort()
    return Figures(
        throughput=messages / elapsed,
        p50_us=quantile(latencies, 0.50),
        p99_us=quantile(latencies, 0.99),
        failed=failed,
        cpu_us=cpu_s / messages * 1e6,
        kernel_us=kernel_us,
    )


@dataclass(frozen=True)
class Mix:
    """How notifications arrive: ``messages`` timed ones after ``warmup`` untimed ones."""

    messages: int
    concurrency: int = 1
    """Closed loop: at most this many in flight; the next is sent when an event arrives."""
    rate: float = 0.0
    """Open loop when > 0: notifications per second on a fixed schedule, whatever the replies
    (late ones are sent at once, in a burst). At most ``slots`` are in flight either way."""
    warmup: int = 0


def slot_messages(
    cache_id: str, blocks: int, remote_layout: Layout, ratio: int
) -> Callable[[str, int], bytes]:
    """``make(req_id, slot)`` for ``drive``: a ReadDone naming the ``blocks`` blocks of its slot,
    so that requests in flight at the same time never share one."""

    def make(req_id: str, slot: int) -> bytes:
        first = slot * blocks
        return read_done_message(
            req_id,
            cache_id,
            range(first, first + blocks),
            remote_layout=remote_layout,
            block_size_ratio=ratio,
        )

    return make


def probe_messages(cache_id: str, layout: Layout) -> Callable[[str], bytes]:
    """``make(tag)`` for ``Target.warm_up``: ReadDones without work (the cache's own layout,
    ratio 1), each under a new req_id, to see that events flow."""
    counter = iter(range(1 << 62))

    def make(tag: str) -> bytes:
        return read_done_message(
            f"probe-{tag}-{next(counter)}", cache_id, [0], remote_layout=layout, block_size_ratio=1
        )

    return make


EVENT_TIMEOUT_S = 30.0


def drive(
    target: Target,
    make: Callable[[str, int], bytes],
    *,
    slots: int,
    mix: Mix,
    prefix: str = "mix",
    progress: Callable[[int], object] | None = None,
    latencies_out: list[float] | None = None,
) -> Figures:
    """Send ``mix`` to ``target`` and time each notification from send to its event.

    ``latencies_out``, when given, receives every timed latency (us), for pooling runs.

    ``make(req_id, slot)`` encodes the notification for ``req_id`` using slot ``slot``'s
    blocks; a slot is used by one notification at a time and slots are reused round-robin, so
    notifications in flight never share blocks and the run walks the whole cache. ``progress``
    gets the number of notifications answered since its last call, about 100 times per run.
    Throughput is timed notifications over first timed send to last timed event; a Failed
    event during the warm-up raises ``MixError`` (a setup the target rejects).
    """
    total = mix.warmup + mix.messages
    in_flight_limit = slots if mix.rate > 0 else min(mix.concurrency, slots)
    interval = 1.0 / mix.rate if mix.rate > 0 else 0.0
    free = deque(range(slots))
    sent: dict[str, tuple[int, int, bool]] = {}  # req_id -> (sent ns, slot, timed)
    latencies: list[float] = []
    failed = answered = sent_n = reported = 0
    step = max(1, total // 100)
    first_timed_ns = last_timed_ns = 0
    push, sub = target.push, target.sub
    t0 = time.perf_counter()
    while answered < total:
        now = time.perf_counter()
        while (
            sent_n < total
            and free
            and (now >= t0 + sent_n * interval if interval else len(sent) < in_flight_limit)
        ):
            req_id = f"{prefix}-{sent_n}"
            slot = free.popleft()
            frame = make(req_id, slot)
            timed = sent_n >= mix.warmup
            sent_ns = time.perf_counter_ns()
            if timed and not first_timed_ns:
                first_timed_ns = sent_ns
            sent[req_id] = (sent_ns, slot, timed)
            push.send(frame)
            sent_n += 1
        # Open loop with a free slot: wake for the next send (1 ms granularity: late sends go
        # out together). Otherwise only an event can let the loop go on.
        next_send = bool(interval and sent_n < total and free)
        if next_send:
            timeout_ms = max(0, math.ceil((t0 + sent_n * interval - time.perf_counter()) * 1e3))
        else:
            timeout_ms = int(EVENT_TIMEOUT_S * 1e3)
        if not sub.poll(timeout_ms):
            if not next_send:
                raise MixError(f"no event within {EVENT_TIMEOUT_S:.0f}s ({len(sent)} in flight)")
            continue
        while True:
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            now_ns = time.perf_counter_ns()
            event = _OUTCOME.decode(frames[2])
            entry = sent.pop(event.req_id, None)
            if entry is None:
                continue  # an event of an earlier warm-up probe
            sent_ns, slot, timed = entry
            free.append(slot)
            answered += 1
            if event.type == "failed":
                if not timed:
                    raise MixError(f"warm-up notification failed: {event.code}: {event.message}")
                failed += 1
            if timed:
                latencies.append((now_ns - sent_ns) / 1000)
                last_timed_ns = now_ns
        if progress is not None and (answered - reported >= step or answered == total):
            progress(answered - reported)
            reported = answered
    latencies.sort()
    if latencies_out is not None:
        latencies_out.extend(latencies)
    elapsed_s = max(last_timed_ns - first_timed_ns, 1) / 1e9
    return Figures(
        throughput=mix.messages / elapsed_s,
        p50_us=quantile(latencies, 0.50),
        p99_us=quantile(latencies, 0.99),
        failed=failed,
    )


FLOORS = ("relay-api", "relay-raw")
"""relay-api is the bare pyzmq relay the targets refer to; relay-raw uses kvd's own socket calls."""


SOAK_GROWTH_LIMIT = 16 << 20
"""The most kvd's RSS may grow over a soak after its warm-up (bytes)."""
SOAK_IN_FLIGHT = 64


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (Linux /proc)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def soak(args: argparse.Namespace) -> int:
    """``--soak N``: N notifications through one kvd, RSS after the warm-up and at the end.

    Closed loop, ``SOAK_IN_FLIGHT`` at a time, every notification a new req_id, so every
    structure that remembers per-request or per-event state sees them all; the warm-up is long
    enough to fill the replay buffer and the memories of answers to their bounds. Exit status
    1 when the RSS grew more than ``SOAK_GROWTH_LIMIT`` after the warm-up.
    """
    total, warmup = args.soak, args.soak_warmup
    if not 0 < warmup < total:
        print(
            f"kvd bench pipeline: --soak-warmup must be in [1, --soak), got {warmup}",
            file=sys.stderr,
        )
        return 2
    quiet = args.json or args.no_progress
    layout = args.transform == "layout"
    heads, head_dim = (LAYOUT_HEADS, LAYOUT_HEAD_DIM) if layout else (1, 8)
    cache = ShmCache.create(
        num_layers=1,
        num_blocks=SOAK_IN_FLIGHT * args.blocks,
        block_size=16,
        num_heads=heads,
        head_dim=head_dim,
        layout="NHD",
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    daemon = DaemonProcess("--log-level", "warning")
    target: Target | None = None
    client: Client | None = None
    rss: list[int] = []
    figures: list[Figures] = []
    try:
        daemon.start()
        client = daemon.client()
        client.attach(CACHE_ID, cache.specs)
        endpoints = daemon.endpoints()
        assert daemon.proc is not None
        pid = daemon.proc.pid
        target = Target(ctx, endpoints.ingest, endpoints.events, pid=pid)
        target.warm_up(probe_messages(CACHE_ID, "NHD"))
        make = slot_messages(CACHE_ID, args.blocks, "HND" if layout else "NHD", 1)
        with progress_bar(total, "kvd bench pipeline --soak", unit="msg", quiet=quiet) as bar:
            for prefix, count in (("warmup", warmup), ("soak", total - warmup)):
                bar.set_postfix_str(prefix)
                mix = Mix(messages=count, concurrency=SOAK_IN_FLIGHT)
                figures.append(
                    drive(
                        target,
                        make,
                        slots=SOAK_IN_FLIGHT,
                        mix=mix,
                        prefix=prefix,
                        progress=bar.update,
                    )
                )
                rss.append(rss_bytes(pid))
    finally:
        if target is not None:
            target.close()
        if client is not None:
            client.close()
        ctx.term()
        daemon.stop()
        cache.close()
    growth = rss[1] - rss[0]
    report = {
        "benchmark": "soak",
        "notifications": total,
        "warmup": warmup,
        "transform": args.transform,
        "blocks_per_notification": args.blocks,
        "in_flight": SOAK_IN_FLIGHT,
        "rss_after_warmup_bytes": rss[0],
        "rss_at_end_bytes": rss[1],
        "growth_bytes": growth,
        "growth_limit_bytes": SOAK_GROWTH_LIMIT,
        "throughput": figures[1].throughput,
        "failed": sum(f.failed for f in figures),
        "meets_targets": growth <= SOAK_GROWTH_LIMIT,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        mib = 1 << 20
        print(
            f"kvd bench pipeline --soak: {total:,} notifications ({warmup:,} of them warm-up), "
            f"transform {args.transform}, {args.blocks} blocks each, {SOAK_IN_FLIGHT} in flight"
            f"\n\nkvd RSS after the warm-up {rss[0] / mib:.1f} MiB, at the end "
            f"{rss[1] / mib:.1f} MiB: growth {growth / mib:+.1f} MiB "
            f"(limit {SOAK_GROWTH_LIMIT / mib:.0f} MiB); {figures[1].throughput:,.0f} msg/s, "
            f"{report['failed']} failed\n\nmeets targets: "
            + ("yes" if report["meets_targets"] else "no")
        )
    return 0 if report["meets_targets"] else 1


def run(args: argparse.Namespace) -> int:
    if args.transform == "merge":
        print("kvd bench pipeline: --transform merge is for --windows", file=sys.stderr)
        return 2
    if args.groups != 1 and args.soak:
        print(
            "kvd bench pipeline: --groups is for the relay comparison, not --soak", file=sys.stderr
        )
        return 2
    if not 1 <= args.groups <= args.blocks:
        print(
            f"kvd bench pipeline: --groups must be in [1, --blocks] ({args.blocks}): every group "
            f"needs a block of each notification, got {args.groups}",
            file=sys.stderr,
        )
        return 2
    if args.soak:
        return soak(args)
    if args.messages is None:
        args.messages = 20000
    quiet = args.json or args.no_progress
    try:
        placed = placement(args.daemon_cpus)
    except PlacementError as exc:
        print(f"kvd bench pipeline: --daemon-cpus: {exc}", file=sys.stderr)
        return 2
    windows = _windows(args)
    if args.transform == "layout":
        num_blocks = windows * args.blocks
        if num_blocks * 16 * LAYOUT_HEADS * LAYOUT_HEAD_DIM * 2 * 2 > MAX_LAYOUT_CACHE_BYTES:
            print(
                "kvd bench pipeline: --transform layout needs one block per notification per "
                "run: use fewer --messages/--rounds or --blocks",
                file=sys.stderr,
            )
            return 2
        cache = ShmCache.create(
            num_layers=1,
            num_blocks=num_blocks,
            block_size=16,
            num_heads=LAYOUT_HEADS,
            head_dim=LAYOUT_HEAD_DIM,
            layout="NHD",
        )
    else:
        cache = ShmCache.create(
            num_layers=1,
            num_blocks=max(64, args.blocks),
            block_size=16,
            num_heads=1,
            head_dim=8,
            layout="NHD",
        )
    affinity = os.sched_getaffinity(0)
    if placed.bench is not None:
        # Before the context: ZMQ's I/O threads and the sender thread start here too.
        os.sched_setaffinity(0, placed.bench)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    work = Path(tempfile.mkdtemp(prefix="kvd-bench-"))
    # A throughput run puts every notification in flight at once, and this process reads the
    # events more slowly than kvd publishes them: kvd's default queue per subscriber (1,023
    # events) drops part of such a burst, as it should for a subscriber that falls behind. The
    # relays queue 1,000,000 events; kvd gets room for the whole burst too.
    burst = args.messages + args.latency_samples
    kvd_args = ["--log-level", "warning", "--peer-queue-bytes", str(burst * (2 << 20))]
    if args.transform == "layout":
        kvd_args += ["--metrics-addr", "0"]  # the executor's time per job, for the report
    if args.batch_window_us is not None:
        kvd_args += ["--batch-window-us", str(args.batch_window_us)]
    if placed.daemon is not None and "KVD_DEDICATED_CPUS" not in os.environ:
        # On a core of its own kvd runs as it should there (its environment may say otherwise).
        kvd_args += ["--dedicated-cpus", "true"]
    daemon = DaemonProcess(*kvd_args, runtime_dir=work / "kvd")
    relays: dict[str, subprocess.Popen[bytes]] = {}
    targets: dict[str, Target] = {}
    rounds: dict[str, list[Figures]] = {name: [] for name in ("kvd", *FLOORS)}
    client: Client | None = None
    try:
        for name in FLOORS:
            flavour = name.removeprefix("relay-")
            ingest, events = f"ipc://{work}/{name}-ingest.sock", f"ipc://{work}/{name}-events.sock"
            with spawning_on(placed.daemon):
                relay = relays[name] = subprocess.Popen(
                    [sys.executable, "-m", "kvd.bench.relay", flavour, ingest, events],
                    stdout=subprocess.PIPE,
                )
            if relay.stdout is None or relay.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"the {name} relay did not start")
            targets[name] = Target(ctx, ingest, events, pid=relay.pid)
        with spawning_on(placed.daemon):
            daemon.start()
        # Open for the whole run: the cache is held by this connection (engine_lease_s).
        client = daemon.client()
        client.attach(CACHE_ID, cache.specs)
        status = client.status()
        window = "auto" if status.batch_window_auto else status.batch_window_us
        io_batch = status.dedicated_cpus
        endpoints = daemon.endpoints()
        assert daemon.proc is not None
        targets["kvd"] = Target(ctx, endpoints.ingest, endpoints.events, pid=daemon.proc.pid)
        makers = {
            name: _messages(name, args.blocks, args.transform, windows, args.groups)
            for name in targets
        }
        for name, target in targets.items():
            target.warm_up(makers[name])
        # The bar moves between measurements only, never inside a timed loop.
        with progress_bar(
            args.rounds * len(targets), "kvd bench pipeline", unit="run", quiet=quiet
        ) as bar:
            for r in range(args.rounds):
                order = ["relay-api", "kvd", "relay-raw"]
                if r % 2:
                    order.reverse()
                for name in order:
                    bar.set_postfix_str(f"round {r + 1}/{args.rounds} {name}")
                    figures = measure(
                        targets[name],
                        makers[name],
                        args.messages,
                        args.latency_samples,
                        endpoints.metrics if name == "kvd" else "",
                    )
                    rounds[name].append(figures)
                    kernel = (
                        f"  kernel {figures.kernel_us:6.1f} us/job" if figures.kernel_us else ""
                    )
                    bar.write(
                        f"round {r + 1}/{args.rounds} {name:9}: {figures.throughput:10,.0f} msg/s"
                        f"  p50 {figures.p50_us:7.1f} us  p99 {figures.p99_us:7.1f} us"
                        f"  CPU {figures.cpu_us:5.1f} us/msg{kernel}"
                    )
                    bar.update()
    except MixError as exc:
        print(f"kvd bench pipeline: {exc}", file=sys.stderr)
        return 1
    finally:
        for target in targets.values():
            target.close()
        if client is not None:
            client.close()
        ctx.term()
        for relay in relays.values():
            relay.kill()
            relay.wait()
        daemon.stop()
        cache.close()
        os.sched_setaffinity(0, affinity)

    report = _report(args, window, placed, io_batch, rounds)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_table(report))
    return 0


def _median(rounds: list[Figures], field: str) -> float:
    return float(statistics.median(getattr(f, field) for f in rounds))


def _ratios(kvd: list[Figures], floor: list[Figures]) -> dict[str, float]:
    pairs = list(zip(kvd, floor, strict=True))
    return {
        "throughput": statistics.median(k.throughput / f.throughput for k, f in pairs),
        "p50": statistics.median(k.p50_us / f.p50_us for k, f in pairs),
        "p99": statistics.median(k.p99_us / f.p99_us for k, f in pairs),
        "cpu": statistics.median(k.cpu_us / f.cpu_us if f.cpu_us else 0.0 for k, f in pairs),
    }


def _report(
    args: argparse.Namespace,
    window: int | str,
    placed: Placement,
    io_batch: bool,
    rounds: dict[str, list[Figures]],
) -> dict[str, object]:
    ratios = {floor: _ratios(rounds["kvd"], rounds[floor]) for floor in FLOORS}
    against = ratios["relay-api"]
    meets = (
        against["p50"] <= TARGET_P50
        and against["throughput"] >= TARGET_THROUGHPUT
        and against["cpu"] <= TARGET_CPU
    )
    beyond: dict[str, float] = {}
    if args.transform == "layout":
        # Per round: kvd's p50 less its kernel time, against that round's relay round trip.
        pairs = list(zip(rounds["kvd"], rounds["relay-api"], strict=True))
        beyond = {
            "kvd_p50_less_kernel_us": statistics.median(k.p50_us - k.kernel_us for k, _ in pairs),
            "over_relay_api_us": statistics.median(
                k.p50_us - k.kernel_us - a.p50_us for k, a in pairs
            ),
        }
        meets = beyond["over_relay_api_us"] <= TARGET_BEYOND_KERNEL_US
    return {
        "benchmark": "pipeline",
        "rounds": args.rounds,
        "messages": args.messages,
        "latency_samples": args.latency_samples,
        "blocks_per_notification": args.blocks,
        "groups": args.groups,
        "transform": args.transform,
        "batch_window_us": window,
        "daemon_cpus": format_cpus(placed.daemon) if placed.daemon else None,
        "bench_cpus": format_cpus(placed.bench) if placed.bench else None,
        "kvd_io_threads_batch": io_batch,
        "figures": {
            name: {k: _median(rs, k) for k in asdict(rs[0])} for name, rs in rounds.items()
        },
        "ratios": ratios,
        "beyond_kernel": beyond,
        "targets": {
            "against": "relay-api",
            "p50_at_most": TARGET_P50,
            "throughput_at_least": TARGET_THROUGHPUT,
            "cpu_at_most": TARGET_CPU,
            "with_work_p50_less_kernel_over_relay_at_most_us": TARGET_BEYOND_KERNEL_US,
        },
        "meets_targets": meets,
    }


def _placement_line(report: dict[str, Any]) -> str:
    where = "kvd and the relays placed by the scheduler"
    if report["daemon_cpus"] is not None:
        where = (
            f"kvd and the relays on CPU {report['daemon_cpus']} (in turn), "
            f"this bench on CPU {report['bench_cpus']}"
        )
    if report["kvd_io_threads_batch"]:
        where += "; kvd's ZMQ I/O threads SCHED_BATCH (dedicated_cpus)"
    return where


def _table(report: dict[str, Any]) -> str:
    figures, ratios = report["figures"], report["ratios"]
    names = ("relay-api", "relay-raw", "kvd")
    rows = [["", *names, "kvd/api", "kvd/raw", "target (vs relay-api)"]]
    for label, field, fmt, key, target in (
        ("throughput (msg/s)", "throughput", "{:,.0f}", "throughput", f">= {TARGET_THROUGHPUT}x"),
        ("latency p50 (us)", "p50_us", "{:.1f}", "p50", f"<= {TARGET_P50}x"),
        ("latency p99 (us)", "p99_us", "{:.1f}", "p99", ""),
        ("CPU per msg (us)", "cpu_us", "{:.1f}", "cpu", f"<= {TARGET_CPU}x"),
    ):
        rows.append(
            [
                label,
                *(fmt.format(figures[n][field]) for n in names),
                *(f"{ratios[floor][key]:.2f}x" for floor in FLOORS),
                target,
            ]
        )
    lines = [
        f"kvd bench pipeline: {report['rounds']} rounds, {report['messages']} notifications "
        f"per throughput run, {report['latency_samples']} latency samples, "
        f"{report['blocks_per_notification']} blocks each in {report['groups']} KV cache "
        f"group{'s' if report['groups'] > 1 else ''}, transform {report['transform']}, "
        f"batch window {report['batch_window_us']} us; " + _placement_line(report),
        "",
        *format_table(rows, right=range(1, 6)),
        "",
        "CPU per msg: the process's CPU time (all threads) per notification of the throughput runs",
    ]
    beyond = report["beyond_kernel"]
    if beyond:
        kernel = figures["kvd"]["kernel_us"]
        lines += [
            f"kernel per job (latency runs, one notification each): {kernel:.1f} us; kvd's p50 "
            f"less it: {beyond['kvd_p50_less_kernel_us']:.1f} us, "
            f"{beyond['over_relay_api_us']:+.1f} us against relay-api's round trip "
            f"(target <= +{TARGET_BEYOND_KERNEL_US:.0f} us)",
            "the relays do no work with --transform layout: targets with work are this line's",
        ]
    failed = {n: f["failed"] for n, f in figures.items() if f["failed"]}
    if failed:
        lines += ["", f"WARNING: Failed events (median per round): {failed}"]
    lines += ["", "meets targets: " + ("yes" if report["meets_targets"] else "no")]
    return "\n".join(lines)
