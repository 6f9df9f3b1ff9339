"""``kvd demo``: the whole chain with real NIXL transfers (``kvd.demo``)."""

from __future__ import annotations

from typing import Any

from kvd.commands import argument, deferred, positive, positive_float, subcommand
from kvd.daemon.config import parse_batch_window
from kvd.progress import add_progress_flag


def add(commands: Any) -> None:
    demo = subcommand(
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
    demo.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    demo.add_argument(
        "--requests", type=positive, default=48, help="requests per case (default: %(default)s)"
    )
    demo.add_argument(
        "--concurrency",
        type=positive,
        default=8,
        help="requests in flight per case (default: %(default)s)",
    )
    demo.add_argument(
        "--max-blocks",
        type=positive,
        default=8,
        help="most decode blocks one request fills; lengths are random (default: %(default)s)",
    )
    demo.add_argument(
        "--num-blocks", type=positive, default=256, help="blocks per cache (default: %(default)s)"
    )
    demo.add_argument("--layers", type=positive, default=2, help="layers (default: %(default)s)")
    demo.add_argument("--heads", type=positive, default=4, help="KV heads (default: %(default)s)")
    demo.add_argument(
        "--head-dim", type=positive, default=64, help="head dimension, bf16 (default: %(default)s)"
    )
    demo.add_argument("--seed", type=int, default=0, help="request mix seed (default: 0)")
    demo.add_argument(
        "--batch-window-us",
        type=argument(parse_batch_window),
        default=None,
        help="kvd's batch window for the run (default: kvd's default)",
    )
    demo.add_argument(
        "--case-timeout",
        type=positive_float,
        default=60.0,
        help="seconds a case may take before its open requests count as failed",
    )
    add_progress_flag(demo, "--quiet")
    demo.set_defaults(run=deferred("kvd.demo"))
