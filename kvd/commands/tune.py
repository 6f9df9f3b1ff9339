"""``kvd tune``: its flags; the sweep and the choice are ``kvd.bench.tune``."""

from __future__ import annotations

from typing import Any

from kvd.commands import deferred, subcommand
from kvd.dtypes import ITEMSIZE
from kvd.progress import add_progress_flag


def add(commands: Any) -> None:
    tune = subcommand(
        commands,
        "tune",
        help="measure batch windows with your geometry and request mix, and recommend one",
        description=(
            "Starts kvd serve, attaches a shared-memory cache of the given geometry and, for "
            "each batch window (set live, as kvd set does), sends the request mix: "
            "notifications whose remote layout or block size needs a real rewrite. Prints "
            "notifications/s and ReadDone->event p50/p99 per window, recommends a window by a "
            "stated rule (--objective) and plots the sweep."
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
    tune.set_defaults(run=deferred("kvd.bench.tune"))
