from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvd.sockets import (
    EndpointError,
    Endpoints,
    RuntimeLock,
    default_runtime_dir,
    normalize_endpoint,
    read_endpoints,
    write_endpoints,
)


def test_runtime_dir_defaults() -> None:
    assert default_runtime_dir("0", {"RUNTIME_DIRECTORY": "/run/kvd/0:/run/other"}) == Path(
        "/run/kvd/0"
    )
    assert default_runtime_dir("2", {"XDG_RUNTIME_DIR": "/run/user/7"}) == Path("/run/user/7/kvd/2")
    assert default_runtime_dir("1", {}).name == "1"


def test_endpoints() -> None:
    rt = Path("/run/kvd/0")
    assert normalize_endpoint("", rt, "ingest") == "ipc:///run/kvd/0/ingest.sock"
    assert normalize_endpoint("tcp://5555", rt, "events") == "tcp://127.0.0.1:5555"
    assert normalize_endpoint("tcp://:0", rt, "events") == "tcp://127.0.0.1:0"
    assert normalize_endpoint("tcp://0.0.0.0:7", rt, "events") == "tcp://0.0.0.0:7"
    assert normalize_endpoint("tcp://[::1]:7", rt, "events") == "tcp://[::1]:7"
    for spec, message in [
        ("udp://x", "must start with ipc:// or tcp://"),
        ("tcp://host:port", "is not tcp://"),
        ("ipc://", "needs a path"),
        ("ipc:///" + "x" * 120, "the limit is 107"),
    ]:
        with pytest.raises(EndpointError, match=message):
            normalize_endpoint(spec, rt, "control")


def test_endpoints_file_round_trip(short_tmp: Path) -> None:
    eps = Endpoints("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3", "ipc:///x")
    write_endpoints(short_tmp, eps)
    assert read_endpoints(short_tmp) == eps
    assert (
        read_endpoints(short_tmp / "none").ingest == f"ipc://{short_tmp / 'none' / 'ingest.sock'}"
    )
    assert "metrics" not in json.loads((short_tmp / "endpoints.json").read_text())
    with_metrics = dataclasses.replace(eps, metrics="http://127.0.0.1:9400/metrics")
    write_endpoints(short_tmp, with_metrics)
    assert read_endpoints(short_tmp) == with_metrics


def test_runtime_lock_excludes_a_second_daemon(short_tmp: Path) -> None:
    first = RuntimeLock(short_tmp)
    first.acquire()
    try:
        with pytest.raises(EndpointError, match=r"another kvd \(pid \d+\) is serving"):
            RuntimeLock(short_tmp).acquire()
    finally:
        first.release()
    again = RuntimeLock(short_tmp)
    again.acquire()
    again.release()
