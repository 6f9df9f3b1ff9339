"""``kvd bench kernels``: the post-process against a plain copy and the vLLM-style chain.

For each case (layout pair, ratio, dtype) three things run on the same listed blocks of the
same tensors, in an order that rotates every repetition:

- ``copy``: a plain copy of the same number of bytes between two contiguous buffers (the floor:
  the post-process must read each byte once and write it once);
- ``kvd``: ``postprocess_tensors`` (the kernel, one call for every tensor);
- ``vllm``: the chain vLLM runs per tensor today (``index_select -> reshape/permute ->
  index_copy_``; NHD -> HND has no vLLM counterpart).

Reported: kvd's GB/s (listed bytes / time), and the medians of the per-repetition ratios
kvd/copy and vllm/kvd.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvd.dtypes import torch_dtype
from kvd.postprocess import Backend, BlockRows, block_rows, postprocess_tensors
from kvd.protocol import DTypeName

# The cases the targets name first, then the rest of the space.
CASES: list[tuple[str, str, int, DTypeName]] = [
    ("HND", "NHD", 1, "bfloat16"),
    ("HND", "NHD", 4, "bfloat16"),
    ("HND", "HND", 4, "bfloat16"),
    ("HND", "NHD", 16, "bfloat16"),
    ("HND", "HND", 2, "bfloat16"),
    ("NHD", "HND", 1, "bfloat16"),
    ("HND", "NHD", 4, "float8_e4m3fn"),
    ("HND", "NHD", 1, "float32"),
]
TARGET_CASES = {("HND", "NHD", 1), ("HND", "NHD", 4), ("HND", "HND", 4)}
TARGET_COPY = {"cpu": 2.0}  # at most this many times a plain copy
TARGET_VLLM = 3.0  # at least this many times faster than the vLLM-style chain
TARGET_COPY_BANDWIDTH = {"cuda": 0.8}  # at least this fraction of a copy's bandwidth


@dataclass
class Row:
    remote_layout: str
    local_layout: str
    ratio: int
    dtype: str
    mbytes: float
    kvd_gbps: float
    copy_gbps: float
    kvd_over_copy: float
    vllm_over_kvd: float | None
    meets_target: bool | None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def vllm_chain(
    physical: torch.Tensor, idx: torch.Tensor, *, remote: str, local: str, ratio: int
) -> None:
    """vLLM's decode-side post-process on one tensor, as its connector runs it.

    vLLM sees the cache as logical (num_blocks, block_size, heads, head_dim); an HND cache is a
    permuted view of HND physical memory.
    """
    if local == "NHD" and remote == "HND" and ratio == 1:
        blocks = physical.index_select(0, idx)
        n, bs, h, d = blocks.shape
        physical.index_copy_(0, idx, blocks.reshape(n, h, bs, d).permute(0, 2, 1, 3))
    elif local == "NHD" and remote == "HND":
        blocks = physical.index_select(0, idx)
        n, bs, h, d = blocks.shape
        merged = blocks.reshape(n, ratio, h, bs // ratio, d).permute(0, 1, 3, 2, 4).flatten(1, 2)
        physical.index_copy_(0, idx, merged)
    elif local == "HND" and remote == "HND":
        logical = physical.permute(0, 2, 1, 3)
        blocks = logical.index_select(0, idx).permute(0, 2, 1, 3)
        n, h, bs, d = blocks.shape
        merged = blocks.reshape(n, ratio, h, bs // ratio, d).permute(0, 2, 1, 3, 4).flatten(2, 3)
        logical.index_copy_(0, idx, merged.permute(0, 2, 1, 3))
    else:
        raise ValueError(f"vLLM has no post-process for {remote} -> {local}")


def run_case(
    args: argparse.Namespace, remote: str, local: str, ratio: int, dtype_name: DTypeName
) -> Row:
    device = torch.device(args.device)
    dtype = torch_dtype(dtype_name)
    shape_block = (
        (args.block_size, args.heads, args.head_dim)
        if local == "NHD"
        else (args.heads, args.block_size, args.head_dim)
    )
    torch.manual_seed(0)
    raw_shape = (args.num_blocks, *shape_block[:-1], shape_block[-1] * dtype.itemsize)
    parts = [  # K and V of every layer, as split tensors; random bytes made where they live
        torch.randint(0, 256, raw_shape, dtype=torch.uint8, device=device).view(dtype)
        for _ in range(2 * args.layers)
    ]
    views: list[BlockRows] = [
        block_rows(p, layout=local, block_size=args.block_size, num_heads=args.heads) for p in parts
    ]
    ids = torch.randperm(args.num_blocks)[: args.blocks].tolist()
    idx = torch.tensor(ids, device=device)
    listed = sum(p[0].numel() * p.element_size() for p in parts) * len(ids)
    src = torch.empty(listed, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    backend: Backend = args.backend

    def kvd() -> None:
        postprocess_tensors(views, ids, ratio=ratio, remote_layout=remote, backend=backend)

    def copy() -> None:
        dst.copy_(src)

    has_vllm = not (remote == "NHD" and local == "HND")

    # vLLM keeps fp8 caches in uint8 storage (and torch has no CPU index_copy_ for fp8).
    vllm_parts = [p.view(torch.uint8) if p.element_size() == 1 else p for p in parts]

    def vllm() -> None:
        for p in vllm_parts:
            vllm_chain(p, idx, remote=remote, local=local, ratio=ratio)

    runs: dict[str, Callable[[], None]] = {"copy": copy, "kvd": kvd}
    if has_vllm:
        runs["vllm"] = vllm
    for fn in runs.values():  # warm-up (first-touch, kernel compilation)
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for rep in range(args.repeat):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            times[name].append(_timed(runs[name], device))
    kvd_over_copy = statistics.median(
        k / c for k, c in zip(times["kvd"], times["copy"], strict=True)
    )
    vllm_over_kvd = (
        statistics.median(v / k for v, k in zip(times["vllm"], times["kvd"], strict=True))
        if has_vllm
        else None
    )
    meets: bool | None = None
    if (remote, local, ratio) in TARGET_CASES and dtype_name == "bfloat16":
        meets = vllm_over_kvd is not None and vllm_over_kvd >= TARGET_VLLM
        if device.type in TARGET_COPY:
            meets = meets and kvd_over_copy <= TARGET_COPY[device.type]
        if device.type in TARGET_COPY_BANDWIDTH:
            meets = meets and 1 / kvd_over_copy >= TARGET_COPY_BANDWIDTH[device.type]
    return Row(
        remote_layout=remote,
        local_layout=local,
        ratio=ratio,
        dtype=dtype_name,
        mbytes=listed / 1e6,
        kvd_gbps=listed / statistics.median(times["kvd"]) / 1e9,
        copy_gbps=listed / statistics.median(times["copy"]) / 1e9,
        kvd_over_copy=kvd_over_copy,
        vllm_over_kvd=vllm_over_kvd,
        meets_target=meets,
    )


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("kvd bench kernels: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    rows = []
    for remote, local, ratio, dtype in CASES:
        if args.block_size % ratio:
            continue
        row = run_case(args, remote, local, ratio, dtype)
        rows.append(row)
        if not args.json:
            print(
                f"  {remote}->{local} r={ratio} {dtype}: {row.kvd_gbps:.1f} GB/s", file=sys.stderr
            )
    report: dict[str, Any] = {
        "benchmark": "kernels",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "backend": args.backend,
        "geometry": {
            "layers": args.layers,
            "tensors": 2 * args.layers,
            "num_blocks": args.num_blocks,
            "listed_blocks": args.blocks,
            "block_size": args.block_size,
            "heads": args.heads,
            "head_dim": args.head_dim,
        },
        "repeat": args.repeat,
        "targets": {
            "vllm_over_kvd_at_least": TARGET_VLLM,
            "kvd_over_copy_at_most": TARGET_COPY.get(device.type),
            "copy_bandwidth_fraction_at_least": TARGET_COPY_BANDWIDTH.get(device.type),
            "cases": sorted(f"{r}->{lo} r={n} bfloat16" for r, lo, n in TARGET_CASES),
        },
        "rows": [asdict(r) for r in rows],
        "meets_targets": all(r.meets_target for r in rows if r.meets_target is not None),
    }
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


def _table(report: dict[str, Any]) -> str:
    g = report["geometry"]
    lines = [
        f"kvd bench kernels on {report['device_name']} ({report['threads']} threads, backend "
        f"{report['backend']}): {g['tensors']} tensors x {g['listed_blocks']} of "
        f"{g['num_blocks']} blocks, {g['block_size']} tokens x {g['heads']} heads x "
        f"{g['head_dim']} head_dim, median of {report['repeat']} interleaved repetitions",
        "",
        f"{'case':28}{'MB':>8}{'kvd GB/s':>10}{'copy GB/s':>11}{'kvd/copy':>10}{'vllm/kvd':>10}"
        "  target",
    ]
    for r in report["rows"]:
        case = f"{r['remote_layout']}->{r['local_layout']} r={r['ratio']} {r['dtype']}"
        vllm = f"{r['vllm_over_kvd']:.1f}x" if r["vllm_over_kvd"] is not None else "n/a"
        target = {None: "", True: "met", False: "MISSED"}[r["meets_target"]]
        lines.append(
            f"{case:28}{r['mbytes']:>8.1f}{r['kvd_gbps']:>10.1f}{r['copy_gbps']:>11.1f}"
            f"{r['kvd_over_copy']:>9.2f}x{vllm:>10}  {target}"
        )
    t = report["targets"]
    bound = (
        f"kvd/copy <= {t['kvd_over_copy_at_most']}x"
        if t["kvd_over_copy_at_most"]
        else f">= {t['copy_bandwidth_fraction_at_least']:.0%} of copy bandwidth"
    )
    lines += [
        "",
        f"targets for {', '.join(t['cases'])}: {bound} and vllm/kvd >= "
        f"{t['vllm_over_kvd_at_least']}x",
        "meets targets: " + ("yes" if report["meets_targets"] else "no"),
    ]
    return "\n".join(lines)
