"""``kvd tune``: measure a batch-window sweep with your geometry and request mix, and pick one.

The sweep is ``kvd.bench.sweep``'s: one ``kvd serve`` with a shared-memory cache of the given
geometry attached, its window set live before each run, and the mix sent with
``kvd.bench.pipeline.drive``: notifications whose remote layout or block size needs a real
rewrite, each naming its own blocks. With ``--repeat`` the windows are visited again in reverse
order (like the rounds of ``kvd bench pipeline``) and each figure is the median over visits.

The recommendation follows one stated rule (``--objective``), so a reader can check it against
the table: by default, among the windows whose p99 is within ``--p99-slack`` of the best p99,
the smallest one whose throughput is within ``--tie`` of the highest of them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from kvd.bench.pipeline import Figures, MixError
from kvd.bench.sweep import Load, Sweep, schedule
from kvd.daemon.config import parse_batch_windows
from kvd.daemon_process import DaemonError
from kvd.dtypes import ITEMSIZE
from kvd.progress import progress_bar
from kvd.shm import ShmCache
from kvd.tables import format_table

Objective = Literal["balanced", "throughput", "p50", "p99"]


class TuneError(ValueError):
    """Arguments that cannot describe a run; the message says which and why."""


@dataclass(frozen=True)
class WindowResult:
    window_us: int
    throughput: float
    """Notifications per second, first timed send to last timed event (median over visits)."""
    p50_us: float
    p99_us: float
    failed: int


@dataclass(frozen=True)
class Recommendation:
    window_us: int
    objective: Objective
    rule: str


def parse_windows(text: str) -> list[int]:
    """``"0,50,100"`` -> [0, 50, 100]: distinct fixed windows (``parse_batch_windows``)."""
    try:
        windows = parse_batch_windows(text, auto=False)
    except ValueError as exc:
        raise TuneError(f"--windows: {exc}") from None
    return [w for w in windows if w != "auto"]  # none is: the type says so


def recommend(
    results: Sequence[WindowResult],
    objective: Objective = "balanced",
    p99_slack: float = 0.1,
    tie: float = 0.05,
) -> Recommendation:
    """The window ``objective`` picks.

    - ``balanced``: among windows whose p99 is at most ``(1 + p99_slack)`` times the best p99,
      the highest throughput; throughputs within ``tie`` of that one count as equal, and the
      smallest window among them wins (a window must pay for the wait it adds);
    - ``throughput``: the highest throughput; ``p50``/``p99``: the lowest p50/p99.

    Exact ties go to the smaller window.
    """
    if not results:
        raise TuneError("no windows were measured")
    by_window = sorted(results, key=lambda r: r.window_us)
    if objective == "throughput":
        best = max(by_window, key=lambda r: r.throughput)
        rule = "the highest throughput"
    elif objective == "p50":
        best = min(by_window, key=lambda r: r.p50_us)
        rule = "the lowest p50"
    elif objective == "p99":
        best = min(by_window, key=lambda r: r.p99_us)
        rule = "the lowest p99"
    else:
        best_p99 = min(r.p99_us for r in by_window)
        limit = best_p99 * (1 + p99_slack)
        candidates = [r for r in by_window if r.p99_us <= limit]
        top = max(r.throughput for r in candidates)
        best = next(r for r in candidates if r.throughput >= top * (1 - tie))
        rule = (
            f"among windows whose p99 is within {p99_slack:.0%} of the best p99 "
            f"({best_p99:,.0f} us), the smallest whose throughput is within {tie:.0%} of "
            f"the highest of them ({top:,.0f}/s)"
        )
    return Recommendation(best.window_us, objective, rule)


def _check(args: argparse.Namespace) -> tuple[list[int], int]:
    """The windows and the number of block slots; ``TuneError`` for arguments that cannot work."""
    windows = parse_windows(args.windows)
    for name in ("layers", "num_blocks", "block_size", "heads", "head_dim", "ratio", "blocks"):
        if getattr(args, name) < 1:
            raise TuneError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("messages", "concurrency", "repeat"):
        if getattr(args, name) < 1:
            raise TuneError(f"--{name} must be at least 1")
    if args.warmup < 0:
        raise TuneError("--warmup must be at least 0")
    if args.rate is not None and not args.rate > 0:
        raise TuneError("--rate must be above 0 notifications per second")
    if args.p99_slack < 0 or not 0 <= args.tie < 1:
        raise TuneError("--p99-slack must be at least 0 and --tie in [0, 1)")
    if args.block_size % args.ratio:
        raise TuneError(f"--ratio {args.ratio} does not divide --block-size {args.block_size}")
    slots = args.num_blocks // args.blocks
    if slots < 1:
        raise TuneError(f"--num-blocks {args.num_blocks} is less than --blocks {args.blocks}")
    if args.rate is None and args.concurrency > slots:
        raise TuneError(
            f"--concurrency {args.concurrency} needs {args.concurrency * args.blocks} blocks "
            f"({args.blocks} per request); the cache has --num-blocks {args.num_blocks}"
        )
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise TuneError("--plot needs matplotlib: pip install 'kvd[tune]' (or --plot '')")
    if args.layout == args.remote_layout and args.ratio == 1:
        print(
            "kvd tune: warning: --remote-layout equals --layout and --ratio is 1, so the "
            "notifications need no rewrite; the figures are the pipeline's own cost",
            file=sys.stderr,
        )
    return windows, slots


def run(args: argparse.Namespace) -> int:
    try:
        windows, slots = _check(args)
    except TuneError as exc:
        print(f"kvd tune: {exc}", file=sys.stderr)
        return 2
    quiet = args.json or args.no_progress
    visits: dict[int, list[Figures]] = {w: [] for w in windows}
    cache = ShmCache.create(
        num_layers=args.layers,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        num_heads=args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        layout=args.layout,
        kv_arrangement=args.kv_arrangement,
    )
    load = Load(
        concurrency=0 if args.rate else args.concurrency, rate=args.rate or 0.0, slots=slots
    )
    sweep = Sweep(
        cache, args.layout, blocks=args.blocks, remote_layout=args.remote_layout, ratio=args.ratio
    )
    per_run = args.warmup + args.messages
    try:
        with (
            sweep,
            progress_bar(
                len(windows) * args.repeat * per_run, "kvd tune", unit="msg", quiet=quiet
            ) as bar,
        ):
            for _, window_us in schedule([load], windows, args.repeat):
                bar.set_postfix_str(f"window {window_us} us")
                figures = sweep.run(
                    load,
                    window_us,
                    messages=args.messages,
                    warmup=args.warmup,
                    progress=bar.update,
                ).figures
                visits[window_us].append(figures)
                bar.write(
                    f"window {window_us:>7} us: {figures.throughput:10,.0f} notifications/s"
                    f"  p50 {figures.p50_us:8,.0f} us  p99 {figures.p99_us:8,.0f} us"
                )
    except (DaemonError, MixError) as exc:
        print(f"kvd tune: {exc}", file=sys.stderr)
        return 1
    finally:
        cache.close()

    results = [_median(w, figures) for w, figures in visits.items()]
    choice = recommend(results, args.objective, args.p99_slack, args.tie)
    report = _report(args, results, choice)
    if args.plot:
        plot(report, Path(args.plot))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0


def _median(window_us: int, figures: list[Figures]) -> WindowResult:
    return WindowResult(
        window_us=window_us,
        throughput=statistics.median(f.throughput for f in figures),
        p50_us=statistics.median(f.p50_us for f in figures),
        p99_us=statistics.median(f.p99_us for f in figures),
        failed=max(f.failed for f in figures),
    )


def _report(
    args: argparse.Namespace, results: list[WindowResult], choice: Recommendation
) -> dict[str, Any]:
    block_bytes = 2 * args.block_size * args.heads * args.head_dim * ITEMSIZE[args.dtype]
    return {
        "tool": "tune",
        "geometry": {
            "layers": args.layers,
            "num_blocks": args.num_blocks,
            "block_size": args.block_size,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "dtype": args.dtype,
            "layout": args.layout,
            "kv_arrangement": args.kv_arrangement,
            "remote_layout": args.remote_layout,
            "ratio": args.ratio,
            "bytes_per_block": block_bytes * args.layers,
        },
        "mix": {
            "blocks_per_request": args.blocks,
            "messages": args.messages,
            "warmup": args.warmup,
            "concurrency": None if args.rate else args.concurrency,
            "rate": args.rate,
            "repeat": args.repeat,
        },
        "windows": [asdict(r) for r in results],
        "recommendation": asdict(choice),
        "plot": str(args.plot) if args.plot else None,
    }


def format_report(report: dict[str, Any]) -> str:
    geometry, mix, choice = report["geometry"], report["mix"], report["recommendation"]
    loop = (
        f"open loop at {mix['rate']:,.0f} notifications/s"
        if mix["rate"]
        else f"closed loop, {mix['concurrency']} in flight"
    )
    lines = [
        f"kvd tune: {geometry['layers']} layers x {geometry['num_blocks']} blocks of "
        f"{geometry['block_size']} tokens x {geometry['heads']} heads x {geometry['head_dim']} "
        f"{geometry['dtype']}, {geometry['layout']} {geometry['kv_arrangement']}; remote "
        f"{geometry['remote_layout']}, ratio {geometry['ratio']}",
        f"mix: {mix['blocks_per_request']} blocks per notification, {mix['messages']} timed "
        f"after {mix['warmup']} warm-up, {loop}; median of {mix['repeat']} visit(s) per window",
        "",
    ]
    rows = [["window us", "notifications/s", "p50 us", "p99 us", "failed", ""]]
    for r in report["windows"]:
        rows.append(
            [
                str(r["window_us"]),
                f"{r['throughput']:,.0f}",
                f"{r['p50_us']:,.0f}",
                f"{r['p99_us']:,.0f}",
                str(r["failed"]),
                "<- recommended" if r["window_us"] == choice["window_us"] else "",
            ]
        )
    lines += format_table(rows, right=(0, 1, 2, 3, 4))
    lines += [
        "",
        f"recommended: batch_window_us = {choice['window_us']} "
        f"(kvd serve --batch-window-us {choice['window_us']})",
        f"rule ({choice['objective']}): {choice['rule']}",
    ]
    if any(r["failed"] for r in report["windows"]):
        lines.append("WARNING: some notifications failed; see kvd's log")
    if report["plot"]:
        lines.append(f"plot: {report['plot']}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Throughput and p50/p99 against the window, the recommended one marked, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    rows = report["windows"]
    windows = [r["window_us"] for r in rows]
    choice = report["recommendation"]["window_us"]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6.5), layout="constrained")
    top.plot(windows, [r["throughput"] for r in rows], "o-", color="tab:blue")
    top.set_ylabel("notifications/s")
    top.set_ylim(bottom=0)
    geometry, mix = report["geometry"], report["mix"]
    loop = f"{mix['rate']:,.0f}/s open loop" if mix["rate"] else f"{mix['concurrency']} in flight"
    top.set_title(
        f"kvd tune: {geometry['layers']} layers, {geometry['block_size']}-token blocks, "
        f"{geometry['heads']}x{geometry['head_dim']} {geometry['dtype']}, "
        f"{geometry['remote_layout']} -> {geometry['layout']} ratio {geometry['ratio']}; "
        f"{mix['blocks_per_request']} blocks/notification, {loop}",
        fontsize=9,
    )
    bottom.plot(windows, [r["p50_us"] for r in rows], "o-", color="tab:green", label="p50")
    bottom.plot(windows, [r["p99_us"] for r in rows], "s-", color="tab:red", label="p99")
    bottom.set_ylabel("ReadDone -> event (us)")
    bottom.set_ylim(bottom=0)
    bottom.set_xlabel("batch window (us)")
    bottom.legend(loc="best")
    # Windows usually grow geometrically (0, 50, 100, ... 2000): a log axis that admits 0.
    nonzero = [w for w in windows if w > 0]
    if nonzero and max(windows) / min(nonzero) > 10:
        bottom.set_xscale("symlog", linthresh=min(nonzero), linscale=0.5)
        bottom.set_xlim(-0.3 * min(nonzero), max(windows) * 1.2)
    bottom.set_xticks(windows, [str(w) for w in windows])
    bottom.xaxis.set_minor_locator(ticker.NullLocator())
    plain = ticker.FuncFormatter(lambda value, _: f"{value:,.0f}")
    for axis in (top.yaxis, bottom.yaxis):
        axis.set_major_formatter(plain)
    for ax in (top, bottom):
        ax.axvline(choice, color="tab:gray", linestyle="--", linewidth=1)
        ax.grid(True, alpha=0.3)
    top.annotate(
        f"recommended: {choice} us",
        xy=(choice, 0),
        xycoords=("data", "axes fraction"),
        xytext=(4, 6),
        textcoords="offset points",
        color="tab:gray",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
