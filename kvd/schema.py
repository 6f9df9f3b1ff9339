"""Generates the language-neutral contract in ``protocol/``: the JSON Schema and golden messages.

``python -m kvd.schema`` rewrites ``protocol/schema.json``; ``--golden`` also (re)writes the
golden vectors. Golden vectors are a promise to other implementations: once released, a vector
must keep decoding, so regenerate them only when adding new ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from kvd import protocol as p

SOCKETS: dict[str, Any] = {
    "control_request": p.ControlRequest,
    "control_reply": p.ControlReply,
    "ingest": p.IngestMessage,
    "event": p.Event,
    "replay_request": p.Replay,
    "replay_end": p.ReplayEnd,
    "handshake_request": p.Handshake,
    "handshake_reply": p.HandshakeReply,
}
"""The union each socket direction carries, by name."""


def schema() -> dict[str, Any]:
    """One document: a root per socket direction, shared definitions under $defs."""
    roots, defs = msgspec.json.schema_components(
        list(SOCKETS.values()), ref_template="#/$defs/{name}"
    )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"kvd wire protocol, version {p.PROTOCOL_VERSION}",
        "description": (
            "MessagePack-encoded messages; the 'type' field tags each union. See "
            "protocol/README.md for sockets, frames and semantics."
        ),
        "protocol_version": p.PROTOCOL_VERSION,
        "sockets": dict(zip(SOCKETS, roots, strict=True)),
        "$defs": defs,
    }


def golden_messages() -> dict[str, tuple[str, Any]]:
    """Named example messages, one or more per message type, with the socket they travel on."""
    shm = p.ShmRef(name="kvd-cache-0", offset=4096)
    tensor = p.TensorSpec(
        name="layer.0",
        shape=[2, 1024, 16, 8, 128],
        dtype="bfloat16",
        layout="NHD",
        kv_arrangement="split",
        block_size=16,
        memory=shm,
    )
    return {
        "attach": ("control_request", p.Attach(cache_id="engine0", tensors=[tensor])),
        "attach_cuda_ipc": (
            "control_request",
            p.Attach(
                cache_id="engine0",
                tensors=[
                    p.TensorSpec(
                        name="layer.0",
                        shape=[1024, 2, 8, 64, 128],
                        dtype="float8_e4m3fn",
                        layout="HND",
                        kv_arrangement="blocks_first",
                        block_size=64,
                        memory=p.CudaIpcRef(
                            handle=bytes(range(64)), offset=1 << 20, device_uuid="GPU-0000"
                        ),
                    )
                ],
            ),
        ),
        "attach_groups": (
            "control_request",
            p.Attach(
                cache_id="engine0",
                tensors=[
                    p.TensorSpec(
                        name="model.layers.0.self_attn.attn",
                        shape=[4096, 2, 64, 128],
                        dtype="float32",
                        block_size=64,
                        memory=p.ShmRef(name="kvd-vllm-1234", offset=0),
                        page_format="cpu_attn_vec",
                        num_heads=2,
                        head_dim=64,
                    ),
                    p.TensorSpec(
                        name="model.layers.1.self_attn.attn",
                        shape=[4096, 2, 32, 256],
                        dtype="float32",
                        block_size=32,
                        memory=p.ShmRef(name="kvd-vllm-1234", offset=0),
                        page_format="cpu_attn_vec",
                        num_heads=2,
                        head_dim=128,
                        group=1,
                    ),
                ],
                engine_id="decode-0",
            ),
        ),
        "detach": ("control_request", p.Detach(cache_id="engine0")),
        "status": ("control_request", p.Status()),
        "status_request": ("control_request", p.Status(req_id="req-1")),
        "ping": ("control_request", p.Ping()),
        "configure": ("control_request", p.Configure(batch_window_us=50)),
        "configure_auto": (
            "control_request",
            p.Configure(batch_window_us="auto", max_batch_blocks=4096),
        ),
        "heartbeat": ("control_request", p.Heartbeat(engine_id="decode-0")),
        "attached": (
            "control_reply",
            p.Attached(
                cache_id="engine0", num_blocks=1024, block_size=16, num_tensors=1, nbytes=67108864
            ),
        ),
        "detached": ("control_reply", p.Detached(cache_id="engine0")),
        "request_status": (
            "control_reply",
            p.RequestStatus(req_id="req-1", state="launched", cache_id="engine0"),
        ),
        "daemon_status": (
            "control_reply",
            p.DaemonStatus(
                version="0.1.0",
                protocol_version=1,
                pid=4242,
                uptime_s=12.5,
                device="cpu",
                batch_window_us=0,
                max_batch_blocks=8192,
                in_flight=0,
                caches=[
                    p.CacheInfo(
                        cache_id="engine0",
                        num_blocks=1024,
                        block_size=16,
                        num_tensors=1,
                        nbytes=67108864,
                    )
                ],
                counters={"ready": 10, "failed": 1},
                rejections={"unknown_cache": 1},
            ),
        ),
        "pong": ("control_reply", p.Pong(version="0.1.0", protocol_version=1, pid=4242)),
        "configured": (
            "control_reply",
            p.Configured(batch_window_us=40, max_batch_blocks=4096, batch_window_auto=True),
        ),
        "lease": (
            "control_reply",
            p.Lease(engine_id="decode-0", lease_s=30.0, cache_ids=["engine0"]),
        ),
        "error": (
            "control_reply",
            p.Error(code="unknown_cache", message="cache_id: 'x' is not attached"),
        ),
        "read_done": (
            "ingest",
            p.ReadDone(
                req_id="req-1",
                cache_id="engine0",
                remote_layout="HND",
                physical_block_ids=[7, 3, 12],
                block_size_ratio=4,
                remote_engine_id="prefill-0",
            ),
        ),
        "read_done_remote_block_size": (
            "ingest",
            p.ReadDone(
                req_id="req-2",
                cache_id="engine0",
                remote_layout="NHD",
                physical_block_ids=[1],
                remote_block_size=16,
            ),
        ),
        "read_done_groups": (
            "ingest",
            p.ReadDone(
                req_id="req-4",
                cache_id="engine0",
                remote_format="cpu_attn_vec",
                physical_block_ids=[9, 4, 5, 6],
                remote_block_size=16,
                groups=[
                    p.BlockGroup(num_blocks=1, covered_sub_blocks=2),
                    p.BlockGroup(num_blocks=3, covered_sub_blocks=5),
                ],
                v=p.GROUPS_VERSION,
            ),
        ),
        "read_done_remote_ranks": (
            "ingest",
            p.ReadDone(
                req_id="req-6",
                cache_id="engine0",
                remote_format="cpu_attn_vec",
                physical_block_ids=[3, 8],
                remote_block_size=64,
                remote_ranks=2,
                v=p.RANKS_VERSION,
            ),
        ),
        "read_done_cuda_event": (
            "ingest",
            p.ReadDone(
                req_id="req-5",
                cache_id="engine0",
                remote_format="HND",
                physical_block_ids=[2, 6],
                remote_block_size=16,
                cuda_event=bytes(range(64, 128)),
            ),
        ),
        "read_failed": (
            "ingest",
            p.ReadFailed(
                req_id="req-3",
                cache_id="engine0",
                physical_block_ids=[4, 5],
                reason="NIXL transfer state ERR",
            ),
        ),
        "ready": (
            "event",
            p.Ready(
                req_id="req-1",
                cache_id="engine0",
                physical_block_ids=[7, 3, 12],
                remote_engine_id="prefill-0",
                elapsed_us=180,
            ),
        ),
        "ready_cuda_event": (
            "event",
            p.Ready(
                req_id="req-2",
                cache_id="engine0",
                physical_block_ids=[9],
                elapsed_us=35,
                epoch=7,
                cuda_event=bytes(range(64)),
            ),
        ),
        "failed": (
            "event",
            p.Failed(
                req_id="req-4",
                cache_id="engine0",
                code="block_out_of_range",
                message="physical_block_ids: [4096] outside [0, 1024)",
                invalid_block_ids=[4096],
            ),
        ),
        "replay": ("replay_request", p.Replay(topic="engine0", from_seq=17)),
        "replay_end": (
            "replay_end",
            p.ReplayEnd(topic="engine0", oldest_seq=1, newest_seq=42, epoch=6917529027641081856),
        ),
        "handshake": ("handshake_request", p.Handshake(engine_id="decode-0")),
        "cache_description": (
            "handshake_reply",
            p.CacheDescription(
                engine_id="prefill-0",
                agent_name="prefill-0",
                agent_metadata=b"opaque NIXL agent metadata",
                mem_type="DRAM",
                num_blocks=1024,
                block_size=16,
                layout="HND",
                kv_arrangement="split",
                dtype="bfloat16",
                num_heads=8,
                head_dim=128,
                tensors=[
                    p.RemoteTensor(
                        name="layer.0", base_addr=1 << 40, nbytes=67108864, block_len=32768
                    )
                ],
            ),
        ),
        "cache_description_page_format": (
            "handshake_reply",
            p.CacheDescription(
                engine_id="prefill-1",
                agent_name="prefill-1",
                agent_metadata=b"opaque NIXL agent metadata",
                mem_type="VRAM",
                device_id=1,
                num_blocks=512,
                block_size=64,
                layout="HND",
                kv_arrangement="split",
                dtype="bfloat16",
                num_heads=8,
                head_dim=128,
                tensors=[
                    p.RemoteTensor(
                        name="layer.0", base_addr=1 << 40, nbytes=134217728, block_len=131072
                    )
                ],
                page_format="HND",
            ),
        ),
    }


def write(root: Path, golden: bool) -> list[Path]:
    written = []
    schema_path = root / "schema.json"
    schema_path.write_text(json.dumps(schema(), indent=2, sort_keys=True) + "\n")
    written.append(schema_path)
    if golden:
        directory = root / "golden"
        directory.mkdir(exist_ok=True)
        encoder = msgspec.msgpack.Encoder()
        manifest = {}
        for name, (socket, message) in golden_messages().items():
            path = directory / f"{name}.msgpack"
            path.write_bytes(encoder.encode(message))
            written.append(path)
            manifest[name] = {
                "socket": socket,
                "file": path.name,
                # bytes fields appear base64-encoded, as msgspec's JSON does.
                "decoded": json.loads(msgspec.json.encode(message)),
            }
        manifest_path = directory / "manifest.json"
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
        written.append(manifest_path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvd.schema", description=__doc__)
    parser.add_argument("--root", default="protocol", help="the protocol directory")
    parser.add_argument("--golden", action="store_true", help="also rewrite the golden vectors")
    args = parser.parse_args(argv)
    for path in write(Path(args.root), args.golden):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
