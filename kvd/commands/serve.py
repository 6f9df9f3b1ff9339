"""``kvd serve``: run the daemon; a flag per setting, generated from ``Config``."""

from __future__ import annotations

import argparse
import os
import sys
import typing
from typing import Any

import msgspec

from kvd.commands import subcommand
from kvd.daemon.config import FIELDS, Config, ConfigError, field_help, load_config, warn_unknown_env


def add(commands: Any) -> None:
    serve = subcommand(
        commands,
        "serve",
        help="run the daemon",
        description=(
            "Run the kvd daemon. Settings come from embedded defaults, then --config, then "
            "KVD_<NAME> environment variables (e.g. KVD_BATCH_WINDOW_US=50), then these flags."
        ),
    )
    serve.add_argument("--config", metavar="PATH", help="TOML file with the settings below")
    defaults = msgspec.structs.asdict(Config())
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
    serve.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import logging

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
