"""The daemon's typed configuration: embedded defaults < TOML file < KVD_* environment < flags.

Every source is validated at the boundary; an error names the source and the field. The field
descriptions below are also the ``--help`` of ``kvd serve``.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from kvd.daemon.metrics_http import parse_metrics_addr
from kvd.protocol import MAX_BATCH_WINDOW_US, BatchWindow

LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "text", "json"]

ENV_PREFIX = "KVD_"
# KVD_* variables read elsewhere, not (only) as settings: by clients (kvd.client, kvd status and
# tail find the daemon with them) and by the daemon's choice of event loop (kvd.daemon.server).
OTHER_ENV = frozenset({"KVD_RUNTIME_DIR", "KVD_GPU", "KVD_NO_UVLOOP"})

log = logging.getLogger(__name__)


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    gpu: Annotated[
        str,
        _doc("Instance name, normally the decode GPU index; names the default runtime dir."),
    ] = "0"
    runtime_dir: Annotated[
        str,
        _doc(
            "Directory for the ipc:// sockets and endpoints.json. Default: $RUNTIME_DIRECTORY "
            "(set by systemd), else $XDG_RUNTIME_DIR/kvd/<gpu>, else /tmp/kvd-<uid>/<gpu>."
        ),
    ] = ""
    control_endpoint: Annotated[
        str, _doc("Control socket (ROUTER). Default ipc://<runtime_dir>/control.sock.")
    ] = ""
    ingest_endpoint: Annotated[
        str,
        _doc(
            "Ingest socket (PULL) for ReadDone/ReadFailed. Default ipc://<runtime_dir>/ingest.sock."
        ),
    ] = ""
    events_endpoint: Annotated[
        str, _doc("Events socket (PUB) for Ready/Failed. Default ipc://<runtime_dir>/events.sock.")
    ] = ""
    replay_endpoint: Annotated[
        str, _doc("Replay socket (ROUTER). Default ipc://<runtime_dir>/replay.sock.")
    ] = ""
    device: Annotated[str, _doc("Where the post-process runs: 'cpu' or 'cuda[:N]'.")] = "cpu"
    stream_priority: Annotated[
        int,
        _doc(
            "Priority of kvd's CUDA stream (lower is more urgent; torch.cuda.Stream."
            "priority_range() gives the device's range). Orders work inside kvd only."
        ),
    ] = 0
    ready_cuda_event: Annotated[
        bool,
        _doc(
            "CUDA only: publish Ready as soon as a post-process is enqueued on the GPU, with an "
            "interprocess CUDA event the engine's stream waits on (Ready.cuda_event), instead of "
            "after kvd saw it complete. Off: docs/design.md, 'Ready without a host round trip', "
            "says when it is safe."
        ),
    ] = False
    dedicated_cpus: Annotated[
        bool,
        _doc(
            "Set when kvd has the CPUs it runs on to itself (systemd CPUAffinity=, a Kubernetes "
            "exclusive cpuset): ZMQ's socket I/O threads then run SCHED_BATCH, so a message "
            "that wakes one no longer preempts kvd's event loop, and a burst's messages move "
            "together. Never on CPUs another busy process shares: there each message would wait "
            "for a scheduler tick. See docs/deployment.md, 'A core of its own'."
        ),
    ] = False
    batch_window_us: Annotated[
        BatchWindow,
        _doc(
            "Longest time (microseconds) the first request of a batch waits for others while "
            "the executor is idle. 0 launches at once; batches still fill while the executor "
            "is busy. 'auto': kvd picks the window from the arrival rate and the launch cost it "
            "observes. `kvd set batch-window-us` changes it without a restart."
        ),
    ] = 0
    max_batch_blocks: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            description=(
                "A batch is launched once it holds this many blocks. `kvd set max-batch-blocks` "
                "changes it without a restart."
            ),
        ),
    ] = 8192
    replay_buffer: Annotated[
        int,
        msgspec.Meta(ge=1, description="Events kept per topic for replay."),
    ] = 65536
    replay_buffer_bytes: Annotated[
        int,
        msgspec.Meta(
            ge=1 << 20,
            description=(
                "Bytes of events kept for replay, all topics together; the oldest go first."
            ),
        ),
    ] = 256 << 20
    journal_max_bytes: Annotated[
        int,
        msgspec.Meta(
            ge=1 << 20,
            description=(
                "Size of the launch journal in the runtime directory (two segments). It bounds "
                "how far back kvd remembers which requests it rewrote, across restarts too: a "
                "notification repeated after that is processed again."
            ),
        ),
    ] = 64 << 20
    peer_queue_bytes: Annotated[
        int,
        msgspec.Meta(
            ge=1 << 20,
            description=(
                "Bytes kvd queues for one peer: notifications of one engine it has not read yet, "
                "events for one subscriber or replay peer that does not read (the kernel's "
                "socket buffers come on top). Counted as messages of the largest size "
                "(max_message_bytes + 4 KiB; 1,023 by default, a few MiB of typical events): "
                "past it an engine's notifications wait in the engine, a subscriber misses "
                "events and replays them, a replay waits its turn."
            ),
        ),
    ] = 1 << 30
    max_connections: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            description=(
                "Peer connections kept, all sockets together; one past it is closed at once "
                "(counted in kvd_connections_refused_total). Lowered at start to fit the "
                "descriptor limit, less 256 for kvd's own use."
            ),
        ),
    ] = 4096
    max_message_bytes: Annotated[
        int,
        msgspec.Meta(
            ge=1024,
            description=(
                "Largest ingest or control message accepted; larger ones are rejected "
                "(message_too_large). ZMQ closes the connection of a peer that sends more than "
                "2x this on the control socket, or than 16x (at least 64 MiB) on ingest."
            ),
        ),
    ] = 1 << 20
    max_subscription_bytes: Annotated[
        int,
        msgspec.Meta(
            ge=256,
            description=(
                "Largest message a subscriber may send: a subscription on the events socket, "
                "a Replay request on the replay socket (a topic is a cache id, at most 128 "
                "bytes). ZMQ closes the connection of a peer that sends more, without reading it."
            ),
        ),
    ] = 1024
    metrics_addr: Annotated[
        str,
        _doc(
            "Serve Prometheus metrics over HTTP at HOST:PORT (GET /metrics), and the health "
            "probes /healthz and /readyz. A bare PORT or "
            ":PORT listens on 127.0.0.1; IPv6 as [ADDR]:PORT; port 0 picks a free port (see "
            "endpoints.json). Empty: off."
        ),
    ] = ""
    drain_timeout_s: Annotated[
        float,
        msgspec.Meta(
            gt=0,
            description=(
                "On SIGTERM, longest time (seconds) to finish the requests already accepted; "
                "those still unfinished then get Failed(shutting_down)."
            ),
        ),
    ] = 10.0
    executor_watchdog_s: Annotated[
        float,
        msgspec.Meta(
            ge=0,
            description=(
                "How long (seconds) a post-process job may go without completing before "
                "/healthz reports kvd unhealthy (a hung kernel: a restart is the cure). "
                "0: no bound."
            ),
        ),
    ] = 60.0
    engine_lease_s: Annotated[
        float,
        msgspec.Meta(
            ge=0,
            description=(
                "How long (seconds) a cache outlives its engine: once the engine's control "
                "connection closed, or, for an engine that sends Heartbeats, after its last one, "
                "kvd answers the cache's requests and detaches it. A cache attached with "
                "release_with_process (vLLM's KvdConnector) goes at once when that process is "
                "gone. 0: caches stay until detached."
            ),
        ),
    ] = 30.0
    log_level: Annotated[LogLevel, _doc("Log threshold.")] = "info"
    log_format: Annotated[
        LogFormat,
        _doc("'text' lines, 'json' lines, or 'auto' (text; no timestamps under journald)."),
    ] = "auto"

    def __post_init__(self) -> None:
        for name, check in _CHECKS.items():
            check(getattr(self, name))


def _check_metrics_addr(value: str) -> None:
    if value:
        parse_metrics_addr(value)  # a ValueError that names the field


# Checks beyond the type, for fields whose values have a syntax of their own. They raise
# ValueError; msgspec reports that as a ValidationError when it builds a Config.
_CHECKS: dict[str, Callable[[Any], None]] = {"metrics_addr": _check_metrics_addr}


class ConfigError(ValueError):
    """Bad configuration; the message names where it came from and the field."""


FIELDS: dict[str, Any] = {f.name: f.type for f in msgspec.structs.fields(Config)}


def field_help(name: str) -> str:
    meta = _meta_of(name)
    return meta.description if meta is not None and meta.description else ""


def load_config(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Merge the sources in precedence order and validate the result."""
    values: dict[str, Any] = {}
    if path is not None:
        values.update(_read_file(Path(path)))
    values.update(_read_env(os.environ if environ is None else environ))
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = _convert(name, value, f"--{name.replace('_', '-')}")
    try:
        return msgspec.convert(values, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"configuration: {exc}") from exc


