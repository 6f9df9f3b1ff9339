"""``kvd bench kernels``: the post-process against a plain copy and the vLLM-style chain.

For each case (remote format -> local format, block sizes, dtype) three things run on the same
listed blocks of the same tensors, in an order that rotates every repetition:

- ``copy``: a plain copy of the same number of bytes between two contiguous buffers (the floor:
  the post-process must read each byte once and write it once);
- ``kvd``: ``CachePostProcess.apply`` (one kernel call per plan for every tensor);
- ``vllm``: the chain vLLM runs per tensor (``index_select -> reshape/permute -> index_copy_``),
  where vLLM has one for the case.

Reported: kvd's GB/s (listed bytes / time), and the medians of the per-repetition ratios
kvd/copy and vllm/kvd. On CUDA also the latency of a small batch (1 to 4 blocks: from the call
to its event complete, against one small ``copy_`` the same way), and each compiled kernel's
registers and spills.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvd.dtypes import torch_dtype
from kvd.kernels.postprocess import CachePostProcess, region_views
from kvd.layout.formats import PRESETS, PageSizes, is_cross_layer, page_elements
from kvd.layout.geometry import TensorGeometry
from kvd.progress import progress_bar
from kvd.protocol import DTypeName
from kvd.tables import format_table
from kvd.torch_cuda import torch_cuda


@dataclass(frozen=True)
class Case:
    """``remote`` pages of ``remote_block_size`` tokens landed in ``local`` pages; the local
    block size is the bench's ``--block-size`` times ``local_scale``."""

    remote: str
    local: str
    ratio: int  # nD / nP, or -(nP / nD) for remote pages larger than local ones
    dtype: DTypeName

    def block_sizes(self, block_size: int) -> tuple[int, int]:
        """(nD, nP) for the bench's ``--block-size`` (the larger of the two)."""
        if self.ratio > 0:
            return block_size, block_size // self.ratio
        return block_size // -self.ratio, block_size

    @property
    def label(self) -> str:
        pair = self.remote if self.remote == self.local else f"{self.remote}->{self.local}"
        size = f"r={self.ratio}" if self.ratio > 0 else f"nP={-self.ratio}nD"
        return f"{pair} {size} {self.dtype}"


CASES = [
    Case("HND", "NHD", 1, "bfloat16"),
    Case("HND", "NHD", 4, "bfloat16"),
    Case("HND", "HND", 4, "bfloat16"),
    Case("NHD", "NHD", 4, "bfloat16"),
    Case("cpu_attn_vec", "cpu_attn_vec", 2, "bfloat16"),
    Case("cpu_attn_vec", "cpu_attn_vec", 4, "bfloat16"),
    Case("cpu_attn_vec", "cpu_attn_vec", 2, "float32"),
    Case("cpu_attn_vec", "cpu_attn_vec", 4, "float32"),
    Case("BLHNC", "BLHNC", 4, "bfloat16"),
    Case("LBHNC", "LBHNC", 4, "bfloat16"),
    Case("HND", "HND", -4, "bfloat16"),
    Case("HND", "NHD", -4, "bfloat16"),
    Case("NHD", "HND", 1, "bfloat16"),
    Case("HND", "NHD", 4, "float8_e4m3fn"),
    Case("HND", "NHD", 1, "float32"),
]
TARGET_COPY = {"cpu": 1.3}  # every bfloat16 case at most this many times a plain copy
TARGET_COPY_BANDWIDTH = {"cuda": 0.85}  # at least this fraction of a copy's bandwidth
TARGET_VLLM = {"cpu": 3.0, "cuda": 10.0}  # times faster than vLLM's chain, where it has one
TARGET_LATENCY = 2.0  # CUDA: 1 to 4 blocks ready within this many times one small copy_
LATENCY_BLOCKS = (1, 2, 3, 4)
SMALL_COPY_BYTES = 4096
NOT_GPU_FORMATS = frozenset({"cpu_attn_vec"})  # vLLM's CPU backend's page: no GPU target


