"""The demo's prefill process: a KV cache filled with known content, exported with NIXL.

``python -m kvd.demo.prefill '<json>'`` (the orchestrator runs it). It prints one JSON line
``{"ready": ...}`` once its handshake socket is bound and serves until its stdin closes; given
on stdin how many request notifications to expect, it waits a little for them, then prints
``{"summary": ...}`` with the requests whose READ notifications it received, and exits.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import msgspec
import torch

from kvd.demo.content import fill
from kvd.nixl.exporter import Exporter
from kvd.protocol import Layout
from kvd.shm import physical_shape

NOTIFICATION_GRACE_S = 5.0


class PrefillSpec(msgspec.Struct, forbid_unknown_fields=True):
    engine_id: str
    block_size: int
    layout: Layout
    seed: int
    num_blocks: int
    layers: int
    heads: int
    head_dim: int
    endpoint: str


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)  # filling once is all the compute this process does
    spec = msgspec.json.decode(argv[0], type=PrefillSpec)
    shape = physical_shape(
        "split",
        spec.layout,
        num_blocks=spec.num_blocks,
        block_size=spec.block_size,
        num_heads=spec.heads,
        head_dim=spec.head_dim,
    )
    tensors = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(spec.layers)]
    for layer, tensor in enumerate(tensors):
        fill(tensor, spec.seed, 2 * layer, layout=spec.layout, heads=spec.heads)

    exporter = Exporter(
        spec.engine_id,
        tensors,
        layout=spec.layout,
        kv_arrangement="split",
        block_size=spec.block_size,
        endpoint=spec.endpoint,
    )
    stop = threading.Event()
    finished: list[str] = []

    server = threading.Thread(
        target=exporter.serve, args=(stop,), kwargs={"on_finished": finished.extend}, name="nixl"
    )
    server.start()
    _emit({"ready": {"engine_id": spec.engine_id, "endpoint": exporter.endpoint}})
    try:
        # The orchestrator writes how many notifications to expect, then closes our stdin;
        # EOF alone (it died) means stop now.
        expected = int(sys.stdin.read().strip() or 0)
        deadline = time.monotonic() + NOTIFICATION_GRACE_S
        while len(finished) < expected and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        server.join()
        exporter.close()
    _emit(
        {
            "summary": {
                "engine_id": spec.engine_id,
                "handshakes": exporter.handshakes,
                "notified_requests": sorted(finished),
                "bad_notifications": exporter.bad_notifications,
            }
        }
    )
    return 0


def _emit(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
