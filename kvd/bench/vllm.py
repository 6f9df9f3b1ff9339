"""``kvd bench vllm``: a real vLLM prefill/decode pair on CPU, with and without kvd, same run.

Starts ``kvd serve``, one prefill instance (vLLM's NIXL connector) and, in turn, two decode
instances of the same block size: one with vLLM's own connector, timing the post-process it runs
inline (on CPU it is wrong: the figures are its cost, not its result), and one with
``KvdConnector``. Each decodes the same requests one after the other. Reported: the time the
decode worker spends per engine step on the post-process (stock: inline; kvd: the hand-off
alone), read-done to Ready latency through kvd, and end-to-end request latency (prefill to last
token) with and without kvd, with their ratios.

The process harness here (``Engine``, ``Prefill``) is also what tests/vllm uses.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvd.daemon_process import DaemonProcess
from kvd.progress import progress_bar
from kvd.tables import format_table

STARTUP_S = 600
KVD_CORE = 0
"""Three processes share two cores here: kvd gets core 0 with the prefill, which sleeps while
the decode instance runs (requests go one at a time), the decode instance core 1."""
_ALL_CORES = frozenset(os.sched_getaffinity(0))
_ids = itertools.count()


def ephemeral_ports() -> range:
    """The ports the kernel gives the local end of outgoing connections."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port nothing is bound to now, outside the ephemeral range, never handed out twice.

    vLLM binds it seconds later. A port from the ephemeral range (what binding port 0 gives)
    may by then be the local end of some process's connection: CI saw a prefill instance fail
    with EADDRINUSE on one.
    """
    ephemeral = ephemeral_ports()
    candidates = [p for p in range(10000, 65536) if p not in ephemeral and p not in _handed_out]
    for port in random.sample(candidates, len(candidates)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free TCP port outside the ephemeral range {ephemeral}")


@contextlib.contextmanager
def _pinned_daemon(core: int) -> Iterator[DaemonProcess]:
    """``kvd serve`` on ``core``: it inherits this process's affinity while it starts."""
    daemon = DaemonProcess()
    os.sched_setaffinity(0, {core} & _ALL_CORES or _ALL_CORES)
    try:
        daemon.start()
    finally:
        os.sched_setaffinity(0, _ALL_CORES)
    try:
        yield daemon
    finally:
        daemon.close()


