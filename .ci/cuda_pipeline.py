"""The whole path on a GPU with real transforms: ``kvd serve --device cuda:0``, a KV cache in
this process attached over CUDA IPC, HND pages rewritten into the NHD cache.

Sends ``--messages`` notifications of ``--blocks`` blocks each (every one its own blocks, so
each block is rewritten exactly once), ``--concurrency`` in flight, and times each from send to
its event (``kvd.bench.pipeline.drive``). Then checks a sample of requests' blocks against the
reference, and every unlisted block untouched. With ``--ready-cuda-event`` the Ready events
carry CUDA events and the latency is to the Ready (the work is enqueued, not done). With
``--engine-markers`` every ReadDone carries a marker recorded on this process's stream when it
is sent (``kvd.cudaipc.HandOffMarkers``), which kvd's stream waits on before writing: with both,
the two directions of ordering on the GPU.

Prints one ``PASS``/``FAIL`` line and writes the figures as JSON to ``--out``. Run by
``.ci/device-check``; needs the repository root on PYTHONPATH (``tests.reference``).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import zmq

from kvd.bench.pipeline import Mix, MixError, Target, drive
from kvd.client import Client, read_done_message
from kvd.cudaipc import HandOffMarkers, export_tensor
from kvd.daemon_process import DaemonProcess
from kvd.protocol import TensorSpec
from tests.reference import expected_block, same_bytes

CACHE_ID = "gpu0"
BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 16, 8, 128, 4
WARMUP = 50


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--ready-cuda-event", action="store_true")
    parser.add_argument("--engine-markers", action="store_true")
    parser.add_argument("--sample", type=int, default=64, help="requests whose bytes are checked")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    mode = "cuda-event Ready" if args.ready_cuda_event else "host Ready"
    if args.engine_markers:
        mode += ", engine markers"
    name = f"pipeline on CUDA ({mode})"
    try:
        report = run(args)
    except (MixError, AssertionError, RuntimeError) as exc:
        print(f"FAIL {name}: {type(exc).__name__}: {exc}")
        return 1
    args.out.write_text(json.dumps(report, indent=2))
    figures = report["figures"]
    line = (
        f"{report['messages']} notifications of {args.blocks} blocks, "
        f"{figures['throughput']:,.0f}/s, p50 {figures['p50_us']:.0f} us, "
        f"p99 {figures['p99_us']:.0f} us, {figures['failed']} failed, "
        f"{report['verified_requests']} requests' bytes verified"
    )
    ok = figures["failed"] == 0 and report["verified_requests"] > 0
    print(f"{'PASS' if ok else 'FAIL'} {name}: {line}")
    return 0 if ok else 1


def run(args: argparse.Namespace) -> dict[str, object]:
    total = WARMUP + args.messages
    num_blocks = total * args.blocks + 1  # the last one is never listed
    torch.manual_seed(0)
    shape = [2, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM]
    tensors = [
        torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device="cuda").view(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    rng = random.Random(0)
    sampled = sorted(rng.sample(range(WARMUP, total), min(args.sample, args.messages)))
    ids_of = {n: list(range(n * args.blocks, (n + 1) * args.blocks)) for n in sampled}
    before = {
        (layer, kv, b): tensors[layer][kv, b].cpu()
        for layer in range(LAYERS)
        for kv in range(2)
        for n in sampled
        for b in ids_of[n]
    }
    last = [t[:, num_blocks - 1].cpu() for t in tensors]
    torch.cuda.synchronize()
    specs = [
        TensorSpec(
            name=f"layer.{i}",
            shape=list(t.shape),
            dtype="bfloat16",
            layout="NHD",
            kv_arrangement="split",
            block_size=BLOCK_SIZE,
            memory=export_tensor(t),
        )
        for i, t in enumerate(tensors)
    ]
    flags = ["--device", "cuda:0", "--log-level", "warning"]
    if args.ready_cuda_event:
        flags += ["--ready-cuda-event", "true"]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with DaemonProcess(*flags) as daemon, Client(daemon.runtime_dir, timeout=60) as client:
        client.attach(CACHE_ID, specs)
        endpoints = daemon.endpoints()
        target = Target(ctx, endpoints.ingest, endpoints.events, CACHE_ID)
        probes = iter(range(1 << 30))
        # Until events flow (SUB connects asynchronously): NHD into NHD, nothing to rewrite.
        target.warm_up(
            lambda tag: read_done_message(
                f"probe-{next(probes)}", CACHE_ID, [0], remote_layout="NHD", block_size_ratio=1
            )
        )

        markers = HandOffMarkers(limit=2 * args.concurrency + 2)
        carried: collections.deque[bytes] = collections.deque()

        def marker() -> bytes:
            """A marker recorded now on this process's stream. ``drive`` keeps at most
            ``concurrency`` notifications in flight, so the one sent ``concurrency + 1``
            before this one was most likely answered and its marker is dropped (answers come
            out of order: recording one again before kvd waited on it would only make kvd
            wait for a later point of this stream, never an earlier one)."""
            if not args.engine_markers:
                return b""
            while len(carried) > args.concurrency:
                markers.drop(carried.popleft())
            handle = markers.record()
            assert handle is not None, "more markers carried than notifications in flight"
            markers.carry(handle)
            carried.append(handle)
            return handle

        def make(req_id: str, slot: int) -> bytes:
            blocks = list(range(slot * args.blocks, (slot + 1) * args.blocks))
            return read_done_message(
                req_id,
                CACHE_ID,
                blocks,
                remote_layout="HND",
                block_size_ratio=1,
                cuda_event=marker(),
            )

        try:
            figures = drive(
                target,
                make,
                slots=total,  # as many slots as notifications: every block rewritten once
                mix=Mix(messages=args.messages, concurrency=args.concurrency, warmup=WARMUP),
                prefix="n",
            )
        finally:
            target.close()
            ctx.term()
        deadline = time.monotonic() + 30
        while client.status().in_flight:  # with CUDA-event Ready, work may still run
            if time.monotonic() > deadline:
                raise MixError("requests still in flight 30 s after the last event")
            time.sleep(0.05)
        torch.cuda.synchronize()
        for (layer, kv, b), was in before.items():
            want = expected_block(
                was,
                kv_parts=1,
                block_size=BLOCK_SIZE,
                heads=HEADS,
                ratio=1,
                remote_layout="HND",
                local_layout="NHD",
            )
            assert same_bytes(tensors[layer][kv, b].cpu(), want), f"layer {layer} block {b}"
        for layer, was in enumerate(last):
            assert same_bytes(tensors[layer][:, num_blocks - 1].cpu(), was), "unlisted changed"
        client.detach(CACHE_ID)
    return {
        "mode": "cuda_event" if args.ready_cuda_event else "host",
        "engine_markers": args.engine_markers,
        "messages": args.messages,
        "blocks_per_message": args.blocks,
        "concurrency": args.concurrency,
        "geometry": {
            "layers": LAYERS,
            "block_size": BLOCK_SIZE,
            "heads": HEADS,
            "head_dim": HEAD_DIM,
        },
        "figures": asdict(figures),
        "verified_requests": len(sampled),
    }


if __name__ == "__main__":
    sys.exit(main())
