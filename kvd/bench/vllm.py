"""``kvd bench vllm``: a real vLLM prefill/decode pair on CPU, with and without kvd, same run.

Starts ``kvd serve``, one prefill instance (vLLM's NIXL connector) and, in turn, two decode
instances of the same block size: vLLM's own connector, post-processing inline (on CPU it is
wrong: the figures are its cost, not its result), and ``KvdConnector``, both timed the same way
by ``kvd.bench.vllm_connectors``. Each runs the same requests one at a time, under load, or
both (``HELP`` says what each figure is); ``kvd.bench.vllm_report`` turns what they recorded
into the figures, the targets and the table.

The process harness here (``Engine``, ``Prefill``) is also what tests/vllm uses.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvd.bench.cores import spawning_on
from kvd.bench.stalls import StallWatch
from kvd.bench.vllm_engine import MAX_MODEL_LEN, STARTUP_S, make_model, prompts
from kvd.bench.vllm_report import mode_report, mode_table, repeated_report, repeated_table
from kvd.cpus import CpuListError
from kvd.daemon_process import DaemonProcess
from kvd.progress import progress_bar
from kvd.vllm.link import IO_CPUS_DEFAULT, parse_io_cpus

KVD_CORE = 0
"""Three processes share two cores here. kvd gets core 0. vLLM's NIXL worker binds the engine
thread of every instance, the prefill's too, to the last core of its NUMA node (core 1 here):
the prefill idles there while a decode instance runs (its requests are prefilled first)."""
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
def pinned_daemon(core: int, timeout: float = 30.0) -> Iterator[DaemonProcess]:
    """``kvd serve`` on ``core``: it inherits this process's affinity while it starts; it must
    answer within ``timeout`` seconds."""
    daemon = DaemonProcess()
    with spawning_on(frozenset({core} & _ALL_CORES or _ALL_CORES)):
        daemon.start(timeout)
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
        # A TP instance has a worker per rank, each bound to one core ("0|1"): its rank 0 on
        # ``core``, the others on the cores after it.
        tp = int(config.get("tensor_parallel_size", 1))
        cores = sorted(_ALL_CORES)
        first = cores.index(core) if core in cores else 0
        bind = "|".join(str(cores[(first + i) % len(cores)]) for i in range(tp))
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": bind,
            # Idle OpenMP threads sleep instead of spinning on the core kvd shares.
            "OMP_WAIT_POLICY": "PASSIVE",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            # A forward that compiles a kernel on a busy machine may take minutes.
            "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(STARTUP_S),
            # vLLM torch.compiles its logprob ranking at the first batch that asks for logprobs:
            # minutes of a decode's step on a busy 2-core machine, while the prefill's lease
            # runs. Eager, it is the same arithmetic (the model itself runs eager here anyway).
            "TORCHDYNAMO_DISABLE": "1",
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
        self,
        work: Path,
        model: Path,
        connector: str,
        module: str | None,
        block_size: int,
        **engine: Any,
    ) -> None:
        """``engine`` adds to the engine config (dtype, kv_cache_dtype, attention_backend)."""
        self.endpoint = f"ipc://{work}/prefill-{next(_ids)}.sock"
        config = {
            "role": "kv_producer",
            "model": str(model),
            "block_size": block_size,
            "connector": connector,
            "module": module,
            "engine_id": f"prefill-{connector.lower()}-{next(_ids)}",
            "endpoint": self.endpoint,
            **engine,
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


HANDSHAKE_TIMED_OUT = "zmq.error.Again"
"""What vLLM's NIXL worker logs when its handshake with the prefill's side channel got no answer:
vLLM waits 5 s for it (hard-coded), which a prefill on a busy 2-core machine can miss. kvd is
not on that path; the requests fall back to recompute. (A handshake vLLM refuses, such as
stock's 64 -> 32, is logged as ``handshake_failed`` too, and is not retried.)"""

HANDSHAKE_TRIES = 3


def run_decode(
    work: Path, model: Path, prefill: Prefill, block_size: int, **config: Any
) -> dict[str, Any]:
    """One decode instance from ``prefill``; ``config`` adds to its engine config (connector,
    module, extra, mode, max_tokens, prompt_lengths, dtype, kv_cache_dtype, attention_backend,
    also_prefill: more prefill endpoints the batch mode reads the same requests from). A run whose
    vLLM handshake with the prefill timed out is run again, with new requests, up to
    ``HANDSHAKE_TRIES`` in all (``result["handshake_retries"]``). ``result["log"]`` is the end of
    the decode's log, ``result["log_file"]`` the whole of it."""
    for attempt in range(HANDSHAKE_TRIES):
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
        result["log_file"] = str(engine.log)
        result["handshake_retries"] = attempt
        if HANDSHAKE_TIMED_OUT not in engine.log.read_text(errors="replace"):
            break
        last = attempt == HANDSHAKE_TRIES - 1
        print(
            f"{engine.name}: vLLM's NIXL handshake with the prefill timed out ({engine.log}); "
            + ("keeping the result" if last else "running the decode again"),
            file=sys.stderr,
        )
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--mode",
        choices=("sequential", "load", "both"),
        default="both",
        help="sequential: requests one at a time; load: transfers land while other requests "
        "decode; both (default), in the same decode instances",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="times to run the two decode instances, swapping which goes first each run (1); "
        "with more, a table of each run's main figures and their medians, and the targets "
        "judged on the medians",
    )
    parser.add_argument(
        "--prefill-block-size", type=int, default=32, help="tokens per prefill block (32)"
    )
    parser.add_argument(
        "--decode-block-size", type=int, default=128, help="tokens per decode block (128)"
    )
    parser.add_argument(
        "--requests", type=int, default=12, help="sequential: requests, one at a time (12)"
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=300,
        help="prompt length of the sequential and the running requests (300)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=16, help="sequential: tokens each decodes (16)"
    )
    parser.add_argument(
        "--running", type=int, default=8, help="load: requests decoding from the start (8)"
    )
    parser.add_argument(
        "--running-tokens",
        type=int,
        default=256,
        help="load: tokens each running one decodes (256: about 250 steps of 8 or more "
        "requests, so a p99 is not the single worst step)",
    )
    parser.add_argument(
        "--arrivals",
        type=int,
        default=32,
        help="load: requests added one at a time while the running ones decode (32)",
    )
    parser.add_argument(
        "--arrival-prompt-tokens",
        type=int,
        default=900,
        help="load: prompt length of the arrivals (900)",
    )
    parser.add_argument(
        "--arrival-tokens", type=int, default=16, help="load: tokens each arrival decodes (16)"
    )
    parser.add_argument(
        "--kvd-io-cpus",
        default=IO_CPUS_DEFAULT,
        help="the kvd connector's kvd_io_cpus: kvd (default: its ZMQ I/O thread on kvd's CPU, "
        "apart from the decode's), engine (on the decode engine's CPU), or a CPU list",
    )


