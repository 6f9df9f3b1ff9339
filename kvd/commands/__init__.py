"""The ``kvd`` command's subcommands, a module each (``kvd.cli`` builds the parser from them).

Each module's ``add(commands)`` adds its parser(s) to ``commands``, the top-level subparsers,
and sets ``run``, which takes the parsed arguments and returns the exit status. Heavy modules
(torch, the daemon) are imported inside ``run`` so ``--help`` stays quick.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


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


def argument(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` as an argparse ``type``: the message of its ``ValueError`` is the usage error."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def positive(text: str) -> int:
    """A whole number, 1 or more (an argparse ``type``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    """A number above 0 (an argparse ``type``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {text}")
    return value
