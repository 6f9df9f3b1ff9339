"""Fuzzing a live ``kvd serve``: random and mutated frames on the ingest and control sockets, and
random Attach geometries. After every bad input the daemon must still be up and answer a
well-formed request. Thousands of cases under CI (``CI`` set), fewer locally."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.client import Client, KvdError, ShmCache, Subscription
from kvd.daemon_process import DaemonProcess
from kvd.protocol import ShmRef, TensorSpec

EXAMPLES = int(os.environ.get("KVD_FUZZ_EXAMPLES", "2000" if os.environ.get("CI") else "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
_ids = itertools.count()

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=25,
)
FIELDS = [
    "type",
    "v",
    "req_id",
    "cache_id",
    "remote_layout",
    "remote_format",
    "physical_block_ids",
    "block_size_ratio",
    "remote_block_size",
    "covered_sub_blocks",
    "generation",
    "remote_engine_id",
    "reason",
]


@st.composite
def ingest_frames(draw: st.DrawFn) -> bytes:
    """Random bytes, any msgpack value, or a ReadDone/ReadFailed with some fields mangled."""
    kind = draw(st.sampled_from(["bytes", "value", "mutated", "nested"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "value":
        return msgspec.msgpack.encode(draw(values))
    if kind == "nested":
        depth = draw(st.integers(min_value=100, max_value=100_000))
        return b"\x81\xa1x" + b"\x91" * depth + b"\xc0"
    message = {
        "type": draw(st.sampled_from(["read_done", "read_failed"])),
        "req_id": f"fuzz-{next(_ids)}",
        "cache_id": "fuzz",
        "remote_layout": "HND",
        "physical_block_ids": [1, 2],
        "block_size_ratio": 2,
    }
    for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4)):
        message[field] = draw(values)
    return msgspec.msgpack.encode(message)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess() as d:
        yield d


@pytest.fixture(scope="module")
def fuzzed(daemon: DaemonProcess) -> Iterator[tuple[Client, Subscription]]:
    cache = ShmCache.create(num_layers=1, num_blocks=16, block_size=8, num_heads=2, head_dim=8)
    with daemon.client() as client:
        client.attach("fuzz", cache.specs)
        with client.subscribe(["fuzz"]) as sub:
            yield client, sub
    cache.close()


def answered(client: Client, sub: Subscription, timeout: float = 30.0) -> None:
    """A well-formed notification right now gets its Ready (other events are skipped)."""
    req_id = f"probe-{next(_ids)}"
    client.read_done(req_id, "fuzz", [0], remote_layout="NHD", block_size_ratio=1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        delivery = sub.poll(0.5)
        if delivery is not None and delivery.event.req_id == req_id:
            assert type(delivery.event).__name__ == "Ready", delivery.event
            return
    raise AssertionError(f"no Ready for {req_id} within {timeout}s")


@FUZZ
@given(frames=st.lists(ingest_frames(), min_size=1, max_size=3))
def test_no_ingest_frame_stops_the_daemon(
    daemon: DaemonProcess, fuzzed: tuple[Client, Subscription], frames: list[bytes]
) -> None:
    client, sub = fuzzed
    for frame in frames:
        client.send_raw(frame)
    answered(client, sub)
    assert daemon.proc is not None and daemon.proc.poll() is None


@pytest.fixture(scope="module")
def control(daemon: DaemonProcess) -> Iterator[zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoints().control)
    yield sock
    sock.close()
    ctx.term()


@st.composite
def control_frames(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["bytes", "value", "mutated"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "value":
        return msgspec.msgpack.encode(draw(values))
    message: dict[str, object] = {
        "type": draw(st.sampled_from(["attach", "detach", "status", "ping", "nope"]))
    }
    for field in draw(st.lists(st.sampled_from(["cache_id", "req_id", "tensors", "force", "v"]))):
        message[field] = draw(values)
    return msgspec.msgpack.encode(message)


@FUZZ
@given(frame=control_frames())
def test_every_control_frame_gets_one_reply(
    daemon: DaemonProcess, control: zmq.Socket[bytes], frame: bytes
) -> None:
    control.send_multipart([b"", frame])
    assert control.poll(30_000), "no reply"
    reply = msgspec.msgpack.decode(control.recv_multipart()[-1])
    assert isinstance(reply, dict) and "type" in reply
    assert not control.poll(0), "more than one reply"
    with daemon.client(timeout=30) as client:
        client.ping()


DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "uint8", "int8", "int4"]


@st.composite
def tensor_specs(draw: st.DrawFn, segment: str, size: int) -> dict[str, object]:
    dims = draw(st.lists(st.integers(min_value=-2, max_value=70), min_size=0, max_size=6))
    spec: dict[str, object] = {
        "name": draw(st.text(max_size=8)),
        "shape": dims,
        "dtype": draw(st.sampled_from(DTYPES)),
        "block_size": draw(st.integers(min_value=-1, max_value=70)),
        "memory": {
            "type": "shm",
            "name": draw(st.sampled_from([segment, "../etc/passwd", "nope", ""])),
            "offset": draw(st.sampled_from([0, 1, 4096, size, -1, 2**62])),
        },
    }
    if draw(st.booleans()):
        spec["layout"] = draw(st.sampled_from(["NHD", "HND", "XYZ"]))
        spec["kv_arrangement"] = draw(st.sampled_from(["split", "blocks_first", "single", "mla"]))
    else:
        spec["page_format"] = draw(
            st.sampled_from(["HND", "cpu_attn_vec", "BLHNC", "nope"])
            | st.fixed_dictionaries(
                {
                    "k": st.lists(st.sampled_from(["L", "H", "N", "C", "X"]), max_size=5),
                    "v": st.lists(st.sampled_from(["L", "H", "N", "C"]), max_size=5),
                    "outer": st.lists(st.sampled_from(["L", "H", "N", "C"]), max_size=3),
                    "regions": st.sampled_from(["", "kv", "head", "x"]),
                }
            )
        )
        for field in ("num_heads", "head_dim", "num_layers"):
            spec[field] = draw(st.integers(min_value=-1, max_value=70))
    return spec


@pytest.fixture(scope="module")
def segment() -> Iterator[ShmCache]:
    cache = ShmCache.create(num_layers=1, num_blocks=8, block_size=16, num_heads=4, head_dim=32)
    yield cache
    cache.close()


@settings(FUZZ, max_examples=max(100, EXAMPLES // 2))
@given(data=st.data())
def test_any_attach_geometry_is_answered_and_never_breaks_the_daemon(
    daemon: DaemonProcess, segment: ShmCache, data: st.DataObject
) -> None:
    size = os.path.getsize(segment.path)
    tensors = data.draw(st.lists(tensor_specs(segment.name, size), min_size=1, max_size=3))
    cache_id = f"geo-{next(_ids)}"
    with daemon.client(timeout=30) as client:
        body = msgspec.msgpack.encode({"type": "attach", "cache_id": cache_id, "tensors": tensors})
        sock = client._control_socket()  # the raw frame: specs msgspec would refuse to encode
        sock.send_multipart([b"", body])
        assert sock.poll(30_000), "no reply to an Attach"
        reply = msgspec.msgpack.decode(sock.recv_multipart()[-1])
        assert reply["type"] in ("attached", "error"), reply
        if reply["type"] == "attached":
            client.detach(cache_id)
        client.ping()


def test_a_valid_attach_of_the_fuzzed_segment_still_works(
    daemon: DaemonProcess, segment: ShmCache
) -> None:
    spec: TensorSpec = msgspec.structs.replace(segment.specs[0], memory=ShmRef(name=segment.name))
    with daemon.client() as client:
        client.attach("geo-ok", [spec])
        with pytest.raises(KvdError, match="cache_exists"):
            client.attach("geo-ok", [spec])
        client.detach("geo-ok")