HELP = """\
Starts kvd serve, one vLLM prefill instance and, in turn, two decode instances of the same
block size: stock vLLM (its NIXL connector, post-processing inline; on CPU its block merge is
wrong, so its figures are its cost, not its result) and KvdConnector. Each decode instance runs
the same requests, in one or both modes:

  sequential  requests one at a time; request latency is prefill to last token.
  load        --running requests decode --running-tokens each while --arrivals more, of
              --arrival-prompt-tokens, join: all are prefilled first, then the arrivals are
              added to the decode instance one at a time over the first half of the running
              requests' decode, and NIXL pulls their KV while those decode.
              Engine step: one LLMEngine.step() that ran a forward. Inter-token: gaps between a
              running request's tokens. TTFT: from an arrival's add to the decode instance to
              its first token (the NIXL READ, the post-process (inline, or through kvd), the
              step that picks it up, the first forward; not the prefill). Request latency: from
              the add to the last token.

Before anything is timed, each decode instance decodes once at every batch size up to its
max_num_seqs (local prompts): vLLM's CPU matmuls create oneDNN primitives at each batch size
they first meet, 1 to 1.5 ms in that step, which a serving engine has long paid.

Both connectors are timed identically, per engine step, by kvd.bench.vllm_connectors:
get_finished is the whole get_transfer_results vLLM calls each step; inside it, vLLM's NIXL
polling (both share it) and stock's inline post-process; a connector's additions are its
get_finished less the polling (kvd: its hand-offs and its drain of kvd's events; stock: the
timing layer alone), in wall time and in the engine thread's CPU time. Every step pays the
timing layer, so the additions of the steps where nothing landed or left are shown apart, and
the CPU per request landed compares stock's inline post-process with kvd's additions in the
other steps. Landed -> released: from vLLM's polling seeing a READ done to the request going
back to the scheduler.

With --runs N above 1, the decode instances run N times, which goes first swapped each run
(stock, kvd, then kvd, stock...); a table shows each run's main figures, stock / kvd, and
their medians, and each target is judged on the medians (kvd's median figure against the
median of the limits the runs derived from stock's), with the runs that met it on their own.
One run's verdict on the latency and inter-token targets is mostly this machine's noise.

Targets (issue 19), judged per mode: kvd's additions <= 0.1x stock's inline post-process and
kvd's get_finished <= 0.5x stock's, both summed over the run; kvd's worst get_finished step no
worse than stock's; request latency p50 <= 1.05x stock's (under load: the arrivals'); under load,
inter-token p99 of the running requests lower with kvd. kvd's tokens must equal the single
instance's (exit 1 if not); stock's are reported. Takes a few minutes and about 6 GB.
"""


