"""The ``kvd`` command's subcommands, a module each (``kvd.cli`` builds the parser from them).

Each module's ``add(commands)`` adds its parser(s) to ``commands``, the top-level subparsers,
and sets ``run``, which takes the parsed arguments and returns the exit status. Heavy modules
(torch, the daemon) are imported inside ``run`` so ``--help`` stays quick.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any


def subcommand(commands: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand parser that ``kvd.cli.main`` can name in usage errors."""
    command: argparse.ArgumentParser = commands.add_parser(name, **kwargs)
    command.set_defaults(command_parser=command)
    return command


def deferred(module: str) -> Callable[[argparse.Namespace], int]:
    """A ``run`` that imports ``module`` when the command runs and calls its ``run(args)``."""

    def run(args: argparse.Namespace) -> int:
        code: int = importlib.import_module(module).run(args)
        return code

    return run
