"""``kvd bench vllm``'s figures, targets and table, from what the decode instances recorded.

Pure logic: the instances (``kvd.bench.vllm_engine``) record raw times, this module turns them
into figures. Times in the report are milliseconds.

The connector figures (``connector_figures``) come from ``kvd.bench.vllm_connectors``: per
engine step, the whole ``get_transfer_results`` ("get_finished"), vLLM's NIXL polling inside
it and stock's inline post-process inside that. Shared polling = poll - inline; a connector's
additions = whole - poll (kvd's hand-offs and event drain; for stock only the timing layer).
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvd.bench.stalls import verdict as stall_verdict
from kvd.tables import format_table, quantile

CONNECTORS = ("stock", "kvd")


def ms(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (``kvd.tables.quantile``) of ``values`` (seconds) in milliseconds;
    NaN when there are none."""
    return 1000 * quantile(sorted(values), q)


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"p50": ms(values, 0.5), "p99": ms(values, 0.99), "max": ms(values, 1.0)}


def connector_figures(timings: dict[str, Any]) -> dict[str, Any]:
    """Per-step and per-run figures of one connector over one run."""
    whole, poll, inline = timings["whole_s"], timings["poll_s"], timings["inline_s"]
    additions = [w - p for w, p in zip(whole, poll, strict=True)]
    additions_cpu = [
        w - p for w, p in zip(timings["whole_cpu_s"], timings["poll_cpu_s"], strict=True)
    ]
    moved = timings["moved"]
    quiet_cpu = [a for a, m in zip(additions_cpu, moved, strict=True) if not m]
    landed = timings["landed"]
    return {
        "steps": len(whole),
        "get_finished": _spread(whole),
        "get_finished_sum": 1000 * sum(whole),
        "get_finished_cpu": _spread(timings["whole_cpu_s"]),
        "get_finished_cpu_sum": 1000 * sum(timings["whole_cpu_s"]),
        "shared_polling_sum": 1000 * (sum(poll) - sum(inline)),
        "inline_post_process": _spread([s for s in inline if s > 0]),
        "inline_post_process_sum": 1000 * sum(inline),
        "inline_post_process_cpu_sum": 1000 * sum(timings["inline_cpu_s"]),
        "additions": _spread(additions),
        "additions_sum": 1000 * sum(additions),
        "additions_cpu_sum": 1000 * sum(additions_cpu),
        # Steps where nothing landed or left: each pays the timing layer, and kvd's idle check.
        "quiet_steps": len(quiet_cpu),
        "quiet_additions_cpu_sum": 1000 * sum(quiet_cpu),
        # Per request landed: what handing it off and releasing it cost the engine thread
        # (kvd), what post-processing it inline cost (stock).
        "additions_cpu_per_request": 1000 * (sum(additions_cpu) - sum(quiet_cpu)) / landed
        if landed
        else math.nan,
        "inline_post_process_cpu_per_request": 1000 * sum(timings["inline_cpu_s"]) / landed
        if landed
        else math.nan,
        "landed_to_released": _spread(timings["landed_to_released_s"]),
        "failed": timings["failed"],
    }


def sequential_figures(run: dict[str, Any]) -> dict[str, Any]:
    latency = run["request_latency_s"]
    return {
        "request_latency": {"p50": ms(latency, 0.5), "mean": 1000 * statistics.fmean(latency)},
    }


def load_figures(run: dict[str, Any]) -> dict[str, Any]:
    """Engine steps that ran a forward, inter-token gaps of the running requests, and of the
    arrivals TTFT (from its add to the decode instance to its first token) and request latency
    (from its add to its last token; the running requests' too)."""
    requests = run["requests"].values()
    running = [r for r in requests if r["kind"] == "running"]
    arrivals = [r for r in requests if r["kind"] == "arrival"]
    forward = run["step_produced"]
    steps = [s for s, produced in zip(run["step_s"], forward, strict=True) if produced]
    steps_cpu = [s for s, produced in zip(run["step_cpu_s"], forward, strict=True) if produced]
    gaps = [b - a for r in running for a, b in itertools.pairwise(r["token_at"])]
    running_done = max((r["token_at"][-1] for r in running if r["token_at"]), default=0.0)

    def latency(of: list[dict[str, Any]]) -> float:
        return ms([r["token_at"][-1] - r["added_at"] for r in of if r["token_at"]], 0.5)

    return {
        "engine_step": _spread(steps),
        "engine_step_cpu": _spread(steps_cpu),
        "running_inter_token": _spread(gaps),
        "ttft": _spread([r["token_at"][0] - r["added_at"] for r in arrivals if r["token_at"]]),
        "request_latency": {"arrivals_p50": latency(arrivals), "running_p50": latency(running)},
        "arrivals_while_running": sum(
            bool(r["token_at"]) and r["token_at"][0] < running_done for r in arrivals
        ),
        "arrivals": len(arrivals),
    }


