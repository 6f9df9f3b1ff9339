"""``kvd demo``: the whole chain with real NIXL transfers (``kvd.demo``)."""

from __future__ import annotations

from typing import Any

from kvd.commands import deferred, subcommand


def add(commands: Any) -> None:
    from kvd.demo import add_arguments

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
    add_arguments(demo)
    demo.set_defaults(run=deferred("kvd.demo"))
