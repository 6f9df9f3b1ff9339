"""What a peer can make kvd hold, row by row: for every socket kvd binds and every field of an
Attach, the largest input a peer can send, what kvd does with it, and the memory (its RSS peak
while it handles the input, its own memory after) and descriptors it then holds.

One ``kvd serve`` with the default limits answers every row; peers are real sockets (a ZMTP
peer written by hand where libzmq's would refuse to send), caches real shared memory. A bound
here is the setting's, never the input's: an input past a limit costs kvd nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
import pytest
import zmq

from kvd.client import Client, ShmCache
from kvd.daemon_process import DaemonProcess
from kvd.endpoints import ENDPOINT_NAMES
from kvd.protocol import (
    Attach,
    ControlReply,
    Detach,
    Detached,
    Error,
    Failed,
    Pong,
    ShmRef,
    TensorSpec,
)
from kvd.subscription import Subscription
from tests.daemon_helpers import (
    RawPeer,
    collect,
    open_fds,
    peak_rss_mib,
    reset_peak_rss,
    settle,
    wait_for,
)

MIB = 1 << 20
MAX_MESSAGE = 1 * MIB
"""``max_message_bytes`` (the default): the largest control request or notification."""
MAX_SUBSCRIPTION = 1024
"""``max_subscription_bytes`` (the default): the largest subscription or replay request."""
INGEST_CEILING = 64 * MIB
"""The largest notification frame read (to answer it message_too_large): max(16x, 64 MiB)."""
HUGE = 128 * MIB
"""A frame larger than any limit."""
FILL = MAX_MESSAGE - 4096
"""A field this long fills an Attach up to ``max_message_bytes``."""
LOGGED = 4096
"""The most kvd may log about one input: what a peer sends is quoted, never all of it."""


def anon_mib(pid: int) -> float:
    """Process ``pid``'s own memory (RssAnon, MiB): its shared-memory mappings left out."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon")


@dataclass
class Kvd:
    daemon: DaemonProcess
    client: Client
    sub: Subscription
    cache: ShmCache
    control: zmq.Socket[bytes]
    pid: int

    def endpoint(self, name: str) -> str:
        address: str = getattr(self.daemon.endpoints(), name)
        return address

    def ask(self, request: dict[str, Any]) -> ControlReply:
        """Send one control request as given (no client-side checks) and return the reply."""
        self.control.send(msgspec.msgpack.encode(request))
        assert self.control.poll(60_000), "no reply"
        return msgspec.msgpack.decode(self.control.recv(), type=ControlReply)


@pytest.fixture(scope="module")
def kvd() -> Iterator[Kvd]:
    runtime_dir = Path(tempfile.mkdtemp(prefix="kvd-l-"))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    daemon = DaemonProcess("--metrics-addr", ":0", runtime_dir=runtime_dir).start()
    try:
        assert daemon.proc is not None
        with (
            daemon.client() as client,
            ShmCache.create(
                num_layers=1, num_blocks=4, block_size=16, num_heads=1, head_dim=8
            ) as cache,
        ):
            client.attach("warm-up", cache.specs)  # torch and the kernels load with it
            client.detach("warm-up")
            control = ctx.socket(zmq.DEALER)
            control.setsockopt(zmq.LINGER, 0)
            control.connect(daemon.endpoints().control)
            with client.subscribe(["nobody"], from_seq=1) as sub:
                assert sub.poll(0.1) is None
                kvd = Kvd(daemon, client, sub, cache, control, daemon.proc.pid)
                assert isinstance(kvd.ask({"type": "ping"}), Pong)  # its connection is up
                settle(kvd.pid)  # the subscription's replays closed their connections
                yield kvd
            control.close()
    finally:
        daemon.close()
        ctx.term()
        shutil.rmtree(runtime_dir, ignore_errors=True)


# -- the sockets -----------------------------------------------------------------------------------


