"""``kvd bench pipeline --windows``: fixed batching windows against ``auto``, at several loads.

The sweep is ``kvd.bench.sweep``'s: one ``kvd serve``, the window set live between runs, so runs
differ in the window only. For each load (a closed loop at a concurrency, or an open loop at a
rate), every round visits every window, in alternating order. Runs are short and rounds many, so
that a slow drift of the machine's load (it is shared) hits every window alike. Throughput is
the median over rounds; p50 and p99 are of every latency of the window's runs together (pooled:
a p99 of one short run is a handful of samples). The report compares ``auto`` with the best
fixed window of each load: its throughput against the highest, its p99 against the lowest.

Transforms (each notification names blocks of its own, 4 KV heads x 64 head_dim, bf16):

- ``layout``: HND pages into an NHD cache of 16-token blocks (a permute; light work per block);
- ``merge``: HND pages of 16 tokens into an NHD cache of 64-token blocks (permute and merge
  four pages into each block; four times the bytes per block).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from kvd.bench.pipeline import Figures, MixError
from kvd.bench.sweep import Load, Sweep, schedule
from kvd.daemon.config import parse_batch_windows
from kvd.daemon_process import DaemonError
from kvd.progress import progress_bar
from kvd.protocol import BatchWindow
from kvd.shm import ShmCache
from kvd.tables import format_table, quantile

HEADS, HEAD_DIM = 4, 64
TRANSFORMS = {"layout": (16, 1), "merge": (64, 4)}
"""transform -> (local block size in tokens, block_size_ratio)."""
OPEN_LOOP_SLOTS = 256
"""Notifications in flight at most in an open loop (each needs blocks of its own)."""
WITHIN = 0.10
"""auto should be within this of the best fixed window, in throughput and in p99."""


class WindowsError(ValueError):
    """Arguments that cannot work; the message names the flag."""


def parse_loads(concurrency: str | None, rates: str | None) -> list[Load]:
    try:
        if rates:
            loads = [
                Load(rate=float(r), slots=OPEN_LOOP_SLOTS) for r in rates.split(",") if r.strip()
            ]
        else:
            loads = [
                Load(concurrency=int(c), slots=int(c)) for c in (concurrency or "1,4,16").split(",")
            ]
    except ValueError:
        raise WindowsError("--concurrency and --rates take comma-separated numbers") from None
    if not loads or any(load.concurrency < 0 or load.rate < 0 for load in loads):
        raise WindowsError("--concurrency and --rates take positive numbers")
    if any(not (load.concurrency or load.rate) for load in loads):
        raise WindowsError("--concurrency and --rates take positive numbers")
    return loads


def _check(args: argparse.Namespace) -> tuple[list[BatchWindow], list[Load]]:
    try:
        windows = parse_batch_windows(args.windows, at_least=2)
    except ValueError as exc:
        raise WindowsError(f"--windows: {exc}") from None
    loads = parse_loads(args.concurrency, args.rates)
    if args.transform not in TRANSFORMS:
        raise WindowsError("--windows needs --transform layout or merge (none has no work)")
    if args.rounds < 1 or args.blocks < 1:
        raise WindowsError("--rounds and --blocks must be at least 1")
    if args.groups != 1:
        raise WindowsError("--groups is for the relay comparison, not --windows")
    return windows, loads


def run(args: argparse.Namespace) -> int:
    try:
        windows, loads = _check(args)
    except WindowsError as exc:
        print(f"kvd bench pipeline: {exc}", file=sys.stderr)
        return 2
    messages = args.messages or 1000
    block_size, ratio = TRANSFORMS[args.transform]
    quiet = args.json or args.no_progress
    slots = max(load.slots for load in loads)
    cache = ShmCache.create(
        num_layers=1,
        num_blocks=slots * args.blocks,
        block_size=block_size,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        layout="NHD",
    )
    figures: dict[tuple[str, str], list[Figures]] = {}
    latencies: dict[tuple[str, str], list[float]] = {}
    chosen: dict[str, list[int]] = {}
    total = len(loads) * args.rounds * len(windows)
    try:
        with (
            Sweep(cache, "NHD", blocks=args.blocks, remote_layout="HND", ratio=ratio) as sweep,
            progress_bar(total, "kvd bench pipeline", unit="run", quiet=quiet) as bar,
        ):
            for load, window in schedule(loads, windows, args.rounds):
                bar.set_postfix_str(f"{load.name}, window {window}")
                key = (load.name, str(window))
                done = sweep.run(load, window, messages=messages, warmup=max(100, messages // 5))
                figures.setdefault(key, []).append(done.figures)
                latencies.setdefault(key, []).extend(done.latencies)
                if done.chose_us is not None:
                    chosen.setdefault(load.name, []).append(done.chose_us)
                bar.write(
                    f"{load.name:>14}, window {window!s:>5}: "
                    f"{done.figures.throughput:9,.0f}/s  p50 {done.figures.p50_us:7,.0f} us"
                    f"  p99 {done.figures.p99_us:7,.0f} us"
                )
                bar.update()
    except (DaemonError, MixError) as exc:
        print(f"kvd bench pipeline: {exc}", file=sys.stderr)
        return 1
    finally:
        cache.close()
    report = _report(
        args,
        windows=windows,
        loads=loads,
        messages=messages,
        figures=figures,
        latencies=latencies,
        chosen=chosen,
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0


def _summary(runs: Sequence[Figures], latencies: list[float]) -> dict[str, float]:
    """Median throughput over runs; p50 and p99 of all their latencies together."""
    pooled = sorted(latencies)
    throughputs = [f.throughput for f in runs]
    median = float(statistics.median(throughputs))
    return {
        "throughput": median,
        "throughput_spread": (max(throughputs) - min(throughputs)) / median if median else 0.0,
        "p50_us": quantile(pooled, 0.50),
        "p99_us": quantile(pooled, 0.99),
        "failed": float(sum(f.failed for f in runs)),
    }


def _report(
    args: argparse.Namespace,
    *,
    windows: list[BatchWindow],
    loads: list[Load],
    messages: int,
    figures: dict[tuple[str, str], list[Figures]],
    latencies: dict[tuple[str, str], list[float]],
    chosen: dict[str, list[int]],
) -> dict[str, Any]:
    out_loads = []
    for load in loads:
        rows = {
            str(w): _summary(figures[(load.name, str(w))], latencies[(load.name, str(w))])
            for w in windows
        }
        fixed = {w: f for w, f in rows.items() if w != "auto"}
        entry: dict[str, Any] = {
            "load": load.name,
            "windows": rows,
            # How much one window's throughput moves between rounds: below this, no difference.
            "noise": float(statistics.median(f["throughput_spread"] for f in rows.values())),
        }
        if "auto" in rows and fixed:
            best_tp = max(fixed, key=lambda w: fixed[w]["throughput"])
            best_p99 = min(fixed, key=lambda w: fixed[w]["p99_us"])
            auto = rows["auto"]
            tp = auto["throughput"] / fixed[best_tp]["throughput"]
            p99 = auto["p99_us"] / fixed[best_p99]["p99_us"]
            entry["auto"] = {
                "chose_us": chosen.get(load.name, []),
                "best_throughput_window": int(best_tp),
                "throughput_ratio": tp,
                "best_p99_window": int(best_p99),
                "p99_ratio": p99,
                "within": tp >= 1 - WITHIN and p99 <= 1 + WITHIN,
            }
        out_loads.append(entry)
    block_size, ratio = TRANSFORMS[args.transform]
    return {
        "benchmark": "pipeline-windows",
        "transform": args.transform,
        "local_block_size": block_size,
        "block_size_ratio": ratio,
        "blocks_per_notification": args.blocks,
        "messages": messages,
        "rounds": args.rounds,
        "loads": out_loads,
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"kvd bench pipeline --windows: transform {report['transform']} (NHD blocks of "
        f"{report['local_block_size']} tokens, ratio {report['block_size_ratio']}), "
        f"{report['blocks_per_notification']} blocks per notification, {report['messages']} "
        f"timed per run, {report['rounds']} rounds (throughput: median; p50, p99: pooled)",
        "",
    ]
    rows = [["load", "window us", "notifications/s", "p50 us", "p99 us", "failed"]]
    for entry in report["loads"]:
        for n, (window, f) in enumerate(entry["windows"].items()):
            label = window
            if window == "auto" and "auto" in entry:
                label = f"auto ({statistics.median(entry['auto']['chose_us']):.0f})"
            rows.append(
                [
                    entry["load"] if n == 0 else "",
                    label,
                    f"{f['throughput']:,.0f}",
                    f"{f['p50_us']:,.0f}",
                    f"{f['p99_us']:,.0f}",
                    f"{f['failed']:.0f}",
                ]
            )
    lines += format_table(rows, right=(1, 2, 3, 4, 5))
    lines.append("")
    for entry in report["loads"]:
        auto = entry.get("auto")
        if auto is None:
            continue
        lines.append(
            f"{entry['load']}: auto {auto['throughput_ratio']:.2f}x the best throughput "
            f"({auto['best_throughput_window']} us), {auto['p99_ratio']:.2f}x the best p99 "
            f"({auto['best_p99_window']} us): "
            + ("within 10%" if auto["within"] else "NOT within 10%")
            + f"; one window's throughput moves {entry['noise']:.0%} between rounds"
        )
    if any("auto" in e for e in report["loads"]):
        lines.append(
            "auto (N): the median over rounds of the longest wait auto allowed at the end of a "
            "run, in us (a batch goes sooner once requests stop coming)"
        )
    return "\n".join(lines)
