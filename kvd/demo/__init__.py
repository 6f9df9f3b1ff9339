"""``kvd demo``: the whole chain with real NIXL transfers, checked byte for byte, no GPU needed.

The orchestrator (this module) starts a ``kvd serve`` daemon, one prefill process per engine
(``kvd.demo.prefill``: a cache filled with known content, exported with NIXL) and one decode
process (``kvd.demo.decode``: NIXL READs over UCX on loopback, kvd's events, checks). The
processes talk JSON lines on their stdout; each child's stderr goes to a log file in the demo's
temporary directory, shown when something fails.
"""

from __future__ import annotations

import argparse
import json
import queue
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

from kvd.demo.cases import CASES, ENGINES, largest_group
from kvd.progress import progress_bar
from kvd.tables import format_table, quantile

CHILD_START_TIMEOUT_S = 60.0
TRANSPORT = "UCX"  # the NIXL backend both sides use (kvd.nixl.agent.DEFAULT_BACKEND)


class DemoError(RuntimeError):
    """A demo process failed or stopped answering; the message carries its log's tail."""


class _Child:
    """A demo subprocess that prints JSON lines; its stderr goes to ``log_path``."""

    def __init__(self, name: str, module: str, spec: dict[str, Any], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True).start()

    def _pump(self, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)

    def message(self, timeout: float) -> dict[str, Any]:
        """The next JSON line; ``DemoError`` if the process exits or is silent for ``timeout``."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise DemoError(
                f"{self.name}: no answer within {timeout}s\n{self.log_tail()}"
            ) from None
        if line is None:
            code = self.proc.wait()
            raise DemoError(f"{self.name}: exited with {code}\n{self.log_tail()}")
        result: dict[str, Any] = json.loads(line)
        return result

    def finish(self, stdin_text: str = "") -> None:
        """Write ``stdin_text`` and close stdin (the children's signal to stop)."""
        if self.proc.stdin is None or self.proc.stdin.closed:
            return
        try:
            self.proc.stdin.write(stdin_text)
            self.proc.stdin.close()
        except BrokenPipeError:
            pass

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return "(no log)"
        return "\n".join(f"  | {line}" for line in text)


def run(args: argparse.Namespace) -> int:
    from kvd.daemon_process import DaemonError, DaemonProcess

    if not 1 <= args.max_blocks <= args.num_blocks // args.concurrency:
        print(
            f"kvd demo: --max-blocks must be in [1, --num-blocks / --concurrency "
            f"= {args.num_blocks // args.concurrency}]",
            file=sys.stderr,
        )
        return 2
    if args.num_blocks // args.concurrency < (group := largest_group(CASES, ENGINES)):
        print(
            f"kvd demo: --num-blocks / --concurrency must be at least {group}: one prefill "
            f"block lands across {group} decode blocks",
            file=sys.stderr,
        )
        return 2
    engines_used = sorted({e for case in CASES for e in case.engines})
    with tempfile.TemporaryDirectory(prefix="kvd-demo-") as tmp:
        workdir = Path(tmp)
        daemon_args = []
        if args.batch_window_us is not None:
            daemon_args += ["--batch-window-us", str(args.batch_window_us)]
        daemon = DaemonProcess(*daemon_args, runtime_dir=workdir / "kvd")
        children: list[_Child] = []
        bar = progress_bar(len(CASES), "kvd demo", unit="case", quiet=args.json or args.no_progress)
        progress = bar.write
        progress(
            f"kvd demo: {len(CASES)} cases x {args.requests} requests, {len(engines_used)} "
            f"prefill engines, NIXL {TRANSPORT} on loopback"
        )
        try:
            daemon.start()
            progress(f"  kvd serve is up (pid {daemon.proc.pid if daemon.proc else '?'})")
            prefills = {}
            for engine_id in engines_used:
                engine = ENGINES[engine_id]
                prefills[engine_id] = child = _Child(
                    engine_id,
                    "kvd.demo.prefill",
                    {
                        "engine_id": engine_id,
                        "block_size": engine.block_size,
                        "layout": engine.layout,
                        "seed": engine.seed,
                        "num_blocks": args.num_blocks,
                        "layers": args.layers,
                        "heads": args.heads,
                        "head_dim": args.head_dim,
                        "endpoint": f"ipc://{workdir / engine_id}.sock",
                    },
                    workdir,
                )
                children.append(child)
            endpoints = {
                e: child.message(CHILD_START_TIMEOUT_S)["ready"]["endpoint"]
                for e, child in prefills.items()
            }
            progress(f"  prefill engines exporting: {', '.join(engines_used)}")
            decode = _Child(
                "decode",
                "kvd.demo.decode",
                {
                    "runtime_dir": str(daemon.runtime_dir),
                    "engines": [
                        {
                            "engine_id": e,
                            "endpoint": endpoints[e],
                            "block_size": ENGINES[e].block_size,
                            "layout": ENGINES[e].layout,
                            "seed": ENGINES[e].seed,
                            "num_blocks": args.num_blocks,
                        }
                        for e in engines_used
                    ],
                    "cases": [
                        {
                            "name": case.name(ENGINES),
                            "engines": list(case.engines),
                            "decode_block_size": case.decode_block_size,
                            "decode_layout": case.decode_layout,
                        }
                        for case in CASES
                    ],
                    "requests": args.requests,
                    "concurrency": args.concurrency,
                    "max_blocks_per_request": args.max_blocks,
                    "num_blocks": args.num_blocks,
                    "layers": args.layers,
                    "heads": args.heads,
                    "head_dim": args.head_dim,
                    "seed": args.seed,
                    "case_timeout_s": args.case_timeout,
                },
                workdir,
            )
            children.append(decode)
            cases = []
            for spec in CASES:
                bar.set_postfix_str(spec.name(ENGINES))
                case = decode.message(CHILD_START_TIMEOUT_S + args.case_timeout)["case"]
                cases.append(case)
                progress(_progress_line(case, len(CASES)))
                bar.update()
            decode.finish()
            notifications = []
            for engine_id, child in prefills.items():
                expected = sum(c["requests_by_engine"].get(engine_id, 0) for c in cases)
                child.finish(f"{expected}\n")
                summary = child.message(CHILD_START_TIMEOUT_S)["summary"]
                summary["expected"] = expected
                notifications.append(summary)
        except (DemoError, DaemonError) as e:
            print(f"kvd demo: {e}", file=sys.stderr)
            return 1
        finally:
            bar.close()
            try:
                for child in children:
                    child.finish()
                for child in children:
                    try:
                        child.proc.wait(10)
                    except subprocess.TimeoutExpired:
                        child.kill()
            finally:
                daemon.close()
    report = _report(cases, notifications, args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_table(report))
    return 0 if report["verified"] else 1


def _progress_line(case: dict[str, Any], total: int) -> str:
    mark = "ok" if case["verified"] else "FAILED"
    line = (
        f"  [{case['index'] + 1}/{total}] {case['name']}: {case['verified_requests']}/"
        f"{case['requests']} requests verified, {case['blocks']} blocks  {mark}"
    )
    for failure in case["failures"][:3]:
        line += f"\n      {failure}"
    return line


def _report(
    cases: list[dict[str, Any]], notifications: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    latencies = sorted(x for c in cases for x in c.pop("latencies_us"))
    kvd_us = sorted(x for c in cases for x in c.pop("kvd_us"))
    notified_ok = all(
        len(n["notified_requests"]) == n["expected"] and not n["bad_notifications"]
        for n in notifications
    )
    nbytes = sum(c["nixl_bytes"] for c in cases)
    seconds = sum(c["nixl_busy_s"] for c in cases)
    return {
        "verified": bool(cases) and all(c["verified"] for c in cases) and notified_ok,
        "transport": TRANSPORT,
        "cases": cases,
        "requests": sum(c["requests"] for c in cases),
        "blocks": sum(c["blocks"] for c in cases),
        "nixl_bytes": nbytes,
        "nixl_gbps": nbytes / seconds / 1e9 if seconds else 0.0,
        "read_done_to_ready_us": {
            "p50": quantile(latencies, 0.50),
            "p99": quantile(latencies, 0.99),
            "samples": len(latencies),
        },
        "kvd_elapsed_us": {"p50": quantile(kvd_us, 0.50), "p99": quantile(kvd_us, 0.99)},
        "prefill_notifications": [
            {
                "engine_id": n["engine_id"],
                "expected": n["expected"],
                "received": len(n["notified_requests"]),
                "bad": n["bad_notifications"],
            }
            for n in notifications
        ],
        "settings": {
            "requests_per_case": args.requests,
            "concurrency": args.concurrency,
            "max_blocks_per_request": args.max_blocks,
            "num_blocks": args.num_blocks,
            "layers": args.layers,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "dtype": "bfloat16",
            "seed": args.seed,
            "batch_window_us": args.batch_window_us,
        },
    }


def _row(name: str, figures: dict[str, Any]) -> list[str]:
    lat = figures["read_done_to_ready_us"]
    return [
        name,
        str(figures["requests"]),
        str(figures["blocks"]),
        "yes" if figures["verified"] else "NO",
        f"{figures['nixl_gbps']:.2f}",
        f"{lat['p50']:.0f}",
        f"{lat['p99']:.0f}",
        f"{figures['kvd_elapsed_us']['p50']:.0f}",
    ]


def _table(report: dict[str, Any]) -> str:
    # The report and each case carry the same figures under the same keys.
    rows = [
        ["case", "requests", "blocks", "verified", "NIXL GB/s", "p50 us", "p99 us", "kvd p50 us"],
        *(_row(c["name"], c) for c in report["cases"]),
        _row("all", report),
    ]
    lines = format_table(rows)
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(len(lines) - 1, "-" * len(lines[0]))
    notes = [
        f"{n['engine_id']}: {n['received']}/{n['expected']} READ notifications"
        for n in report["prefill_notifications"]
    ]
    failures = [
        f"  {c['name']}: {failure}" for c in report["cases"] for failure in c["failures"][:3]
    ]
    verdict = (
        "every block verified byte for byte"
        if report["verified"]
        else "VERIFICATION FAILED" + (" (first failures below)" if failures else "")
    )
    lines += [
        "",
        "latency: ReadDone sent -> Ready received, per request; kvd: its own part of that "
        "(Ready.elapsed_us)",
        f"NIXL {report['transport']} GB/s: bytes read / time with a READ in flight",
        "prefill side: " + "; ".join(notes),
        f"result: {verdict}",
        *failures,
    ]
    return "\n".join(lines)
