"""Every CUDA kernel variant against a plain ``copy_``, per GPU page format, in one run.

For each bfloat16 case of ``kvd bench kernels`` whose local format is a GPU one, the in-place
kernel prepared for each tile size of ``kvd.kernels.gpu.TILE_CHOICES`` and a ``copy_`` of the
same bytes, interleaved, ``--repeat`` times; then the tile kvd's own warm-up measurement
(``gpu.tune``) picks. Then the small batch: 1 to 4 blocks from the call to its event complete,
through a captured launch (``gpu.Replay``) and a direct one, against one small ``copy_``.

Prints one ``INFO`` line per case and per batch size, and a ``PASS``/``FAIL`` line per case:
whether the tile warm-up picked is within ``--tolerance`` of the best measured here (the choice
is made from data on the device, so this checks that the data agree). Writes everything as JSON
to ``--out``. Run by ``.ci/device-check``; needs kvd on PYTHONPATH and a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvd.bench.kernels import (
    CASES,
    LATENCY_BLOCKS,
    NOT_GPU_FORMATS,
    SMALL_COPY_BYTES,
    Case,
    _tensors,
    _timed,
)
from kvd.kernels import gpu
from kvd.kernels.device import lane_for
from kvd.kernels.postprocess import CachePostProcess, region_views
from kvd.layout.formats import PRESETS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("FAIL variants: no CUDA device")
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    lane_for(device).enter()  # everything on kvd's stream, as its executor runs it
    report: dict[str, Any] = {
        "device_name": torch.cuda.get_device_name(device),
        "geometry": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "tile_choices": list(gpu.TILE_CHOICES),
        "cases": [],
        "latency": [],
    }
    failed = False
    cases = [
        c
        for c in CASES
        if c.dtype == "bfloat16"
        and c.local not in NOT_GPU_FORMATS
        and args.block_size % abs(c.ratio) == 0
    ]
    for case in cases:
        try:
            entry = tiles(args, case, device)
        except Exception as exc:  # noqa: BLE001 (one case's failure must not hide the others)
            print(f"FAIL variants {case.label}: {type(exc).__name__}: {exc}", flush=True)
            failed = True
            continue
        report["cases"].append(entry)
        measured = entry["measured"]
        if not measured:
            print(f"INFO variants {case.label}: nothing to rewrite", flush=True)
            continue
        line = ", ".join(f"{m['tile_bytes'] >> 10} KiB {m['of_copy']:.0%}" for m in measured)
        best = max(measured, key=lambda m: m["of_copy"])
        print(
            f"INFO variants {case.label}: {line} of copy_ bandwidth; best "
            f"{best['tile_bytes'] >> 10} KiB",
            flush=True,
        )
        chosen = entry["chosen_tile_bytes"]
        if chosen is None:
            continue  # one shape only: nothing to choose
        got = next((m["of_copy"] for m in measured if m["tile_bytes"] == chosen), None)
        ok = got is not None and got >= best["of_copy"] * (1 - args.tolerance)
        failed |= not ok
        print(
            f"{'PASS' if ok else 'FAIL'} variants {case.label}: warm-up chose "
            f"{chosen >> 10} KiB ({got if got is None else f'{got:.0%}'}), best here "
            f"{best['tile_bytes'] >> 10} KiB ({best['of_copy']:.0%})",
            flush=True,
        )
    try:
        report["latency"] = latency(args, device)
    except Exception as exc:  # noqa: BLE001
        print(f"FAIL variants latency: {type(exc).__name__}: {exc}", flush=True)
        failed = True
    for row in report["latency"]:
        print(
            f"INFO variants latency: {row['blocks']} block(s): captured {row['replay_us']:.1f} "
            f"us ({row['replay_over_copy']:.2f}x), direct {row['direct_us']:.1f} us "
            f"({row['direct_over_copy']:.2f}x), one small copy_ {row['copy_us']:.1f} us",
            flush=True,
        )
    args.out.write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


def _post(args: argparse.Namespace, case: Case, device: torch.device) -> tuple[Any, ...]:
    tensors, geometry, listed_blocks = _tensors(args, case, device)
    post = CachePostProcess([v for t in tensors for v in region_views(t, geometry)], device)
    ids = torch.randperm(geometry.num_blocks)[:listed_blocks].tolist()
    return tensors, geometry, post, ids


def tiles(args: argparse.Namespace, case: Case, device: torch.device) -> dict[str, Any]:
    """Each tile size forced in turn, against ``copy_``; then warm-up's own choice."""
    nD, nP = case.block_sizes(args.block_size)
    remote = PRESETS[case.remote]
    tensors, geometry, _, ids = _post(args, case, device)
    default = gpu.TILE_BYTES
    measured: list[dict[str, Any]] = []
    shapes: set[tuple[int, ...]] = set()
    listed = 0
    try:
        for tile in gpu.TILE_CHOICES:
            gpu.TILE_BYTES = tile
            gpu._tiles.clear()
            post = CachePostProcess([v for t in tensors for v in region_views(t, geometry)], device)
            post.apply([(ids, 0)], remote, nP)  # compiles it
            launches = post._launches[(remote, nP, 0)]
            prepared = [la.prepared for la in launches if la.prepared is not None]
            if not prepared or not all(p.in_place for p in prepared):
                break  # nothing to rewrite, or through scratch: no tile to choose
            shape = tuple(s for p in prepared for s in p.shape)
            if shape in shapes:
                continue  # the same kernels as a larger tile
            shapes.add(shape)
            listed = post.block_bytes * len(ids)
            src = torch.empty(listed, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            kvd_t, copy_t = [], []
            for rep in range(args.repeat):
                runs: list[tuple[list[float], Callable[[], object]]] = [
                    (kvd_t, lambda post=post: post.apply([(ids, 0)], remote, nP)),
                    (copy_t, lambda dst=dst, src=src: dst.copy_(src)),
                ]
                for times, fn in runs if rep % 2 else runs[::-1]:
                    times.append(_timed(fn, device))
            measured.append(
                {
                    "tile_bytes": tile,
                    "warps": [p.num_warps for p in prepared],
                    "slice_bytes": [p.slice_words * p.width for p in prepared],
                    "kvd_gbps": listed / statistics.median(kvd_t) / 1e9,
                    "copy_gbps": listed / statistics.median(copy_t) / 1e9,
                    "of_copy": statistics.median(c / k for k, c in zip(kvd_t, copy_t, strict=True)),
                }
            )
    finally:
        gpu.TILE_BYTES = default
        gpu._tiles.clear()
    chosen = None
    if len(measured) > 1:
        post = CachePostProcess([v for t in tensors for v in region_views(t, geometry)], device)
        post.warm_up(remote, nP)
        tiles_chosen = {v.get("tile_bytes") for v in post.variants(remote, nP)}
        chosen = tiles_chosen.pop() if len(tiles_chosen) == 1 else None
    del tensors
    torch.cuda.empty_cache()
    return {
        "case": case.label,
        "block_size": nD,
        "listed_mbytes": listed / 1e6,
        "measured": measured,
        "chosen_tile_bytes": chosen,
    }


def latency(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """1 to 4 blocks (HND -> NHD, as ``kvd bench kernels``) from the call to its event complete,
    through the captured launch and directly, each against one small ``copy_``."""
    case = Case("HND", "NHD", 1, "bfloat16")
    _, nP = case.block_sizes(args.block_size)
    remote = PRESETS["HND"]
    tensors, _, post, ids = _post(args, case, device)
    post.warm_up(remote, nP)
    (launch,) = post._launches[(remote, nP, 0)]
    if not launch.replays:  # warm-up found them slower: make them anyway, to measure them
        assert launch.prepared is not None
        where = post._where(launch.bundle)
        for n in range(1, gpu.GRAPH_GROUPS + 1):
            launch.replays[n] = gpu.Replay(launch.prepared, where, post.lane, n)
    replays = dict(launch.replays)
    stream = post.lane.stream
    src = torch.empty(SMALL_COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    event = torch.cuda.Event()

    def timed(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        event.record(stream)
        event.synchronize()
        return (time.perf_counter() - start) * 1e6

    rows = []
    repeat = max(50, 20 * args.repeat)
    try:
        for n in LATENCY_BLOCKS:
            requests = [(ids[:n], 0)]
            times: dict[str, list[float]] = {"replay": [], "direct": [], "copy": []}
            for rep in range(repeat + 5):
                launch.replays.clear()
                launch.replays.update(replays)
                replay_t = timed(lambda: post.apply(requests, remote, nP))  # noqa: B023
                launch.replays.clear()
                direct_t = timed(lambda: post.apply(requests, remote, nP))  # noqa: B023
                copy_t = timed(lambda: dst.copy_(src))
                if rep >= 5:
                    times["replay"].append(replay_t)
                    times["direct"].append(direct_t)
                    times["copy"].append(copy_t)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append(
                {
                    "blocks": n,
                    "replay_us": med["replay"],
                    "direct_us": med["direct"],
                    "copy_us": med["copy"],
                    "replay_over_copy": statistics.median(
                        r / c for r, c in zip(times["replay"], times["copy"], strict=True)
                    ),
                    "direct_over_copy": statistics.median(
                        d / c for d, c in zip(times["direct"], times["copy"], strict=True)
                    ),
                }
            )
    finally:
        launch.replays.clear()
        launch.replays.update(replays)
    del tensors
    return rows


if __name__ == "__main__":
    sys.exit(main())
