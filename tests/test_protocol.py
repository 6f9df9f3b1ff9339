"""The wire contract: round trips, the checked-in schema, and the golden vectors."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd import protocol as p
from kvd.schema import SOCKETS, golden_messages, schema

PROTOCOL_DIR = Path(__file__).resolve().parent.parent / "protocol"
MANIFEST = json.loads((PROTOCOL_DIR / "golden" / "manifest.json").read_text())


@pytest.mark.parametrize("name", sorted(golden_messages()))
def test_round_trip(name: str) -> None:
    socket, message = golden_messages()[name]
    decoder = msgspec.msgpack.Decoder(SOCKETS[socket])
    assert decoder.decode(msgspec.msgpack.encode(message)) == message


def test_schema_matches_code() -> None:
    checked_in = json.loads((PROTOCOL_DIR / "schema.json").read_text())
    assert checked_in == json.loads(json.dumps(schema())), (
        "protocol/schema.json drifted from kvd/protocol.py: run `python -m kvd.schema`"
    )


def test_every_message_type_has_a_golden_vector() -> None:
    tags = set()
    for union in SOCKETS.values():
        members = getattr(union, "__args__", (union,))
        tags |= {m.__struct_config__.tag for m in members}
    covered = {entry["decoded"]["type"] for entry in MANIFEST.values()}
    assert tags <= covered, f"no golden vector for {sorted(tags - covered)}"


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_golden_vector_decodes(name: str) -> None:
    entry = MANIFEST[name]
    frame = (PROTOCOL_DIR / "golden" / entry["file"]).read_bytes()
    message = msgspec.msgpack.Decoder(SOCKETS[entry["socket"]]).decode(frame)
    # The decoded value is what the manifest promises other implementations ...
    assert json.loads(msgspec.json.encode(message)) == entry["decoded"]
    # ... and kvd's encoding of it is byte-identical to the vector.
    assert msgspec.msgpack.encode(message) == frame


def test_unknown_fields_are_ignored() -> None:
    frame = msgspec.msgpack.encode(
        {
            "type": "read_done",
            "req_id": "r",
            "cache_id": "c",
            "remote_layout": "HND",
            "physical_block_ids": [1],
            "block_size_ratio": 2,
            "added_in_v1_5": [1, 2, 3],
        }
    )
    msg = msgspec.msgpack.Decoder(p.IngestMessage).decode(frame)
    assert isinstance(msg, p.ReadDone) and msg.physical_block_ids == [1]


def test_version_defaults_to_1_and_is_omitted() -> None:
    encoded = msgspec.msgpack.decode(msgspec.msgpack.encode(p.Ping()))
    assert encoded == {"type": "ping"}
    assert msgspec.msgpack.Decoder(p.ControlRequest).decode(msgspec.msgpack.encode(encoded)).v == 1


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=140)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)


def test_decode_header_reads_routing_fields_of_bad_frames() -> None:
    frame = msgspec.msgpack.encode(
        {"type": "read_done", "req_id": "r9", "cache_id": "c", "physical_block_ids": ["x"]}
    )
    header = p.decode_header(frame)
    assert header is not None
    assert (header.type, header.req_id, header.cache_id) == ("read_done", "r9", "c")
    assert p.decode_header(b"\xc1garbage") is None
    assert p.decode_header(msgspec.msgpack.encode([1, 2])) is None


def test_decode_header_is_bounded_and_never_recurses() -> None:
    nested = b"\x82" + msgspec.msgpack.encode("x") + b"\x91" * 500_000 + b"\xc0"
    nested += msgspec.msgpack.encode("req_id") + msgspec.msgpack.encode("late")
    assert p.decode_header(nested) == p.MessageHeader()  # gave up within its budget
    ids_first = msgspec.msgpack.encode({"physical_block_ids": list(range(4000)), "req_id": "r"})
    assert p.decode_header(ids_first).req_id == "r"
    too_long = msgspec.msgpack.encode({"req_id": "r" * 100, "cache_id": "c" * 1000})
    assert (p.decode_header(too_long).req_id, p.decode_header(too_long).cache_id) == ("r" * 100, "")


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=12), _values, max_size=8))
def test_decode_header_agrees_with_msgspec_on_any_map(fields: dict[str, object]) -> None:
    header = p.decode_header(msgspec.msgpack.encode(fields))
    assert header is not None
    for name in ("type", "req_id", "cache_id", "remote_engine_id"):
        value = fields.get(name)
        want = value if isinstance(value, str) and len(value) <= 128 else ""
        assert getattr(header, name) == want
    generation = fields.get("generation")
    ok = isinstance(generation, int) and not isinstance(generation, bool)
    assert header.generation == (generation if ok else 0)


def test_seq_frames() -> None:
    assert p.encode_seq(1) == b"\x00" * 7 + b"\x01"
    assert p.decode_seq(p.encode_seq(p.END_SEQ)) == 2**64 - 1
    with pytest.raises(ValueError, match="8 bytes"):
        p.decode_seq(b"\x01")
