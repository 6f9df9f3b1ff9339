"""The ``kvd`` command: serve, tail, status, set, detach, demo, bench, tune.

This module builds the parser from the subcommands' modules (``kvd.commands``) and dispatches.
Exit codes: 0 success, 1 failure at run time, 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from kvd import __version__
from kvd.commands import bench, client, demo, serve, tune


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
    for module in (serve, client, demo, bench, tune):
        module.add(commands)
    return parser


if __name__ == "__main__":
    sys.exit(main())
