"""The commands that ask a running kvd: ``kvd tail``, ``status``, ``set`` and ``detach``.

kvd's absence, a timeout or an error reply is one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from kvd.commands import subcommand
from kvd.cpus import format_cpus
from kvd.tables import format_table


def add(commands: Any) -> None:
    _add_tail(commands)
    _add_status(commands)
    _add_set(commands)
    _add_detach(commands)


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
    tail = subcommand(
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
    status = subcommand(
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
    cmd = subcommand(
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
    cmd = subcommand(
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
            "/".join(map(str, c.group_block_sizes or [c.block_size])),
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
