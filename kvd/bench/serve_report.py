"""``kvd bench serve``'s figures, targets and table, from what each run measured."""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass
from typing import Any

from kvd.bench.stalls import SUSPECT_S
from kvd.bench.vllm_report import ms
from kvd.tables import format_table

CONNECTORS = ("stock", "kvd")

FIGURES: list[tuple[str, str, str, bool]] = [
    # (key, label, vllm bench serve's key, higher is better)
    ("req_s", "requests/s", "request_throughput", True),
    ("tok_s", "output tokens/s", "output_throughput", True),
    ("ttft_p50", "TTFT p50 ms", "median_ttft_ms", False),
    ("ttft_p99", "TTFT p99 ms", "p99_ttft_ms", False),
    ("ttft_max", "TTFT longest ms", "", False),
    ("tpot_p50", "TPOT p50 ms", "median_tpot_ms", False),
    ("tpot_p99", "TPOT p99 ms", "p99_tpot_ms", False),
    ("itl_p50", "ITL p50 ms", "median_itl_ms", False),
    ("itl_p99", "ITL p99 ms", "p99_itl_ms", False),
    ("e2e_p50", "e2e p50 ms", "median_e2el_ms", False),
    ("e2e_p99", "e2e p99 ms", "p99_e2el_ms", False),
]


@dataclass(frozen=True, slots=True)
class Target:
    key: str
    label: str
    limit: float
    """kvd / stock must be at least (throughput) or at most (latency) this."""
    higher: bool

    def met(self, ratio: float) -> bool:
        return ratio >= self.limit if self.higher else ratio <= self.limit


TARGETS = [
    Target("req_s", "request throughput >= 1.0x stock", 1.0, True),
    Target("ttft_p50", "TTFT p50 <= 1.05x stock", 1.05, False),
    Target("ttft_p99", "TTFT p99 <= 1.0x stock", 1.0, False),
    Target("itl_p99", "ITL p99 <= 1.0x stock", 1.0, False),
    Target("e2e_p50", "e2e p50 <= 1.0x stock", 1.0, False),
]


INTERVAL_CONFIDENCE = 0.9
"""The least confidence of the interval printed around the median of the per-run ratios."""