TIMED_CONNECTORS = {"stock": "TimedNixlConnector", "kvd": "TimedKvdConnector"}
"""The decode connectors compared, by name (``kvd.bench.vllm_connectors``)."""
CONNECTOR_ORDER = ("stock", "kvd")

SIZES = (
    "runs",
    "prefill_block_size",
    "decode_block_size",
    "requests",
    "prompt_tokens",
    "max_tokens",
    "running",
    "running_tokens",
    "arrivals",
    "arrival_prompt_tokens",
    "arrival_tokens",
)
"""The options that size a run: positive integers, in the report's ``config``."""


def check_arguments(args: argparse.Namespace) -> str | None:
    """Why ``args`` cannot run, naming the option; None when they can."""
    try:
        parse_io_cpus(args.kvd_io_cpus, "--kvd-io-cpus")
    except CpuListError as exc:
        return str(exc)
    for name in SIZES:
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')}: {getattr(args, name)} is not a positive integer"
    if args.decode_block_size % args.prefill_block_size:
        return (
            f"--decode-block-size: {args.decode_block_size} is not a multiple of "
            f"--prefill-block-size {args.prefill_block_size} (vLLM 0.32 pulls into whole "
            "multiples only)"
        )
    # Prompts are N, N-1, ... tokens long: one token at least each.
    for prompt, count in (
        ("prompt_tokens", "requests"),
        ("prompt_tokens", "running"),
        ("arrival_prompt_tokens", "arrivals"),
    ):
        if getattr(args, prompt) < getattr(args, count):
            return (
                f"--{prompt.replace('_', '-')}: {getattr(args, prompt)} is below "
                f"--{count} {getattr(args, count)}"
            )
    for prompt, tokens in (
        ("prompt_tokens", "max_tokens"),
        ("prompt_tokens", "running_tokens"),
        ("arrival_prompt_tokens", "arrival_tokens"),
    ):
        if getattr(args, prompt) + getattr(args, tokens) > MAX_MODEL_LEN:
            return (
                f"--{prompt.replace('_', '-')} {getattr(args, prompt)} + "
                f"--{tokens.replace('_', '-')} {getattr(args, tokens)} exceeds the model "
                f"length {MAX_MODEL_LEN}"
            )
    return None


def load_requests(args: argparse.Namespace) -> dict[str, Any]:
    """The load run's prompts and lengths, as a decode instance's ``load`` config takes them."""
    return {
        "running": prompts(tuple(args.prompt_tokens - i for i in range(args.running)), seed=1),
        "running_tokens": args.running_tokens,
        "arrivals": prompts(
            tuple(args.arrival_prompt_tokens - i for i in range(args.arrivals)), seed=2
        ),
        "arrival_tokens": args.arrival_tokens,
    }