@dataclass(frozen=True)
class Target:
    """One of issue 19's targets: ``kvd`` against ``limit`` (derived from stock's figure)."""

    name: str
    kvd: float
    stock: float
    limit: float
    strict: bool = False  # kvd must be below the limit, not at it

    @property
    def met(self) -> bool:
        return self.kvd < self.limit if self.strict else self.kvd <= self.limit


def targets(stock: dict[str, Any], kvd: dict[str, Any]) -> list[Target]:
    """The targets a run's figures can show (the inter-token one only under load)."""
    s, k = stock["connector"], kvd["connector"]
    found = [
        Target(
            "kvd's additions <= 0.1x stock's inline post-process (ms, summed over the run)",
            k["additions_sum"],
            s["inline_post_process_sum"],
            0.1 * s["inline_post_process_sum"],
        ),
        Target(
            "kvd's get_finished <= 0.5x stock's (ms, summed over the run)",
            k["get_finished_sum"],
            s["get_finished_sum"],
            0.5 * s["get_finished_sum"],
        ),
        Target(
            "kvd's worst get_finished step <= stock's (ms)",
            k["get_finished"]["max"],
            s["get_finished"]["max"],
            s["get_finished"]["max"],
        ),
    ]
    latency = "arrivals_p50" if "arrivals_p50" in stock["request_latency"] else "p50"
    found.append(
        Target(
            f"request latency {latency.replace('_', ' ')} <= 1.05x stock's (ms)",
            kvd["request_latency"][latency],
            stock["request_latency"][latency],
            1.05 * stock["request_latency"][latency],
        )
    )
    if "running_inter_token" in stock:
        found.append(
            Target(
                "inter-token p99 of running requests < stock's (ms)",
                kvd["running_inter_token"]["p99"],
                stock["running_inter_token"]["p99"],
                stock["running_inter_token"]["p99"],
                strict=True,
            )
        )
    return found


def mode_report(
    mode: str, runs: dict[str, dict[str, Any]], equal_to_baseline: dict[str, list[bool]]
) -> dict[str, Any]:
    """One mode's figures for both connectors, its targets, and which requests decoded the
    baseline's tokens."""
    figures = {}
    for name in CONNECTORS:
        run = runs[name]
        of_mode = load_figures(run[mode]) if mode == "load" else sequential_figures(run[mode])
        figures[name] = {
            **of_mode,
            "connector": connector_figures(run[mode + "_connector"]),
            "load_average": run.get("load_average"),
            "worst_stall_s": run.get("worst_stall_s"),
        }
    return {
        "figures": figures,
        "targets": [{**asdict(t), "met": t.met} for t in targets(figures["stock"], figures["kvd"])],
        "tokens_equal_to_baseline": {name: sum(same) for name, same in equal_to_baseline.items()},
        "requests": len(equal_to_baseline["kvd"]),
    }


def _cell(value: float, digits: int = 2) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def _ratio(kvd: float, stock: float) -> str:
    if math.isnan(kvd) or math.isnan(stock) or stock == 0:
        return ""
    return f"{kvd / stock:.2f}x"


def _row(
    label: str, stock: float, kvd: float, digits: int = 2, ratio: bool = True
) -> tuple[str, str, str, str]:
    return (label, _cell(stock, digits), _cell(kvd, digits), _ratio(kvd, stock) if ratio else "")


