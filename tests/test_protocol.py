"""The wire contract: round trips, the checked-in schema, and the golden vectors."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

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


def test_decode_header_reads_routing_fields_of_bad_frames() -> None:
    frame = msgspec.msgpack.encode(
        {"type": "read_done", "req_id": "r9", "cache_id": "c", "physical_block_ids": ["x"]}
    )
    header = p.decode_header(frame)
    assert header is not None
    assert (header.req_id, header.cache_id, header.physical_block_ids) == ("r9", "c", [])
    assert p.decode_header(b"\xc1garbage") is None
    assert p.decode_header(msgspec.msgpack.encode([1, 2])) is None


def test_seq_frames() -> None:
    assert p.encode_seq(1) == b"\x00" * 7 + b"\x01"
    assert p.decode_seq(p.encode_seq(p.END_SEQ)) == 2**64 - 1
    with pytest.raises(ValueError, match="8 bytes"):
        p.decode_seq(b"\x01")