@dataclass
class Row:
    case: str
    mbytes: float
    kvd_gbps: float
    copy_gbps: float
    kvd_over_copy: float
    vllm_over_kvd: float | None
    meets_target: bool | None
    variants: list[dict[str, Any]] = field(default_factory=list)
    """On CUDA: per kernel launch, what warm-up measured and chose (``gpu.choices``)."""


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

    ``physical`` is one K or V half ([num_blocks, page]) of a split cache, or a per-layer
    LBHNC tensor. vLLM sees the cache as logical (num_blocks, block_size, heads, head_dim)
    (content K|V packed for LBHNC); an HND cache is a permuted view of HND physical memory.
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
    elif local == remote and local in ("HND", "LBHNC"):
        # kv_postprocess_blksize_on_receive: [B, H, N, C] blocks, sub-blocks head-major.
        blocks = physical.index_select(0, idx)
        n, h, bs, d = blocks.shape
        merged = blocks.reshape(n, ratio, h, bs // ratio, d).permute(0, 2, 1, 3, 4).flatten(2, 3)
        physical.index_copy_(0, idx, merged)
    else:
        raise ValueError(f"vLLM has no post-process for {remote} -> {local}")


def has_vllm_chain(case: Case) -> bool:
    if case.ratio < 1:
        return False  # vLLM 0.32 refuses remote blocks larger than local ones
    if (case.remote, case.local) == ("HND", "NHD"):
        return True
    return case.remote == case.local and case.local in ("HND", "LBHNC") and case.ratio > 1


def _tensors(
    args: argparse.Namespace, case: Case, device: torch.device
) -> tuple[list[torch.Tensor], TensorGeometry, int]:
    """The local cache as an engine holds it: per-layer tensors (split ones [2, nb, page]), or
    one tensor of every layer for a cross-layer format. Random bytes, made where they live."""
    nD, _ = case.block_sizes(args.block_size)
    fmt = PRESETS[case.local]
    dtype = torch_dtype(case.dtype)
    layers = args.layers if is_cross_layer(fmt) else 1
    sizes = PageSizes(layers, args.heads, nD, args.head_dim, dtype.itemsize)
    # The same bytes in every case: smaller pages, more of them.
    num_blocks = args.num_blocks * args.block_size // nD
    geometry = TensorGeometry(fmt, sizes, num_blocks)
    page = page_elements(fmt, sizes)
    count = 1 if is_cross_layer(fmt) else args.layers
    shape = [2, num_blocks, page] if fmt.regions == "kv" else [num_blocks, page]
    torch.manual_seed(0)
    tensors = [
        torch.randint(
            0, 256, [*shape[:-1], page * dtype.itemsize], dtype=torch.uint8, device=device
        )
        for _ in range(count)
    ]
    return tensors, geometry, args.blocks * args.block_size // nD


def run_case(args: argparse.Namespace, case: Case, progress: Callable[[], None]) -> Row:
    device = torch.device(args.device)
    nD, nP = case.block_sizes(args.block_size)
    tensors, geometry, listed_blocks = _tensors(args, case, device)
    post = CachePostProcess(
        [v for t in tensors for v in region_views(t, geometry)], device, args.backend
    )
    ids = torch.randperm(geometry.num_blocks)[:listed_blocks].tolist()
    idx = torch.tensor(ids, device=device)
    listed = post.block_bytes * len(ids)
    src = torch.empty(listed, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    remote = PRESETS[case.remote]
    post.warm_up(remote, nP)  # as an attach does: compiles, and on CUDA picks the variants

    def kvd() -> None:
        post.apply([(ids, 0)], remote, nP)

    def copy() -> None:
        dst.copy_(src)

    runs: dict[str, Callable[[], None]] = {"copy": copy, "kvd": kvd}
    if has_vllm_chain(case):
        dtype = torch_dtype(case.dtype)
        # vLLM keeps fp8 caches in uint8 storage (and torch has no CPU index_copy_ for fp8).
        view = torch.uint8 if dtype.itemsize == 1 else dtype
        halves = [h for t in tensors for h in (t if geometry.format.regions == "kv" else [t])]
        if case.local == "NHD":
            block = (nD, args.heads, args.head_dim)
        elif case.local == "HND":
            block = (args.heads, nD, args.head_dim)
        else:
            block = (args.heads, nD, 2 * args.head_dim)
        logical = [h.view(view).view(geometry.num_blocks, *block) for h in halves]

        def vllm() -> None:
            for t in logical:
                vllm_chain(t, idx, remote=case.remote, local=case.local, ratio=case.ratio)

        runs["vllm"] = vllm
    for fn in runs.values():  # warm-up (first touch, kernel compilation)
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for rep in range(args.repeat):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            times[name].append(_timed(runs[name], device))
        progress()
    kvd_over_copy = statistics.median(
        k / c for k, c in zip(times["kvd"], times["copy"], strict=True)
    )
    vllm_over_kvd = (
        statistics.median(v / k for v, k in zip(times["vllm"], times["kvd"], strict=True))
        if "vllm" in times
        else None
    )
    meets: bool | None = None
    if case.dtype == "bfloat16" and not (device.type == "cuda" and case.local in NOT_GPU_FORMATS):
        meets = vllm_over_kvd is None or vllm_over_kvd >= TARGET_VLLM[device.type]
        if device.type in TARGET_COPY:
            meets = meets and kvd_over_copy <= TARGET_COPY[device.type]
        if device.type in TARGET_COPY_BANDWIDTH:
            meets = meets and 1 / kvd_over_copy >= TARGET_COPY_BANDWIDTH[device.type]
    return Row(
        case=case.label,
        mbytes=listed / 1e6,
        kvd_gbps=listed / statistics.median(times["kvd"]) / 1e9,
        copy_gbps=listed / statistics.median(times["copy"]) / 1e9,
        kvd_over_copy=kvd_over_copy,
        vllm_over_kvd=vllm_over_kvd,
        meets_target=meets,
        variants=post.variants(remote, nP),
    )


@dataclass
class LatencyRow:
    blocks: int
    kvd_us: float
    copy_us: float
    kvd_over_copy: float
    meets_target: bool


def latency(args: argparse.Namespace, device: torch.device) -> list[LatencyRow]:
    """1 to 4 listed blocks (HND -> NHD, bf16, the bench's geometry) from ``apply`` to its
    event complete, against one ``copy_`` of ``SMALL_COPY_BYTES`` the same way, both on kvd's
    stream, interleaved; medians of many repetitions."""
    case = Case("HND", "NHD", 1, "bfloat16")
    tensors, geometry, _ = _tensors(args, case, device)
    post = CachePostProcess([v for t in tensors for v in region_views(t, geometry)], device)
    stream = post.lane.stream
    ids = torch.randperm(geometry.num_blocks)[: max(LATENCY_BLOCKS)].tolist()
    post.warm_up(PRESETS["HND"], case.block_sizes(args.block_size)[1])
    src = torch.empty(SMALL_COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    event = torch_cuda().Event()

    def timed(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        event.record(stream)
        event.synchronize()
        return (time.perf_counter() - start) * 1e6

    rows = []
    repeat = max(50, 20 * args.repeat)
    nP = case.block_sizes(args.block_size)[1]
    for n in LATENCY_BLOCKS:
        requests = [(ids[:n], 0)]
        kvd_times, copy_times = [], []
        for rep in range(repeat + 5):  # the first few: warm-up
            kvd_t = timed(lambda: post.apply(requests, PRESETS["HND"], nP))  # noqa: B023
            copy_t = timed(lambda: dst.copy_(src))
            if rep >= 5:
                kvd_times.append(kvd_t)
                copy_times.append(copy_t)
        kvd_us, copy_us = statistics.median(kvd_times), statistics.median(copy_times)
        ratio = statistics.median(k / c for k, c in zip(kvd_times, copy_times, strict=True))
        rows.append(LatencyRow(n, kvd_us, copy_us, ratio, ratio <= TARGET_LATENCY))
    return rows


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("kvd bench kernels: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if device.type == "cuda":
        from kvd.kernels.device import lane_for

        if device == torch.device("cuda"):
            device = torch.device("cuda", torch.cuda.current_device())
        # Everything on kvd's stream, as kvd's executor thread runs it.
        lane_for(device).enter()
    cases = [c for c in CASES if args.block_size % abs(c.ratio) == 0]
    rows = []
    quiet = args.json or args.no_progress
    with progress_bar(
        len(cases) * args.repeat, "kvd bench kernels", unit="rep", quiet=quiet
    ) as bar:
        rows = [run_case(args, case, bar.update) for case in cases]
    latency_rows = latency(args, device) if device.type == "cuda" else []
    stats: dict[str, dict[str, int]] = {}
    if device.type == "cuda":
        from kvd.kernels import gpu

        stats = gpu.kernel_stats()
    report: dict[str, Any] = {
        "benchmark": "kernels",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "backend": args.backend,
        "geometry": {
            "layers": args.layers,
            "num_blocks": args.num_blocks,
            "listed_blocks": args.blocks,
            "block_size": args.block_size,
            "heads": args.heads,
            "head_dim": args.head_dim,
        },
        "repeat": args.repeat,
        "targets": {
            "kvd_over_copy_at_most": TARGET_COPY.get(device.type),
            "copy_bandwidth_fraction_at_least": TARGET_COPY_BANDWIDTH.get(device.type),
            "vllm_over_kvd_at_least": TARGET_VLLM[device.type],
            "cases": "every bfloat16 case"
            + (" of a GPU page format" if device.type == "cuda" else ""),
            "latency_over_copy_at_most": TARGET_LATENCY if latency_rows else None,
        },
        "rows": [asdict(r) for r in rows],
        "latency": [asdict(r) for r in latency_rows],
        "kernel_stats": stats,
        "meets_targets": all(r.meets_target for r in rows if r.meets_target is not None)
        and all(r.meets_target for r in latency_rows)
        and all(s["spills"] == 0 for s in stats.values()),
    }
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


def _variant_line(chosen: dict[str, Any]) -> str:
    """What warm-up measured and chose for one launch (``gpu.choices``), in a line."""
    parts = []
    if "tile_bytes" in chosen:
        measured = ", ".join(
            f"{int(tile) >> 10} KiB {gbps:.0f} GB/s" for tile, gbps in chosen["tile_gbps"].items()
        )
        parts.append(f"tile {int(chosen['tile_bytes']) >> 10} KiB ({measured})")
    if "replays" in chosen:
        times = ""
        if chosen["replay_us"] is not None and chosen["direct_us"] is not None:
            times = f" (1 group: {chosen['replay_us']:.1f} us, direct {chosen['direct_us']:.1f} us)"
        parts.append(f"captured launches {'yes' if chosen['replays'] else 'no'}{times}")
    return "; ".join(parts) or "nothing measured"


def _table(report: dict[str, Any]) -> str:
    g = report["geometry"]
    cells = [["case", "MB", "kvd GB/s", "copy GB/s", "kvd/copy", "vllm/kvd", "target"]]
    for r in report["rows"]:
        vllm = f"{r['vllm_over_kvd']:.1f}x" if r["vllm_over_kvd"] is not None else "n/a"
        target = {None: "", True: "met", False: "MISSED"}[r["meets_target"]]
        cells.append(
            [
                r["case"],
                f"{r['mbytes']:.1f}",
                f"{r['kvd_gbps']:.1f}",
                f"{r['copy_gbps']:.1f}",
                f"{r['kvd_over_copy']:.2f}x",
                vllm,
                target,
            ]
        )
    latency_lines = []
    if report["latency"]:
        latency_cells = [["blocks", "kvd us", "copy_ us", "kvd/copy_", "target"]]
        for r in report["latency"]:
            target = "met" if r["meets_target"] else "MISSED"
            latency_cells.append(
                [
                    str(r["blocks"]),
                    f"{r['kvd_us']:.1f}",
                    f"{r['copy_us']:.1f}",
                    f"{r['kvd_over_copy']:.2f}x",
                    target,
                ]
            )
        latency_lines = [
            "",
            f"latency, call to event complete, vs one {SMALL_COPY_BYTES}-byte copy_ (target "
            f"<= {report['targets']['latency_over_copy_at_most']}x):",
            *format_table(latency_cells, right=(0, 1, 2, 3)),
        ]
    for name, stat in report["kernel_stats"].items():
        latency_lines.append(
            f"kernel {name}: {stat['registers']} registers, {stat['spills']} spills"
        )
    for r in report["rows"]:
        for chosen in r.get("variants", []):
            latency_lines.append(f"variants {r['case']}: {_variant_line(chosen)}")
    t = report["targets"]
    bound = (
        f"kvd/copy <= {t['kvd_over_copy_at_most']}x"
        if t["kvd_over_copy_at_most"]
        else f">= {t['copy_bandwidth_fraction_at_least']:.0%} of copy bandwidth"
    )
    missed = [r["case"] for r in report["rows"] if r["meets_target"] is False]
    return "\n".join(
        [
            f"kvd bench kernels on {report['device_name']} ({report['threads']} threads, "
            f"OMP_WAIT_POLICY={report['omp_wait_policy'] or 'unset'}, backend "
            f"{report['backend']}): {g['layers']} layers, {g['listed_blocks']} of "
            f"{g['num_blocks']} blocks of {g['block_size']} tokens x {g['heads']} heads x "
            f"{g['head_dim']} head_dim (smaller blocks: more of them, same bytes), median of "
            f"{report['repeat']} interleaved repetitions",
            "",
            *format_table(cells, right=(1, 2, 3, 4, 5)),
            "",
            f"targets for {t['cases']}: {bound}, and vllm/kvd >= {t['vllm_over_kvd_at_least']}x "
            "where vLLM has a chain",
            *latency_lines,
            "meets targets: " + ("yes" if report["meets_targets"] else f"no ({', '.join(missed)})"),
        ]
    )