def mode_table(mode: str, report: dict[str, Any]) -> list[str]:
    s, k = report["figures"]["stock"], report["figures"]["kvd"]
    sc, kc = s["connector"], k["connector"]
    rows: list[tuple[str, str, str, str]] = [("figure (ms)", "stock vLLM", "with kvd", "kvd/stock")]
    if mode == "load":
        rows += [
            _row("engine step p50 (steps with a forward)", *_pair(s, k, "engine_step", "p50")),
            _row("engine step p99", *_pair(s, k, "engine_step", "p99")),
            _row(
                "  its CPU time p50 (the engine's process)", *_pair(s, k, "engine_step_cpu", "p50")
            ),
            _row("  its CPU time p99", *_pair(s, k, "engine_step_cpu", "p99")),
            _row("inter-token p99, running requests", *_pair(s, k, "running_inter_token", "p99")),
            _row("TTFT p50, arrivals", *_pair(s, k, "ttft", "p50")),
            _row("TTFT p99, arrivals", *_pair(s, k, "ttft", "p99")),
            _row("request latency p50, arrivals", *_pair(s, k, "request_latency", "arrivals_p50")),
            _row("request latency p50, running", *_pair(s, k, "request_latency", "running_p50")),
        ]
    else:
        rows += [
            _row("request latency p50", *_pair(s, k, "request_latency", "p50")),
            _row("request latency mean", *_pair(s, k, "request_latency", "mean")),
        ]
    rows += [
        _row("get_finished per step p50", *_pair(sc, kc, "get_finished", "p50"), 3),
        _row("get_finished per step p99", *_pair(sc, kc, "get_finished", "p99"), 3),
        _row("get_finished worst step", *_pair(sc, kc, "get_finished", "max"), 3),
        _row("get_finished CPU time, worst step", *_pair(sc, kc, "get_finished_cpu", "max"), 3),
        _row("get_finished, summed over the run", sc["get_finished_sum"], kc["get_finished_sum"]),
        _row("  its CPU time, summed", sc["get_finished_cpu_sum"], kc["get_finished_cpu_sum"]),
        _row("  NIXL polling (both), summed", sc["shared_polling_sum"], kc["shared_polling_sum"]),
        _row(
            "  inline post-process, summed",
            sc["inline_post_process_sum"],
            kc["inline_post_process_sum"],
        ),
        _row("  additions (hand-off, events), summed", sc["additions_sum"], kc["additions_sum"]),
        # Without the time the engine thread spent preempted, which wall time counts.
        _row(
            "  inline post-process CPU time, summed",
            sc["inline_post_process_cpu_sum"],
            kc["inline_post_process_cpu_sum"],
        ),
        _row("  additions CPU time, summed", sc["additions_cpu_sum"], kc["additions_cpu_sum"]),
        _row(
            "    in steps where nothing landed or left",
            sc["quiet_additions_cpu_sum"],
            kc["quiet_additions_cpu_sum"],
        ),
        # The per-request form of the 0.1x target, without the steps' timing floor.
        _row(
            "CPU per request: stock's inline / kvd's additions",
            sc["inline_post_process_cpu_per_request"],
            kc["additions_cpu_per_request"],
            3,
        ),
        _row(
            "inline post-process per step p50",
            *_pair(sc, kc, "inline_post_process", "p50"),
            3,
        ),
        # Stock releases what lands in the same call: a ratio to its ~0 says nothing.
        _row("landed -> released p50", *_pair(sc, kc, "landed_to_released", "p50"), ratio=False),
        _row("landed -> released p99", *_pair(sc, kc, "landed_to_released", "p99"), ratio=False),
    ]
    steps = (
        f"steps {sc['steps']} / {kc['steps']}, of which nothing landed or left in "
        f"{sc['quiet_steps']} / {kc['quiet_steps']}"
    )
    lines = [*format_table(rows, right=(1, 2, 3)), f"get_finished calls (stock / kvd): {steps}"]
    if mode == "load":
        lines.append(
            f"arrivals whose first token came while the running requests decoded (stock / kvd): "
            f"{s['arrivals_while_running']} / {k['arrivals_while_running']} of {s['arrivals']}"
        )
    if s["load_average"] and k["load_average"]:
        lines.append(
            "1-minute load average before / after each decode instance: stock "
            f"{s['load_average'][0]:.1f} / {s['load_average'][1]:.1f}, kvd "
            f"{k['load_average'][0]:.1f} / {k['load_average'][1]:.1f} ({os.cpu_count()} cores)"
        )
    if s.get("worst_stall_s") and k.get("worst_stall_s"):
        lines.append(
            "longest a ready thread waited for its core, per core (kvd.bench.stalls): stock "
            f"{_cores(s['worst_stall_s'])}, kvd {_cores(k['worst_stall_s'])}"
        )
    lines += _outcome_lines(report, [("", report["figures"])], kc["failed"], "")
    for target in report["targets"]:
        verdict = "met   " if target["met"] else "MISSED"
        lines.append(
            f"{verdict} {target['name']}: kvd {target['kvd']:.3f}, stock {target['stock']:.3f}"
        )
    return lines


def _cores(worst_s: dict[str, float]) -> str:
    by_core = sorted(worst_s.items(), key=lambda item: int(item[0]))  # "10" after "9"
    return " / ".join(f"{late:.3f} s" for _, late in by_core)


def _pair(stock: dict[str, Any], kvd: dict[str, Any], key: str, q: str) -> tuple[float, float]:
    return stock[key][q], kvd[key][q]


# -- several runs ---------------------------------------------------------------------------------