def raw(kvd: Kvd, name: str, socket_type: str, *frames: bytes) -> str:
    """Send one message from a raw ZMTP peer: 'closed' when kvd closed the connection for it,
    else 'kept'."""
    peer = RawPeer(kvd.endpoint(name), socket_type)
    try:
        sent = peer.send(*frames)
        return "closed" if not sent or peer.closed_by_kvd(timeout=2) else "kept"
    finally:
        peer.close()


def oversized_notification(kvd: Kvd) -> str:
    """The largest notification kvd reads: answered Failed(message_too_large), its req_id found
    in the frame's first bytes."""
    frame = msgspec.msgpack.encode(
        {"type": "read_done", "req_id": "too-large", "cache_id": "nobody", "x": "x" * HUGE}
    )[: INGEST_CEILING - 1]
    kept = raw(kvd, "ingest", "PUSH", frame)
    (delivery,) = collect(kvd.sub, 1)
    event = delivery.event
    assert isinstance(event, Failed) and event.req_id == "too-large", event
    return f"{kept}, {event.code}"


def http(kvd: Kvd, request: bytes) -> str:
    """Send ``request`` to the metrics listener: 'closed' when kvd closed the connection (while
    it was sent, or after), 'kept' when kvd neither read on nor closed it for 10 s."""
    url = urlsplit(kvd.endpoint("metrics"))
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        try:
            sock.sendall(request)
            while sock.recv(1 << 16):
                pass
        except TimeoutError:
            return "kept"
        except OSError:
            pass  # reset: kvd closed it with bytes unread
    return "closed"


@dataclass(frozen=True)
class Row:
    what: str
    send: Callable[[Kvd], str]
    """Sends the input; returns what kvd did with it (the reply's type and code, 'closed')."""
    outcome: str
    peak_mib: float
    """The most kvd's RSS may rise while it handles the input."""
    held_mib: float = 4
    """The most kvd's own memory (RssAnon) may have grown once it answered."""


SOCKETS = [
    Row(
        "control: the largest frame read, 2x max_message_bytes",
        lambda k: raw(k, "control", "DEALER", b"\x80" * (2 * MAX_MESSAGE)),
        "kept",
        peak_mib=4 * MAX_MESSAGE / MIB + 8,
    ),
    Row(
        "control: any larger frame",
        lambda k: raw(k, "control", "DEALER", b"\x80" * HUGE),
        "closed",
        peak_mib=8,
    ),
    Row(
        "ingest: the largest frame read, max(16x max_message_bytes, 64 MiB)",
        oversized_notification,
        "kept, message_too_large",
        peak_mib=2 * INGEST_CEILING / MIB + 8,
    ),
    Row(
        "ingest: any larger frame",
        lambda k: raw(k, "ingest", "PUSH", b"\x80" * HUGE),
        "closed",
        peak_mib=8,
    ),
    Row(
        "events: the largest subscription, max_subscription_bytes",
        lambda k: raw(k, "events", "SUB", b"\x01" + b"t" * (MAX_SUBSCRIPTION - 1)),
        "kept",
        peak_mib=8,
    ),
    Row(
        "events: any larger subscription",
        lambda k: raw(k, "events", "SUB", b"\x01" + b"t" * HUGE),
        "closed",
        peak_mib=8,
    ),
    Row(
        "replay: the largest request, max_subscription_bytes",
        lambda k: raw(k, "replay", "DEALER", b"\x80" * MAX_SUBSCRIPTION),
        "kept",
        peak_mib=8,
    ),
    Row(
        "replay: any larger request",
        lambda k: raw(k, "replay", "DEALER", b"\x82" + bytes(HUGE)),
        "closed",
        peak_mib=8,
    ),
    Row(
        "metrics: a request head of any size (16 KiB read)",
        lambda k: http(k, b"GET /metrics HTTP/1.1\r\nX: " + b"x" * HUGE),
        "closed",
        peak_mib=8,
    ),
]


# -- the fields of an Attach -------------------------------------------------------------------


def tensor(kvd: Kvd, **changes: Any) -> dict[str, Any]:
    """The fixture cache's tensor as a peer would send it, with ``changes``."""
    fields: dict[str, Any] = msgspec.to_builtins(kvd.cache.specs[0])
    for key, value in changes.items():
        if key.startswith("memory."):
            fields["memory"] = {**fields["memory"], key.removeprefix("memory."): value}
        else:
            fields[key] = value
    return fields