class Engine:
    """One ``kvd.bench.vllm_engine`` process (and vLLM's processes under it)."""

    def __init__(self, work: Path, role: str, config: dict[str, Any], core: int) -> None:
        self.name = f"{role}-{next(_ids)}"
        self.log = work / f"{self.name}.log"
        path = work / f"{self.name}.json"
        path.write_text(json.dumps(config))
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            # Idle OpenMP threads sleep instead of spinning on the core kvd shares.
            "OMP_WAIT_POLICY": "PASSIVE",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        }
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvd.bench.vllm_engine", role, str(path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while "READY" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} did not start:\n{self.tail()}")
            time.sleep(0.5)

    def wait(self, timeout: float = STARTUP_S) -> None:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{self.name} did not finish:\n{self.tail()}") from None
        finally:
            self.kill()  # vLLM's engine and worker processes outlive its main process
        if code != 0:
            raise RuntimeError(f"{self.name} exited with {code}:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class Prefill(Engine):
    """A prefill instance serving ``baseline`` and ``prefill`` requests."""

    def __init__(
        self, work: Path, model: Path, connector: str, module: str | None, block_size: int
    ) -> None:
        self.endpoint = f"ipc://{work}/prefill-{next(_ids)}.sock"
        config = {
            "role": "kv_producer",
            "model": str(model),
            "block_size": block_size,
            "connector": connector,
            "module": module,
            "engine_id": f"prefill-{connector.lower()}-{next(_ids)}",
            "endpoint": self.endpoint,
        }
        super().__init__(work, "prefill", config, core=0)

    def call(self, request: dict[str, Any]) -> Any:
        import msgspec
        import zmq

        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        try:
            sock.send(msgspec.msgpack.encode(request))
            if not sock.poll(STARTUP_S * 1000):
                raise RuntimeError(f"the prefill server did not answer:\n{self.tail()}")
            return msgspec.msgpack.decode(sock.recv())
        finally:
            sock.close()
            ctx.term()


def run_decode(
    work: Path, model: Path, prefill: Prefill, block_size: int, **config: Any
) -> dict[str, Any]:
    """One decode instance from ``prefill``; ``config`` adds to its engine config (connector,
    module, extra, mode, max_tokens, prompt_lengths)."""
    out = work / f"decode-{next(_ids)}.json"
    full = {
        "role": "kv_consumer",
        "model": str(model),
        "block_size": block_size,
        "connector": "KvdConnector",
        "module": "kvd.vllm",
        "engine_id": f"decode-{block_size}-{next(_ids)}",
        "prefill": prefill.endpoint,
        "out": str(out),
        "max_tokens": 16,
        **config,
    }
    engine = Engine(work, "decode", full, core=1)
    engine.wait()
    result: dict[str, Any] = json.loads(out.read_text())
    result["log"] = engine.tail(200)
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--prefill-block-size", type=int, default=32, help="tokens per prefill block (32)"
    )
    parser.add_argument(
        "--decode-block-size", type=int, default=128, help="tokens per decode block (128)"
    )
    parser.add_argument("--requests", type=int, default=12, help="requests per run (12)")
    parser.add_argument(
        "--prompt-tokens", type=int, default=300, help="prompt length of each request (300)"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens decoded (16)")


def run(args: argparse.Namespace) -> int:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        print(
            f"kvd bench vllm: vLLM is not importable ({exc}): pip install -e '.[vllm]'",
            file=sys.stderr,
        )
        return 2
    from kvd.bench.vllm_engine import make_model

    lengths = [args.prompt_tokens - i for i in range(args.requests)]
    quiet = args.json or args.no_progress
    with (
        tempfile.TemporaryDirectory(prefix="kvd-bench-vllm-") as tmp,
        progress_bar(4, "kvd bench vllm", unit="step", quiet=quiet) as bar,
    ):
        work = Path(tmp)
        model = make_model(work / "model")
        with _pinned_daemon(KVD_CORE) as kvd:
            prefill = Prefill(work, model, "NixlConnector", None, args.prefill_block_size)
            try:
                prefill.wait_ready()
                bar.update()
                runs = {}
                for name, connector, module in (
                    ("stock", "TimedNixlConnector", "kvd.bench.vllm_engine"),
                    ("kvd", "KvdConnector", "kvd.vllm"),
                ):
                    stats = work / f"stats-{name}.json"
                    extra = {"kvd_stats_path": str(stats), "kvd_runtime_dir": str(kvd.runtime_dir)}
                    result = run_decode(
                        work,
                        model,
                        prefill,
                        args.decode_block_size,
                        connector=connector,
                        module=module,
                        extra=extra,
                        mode="sequential",
                        max_tokens=args.max_tokens,
                        prompt_lengths=lengths,
                    )
                    result["stats"] = json.loads(stats.read_text())
                    runs[name] = result
                    bar.update()
            finally:
                prefill.kill()
        report = _report(args, runs)
        bar.update()
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _report(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    stock, kvd = runs["stock"], runs["kvd"]
    stock_step = stock["stats"]["post_process_s"]
    kvd_step = kvd["stats"]["handoff_s"]
    e2e = {name: r["request_latency_s"] for name, r in runs.items()}
    same = [
        a["token_ids"] == b["token_ids"]
        for a, b in zip(stock["decode"], kvd["decode"], strict=True)
    ]
    return {
        "prefill_block_size": args.prefill_block_size,
        "decode_block_size": args.decode_block_size,
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "post_process_per_step_ms": {
            "stock_inline": {"p50": _ms(stock_step, 0.5), "p99": _ms(stock_step, 0.99)},
            "kvd_handoff": {"p50": _ms(kvd_step, 0.5), "p99": _ms(kvd_step, 0.99)},
        },
        "read_done_to_ready_ms": {
            "p50": _ms(kvd["stats"]["ready_latency_s"], 0.5),
            "p99": _ms(kvd["stats"]["ready_latency_s"], 0.99),
        },
        "request_latency_ms": {
            name: {"p50": _ms(v, 0.5), "mean": 1000 * statistics.fmean(v)}
            for name, v in e2e.items()
        },
        "ratios": {
            "handoff_over_inline_p50": _ms(kvd_step, 0.5) / _ms(stock_step, 0.5),
            "request_latency_kvd_over_stock_p50": _ms(e2e["kvd"], 0.5) / _ms(e2e["stock"], 0.5),
        },
        "tokens_equal_to_stock": sum(same),
        "kvd_failed": kvd["stats"]["failed"],
    }


def _table(report: dict[str, Any]) -> str:
    step, e2e = report["post_process_per_step_ms"], report["request_latency_ms"]
    ready, ratios = report["read_done_to_ready_ms"], report["ratios"]
    rows = [
        ("figure", "stock vLLM", "with kvd", "kvd/stock"),
        (
            "post-process per step p50 (ms)",
            f"{step['stock_inline']['p50']:.3f}",
            f"{step['kvd_handoff']['p50']:.3f}",
            f"{ratios['handoff_over_inline_p50']:.2f}x",
        ),
        (
            "post-process per step p99 (ms)",
            f"{step['stock_inline']['p99']:.3f}",
            f"{step['kvd_handoff']['p99']:.3f}",
            "",
        ),
        ("read-done -> Ready p50 / p99 (ms)", "-", f"{ready['p50']:.2f} / {ready['p99']:.2f}", ""),
        (
            "request latency p50 (ms)",
            f"{e2e['stock']['p50']:.1f}",
            f"{e2e['kvd']['p50']:.1f}",
            f"{ratios['request_latency_kvd_over_stock_p50']:.2f}x",
        ),
    ]
    lines = [
        f"kvd bench vllm: prefill {report['prefill_block_size']} -> decode "
        f"{report['decode_block_size']} tokens per block, {report['requests']} requests of "
        f"about {report['prompt_tokens']} tokens, one at a time",
        "",
        *format_table(rows, right=(1, 2, 3)),
        "",
        "stock: vLLM's own inline post-process (wrong on CPU: timed, not trusted); kvd: the "
        "hand-off to kvd alone",
        f"requests whose tokens equal stock vLLM's: {report['tokens_equal_to_stock']} of "
        f"{report['requests']} (stock decodes wrong tokens on CPU)",
    ]
    return "\n".join(lines)
