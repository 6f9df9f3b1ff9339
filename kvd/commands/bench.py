"""``kvd bench ...``: each benchmark's flags; the benchmarks themselves are in ``kvd.bench``."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from kvd.commands import argument, deferred, positive, subcommand
from kvd.daemon.config import parse_batch_window
from kvd.progress import add_progress_flag


def add(commands: Any) -> None:
    bench = subcommand(
        commands,
        "bench",
        help="measure kvd against a baseline in the same run",
        description="Benchmarks print ratios against a baseline measured in the same run.",
    )
    which = bench.add_subparsers(title="benchmarks", metavar="BENCH")
    pipeline = subcommand(
        which,
        "pipeline",
        help="notification throughput and ReadDone->Ready latency vs a bare ZMQ relay",
        description=(
            "Starts kvd serve and a bare pyzmq+msgspec relay (PUSH->PULL->PUB->SUB on ipc) and "
            "measures, for each, sustained notifications per second and the latency from "
            "ReadDone sent to Ready received, with transforms that need no work."
        ),
    )
    pipeline.add_argument("--json", action="store_true", help="print one JSON object")
    add_progress_flag(pipeline)
    pipeline.add_argument(
        "--messages",
        type=int,
        default=None,
        help="notifications per throughput run (default: 20000; with --windows 1000 per run)",
    )
    pipeline.add_argument(
        "--latency-samples",
        type=int,
        default=2000,
        help="one-at-a-time round trips per latency run (default: %(default)s)",
    )
    pipeline.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds of kvd and relay (default: %(default)s)",
    )
    pipeline.add_argument(
        "--blocks", type=int, default=16, help="block ids per notification (default: %(default)s)"
    )
    pipeline.add_argument(
        "--groups",
        type=positive,
        default=1,
        metavar="N",
        help=(
            "KV cache groups of a hybrid model (sliding-window + full attention, say): each "
            "ReadDone (protocol v2) splits its --blocks across N groups, the same total per "
            "notification, so the figures compare with N=1's; 1 to --blocks, with --transform "
            "none or layout (default: %(default)s)"
        ),
    )
    pipeline.add_argument(
        "--transform",
        choices=["none", "layout", "merge"],
        default="none",
        help=(
            "none: NHD notifications into an NHD cache, the pipeline's own cost (default); "
            "layout: real HND->NHD rewrites on kvd's side (the relays still do none); "
            "merge (with --windows): HND 16-token pages merged into NHD 64-token blocks"
        ),
    )
    pipeline.add_argument(
        "--batch-window-us",
        type=argument(parse_batch_window),
        default=None,
        help="kvd's batch window for the run, microseconds or 'auto' (default: kvd's default)",
    )
    pipeline.add_argument(
        "--daemon-cpus",
        type=_daemon_cpus,
        default="auto",
        metavar="CPUS",
        help=(
            "the CPUs of the daemon under test, kvd and each relay in turn, as kvd is meant to "
            "run on a core of its own: a list such as 1 or 2-3 (this bench runs on the others), "
            "'auto' for the last CPU this process may use when it may use two or more, 'none' "
            "to leave every process to the scheduler (default: %(default)s). On a core of its "
            "own kvd runs with dedicated_cpus = true unless KVD_DEDICATED_CPUS says otherwise"
        ),
    )
    pipeline.add_argument(
        "--soak",
        type=int,
        default=0,
        metavar="N",
        help=(
            "instead: send N notifications (e.g. 1000000) through one kvd and print its RSS "
            "after the warm-up and at the end; fails when it grew by more than 16 MiB"
        ),
    )
    pipeline.add_argument(
        "--soak-warmup",
        type=int,
        default=200_000,
        metavar="N",
        help="notifications of the soak sent before its first RSS reading (default: %(default)s)",
    )
    windows = pipeline.add_argument_group(
        "windows",
        "With --windows, compare batch windows instead: one kvd, the window changed live "
        "between runs, every load and window in each round; auto against the best fixed window.",
    )
    windows.add_argument(
        "--windows",
        metavar="LIST",
        help="windows to compare, microseconds or 'auto', e.g. 0,25,50,100,200,400,auto",
    )
    windows.add_argument(
        "--concurrency",
        metavar="LIST",
        help="closed-loop loads: notifications in flight (default: 1,4,16)",
    )
    windows.add_argument(
        "--rates", metavar="LIST", help="open-loop loads instead: notifications per second"
    )
    pipeline.set_defaults(run=_bench_pipeline)
    kernels = subcommand(
        which,
        "kernels",
        help="the post-process vs a plain copy and the vLLM-style chain",
        description=(
            "Times the post-process over layout pairs, ratios and dtypes against a plain copy of "
            "the same bytes and against vLLM's index_select -> permute -> index_copy_ chain, "
            "interleaved in the same run; prints GB/s and the medians of the per-repetition "
            "ratios."
        ),
    )
    kernels.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: %(default)s)")
    kernels.add_argument("--json", action="store_true", help="print one JSON object")
    kernels.add_argument(
        "--backend",
        choices=["auto", "kernel", "torch"],
        default="auto",
        help="kernel: the compiled/Triton kernel; torch: the plain-torch fallback",
    )
    kernels.add_argument("--layers", type=int, default=2, help="layers (K and V each; default 2)")
    kernels.add_argument("--num-blocks", type=int, default=512, help="blocks per tensor")
    kernels.add_argument("--blocks", type=int, default=256, help="listed blocks (random ids)")
    kernels.add_argument("--block-size", type=int, default=64, help="tokens per decode block")
    kernels.add_argument("--heads", type=int, default=8, help="KV heads")
    kernels.add_argument("--head-dim", type=int, default=128, help="head dimension")
    kernels.add_argument("--repeat", type=int, default=7, help="interleaved repetitions")
    add_progress_flag(kernels)
    kernels.set_defaults(run=deferred("kvd.bench.kernels"))
    # These two keep their flags and description beside the run (HELP, add_arguments).
    for name, text in (
        (
            "vllm",
            "a real vLLM prefill/decode pair on CPU, stock vLLM and kvd side by side, one "
            "request at a time and under load",
        ),
        (
            "serve",
            "the deployed shape: vllm serve prefill and decode servers behind a P/D proxy, "
            "driven by vllm bench serve, stock vLLM's decode and kvd's side by side",
        ),
    ):
        module = importlib.import_module(f"kvd.bench.{name}")
        command = subcommand(
            which,
            name,
            help=text,
            description=module.HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(command)
        command.set_defaults(run=deferred(module.__name__))
    chaos = subcommand(
        which,
        "chaos",
        help="exactly once under random SIGKILLs, every block verified byte for byte",
        description=(
            "Starts kvd serve and, in this process, an engine that streams requests (HND pages "
            "into an NHD shared-memory cache at ratio 2 or 4, some sent twice on purpose) and "
            "follows the engine contract. Each cycle kvd is SIGKILLed at a random point "
            "(sometimes right after a big request is seen launched, sometimes again while it "
            "starts) and started again on the same runtime directory, until every request has "
            "a final answer. Every Ready request's blocks are checked byte for byte against an "
            "independent statement of the post-process. Exits 1 if a block is corrupt, a request "
            "is never answered, or kvd contradicts an answer it recorded."
        ),
    )
    chaos.add_argument("--cycles", type=int, default=20, help="kill cycles (default: %(default)s)")
    chaos.add_argument(
        "--requests", type=int, default=24, help="requests per cycle (default: %(default)s)"
    )
    chaos.add_argument(
        "--seed", type=int, default=None, help="seed of the plan and the content (default: random)"
    )
    chaos.add_argument("--json", action="store_true", help="print one JSON object")
    add_progress_flag(chaos)
    chaos.set_defaults(run=deferred("kvd.bench.chaos"))
    startup = subcommand(
        which,
        "startup",
        help="time from exec to READY of kvd serve, idle and beside busy processes",
        description=(
            "Starts kvd serve again and again, each on a fresh runtime directory, and times it "
            "from exec to the READY=1 it sends on NOTIFY_SOCKET (what systemd waits for). Each "
            "load runs that many busy-loop processes meanwhile, standing in for busy engines."
        ),
    )
    startup.add_argument(
        "--starts", type=positive, default=5, help="starts per load (default: %(default)s)"
    )
    startup.add_argument(
        "--load",
        type=_counts,
        default=[0, 2],
        metavar="LIST",
        help="busy-loop processes meanwhile, one load per item (default: 0,2)",
    )
    startup.add_argument("--device", default="cpu", help="kvd serve's --device (default: cpu)")
    startup.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds a start may take before the benchmark fails (default: %(default)s)",
    )
    startup.add_argument("--json", action="store_true", help="print one JSON object")
    add_progress_flag(startup)
    startup.set_defaults(run=deferred("kvd.bench.startup"))


def _bench_pipeline(args: argparse.Namespace) -> int:
    if args.windows:
        from kvd.bench.windows import run as compare_windows

        return compare_windows(args)
    from kvd.bench.pipeline import run

    return run(args)


def _daemon_cpus(text: str) -> str:
    from kvd.cpus import CpuListError, parse_cpus

    if text not in ("auto", "none"):
        try:
            parse_cpus(text)
        except CpuListError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _counts(text: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers, got {text!r}"
        ) from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers >= 0, got {text!r}")
    return values
