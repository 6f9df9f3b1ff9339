"""The post-process of one attached cache: rewrite landed blocks into the local page format.

``CachePostProcess`` holds a cache's regions (every tensor's K, V or per-head regions, as raw
byte views) and, per (remote format, remote block size, coverage), the plans and prepared
launches that rewrite them. ``apply`` rewrites the listed blocks of every region: complete
groups of all requests in one kernel call per plan, a request's partly covered last page with
the plan that zeroes its uncovered tokens, and pages its READ never reached zeroed whole (as
vLLM's ``post_process_device_kv_on_receive`` does).

Block ids are checked here, once for the whole call, before any address is formed: the
kernels trust what they are given.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt
import torch

from kvd.kernels import cpu
from kvd.layout import planner
from kvd.layout.formats import KV, PageSizes, page_bytes, resolve
from kvd.layout.geometry import (
    BlockIds,
    TensorGeometry,
    block_id_list,
    check_block_ids,
    check_tensor,
    group_problem,
    group_shape,
)
from kvd.layout.planner import Plan
from kvd.protocol import FormatRef, PageFormat

if TYPE_CHECKING:  # Triton is imported only where CUDA is used
    from kvd.kernels.device import Lane
    from kvd.kernels.gpu import Prepared, Regions, Replay

log = logging.getLogger(__name__)

Backend = Literal["auto", "kernel", "torch"]
"""``kernel``: the compiled CPU kernel, or Triton on CUDA; ``torch``: plain torch ops (the
fallback when no kernel is built); ``auto``: the kernel when there is one."""

Request = tuple[BlockIds, int]
"""(local block ids in request order, covered_sub_blocks): the ids of any kind ``BlockIds``
names; ``covered_sub_blocks`` counts the
remote pages the READ filled from the request's first page on, as vLLM's NIXL worker counts them
(``min(len(local) * ratio, len(remote))``); 0 means all of them."""


@dataclass(frozen=True, eq=False)
class RegionView:
    """One region of a tensor: ``pages`` is (num_blocks, page_bytes) uint8, one row per block
    (rows ``block_stride`` bytes apart), holding pages of ``format`` with ``sizes``. ``kv``
    says which region of a ``regions="kv"`` format it is."""

    pages: torch.Tensor
    format: PageFormat
    sizes: PageSizes
    kv: KV = "k"

    @property
    def num_blocks(self) -> int:
        return int(self.pages.shape[0])

    @property
    def page_bytes(self) -> int:
        return int(self.pages.shape[1])

    @property
    def block_stride(self) -> int:
        return int(self.pages.stride(0))

    @property
    def base(self) -> int:
        return int(self.pages.data_ptr())


def region_views(
    tensor: torch.Tensor, geometry: TensorGeometry, where: str = "tensor"
) -> list[RegionView]:
    """The regions of one attached tensor: contiguous, in its physical shape, of ``geometry``.

    Raises ``GeometryError`` (``check_tensor``) naming ``where`` when it is not.
    """
    check_tensor(tensor, geometry, where)
    start = tensor.storage_offset() * tensor.element_size()
    views = []
    for i in range(geometry.num_regions):
        pages = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
            tensor.untyped_storage(),
            start + i * geometry.region_stride,
            (geometry.num_blocks, geometry.page_bytes),
            (geometry.block_stride, 1),
        )
        kv: KV = "v" if geometry.format.regions == "kv" and i == 1 else "k"
        views.append(RegionView(pages, geometry.format, geometry.sizes, kv))
    return views


@dataclass(frozen=True, eq=False)
class _Bundle:
    """Regions that share one plan: same format, region kind and sizes."""

    format: PageFormat
    kv: KV
    sizes: PageSizes
    regions: tuple[RegionView, ...]

    @functools.cached_property
    def bases(self) -> npt.NDArray[np.int64]:
        return np.array([r.base for r in self.regions], dtype=np.int64)

    @functools.cached_property
    def strides(self) -> npt.NDArray[np.int64]:
        return np.array([r.block_stride for r in self.regions], dtype=np.int64)

    @property
    def alignment(self) -> int:
        """The largest power of two (up to 16) dividing every page address."""
        every = int(np.bitwise_or.reduce(np.concatenate([self.bases, self.strides])))
        return min(every & -every, 16) if every else 16


@dataclass(frozen=True, eq=False)
class _Launch:
    """One kernel call's worth of a request: a plan over the regions of one bundle."""

    bundle: _Bundle
    plan: Plan
    prepared: Prepared | None = None  # the plan on the GPU, made once
    replays: dict[int, Replay] = field(default_factory=dict)
    """Captured launches by number of groups (CUDA, made at warm-up where faster)."""