def run(args: argparse.Namespace) -> int:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        print(
            f"kvd bench vllm: vLLM is not importable ({exc}): pip install -e '.[vllm]'",
            file=sys.stderr,
        )
        return 2
    problem = check_arguments(args)
    if problem is not None:
        print(f"kvd bench vllm: {problem}", file=sys.stderr)
        return 2
    modes = ["sequential", "load"] if args.mode == "both" else [args.mode]
    lengths = [args.prompt_tokens - i for i in range(args.requests)]
    load = load_requests(args)
    quiet = args.json or args.no_progress
    with (
        tempfile.TemporaryDirectory(prefix="kvd-bench-vllm-") as tmp,
        progress_bar(3 + 2 * args.runs, "kvd bench vllm", unit="step", quiet=quiet) as bar,
        StallWatch() as stalls,
    ):
        work = Path(tmp)
        model = make_model(work / "model")
        with pinned_daemon(KVD_CORE) as kvd:
            prefill = Prefill(work, model, "NixlConnector", None, args.prefill_block_size)
            try:
                prefill.wait_ready()
                bar.update()
                baseline = {
                    "sequential": prefill.call(
                        {
                            "op": "baseline",
                            "prompts": prompts(tuple(lengths)),
                            "max_tokens": args.max_tokens,
                        }
                    ),
                    "load": prefill.call(
                        {
                            "op": "baseline",
                            "prompts": [*load["running"], *load["arrivals"]],
                            "max_tokens": max(args.running_tokens, args.arrival_tokens),
                        }
                    ),
                }
                bar.update()
                runs: list[dict[str, dict[str, Any]]] = []
                for i in range(args.runs):
                    pair: dict[str, dict[str, Any]] = {}
                    # Each run after the first swaps which connector goes first: a machine
                    # that drifts over the minutes then favours neither.
                    for name in CONNECTOR_ORDER if i % 2 == 0 else CONNECTOR_ORDER[::-1]:
                        before = os.getloadavg()[0]
                        stalls.take()
                        result = run_decode(
                            work,
                            model,
                            prefill,
                            args.decode_block_size,
                            connector=TIMED_CONNECTORS[name],
                            module="kvd.bench.vllm_connectors",
                            extra={
                                "kvd_runtime_dir": str(kvd.runtime_dir),
                                "kvd_io_cpus": args.kvd_io_cpus,
                            },
                            modes=modes,
                            timed=True,
                            max_tokens=args.max_tokens,
                            prompt_lengths=lengths,
                            load=load,
                            max_num_seqs=max(8, args.running + args.arrivals),
                        )
                        result["load_average"] = [before, os.getloadavg()[0]]
                        result["worst_stall_s"] = stalls.take()
                        pair[name] = result
                        bar.update()
                    runs.append(pair)
            finally:
                prefill.kill()
        report: dict[str, Any] = {
            "config": {"mode": args.mode, **{name: getattr(args, name) for name in SIZES}},
            "kvd_io_thread": io_thread_note(runs[-1]["kvd"]["log_file"]),
        }
        for mode in modes:
            reports = [
                mode_report(mode, r, equal_to_baseline(mode, r, baseline[mode])) for r in runs
            ]
            report[mode] = reports[0] if args.runs == 1 else repeated_report(reports)
        bar.update()
    print(json.dumps(report, indent=2) if args.json else table(report, modes))
    mismatched = any(
        report[mode]["tokens_equal_to_baseline"]["kvd"] < report[mode]["requests"] for mode in modes
    )
    if mismatched:
        print("kvd bench vllm: kvd decoded other tokens than the single instance", file=sys.stderr)
    return 1 if mismatched else 0


def io_thread_note(log_file: str) -> str:
    """Where the kvd connector's ZMQ I/O thread ran, as its startup line says."""
    found = re.search(r"ZMQ's I/O thread (.+)", Path(log_file).read_text(errors="replace"))
    return found[1].strip() if found else "(the decode's log does not say)"


def equal_to_baseline(
    mode: str, runs: dict[str, dict[str, Any]], baseline: list[dict[str, Any]]
) -> dict[str, list[bool]]:
    """Per connector, per request: its tokens are the single instance's (greedy, so a shorter
    decode is a prefix of a longer one)."""
    equal = {}
    for name, result in runs.items():
        if mode == "load":
            requests = result["load"]["requests"]
            running = sum(r["kind"] == "running" for r in requests.values())
            names = [f"running-{i}" for i in range(running)]
            names += [f"arrival-{i}" for i in range(len(requests) - running)]
            decoded = [requests[n].get("token_ids", []) for n in names]
        else:
            decoded = [d["token_ids"] for d in result["sequential"]["decode"]]
        equal[name] = [
            bool(got) and got == want["token_ids"][: len(got)]
            for got, want in zip(decoded, baseline, strict=True)
        ]
    return equal


def table(report: dict[str, Any], modes: list[str]) -> str:
    config = report["config"]
    titles = {
        "sequential": f"{config['requests']} requests of about {config['prompt_tokens']} "
        f"tokens, one at a time, {config['max_tokens']} tokens each",
        "load": f"{config['running']} requests decoding {config['running_tokens']} tokens "
        f"while {config['arrivals']} of about {config['arrival_prompt_tokens']} tokens arrive "
        f"and decode {config['arrival_tokens']}",
    }
    lines = [
        f"kvd bench vllm: prefill {config['prefill_block_size']} -> decode "
        f"{config['decode_block_size']} tokens per block; kvd on CPU {KVD_CORE}",
        f"kvd's connector: ZMQ's I/O thread {report['kvd_io_thread']}",
    ]
    for mode in modes:
        of_mode = report[mode]
        rows = repeated_table(mode, of_mode) if "runs" in of_mode else mode_table(mode, of_mode)
        lines += ["", f"{mode}: {titles[mode]}", *rows]
    return "\n".join(lines)