def _read_file(path: Path) -> dict[str, Any]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        config = msgspec.toml.decode(data, type=Config)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        text = str(exc)
        expected = next((e for n, e in _EXPECTED.items() if text.endswith(f"`$.{n}`")), "")
        raise ConfigError(
            f"{path}: {text}" + (f" (expected {expected})" if expected else "")
        ) from exc
    present = msgspec.toml.decode(data)
    return {k: getattr(config, k) for k in present}


def _read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name not in FIELDS:
            continue  # KVD_* variables that are not settings (e.g. for clients) pass through
        values[name] = _convert(name, raw, key)
    return values


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """A message for each ``KVD_*`` variable that nothing reads, naming the closest known one.

    A typo in the TOML file is an error; in the environment the variable is simply not read,
    so ``kvd serve`` warns instead (clients share the environment, hence no error).
    """
    known = sorted({ENV_PREFIX + name.upper() for name in FIELDS} | OTHER_ENV)
    messages = []
    for key in sorted(environ):
        if not key.startswith(ENV_PREFIX) or key in known:
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        messages.append(f"{key} is not a kvd setting and is ignored{hint}")
    return messages


def warn_unknown_env(environ: Mapping[str, str] | None = None) -> None:
    """Log ``unknown_env`` at warning level (``kvd serve`` does, once logging is set up)."""
    for message in unknown_env(os.environ if environ is None else environ):
        log.warning("%s", message)