class CachePostProcess:
    """Rewrites listed blocks of one cache's regions from a remote page format, in place.

    Every region must have the same ``num_blocks`` and block size. Plans and prepared launches
    are memoised per (remote format, remote block size, coverage). ``apply`` runs on the
    caller's thread (the executor's); on CUDA it launches on ``lane``'s stream and device
    (by default the process's lane on ``device``), whatever the calling thread's current ones,
    and returns without waiting for the GPU.
    """

    def __init__(
        self,
        regions: Sequence[RegionView],
        device: torch.device | str = "cpu",
        backend: Backend = "auto",
        lane: Lane | None = None,
    ) -> None:
        if not regions:
            raise ValueError("regions: a cache needs at least one region")
        self.device = torch.device(device)
        first = regions[0]
        if self.device == torch.device("cuda"):
            self.device = first.pages.device  # "cuda" is the first region's cuda:N
        by_plan: dict[tuple[PageFormat, KV, PageSizes], list[RegionView]] = {}
        for i, region in enumerate(regions):
            if region.pages.device != self.device and not (
                self.device.type == region.pages.device.type and self.device.index is None
            ):
                raise ValueError(f"regions[{i}]: on {region.pages.device}, not {self.device}")
            if region.num_blocks != first.num_blocks:
                raise ValueError(
                    f"regions[{i}]: {region.num_blocks} blocks, regions[0] {first.num_blocks}"
                )
            if region.sizes.block_size != first.sizes.block_size:
                raise ValueError(
                    f"regions[{i}]: block size {region.sizes.block_size}, regions[0] "
                    f"{first.sizes.block_size}"
                )
            if region.page_bytes != page_bytes(region.format, region.sizes):
                raise ValueError(
                    f"regions[{i}]: pages of {region.page_bytes} bytes, the format says "
                    f"{page_bytes(region.format, region.sizes)}"
                )
            by_plan.setdefault((region.format, region.kv, region.sizes), []).append(region)
        self._bundles = [_Bundle(*key, tuple(group)) for key, group in by_plan.items()]
        self._regions = list(regions)
        self.block_bytes = sum(r.page_bytes for r in regions)
        """Bytes one block id stands for across every region: what ``apply`` may rewrite."""
        self.num_blocks = first.num_blocks
        self.block_size = first.sizes.block_size
        self.backend = self._pick_backend(backend)
        self._launches: dict[tuple[FormatRef, int, int, int], list[_Launch]] = {}
        self._needs_work: dict[tuple[FormatRef, int, int], bool] = {}
        self._lane = lane
        self._on_device: dict[_Bundle, Regions] = {}
        self._zeroes: dict[_Bundle, _Launch] = {}

    @property
    def lane(self) -> Lane:
        """Where the Triton backend launches: kvd's stream on the device."""
        if self._lane is None:
            from kvd.kernels.device import lane_for

            self._lane = lane_for(self.device)
        return self._lane

    def _pick_backend(self, backend: Backend) -> Literal["c", "triton", "torch"]:
        if backend == "torch":
            return "torch"
        if self.device.type == "cuda":
            return "triton"
        if self.device.type == "cpu" and cpu.available():
            return "c"
        if backend == "kernel":
            raise RuntimeError(f"no post-process kernel for {self.device} in this build")
        return "torch"

    def needs_work(
        self,
        remote: FormatRef,
        remote_block_size: int,
        covered: int = 0,
        num_ids: int = 0,
        *,
        remote_ranks: int = 1,
    ) -> bool:
        """Whether ``apply`` would change any byte of a request of ``num_ids`` blocks.

        Cheap (structural, memoised; no plan is built): the format pair moves bytes at this
        block size, or ``covered`` leaves pages (partly) unwritten, which are then zeroed.
        With ``num_ids`` 0 (unknown) any ``covered`` but 0 counts as leaving pages unwritten.
        Raises ``FormatError``/``ValueError`` as ``apply`` would for the formats and sizes.
        """
        pages, remote_pages = group_shape(self.block_size, remote_block_size)
        if covered and (not num_ids or covered < num_ids // pages * remote_pages):
            return True
        key = (remote, remote_block_size, remote_ranks)
        known = self._needs_work.get(key)
        if known is None:
            checked = resolve(remote, "remote_format")
            known = self._needs_work[key] = any(
                planner.needs_work(
                    checked,
                    b.format,
                    b.sizes,
                    remote_block_size,
                    kv=b.kv,
                    remote_ranks=remote_ranks,
                )
                for b in self._bundles
            )
        return known

    def apply(
        self,
        requests: Sequence[Request],
        remote: FormatRef,
        remote_block_size: int,
        *,
        remote_ranks: int = 1,
    ) -> None:
        """Rewrite every listed block of every region, landed in ``remote`` at nP tokens (from
        ``remote_ranks`` ranks, interleaved: ``planner.plan``).

        Raises, before anything is written: ``ValueError`` for ids not of a ``BlockIds`` kind,
        out of range or listed twice (over all requests), a request whose ids do not fill whole
        groups (nP > nD: a multiple of nP / nD ids), or a ``covered`` beyond what the ids
        hold; ``FormatError`` and ``PlanError`` from the planner. ``MemoryFault`` when a page
        faults (the call stops; pages may be partly rewritten).
        """
        pages, remote_pages = group_shape(self.block_size, remote_block_size)
        full: list[int] = []
        partial: dict[int, list[int]] = {}
        unreached: list[int] = []
        listed: list[int] = []
        for n, (request_ids, covered) in enumerate(requests):
            ids = block_id_list(request_ids, f"requests[{n}].physical_block_ids")
            listed += ids
            broken = group_problem(len(ids), covered, pages, remote_pages)
            if broken is not None:
                field, why = broken
                what = "" if field == "physical_block_ids" else f"{field} "
                raise ValueError(f"requests[{n}]: {what}{why}")
            whole, part = divmod(covered or len(ids) // pages * remote_pages, remote_pages)
            full += ids[: whole * pages]
            if part:
                partial.setdefault(part, []).append(ids[whole])
            unreached += ids[(whole + (1 if part else 0)) * pages :]
        problem = check_block_ids(listed, self.num_blocks)
        if problem is not None:
            raise problem
        work = [(0, full), *sorted(partial.items())]
        with self._launching():  # plans are prepared (uploaded) on the lane too
            calls = [
                (launch, np.asarray(ids, dtype=np.int64).reshape(-1, pages))
                for covered, ids in work
                if ids
                for launch in self._launches_for(remote, remote_block_size, covered, remote_ranks)
            ]
            if unreached:
                groups = np.asarray(unreached, dtype=np.int64).reshape(-1, 1)
                calls += [(self._zero_launch(b), groups) for b in self._bundles]
            for launch, groups in calls:
                self._run(launch, groups)

    def _launching(self) -> contextlib.AbstractContextManager[None]:
        """Around every kernel call: on CUDA, the lane's device and stream."""
        if self.backend != "triton":
            return contextlib.nullcontext()
        return self.lane.launching()

    def _zero_launch(self, bundle: _Bundle) -> _Launch:
        known = self._zeroes.get(bundle)
        if known is None:
            plan = planner.zero_plan(page_bytes(bundle.format, bundle.sizes))
            known = self._zeroes[bundle] = _Launch(bundle, plan)
        return known

    def warm_up(self, remote: FormatRef, remote_block_size: int) -> None:
        """Compile the kernels a request in ``remote`` at nP would launch, on scratch pages
        (never the cache's): CUDA's first launch of a kernel shape pays its compilation.

        On CUDA also pick the variants by measurement, on scratch pages: the in-place tile
        size of each plan (``gpu.tune``), and whether launches of a few groups replay a
        captured graph (``gpu.Replay``) or launch directly; this waits for the device and
        takes seconds, so it belongs to the attach worker. Otherwise asynchronous, like
        ``apply``."""
        with self._launching():
            launches = self._launches_for(remote, remote_block_size, 0)
            if self.backend == "triton":
                launches = self._tuned(remote, remote_block_size, launches)
            for launch in launches:
                plan, bundle = launch.plan, launch.bundle
                scratch = torch.zeros(
                    (plan.pages_per_group, plan.page_bytes), dtype=torch.uint8, device=self.device
                )
                region = RegionView(scratch, bundle.format, bundle.sizes, bundle.kv)
                on_scratch = _Bundle(bundle.format, bundle.kv, bundle.sizes, (region,))
                groups = np.arange(plan.pages_per_group, dtype=np.int64).reshape(1, -1)
                self._run(_Launch(on_scratch, plan, launch.prepared), groups, warm_up=True)
            if self.backend == "triton":
                for launch in launches:
                    self._capture(launch)

    def variants(self, remote: FormatRef, remote_block_size: int) -> list[dict[str, object]]:
        """On CUDA, per launch of a fully covered request from ``remote`` at nP: what warm-up
        measured and chose (``gpu.choices``: tile size, replays); empty elsewhere."""
        if self.backend != "triton":
            return []
        from kvd.kernels import gpu

        key = (remote, remote_block_size, 0, 1)
        return [gpu.choices(launch.plan) for launch in self._launches.get(key, [])]

    def _tuned(
        self, remote: FormatRef, remote_block_size: int, launches: list[_Launch]
    ) -> list[_Launch]:
        """``launches`` prepared again where ``gpu.tune`` chose another tile than theirs."""
        from kvd.kernels import gpu

        for launch in launches:
            gpu.tune(launch.plan, self.lane, launch.bundle.alignment)
        if all(
            launch.prepared is None
            or not launch.prepared.in_place
            or launch.prepared.tile_bytes == gpu.tile_for(launch.plan)
            for launch in launches
        ):
            return launches
        del self._launches[(remote, remote_block_size, 0, 1)]
        return self._launches_for(remote, remote_block_size, 0)

    def _capture(self, launch: _Launch) -> None:
        """Capture ``launch`` for 1 to ``gpu.GRAPH_GROUPS`` groups, if a captured launch of one
        group on scratch pages completes sooner than a direct one (or cannot be timed)."""
        from kvd.kernels import gpu

        prepared = launch.prepared
        if prepared is None or not prepared.in_place or launch.replays or gpu.GRAPH_GROUPS < 1:
            return
        plan, lane = launch.plan, self.lane
        scratch = torch.zeros(
            (plan.pages_per_group, plan.page_bytes), dtype=torch.uint8, device=self.device
        )
        on_scratch = gpu.regions(
            lane,
            np.array([scratch.data_ptr()], dtype=np.int64),
            np.array([plan.page_bytes], dtype=np.int64),
        )
        groups = np.arange(plan.pages_per_group, dtype=np.int64).reshape(1, -1)
        try:
            trial = gpu.Replay(prepared, on_scratch, lane, 1)
            replay_ms = lane.api.time_ms(lambda: trial(groups), gpu.TUNE_REPEAT)
        except Exception as exc:  # noqa: BLE001 (any capture failure: launch directly)
            log.warning("kvd launches %s directly: capturing it failed: %s", plan, exc)
            return
        direct_ms = lane.api.time_ms(
            lambda: gpu.apply_runs(prepared, on_scratch, groups, lane), gpu.TUNE_REPEAT
        )
        gpu.note_replay(plan, replay_ms, direct_ms)
        if replay_ms is not None and direct_ms is not None and replay_ms >= direct_ms:
            return
        where = self._where(launch.bundle)
        for n in range(1, gpu.GRAPH_GROUPS + 1):
            launch.replays[n] = gpu.Replay(prepared, where, lane, n)

    def _launches_for(
        self, remote: FormatRef, remote_block_size: int, covered: int, remote_ranks: int = 1
    ) -> list[_Launch]:
        key = (remote, remote_block_size, covered, remote_ranks)
        known = self._launches.get(key)
        if known is None:
            checked = resolve(remote, "remote_format")
            known = []
            for bundle in self._bundles:
                plan = planner.plan(
                    checked,
                    bundle.format,
                    bundle.sizes,
                    remote_block_size,
                    covered=covered,
                    kv=bundle.kv,
                    remote_ranks=remote_ranks,
                )
                if plan.is_identity:
                    continue
                # K and V halves usually share a plan: one launch then covers both.
                same = next((n for n, k in enumerate(known) if k.plan.same_moves(plan)), None)
                if same is None:
                    known.append(_Launch(bundle, plan))
                    continue
                first = known[same].bundle
                joined = _Bundle(
                    first.format, first.kv, first.sizes, first.regions + bundle.regions
                )
                known[same] = _Launch(joined, known[same].plan)
            if self.backend == "triton":
                from kvd.kernels import gpu

                known = [
                    _Launch(k.bundle, k.plan, gpu.prepare(k.plan, self.lane, k.bundle.alignment))
                    for k in known
                ]
            self._launches[key] = known
        return known

    def _run(
        self, launch: _Launch, groups: npt.NDArray[np.int64], *, warm_up: bool = False
    ) -> None:
        bundle, plan = launch.bundle, launch.plan
        if self.backend == "torch":
            for region in bundle.regions:
                cpu.apply_runs_torch(region.pages, groups, plan)
        elif self.backend == "c":
            cpu.apply_runs(cpu.page_table(bundle.bases, bundle.strides, groups), plan)
        else:
            from kvd.kernels import gpu

            replay = launch.replays.get(len(groups)) if launch.replays else None
            if replay is not None:
                replay(groups)
                return
            if launch.prepared is None:
                launch = self._prepare(launch)
            assert launch.prepared is not None
            if warm_up:  # a warm-up's bundle is over scratch pages, used once
                where = gpu.regions(self.lane, bundle.bases, bundle.strides)
            else:
                where = self._where(bundle)
            gpu.apply_runs(launch.prepared, where, groups, self.lane)

    def _where(self, bundle: _Bundle) -> Regions:
        """``bundle``'s region table on the device, uploaded once."""
        from kvd.kernels import gpu

        where = self._on_device.get(bundle)
        if where is None:
            where = self._on_device[bundle] = gpu.regions(self.lane, bundle.bases, bundle.strides)
        return where

    def _prepare(self, launch: _Launch) -> _Launch:
        """``launch`` with its plan prepared on the lane (zero plans: once per bundle)."""
        from kvd.kernels import gpu

        prepared = gpu.prepare(launch.plan, self.lane, launch.bundle.alignment)
        done = _Launch(launch.bundle, launch.plan, prepared)
        if self._zeroes.get(launch.bundle) is launch:
            self._zeroes[launch.bundle] = done
        return done