RUN_FIGURES: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "load": (
        ("engine step p50", ("engine_step", "p50")),
        ("engine step p99", ("engine_step", "p99")),
        ("inter-token p99, running requests", ("running_inter_token", "p99")),
        ("TTFT p50, arrivals", ("ttft", "p50")),
        ("request latency p50, arrivals", ("request_latency", "arrivals_p50")),
    ),
    "sequential": (("request latency p50", ("request_latency", "p50")),),
}
"""Per mode, the figures a several-run table shows besides the connector's: label, path."""

CONNECTOR_RUN_FIGURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("get_finished, summed", ("get_finished_sum",)),
    ("get_finished, worst step", ("get_finished", "max")),
    ("landed -> released p50", ("landed_to_released", "p50")),
)


def repeated_report(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's reports of several runs, each as ``mode_report`` made it, and the targets
    judged on the runs' medians: kvd's median figure against the median of the limits each run
    derived from stock's, with the runs that met each on its own."""
    medians = []
    for per_run in zip(*(r["targets"] for r in reports), strict=True):
        target = Target(
            per_run[0]["name"],
            statistics.median(t["kvd"] for t in per_run),
            statistics.median(t["stock"] for t in per_run),
            statistics.median(t["limit"] for t in per_run),
            per_run[0]["strict"],
        )
        medians.append(
            {**asdict(target), "met": target.met, "met_in": sum(t["met"] for t in per_run)}
        )
    return {
        "runs": reports,
        "targets": medians,
        "tokens_equal_to_baseline": {
            name: sum(r["tokens_equal_to_baseline"][name] for r in reports) for name in CONNECTORS
        },
        "requests": sum(r["requests"] for r in reports),
    }


def repeated_table(mode: str, report: dict[str, Any]) -> list[str]:
    """Each run's main figures (stock / kvd, ms) with their medians, then the targets."""
    reports = report["runs"]
    header = ("figure (ms), stock / kvd", *(f"run {i}" for i in range(1, len(reports) + 1)))
    rows: list[tuple[str, ...]] = [(*header, "median")]

    def row(label: str, stock: list[float], kvd: list[float]) -> tuple[str, ...]:
        cells = [f"{_cell(s)} / {_cell(k)}" for s, k in zip(stock, kvd, strict=True)]
        median = f"{_cell(_median(stock))} / {_cell(_median(kvd))}"
        return (label, *cells, median)

    def side(name: str, path: tuple[str, ...], connector: bool) -> list[float]:
        values = []
        for r in reports:
            figure: Any = r["figures"][name]
            for key in ("connector", *path) if connector else path:
                figure = figure[key]
            values.append(float(figure))
        return values

    for label, path in RUN_FIGURES[mode]:
        rows.append(row(label, side("stock", path, False), side("kvd", path, False)))
    rows.append(
        row(
            "stock's inline post-process / kvd's additions, summed",
            side("stock", ("inline_post_process_sum",), True),
            side("kvd", ("additions_sum",), True),
        )
    )
    for label, path in CONNECTOR_RUN_FIGURES:
        rows.append(row(label, side("stock", path, True), side("kvd", path, True)))
    lines = format_table(rows, right=tuple(range(1, len(header) + 1)))
    failed = sum(r["figures"]["kvd"]["connector"]["failed"] for r in reports)
    runs = [(f"run {i}, ", r["figures"]) for i, r in enumerate(reports, 1)]
    lines += _outcome_lines(report, runs, failed, ", all runs")
    for target in report["targets"]:
        verdict = "met   " if target["met"] else "MISSED"
        lines.append(
            f"{verdict} {target['name']}: medians kvd {target['kvd']:.3f}, stock "
            f"{target['stock']:.3f}; met in {target['met_in']} of {len(reports)} runs"
        )
    return lines


def _outcome_lines(
    report: dict[str, Any], runs: list[tuple[str, dict[str, Any]]], failed: int, scope: str
) -> list[str]:
    """A warning for each decode instance the machine stalled, then whose tokens were the
    single instance's and how many requests kvd failed; ``runs``: (label, figures) per run,
    ``scope`` what the counts cover."""
    lines = []
    for label, figures in runs:
        for name in CONNECTORS:
            warning = stall_verdict(figures[name].get("worst_stall_s") or {})
            if warning:
                lines.append(f"WARNING ({label}{name}'s decode instance): {warning}")
    equal = report["tokens_equal_to_baseline"]
    lines.append(
        f"requests decoding the single instance's tokens{scope}: kvd {equal['kvd']} of "
        f"{report['requests']}, stock {equal['stock']} of {report['requests']} (stock's CPU "
        "block merge is wrong at 32 -> 64/128)"
    )
    lines.append(f"kvd failed (recomputed){scope}: {failed}")
    return lines


def _median(values: list[float]) -> float:
    known = [v for v in values if not math.isnan(v)]
    return statistics.median(known) if known else math.nan