def attach(
    cache_id: str = "limits",
    engine_id: str = "",
    release_with_process: object = False,
    **changes: Any,
) -> Callable[[Kvd], str]:
    """An Attach of the fixture's cache, one field changed: its reply as 'Type' or 'Error code'
    (an attached cache is detached again once kvd's memory was measured)."""

    def send(kvd: Kvd) -> str:
        request = {
            "type": "attach",
            "cache_id": cache_id,
            "tensors": [tensor(kvd, **changes)],
            "engine_id": engine_id,
            "release_with_process": release_with_process,
        }
        return outcome(kvd.ask(request))

    return send


def outcome(reply: ControlReply) -> str:
    return f"Error {reply.code}" if isinstance(reply, Error) else type(reply).__name__


def most_tensors(kvd: Kvd) -> str:
    """As many tensors as one Attach holds, each its own pages of one segment."""
    last = msgspec.structs.replace(
        kvd.cache.specs[0],
        name="layer.99999",
        memory=ShmRef(name=kvd.cache.name, offset=2**31),
    )
    count = (MAX_MESSAGE - 1024) // len(msgspec.msgpack.encode(last))
    many = ShmCache.create(num_layers=count, num_blocks=1, block_size=16, num_heads=1, head_dim=8)
    try:
        request = Attach(cache_id="limits", tensors=many.specs)
        assert len(msgspec.msgpack.encode(request)) <= MAX_MESSAGE
        return f"{outcome(kvd.ask(msgspec.to_builtins(request)))} of {count}"
    finally:
        many.close()  # kvd keeps its mapping while attached


def sparse_segment(kvd: Kvd) -> str:
    """A 64 MiB segment the engine never wrote: refused, none of it allocated by kvd."""
    name = f"kvd-limits-sparse-{os.getpid()}"
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 64 * MIB)
        spec = TensorSpec(
            name="sparse",
            shape=[2, 4096, 16, 4, 64],
            dtype="bfloat16",
            layout="NHD",
            kv_arrangement="split",
            block_size=16,
            memory=ShmRef(name=name),
        )
        request = msgspec.to_builtins(Attach(cache_id="limits", tensors=[spec]))
        reply = outcome(kvd.ask(request))
        return f"{reply}, {os.fstat(fd).st_blocks * 512} bytes allocated"
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm/{name}")