BATCH_WINDOW_US = f"microseconds (0..{MAX_BATCH_WINDOW_US})"
"""What a fixed batch window looks like; ``or 'auto'`` where ``auto`` may be one."""

# What a value must look like, for fields whose type msgspec's own message does not say.
_EXPECTED = {"batch_window_us": f"{BATCH_WINDOW_US} or 'auto'"}


def parse_batch_window(text: str) -> BatchWindow:
    """A batch window as a flag gives it: ``'auto'`` or whole microseconds in
    0..``MAX_BATCH_WINDOW_US``. ``ValueError`` saying what was expected otherwise."""
    text = text.strip()
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_BATCH_WINDOW_US:
        raise ValueError(f"expected {_EXPECTED['batch_window_us']}, got {text!r}")
    return value


def parse_batch_windows(
    text: str, *, auto: bool = True, at_least: Literal[1, 2] = 1
) -> list[BatchWindow]:
    """``"0,50,auto"`` -> ``[0, 50, "auto"]``: ``at_least`` windows, each once and as
    ``parse_batch_window`` takes it (``'auto'`` only with ``auto``). ``ValueError`` saying what
    was expected otherwise."""
    expected = _EXPECTED["batch_window_us"] if auto else BATCH_WINDOW_US
    windows = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            window = parse_batch_window(part)
        except ValueError:
            window = None
        if window is None or (window == "auto" and not auto):
            raise ValueError(f"expected comma-separated {expected}, got {text!r}")
        windows.append(window)
    if len(set(windows)) < at_least:
        raise ValueError(
            "give at least one window" if at_least == 1 else "give two or more distinct windows"
        )
    if len(set(windows)) != len(windows):
        raise ValueError(f"{text!r} repeats a window")
    return windows


def _convert(name: str, value: Any, source: str) -> Any:
    try:
        converted = msgspec.convert(value, FIELDS[name], strict=False)
        if name in _CHECKS:
            _CHECKS[name](converted)
    except (msgspec.ValidationError, ValueError) as exc:
        expected = f" (expected {_EXPECTED[name]})" if name in _EXPECTED else ""
        raise ConfigError(f"{source}={value!r}: {exc}{expected}") from exc
    return converted


def _meta_of(name: str) -> msgspec.Meta | None:
    annotated = FIELDS[name]
    for extra in getattr(annotated, "__metadata__", ()):
        if isinstance(extra, msgspec.Meta):
            return extra
    return None