def median_interval(values: list[float]) -> tuple[float, float, float] | None:
    """A distribution-free interval for the median of what ``values`` sample: the k-th smallest
    and k-th largest, with the largest k whose confidence (the chance that the median lies
    between them, from the binomial law) is at least ``INTERVAL_CONFIDENCE``; then that
    confidence. None for fewer than 5 values (4 give at most 87.5%)."""
    n = len(values)
    ordered = sorted(values)
    best: tuple[float, float, float] | None = None
    for k in range(1, n // 2 + 1):
        outside = sum(math.comb(n, i) for i in range(k)) / 2**n
        confidence = 1 - 2 * outside
        if confidence < INTERVAL_CONFIDENCE:
            break
        best = (ordered[k - 1], ordered[n - k], confidence)
    return best


def connector_figures(connector: str, measured: dict[str, Any]) -> dict[str, Any]:
    """``connector``'s decode server's figures in one run."""
    result = measured["result"]
    figures: dict[str, Any] = {}
    for key, _, source, _ in FIGURES:
        if source:
            figures[key] = float(result.get(source, 0.0))
    ttfts = [t for t in result.get("ttfts", []) if t]
    figures["ttft_max"] = max(ttfts, default=0.0) * 1000
    figures["failed"] = int(result.get("failed", 0))
    figures["completed"] = int(result.get("completed", 0))
    legs = measured.get("legs", [])
    figures["decode_first_byte_max_ms"] = 1000 * max(
        (leg["decode_first_byte_s"] or 0.0 for leg in legs), default=0.0
    )
    figures["prefill_leg_max_ms"] = 1000 * max((leg["prefill_s"] for leg in legs), default=0.0)
    figures["worst_stall_s"] = max(measured.get("stalls", {}).values(), default=0.0)
    figures["quiet_wait_s"] = float(measured.get("quiet_wait_s", 0.0))
    figures["other_busy"] = bool(measured.get("other_busy", False))
    figures["kvd_cpu_s"] = measured.get("kvd_cpu_s", 0.0)
    threads = measured.get("threads_cpu_s", {})
    figures["prefill_cpu_s"] = sum(threads.get("prefill", {}).values())
    figures["decode_cpu_s"] = sum(threads.get(connector, {}).values())
    before, after = measured.get("connector_before", {}), measured.get("connector_after", {})
    if after:
        requests = after.get("requests", 0) - before.get("requests", 0)
        recent = _latest(after, "ready_latency", requests)
        figures["kvd_requests"] = requests
        # Handed off at a step's end: released a step after stock's inline merge would.
        figures["late_requests"] = requests - (after.get("early", 0) - before.get("early", 0))
        figures["ready_p50_ms"] = ms(recent, 0.5) if recent else math.nan
        figures["ready_max_ms"] = ms(recent, 1.0) if recent else math.nan
        answered = _latest(after, "answer_latency", requests)
        figures["answered_p50_ms"] = ms(answered, 0.5) if answered else math.nan
        handoff_before = before.get("handoff", {}).get("sum_s", 0.0)
        figures["handoff_sum_ms"] = 1000 * (
            after.get("handoff", {}).get("sum_s", 0.0) - handoff_before
        )
        figures["handoff_max_ms"] = 1000 * after.get("handoff", {}).get("max_s", 0.0)
    return figures


def _latest(stats: dict[str, Any], figure: str, requests: int) -> list[float]:
    """The connector stats' last ``requests`` samples of ``figure`` (this run's)."""
    values: list[float] = stats.get(figure, {}).get("recent_s", [])
    return values[-requests:] if requests else []


def run_report(measured: dict[str, dict[str, Any]], order: tuple[str, ...]) -> dict[str, Any]:
    return {
        "order": list(order),
        **{c: connector_figures(c, measured[c]) for c in CONNECTORS},
        # Each server's threads' CPU seconds during each decode's turn: which resource limited it.
        "threads_cpu_s": {c: measured[c].get("threads_cpu_s", {}) for c in CONNECTORS},
    }


def _ratio(kvd: float, stock: float) -> float:
    return kvd / stock if stock else float("inf")


def _shown(ratio: float, limit: float | None) -> str:
    """``ratio`` to two places, or three where two would read as the limit it misses or meets
    only beyond them (1.003x, a miss of 1.0x, would read 1.00x)."""
    if limit is not None and ratio != limit and f"{ratio:.2f}" == f"{limit:.2f}":
        return f"{ratio:.3f}x"
    return f"{ratio:.2f}x"


def repeated_report(
    runs: list[dict[str, Any]],
    checks: dict[str, Any],
    placement: dict[str, str],
    *,
    stale_reads: bool,
    released: bool,
) -> dict[str, Any]:
    """Medians over the runs, the median of each figure's per-run ratios kvd/stock (each run
    pairs the two servers, minutes apart at most, so a machine that drifts between runs moves
    both), and each target judged on those (with the runs that met it and the median's
    interval)."""
    medians = {
        c: {k: statistics.median(r[c][k] for r in runs) for k in runs[0][c]} for c in CONNECTORS
    }
    per_run = {key: [_ratio(r["kvd"][key], r["stock"][key]) for r in runs] for key, *_ in FIGURES}
    ratios = {key: statistics.median(values) for key, values in per_run.items()}
    verdicts = []
    for target in TARGETS:
        ratio = ratios[target.key]
        interval = median_interval(per_run[target.key])
        verdicts.append(
            {
                "target": target.label,
                "limit": target.limit,
                "ratio": ratio,
                "met": target.met(ratio),
                "runs_met": sum(target.met(r) for r in per_run[target.key]),
                # Where the median of the per-run ratios lies, from these runs: whether a miss
                # (or a meeting) is kvd's or the machine's noise.
                "interval": interval,
                "decided": interval is not None
                and target.met(interval[0]) == target.met(interval[1]),
            }
        )
    return {
        "runs": runs,
        "medians": medians,
        "ratios": ratios,
        "targets": verdicts,
        "checks": checks,
        "placement": placement,
        "stale_reads": stale_reads,
        "released_at_shutdown": released,
    }


def _cell(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def table(report: dict[str, Any], args: argparse.Namespace) -> list[str]:
    medians = report["medians"]
    runs = report["runs"]
    title = f"medians of {len(runs)} runs" if len(runs) > 1 else "one run"
    lines = [
        f"kvd bench serve: {title}; {args.num_prompts} requests ({args.prompts} prompts) of "
        f"{args.input_len} -> {args.output_len} tokens at concurrency {args.concurrency}, "
        f"prefill block {args.prefill_block} -> decode block {args.decode_block}",
        "",
    ]
    rows = [["", "stock", "kvd", "kvd/stock", *(f"run {i + 1}" for i in range(len(runs)))]]
    for key, label, _, _ in FIGURES:
        stock, kvd = medians["stock"][key], medians["kvd"][key]
        per_run = [f"{_ratio(r['kvd'][key], r['stock'][key]):.2f}x" for r in runs]
        ratio = report["ratios"][key]
        rows.append([label, _cell(stock), _cell(kvd), f"{ratio:.2f}x", *per_run])
    for key, label in (
        ("decode_first_byte_max_ms", "decode leg, longest to 1st byte ms"),
        ("kvd_cpu_s", "kvd's CPU time s"),
        ("prefill_cpu_s", "prefill server's CPU time s"),
        ("decode_cpu_s", "decode server's CPU time s"),
    ):
        rows.append([label, _cell(medians["stock"][key]), _cell(medians["kvd"][key]), ""])
    for key, label in (
        ("ready_p50_ms", "kvd ReadDone->Ready p50 ms"),
        ("ready_max_ms", "kvd ReadDone->Ready max ms"),
        ("answered_p50_ms", "kvd answer at the link p50 ms"),
        ("late_requests", "handed off at step's end, requests"),
        ("handoff_sum_ms", "hand-offs, engine thread, sum ms"),
        ("handoff_max_ms", "hand-off, engine thread, max ms"),
    ):
        if key in medians["kvd"]:
            rows.append([label, "", _cell(medians["kvd"][key]), ""])
    width = len(rows[0])
    lines += format_table([r + [""] * (width - len(r)) for r in rows], right=range(1, width))
    if len(runs) > 1:
        lines.append("stock, kvd: medians of the runs; kvd/stock: the median of the runs' ratios")
    lines.append("")
    for verdict in report["targets"]:
        mark = "met" if verdict["met"] else "MISSED"
        interval = verdict.get("interval")
        noise = ""
        if interval is not None:
            low, high, confidence = interval
            noise = f"; {confidence:.0%} interval {low:.2f}x-{high:.2f}x: " + (
                "beyond the runs' noise" if verdict["decided"] else "within the runs' noise"
            )
        shown = _shown(verdict["ratio"], verdict.get("limit"))
        lines.append(
            f"  {mark:6} {verdict['target']}: {shown} "
            f"({verdict['runs_met']} of {len(runs)} runs{noise})"
        )
    failed = {c: sum(r[c]["failed"] for r in runs) for c in CONNECTORS}
    if any(failed.values()):
        lines.append(f"  failed requests: stock {failed['stock']}, kvd {failed['kvd']}")
    for connector, check in report["checks"].items():
        lines.append(
            f"  greedy text equal to a single instance's, {connector}: "
            f"{check['equal']} of {check['of']}"
        )
    worst = max(max(r[c]["worst_stall_s"] for c in CONNECTORS) for r in runs)
    if worst > SUSPECT_S:
        lines.append(
            f"  WARNING: the machine kept a ready thread off its core for {worst:.1f}s during a "
            "timed run: those figures measure the machine"
        )
    quiet = max(r[c].get("quiet_wait_s", 0.0) for r in runs for c in CONNECTORS)
    if any(r[c].get("other_busy") for r in runs for c in CONNECTORS):
        lines.append(
            "  WARNING: before a turn the other decode server still used its core after "
            f"{quiet:.0f}s: that turn shared the core"
        )
    elif quiet:
        lines.append(
            f"  before each turn the other decode server went quiet (waited up to {quiet:.1f}s)"
        )
    if report["stale_reads"]:
        lines.append("  WARNING: the prefill logged reads of blocks past their lease")
    lines.append(
        "  the kvd decode server's SIGTERM "
        + ("released its kvd cache at once" if report["released_at_shutdown"] else
           "left its cache attached to kvd (released when the engine lease ends)")
    )  # fmt: skip
    lines.append(
        "  where each ran: " + "; ".join(f"{n}: {p}" for n, p in report["placement"].items())
    )
    return lines
