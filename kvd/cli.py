"""The ``kvd`` command: serve, tail, status, set, detach, demo, bench, tune.

Heavy modules (torch, the daemon) are imported inside each command so ``--help`` stays quick.
Exit codes: 0 success, 1 failure at run time, 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvd import __version__
from kvd.cpus import format_cpus
from kvd.daemon.config import FIELDS, ConfigError, field_help
from kvd.dtypes import ITEMSIZE
from kvd.progress import add_progress_flag
from kvd.tables import format_table


def main(argv: Sequence[str] | None = None) -> int:
    # Before any command imports torch, whose OpenMP runtime reads it once: idle OpenMP workers
    # then sleep instead of spinning. kvd's CPU kernel runs its own threads, and a torch worker
    # still spinning after some earlier op takes the core one of them needs (kvd/copy went from
    # about 1.3x to 1.0x in `kvd bench kernels`); a sidecar should not burn the engine's cores
    # idling either. A value the user set is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # Name the command whose flags were wrong, with its usage, not the top-level one.
        command: argparse.ArgumentParser = getattr(args, "command_parser", parser)
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    if not hasattr(args, "run"):
        getattr(args, "command_parser", parser).print_help()
        return 2
    try:
        code: int = args.run(args)
    except KeyboardInterrupt:
        return 130
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvd",
        description=(
            "kvd post-processes NIXL-received KV-cache blocks next to a decode GPU and "
            "announces when they are ready."
        ),
    )
    parser.add_argument("-V", "--version", action="version", version=f"kvd {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_serve(commands)
    _add_tail(commands)
    _add_status(commands)
    _add_set(commands)
    _add_detach(commands)
    _add_demo(commands)
    _add_bench(commands)
    _add_tune(commands)
    return parser


def _command(commands: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand parser that ``main`` can name in usage errors."""
    command: argparse.ArgumentParser = commands.add_parser(name, **kwargs)
    command.set_defaults(command_parser=command)
    return command


# -- serve --------------------------------------------------------------------------------------


def _add_serve(commands: Any) -> None:
    serve = _command(
        commands,
        "serve",
        help="run the daemon",
        description=(
            "Run the kvd daemon. Settings come from embedded defaults, then --config, then "
            "KVD_<NAME> environment variables (e.g. KVD_BATCH_WINDOW_US=50), then these flags."
        ),
    )
    serve.add_argument("--config", metavar="PATH", help="TOML file with the settings below")
    defaults = msgspec.structs.asdict(_default_config())
    for name, annotated in FIELDS.items():
        base = (
            typing.get_args(annotated)[0]
            if typing.get_origin(annotated) is typing.Annotated
            else annotated
        )
        kwargs: dict[str, Any] = {
            "default": None,
            "help": f"{field_help(name)} (default: {defaults[name]!r})",
        }
        if typing.get_origin(base) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(base))
        else:
            kwargs["metavar"] = name.upper()
        serve.add_argument(f"--{name.replace('_', '-')}", dest=name, **kwargs)
    serve.set_defaults(run=_serve)


def _default_config() -> Any:
    from kvd.daemon.config import Config

    return Config()


def _serve(args: argparse.Namespace) -> int:
    import logging

    from kvd.daemon.config import load_config, warn_unknown_env
    from kvd.daemon.logs import setup_logging
    from kvd.daemon.server import Server

    overrides = {name: getattr(args, name) for name in FIELDS}
    try:
        config = load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"kvd serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_format)
    warn_unknown_env()
    server = Server(config)
    code = server.run()
    if server.work_abandoned:
        # A transform is still running on the executor thread: a normal interpreter exit would
        # tear down torch's thread pools under it (std::terminate). Every request was answered
        # and the sockets are closed, so leave without the teardown.
        logging.shutdown()
        os._exit(code)
    return code


# -- client commands ----------------------------------------------------------------------------