BIG = 2**62
FORMAT = {
    "page_format": "NHD",
    "layout": None,
    "kv_arrangement": None,
    "num_heads": 1,
    "head_dim": 8,
}
ATTACH_FIELDS = [
    Row("(the cache as it is)", attach(), "Attached", peak_mib=8),
    Row("(the cache with its page_format)", attach(**FORMAT), "Attached", peak_mib=8),
    Row("cache_id", attach(cache_id="c" * FILL), "Error invalid_message", peak_mib=8),
    Row("engine_id", attach(engine_id="e" * FILL), "Error invalid_message", peak_mib=8),
    Row(
        "release_with_process",
        attach(release_with_process="r" * FILL),
        "Error invalid_message",
        peak_mib=8,
    ),
    Row("tensors", most_tensors, r"Attached of \d{4}", peak_mib=96, held_mib=32),
    Row("tensors[].name", attach(name="n" * FILL), "Attached", peak_mib=8),
    Row("tensors[].shape", attach(shape=[1] * FILL), "Error invalid_cache", peak_mib=40),
    Row("tensors[].shape[]", attach(shape=[2, BIG, 16, 1, 8]), "Error memory_unavailable", 8),
    Row("tensors[].dtype", attach(dtype="d" * FILL), "Error invalid_message", peak_mib=8),
    Row("tensors[].layout", attach(layout="l" * FILL), "Error invalid_message", peak_mib=8),
    Row(
        "tensors[].kv_arrangement",
        attach(kv_arrangement="k" * FILL),
        "Error invalid_message",
        peak_mib=8,
    ),
    Row("tensors[].block_size", attach(block_size=BIG), "Error invalid_cache", peak_mib=8),
    Row("tensors[].memory.name", attach(**{"memory.name": "m" * FILL}), "Error invalid_cache", 8),
    Row("tensors[].memory.offset", attach(**{"memory.offset": BIG}), "Error memory_unavailable", 8),
    Row(
        "tensors[].memory (cuda_ipc).handle",
        attach(memory={"type": "cuda_ipc", "handle": b"h" * FILL}),
        "Error invalid_cache",
        peak_mib=8,
    ),
    Row(
        "tensors[].memory (cuda_ipc).device_uuid",
        attach(memory={"type": "cuda_ipc", "handle": bytes(64), "device_uuid": "u" * FILL}),
        "Error invalid_cache",
        peak_mib=8,
    ),
    Row(
        "tensors[].page_format",
        attach(page_format={"k": ["N"] * (FILL // 2)}),
        "Error invalid_message",
        peak_mib=8,
    ),
    Row("tensors[].page_format (a name)", attach(page_format="p" * FILL), "Error invalid_cache", 8),
    # The sizes of the logical axes: read where a page_format is given (else from the shape).
    Row("tensors[].num_heads", attach(**{**FORMAT, "num_heads": BIG}), "Error invalid_cache", 8),
    Row("tensors[].head_dim", attach(**{**FORMAT, "head_dim": BIG}), "Error invalid_cache", 8),
    Row("tensors[].num_layers", attach(**{**FORMAT, "num_layers": BIG}), "Error invalid_cache", 8),
    Row("tensors[].group", attach(group=BIG), "Error invalid_cache", peak_mib=8),
    Row(
        "the segment: one the engine never wrote (64 MiB, sparse)",
        sparse_segment,
        "Error memory_unavailable, 0 bytes allocated",
        peak_mib=8,
    ),
]


@pytest.mark.parametrize("row", SOCKETS + ATTACH_FIELDS, ids=lambda row: row.what)
def test_what_the_largest_input_makes_kvd_hold(kvd: Kvd, row: Row) -> None:
    pid = kvd.pid
    logged = kvd.daemon.log_path.stat().st_size
    fds = open_fds(pid)
    anon = anon_mib(pid)
    reset_peak_rss(pid)
    rss = peak_rss_mib(pid)
    try:
        result = row.send(kvd)
        kvd.client.ping()  # kvd is up and answers
        peak = peak_rss_mib(pid) - rss
        held = anon_mib(pid) - anon
    finally:
        if kvd.client.status().caches:  # an attached cache is detached again
            reply = kvd.ask(msgspec.to_builtins(Detach(cache_id="limits")))
            assert isinstance(reply, Detached), reply
    assert re.fullmatch(row.outcome, result), f"{row.what}: {result!r}, not {row.outcome!r}"
    assert peak <= row.peak_mib, f"{row.what}: kvd's RSS peaked {peak:.1f} MiB higher"
    assert held <= row.held_mib, f"{row.what}: kvd holds {held:.1f} MiB more"
    logged = kvd.daemon.log_path.stat().st_size - logged
    assert logged <= LOGGED, f"{row.what}: kvd logged {logged} bytes"
    # What kvd opened for the input (a connection, a segment) is closed again.
    with contextlib.suppress(AssertionError):
        wait_for(lambda: open_fds(pid) == fds, timeout=10)
    assert open_fds(pid) == fds, f"{row.what}: {open_fds(pid)} descriptors open, {fds} before"


def test_the_table_has_every_socket_and_every_field_of_an_attach() -> None:
    """The table names every socket kvd binds and every field of an Attach and its tensors."""
    names = {row.what.split(":")[0] for row in SOCKETS}
    assert names == {*ENDPOINT_NAMES, "metrics"}
    fields = {f.name for f in msgspec.structs.fields(Attach)} - {"v"}
    fields |= {f"tensors[].{f.name}" for f in msgspec.structs.fields(TensorSpec)}
    covered = {row.what.split(" ")[0] for row in ATTACH_FIELDS}
    assert fields <= covered, sorted(fields - covered)