def _add_locator(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument(
        "--runtime-dir",
        default=os.environ.get("KVD_RUNTIME_DIR"),
        help="the daemon's runtime directory (default: $KVD_RUNTIME_DIR, else as kvd serve)",
    )
    cmd.add_argument(
        "--gpu", default=os.environ.get("KVD_GPU", "0"), help="instance name (default: %(default)s)"
    )
    cmd.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for kvd (default: %(default)s)"
    )


def _client(args: argparse.Namespace) -> Any:
    from kvd.client import Client

    return Client(args.runtime_dir, gpu=args.gpu, timeout=args.timeout)


def _run_client(name: str, args: argparse.Namespace, work: Callable[[Any], int]) -> int:
    """Run ``work(client)``; kvd's absence, a timeout or an error reply is one line on stderr
    and exit status 1, never a traceback."""
    from kvd.client import KvdError, KvdTimeout, KvdUnavailable, ReplayError

    if args.timeout <= 0:
        print(f"kvd {name}: --timeout must be above 0 seconds", file=sys.stderr)
        return 2
    client = _client(args)
    try:
        return work(client)
    except (KvdUnavailable, KvdTimeout, KvdError, ReplayError) as exc:
        print(f"kvd {name}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    finally:
        client.close()


def _add_tail(commands: Any) -> None:
    tail = _command(
        commands,
        "tail",
        help="print completion events as JSON lines",
        description=(
            "Subscribe to kvd's events and print one JSON object per line: topic, seq, and the "
            "event's fields. Gaps are filled by replay; lost events are reported on stderr."
        ),
    )
    _add_locator(tail)
    tail.add_argument(
        "--cache",
        action="append",
        default=[],
        metavar="ID",
        help="only this cache's events (repeatable; default: every cache)",
    )
    tail.add_argument(
        "--from-seq",
        type=int,
        metavar="N",
        help="first replay each --cache from seq N (1 = everything still buffered)",
    )
    tail.add_argument("--count", type=int, metavar="N", help="exit after N events")
    tail.set_defaults(run=_tail)


def _tail(args: argparse.Namespace) -> int:
    if args.from_seq is not None and not args.cache:
        print("kvd tail: --from-seq needs at least one --cache", file=sys.stderr)
        return 2
    return _run_client("tail", args, lambda client: _print_events(client, args))


def _print_events(client: Any, args: argparse.Namespace) -> int:
    from kvd.client import EventsLost

    shown = 0
    with client.subscribe(args.cache, from_seq=args.from_seq) as events:
        while args.count is None or shown < args.count:
            try:
                delivery = next(events)
            except EventsLost as exc:
                print(f"kvd tail: {exc}", file=sys.stderr)
                continue
            fields = msgspec.to_builtins(delivery.event)
            line = {"topic": delivery.topic, "seq": delivery.seq, **fields}
            print(json.dumps(line), flush=True)
            shown += 1
    return 0


def _add_status(commands: Any) -> None:
    status = _command(
        commands,
        "status",
        help="show the daemon's status or one request's state",
        description="Ask a running kvd for its status: caches, counters, rejections.",
    )
    _add_locator(status)
    status.add_argument("--json", action="store_true", help="print the reply as JSON")
    status.add_argument("--req", metavar="REQ_ID", help="show one request's state instead")
    status.set_defaults(run=_status)


def _status(args: argparse.Namespace) -> int:
    def show(client: Any) -> int:
        reply = client.request_status(args.req) if args.req else client.status()
        if args.json:
            print(json.dumps(msgspec.to_builtins(reply), indent=2))
        else:
            print(format_status(reply))
        return 0

    return _run_client("status", args, show)


def _add_set(commands: Any) -> None:
    cmd = _command(
        commands,
        "set",
        help="change the batching of a running kvd, without a restart",
        description=(
            "Change a setting of the running kvd at once: batch-window-us (microseconds, "
            "0..1000000, or 'auto') or max-batch-blocks. Batches already waiting get the new "
            "value. Only kvd's own user or root may, over the ipc control socket. Prints the "
            "settings in force; the configuration file is not changed."
        ),
    )
    _add_locator(cmd)
    cmd.add_argument("setting", choices=["batch-window-us", "max-batch-blocks"])
    cmd.add_argument("value", help="N, or 'auto' for batch-window-us")
    cmd.set_defaults(run=_set)


def _set(args: argparse.Namespace) -> int:
    value: int | str
    if args.setting == "batch-window-us" and args.value == "auto":
        value = "auto"
    else:
        try:
            value = int(args.value)
        except ValueError:
            expected = "an integer" + (" or 'auto'" if args.setting == "batch-window-us" else "")
            print(
                f"kvd set: {args.setting}: expected {expected}, got {args.value!r}", file=sys.stderr
            )
            return 2

    def change(client: Any) -> int:
        settings = client.configure(**{args.setting.replace("-", "_"): value})
        auto = " (auto)" if settings.batch_window_auto else ""
        print(
            f"batch window {settings.batch_window_us} us{auto}, max {settings.max_batch_blocks} "
            "blocks per batch"
        )
        return 0

    return _run_client("set", args, change)


def _add_detach(commands: Any) -> None:
    cmd = _command(
        commands,
        "detach",
        help="detach a cache (an operator's, with --force)",
        description=(
            "Detach a cache and release kvd's mapping of its memory. Without --force it is "
            "refused while requests of the cache are in flight, and unless you attached it "
            "(--engine-id names its engine). With --force, as kvd's own user or root: its "
            "requests not yet started get Failed(cache_detached), the started ones finish, then "
            "it is detached."
        ),
    )
    _add_locator(cmd)
    cmd.add_argument("cache_id", metavar="CACHE_ID")
    cmd.add_argument("--engine-id", default="", help="the engine that attached it")
    cmd.add_argument(
        "--force", action="store_true", help="as an operator: answer its requests, then detach"
    )
    cmd.set_defaults(run=_detach)


def _detach(args: argparse.Namespace) -> int:
    def detach(client: Any) -> int:
        client.detach(args.cache_id, engine_id=args.engine_id, force=args.force)
        print(f"detached {args.cache_id}")
        return 0

    return _run_client("detach", args, detach)


def format_status(reply: Any) -> str:
    from kvd.protocol import RequestStatus

    if isinstance(reply, RequestStatus):
        lines = [f"request  {reply.req_id}", f"state    {reply.state}"]
        if reply.cache_id:
            lines.append(f"cache    {reply.cache_id}")
        if reply.code:
            lines.append(f"code     {reply.code}")
            lines.append(f"message  {reply.message}")
        return "\n".join(lines)
    lines = [
        f"kvd {reply.version} (protocol {reply.protocol_version}), pid {reply.pid}, "
        f"up {reply.uptime_s:.0f}s",
        f"device {reply.device}, batch window {reply.batch_window_us} us"
        f"{' (auto)' if reply.batch_window_auto else ''}, max {reply.max_batch_blocks} blocks "
        f"per batch, {reply.in_flight} requests in flight, engine lease "
        + (f"{reply.engine_lease_s:g}s" if reply.engine_lease_s else "off"),
        "",
    ]
    if reply.cpus:
        dedicated = ", dedicated (ZMQ I/O threads SCHED_BATCH)" if reply.dedicated_cpus else ""
        lines[-1:-1] = [f"cpus {format_cpus(reply.cpus)}{dedicated}"]
    if reply.journal_problem:
        lines[-1:-1] = [f"JOURNAL FAILING, new work is refused: {reply.journal_problem}"]
    rows = [
        ("CACHE", "ENGINE", "BLOCKS", "BLOCK SIZE", "TENSORS", "MiB", "IN FLIGHT", "ENGINE STATE")
    ]
    rows += [
        (
            c.cache_id,
            c.engine_id or "-",
            str(c.num_blocks),
            str(c.block_size),
            str(c.num_tensors),
            f"{c.nbytes / 2**20:.1f}",
            str(c.in_flight),
            _engine_state(c),
        )
        for c in reply.caches
    ]
    if len(rows) == 1:
        lines.append("no caches attached")
    else:
        lines += format_table(rows)
    lines.append("")
    lines += format_table([("COUNTER", "VALUE"), *((k, str(v)) for k, v in reply.counters.items())])
    if reply.rejections:
        lines.append("")
        lines += format_table(
            [("REJECTED", "COUNT"), *((k, str(v)) for k, v in reply.rejections.items())]
        )
    return "\n".join(lines)


def _engine_state(cache: Any) -> str:
    if cache.detaching:
        return "detaching"
    if cache.expires_in_s is not None:
        return f"gone, detached in {cache.expires_in_s:.0f}s"
    return "attached"


# -- demo ---------------------------------------------------------------------------------------


def _add_demo(commands: Any) -> None:
    from kvd.demo import add_arguments

    demo = _command(
        commands,
        "demo",
        help="the whole chain with real NIXL transfers, verified byte for byte (no GPU needed)",
        description=(
            "Starts kvd serve, four prefill processes that fill their caches with known content "
            "and export them with NIXL, and a decode process that pulls requests with NIXL READs "
            "(UCX over loopback), has kvd post-process them and checks every token of every "
            "decode block against what the prefill wrote. Runs prefill 16-token HND blocks into "
            "decode 16/32/64 NHD and HND, NHD into NHD and HND, 64-token HND blocks into 16-token "
            "NHD and HND (each across 4 decode blocks), and two prefill engines with different "
            "block sizes into one decode cache at once. Exits 1 if anything fails to verify."
        ),
    )
    add_arguments(demo)
    demo.set_defaults(run=_demo)


def _demo(args: argparse.Namespace) -> int:
    from kvd.demo import run

    return run(args)


# -- bench --------------------------------------------------------------------------------------


def _add_bench(commands: Any) -> None:
    bench = _command(
        commands,
        "bench",
        help="measure kvd against a baseline in the same run",
        description="Benchmarks print ratios against a baseline measured in the same run.",
    )
    which = bench.add_subparsers(title="benchmarks", metavar="BENCH")
    pipeline = _command(
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
        type=_batch_window,
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
    kernels = _command(
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
    kernels.set_defaults(run=_bench_kernels)
    from kvd.bench.vllm import HELP as VLLM_HELP
    from kvd.bench.vllm import add_arguments as add_vllm_arguments

    vllm = _command(
        which,
        "vllm",
        help="a real vLLM prefill/decode pair on CPU, stock vLLM and kvd side by side, "
        "one request at a time and under load",
        description=VLLM_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_vllm_arguments(vllm)
    vllm.set_defaults(run=_bench_vllm)
    from kvd.bench.serve import HELP as SERVE_HELP
    from kvd.bench.serve import add_arguments as add_serve_arguments

    serve = _command(
        which,
        "serve",
        help="the deployed shape: vllm serve prefill and decode servers behind a P/D proxy, "
        "driven by vllm bench serve, stock vLLM's decode and kvd's side by side",
        description=SERVE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(serve)
    serve.set_defaults(run=_bench_serve)
    chaos = _command(
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
    chaos.set_defaults(run=_bench_chaos)
    startup = _command(
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
        "--starts", type=_positive, default=5, help="starts per load (default: %(default)s)"
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
    startup.set_defaults(run=_bench_startup)


def _bench_kernels(args: argparse.Namespace) -> int:
    from kvd.bench.kernels import run

    return run(args)


def _bench_vllm(args: argparse.Namespace) -> int:
    from kvd.bench.vllm import run

    return run(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from kvd.bench.serve import run

    return run(args)


def _bench_chaos(args: argparse.Namespace) -> int:
    from kvd.bench.chaos import run

    return run(args)


def _bench_startup(args: argparse.Namespace) -> int:
    from kvd.bench.startup import run

    return run(args)


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


def _batch_window(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected microseconds or 'auto', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected microseconds >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, got {value}")
    return value


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


# -- tune ---------------------------------------------------------------------------------------


def _add_tune(commands: Any) -> None:
    tune = _command(
        commands,
        "tune",
        help="measure batch windows with your geometry and request mix, and recommend one",
        description=(
            "For each batch window, starts kvd serve with it, attaches a shared-memory cache of "
            "the given geometry and sends the request mix: notifications whose remote layout or "
            "block size needs a real rewrite. Prints notifications/s and ReadDone->event "
            "p50/p99 per window, recommends a window by a stated rule (--objective) and plots "
            "the sweep."
        ),
    )
    geometry = tune.add_argument_group("geometry (the decode cache kvd rewrites)")
    geometry.add_argument("--layers", type=int, default=2, help="layers (default: 2)")
    geometry.add_argument(
        "--num-blocks", type=int, default=4096, help="blocks per tensor (default: 4096)"
    )
    geometry.add_argument(
        "--block-size", type=int, default=16, help="tokens per decode block (default: 16)"
    )
    geometry.add_argument("--heads", type=int, default=8, help="KV heads (default: 8)")
    geometry.add_argument("--head-dim", type=int, default=128, help="head dimension (default: 128)")
    geometry.add_argument(
        "--dtype", choices=list(ITEMSIZE), default="bfloat16", help="(default: bfloat16)"
    )
    geometry.add_argument(
        "--layout", choices=["NHD", "HND"], default="NHD", help="the decode layout (default: NHD)"
    )
    geometry.add_argument(
        "--kv-arrangement",
        choices=["split", "blocks_first"],
        default="split",
        help="K and V in two halves (split, FlashAttention) or per block (FlashInfer)",
    )
    geometry.add_argument(
        "--remote-layout",
        choices=["NHD", "HND"],
        default="HND",
        help="the prefill layout the notifications name (default: HND)",
    )
    geometry.add_argument(
        "--ratio",
        type=int,
        default=1,
        help="block_size_ratio: decode block size / prefill block size (default: 1)",
    )
    mix = tune.add_argument_group("request mix")
    mix.add_argument(
        "--blocks", type=int, default=4, help="decode blocks per notification (default: 4)"
    )
    loop = mix.add_mutually_exclusive_group()
    loop.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="closed loop: notifications in flight, the next sent as an event arrives (default: 8)",
    )
    loop.add_argument(
        "--rate",
        type=float,
        default=None,
        metavar="PER_S",
        help="open loop instead: notifications per second on a fixed schedule",
    )
    mix.add_argument(
        "--messages",
        type=int,
        default=2000,
        help="timed notifications per window (default: %(default)s)",
    )
    mix.add_argument(
        "--warmup",
        type=int,
        default=100,
        help="untimed notifications first, per window (default: %(default)s)",
    )
    sweep = tune.add_argument_group("sweep and choice")
    sweep.add_argument(
        "--windows",
        default="0,50,100,200,500,1000,2000",
        help="batch windows to try, microseconds, comma-separated (default: %(default)s)",
    )
    sweep.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="visits per window, alternating the order; figures are medians (default: 1)",
    )
    sweep.add_argument(
        "--objective",
        choices=["balanced", "throughput", "p50", "p99"],
        default="balanced",
        help=(
            "balanced (default): among windows whose p99 is within --p99-slack of the best "
            "p99, the smallest whose throughput is within --tie of the highest of them; "
            "throughput: the highest throughput; p50, p99: the lowest p50, p99"
        ),
    )
    sweep.add_argument(
        "--p99-slack",
        type=float,
        default=0.1,
        metavar="FRACTION",
        help="balanced: how far above the best p99 a window may be (default: 0.1 = 10%%)",
    )
    sweep.add_argument(
        "--tie",
        type=float,
        default=0.05,
        metavar="FRACTION",
        help="balanced: throughputs this close count as equal (default: 0.05 = 5%%)",
    )
    out = tune.add_argument_group("output")
    out.add_argument(
        "--plot",
        default="tune.png",
        metavar="PATH",
        help="PNG of throughput and p50/p99 against the window ('' for none; default: tune.png)",
    )
    out.add_argument("--json", action="store_true", help="print one JSON object")
    add_progress_flag(out)
    tune.set_defaults(run=_tune)


def _tune(args: argparse.Namespace) -> int:
    from kvd.bench.tune import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
