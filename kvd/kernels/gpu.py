"""The CUDA kernels: Triton programs that execute a plan over groups of pages, in place.

A plan is a word gather index over a group of pages (``Plan.gather_index``): word ``i`` of a
group receives landed word ``index[i]``, or zero where it is -1. The kernels read each moving
word once and write it once, in place; words already in place are neither read nor written.

**In place, by closed sets of units** (``_permute_units``, the common path). The planner's
moves are runs of whole head vectors (or token runs), so the index moves *units* of ``W`` words:
unit ``u`` receives unit ``src[u]`` whole. A program loads a set of units, waits at a barrier,
then stores them; the set must be closed (nothing it overwrites is still to be read by another
program). Two kinds of closed set, chosen by the unit's size as an H200 measured them:

- *Slices of every unit* (units under ``WHOLE_UNIT_BYTES``, e.g. 256-byte head vectors): words
  at offset ``o`` of a unit come only from offset ``o`` of another unit, so "every unit, offsets
  ``[o, o + SLICE)``" is closed. The benchmark's 128 KiB HND -> NHD page is 2 programs of 16
  warps, each moving one 128-byte line of all 512 head vectors (47-56% of a copy's bandwidth;
  whole components of such small units, in smaller tiles, reached only 24-26%).
- *Whole components* (larger units, e.g. the 4 KiB token runs of a block merge): the moving
  units fall apart into the cycles and chains of ``u <- src[u]``, each read only by its own
  units; ``prepare`` packs whole components into programs of ``COMPONENT_TILE_BYTES`` (38-59%
  of a copy's bandwidth, against 30-35% for slices of every unit).

A tile is bounded (at most ``WORDS_PER_THREAD`` words per thread, one address per row rather
than per word) so that it fits in registers without spilling.

**Two passes through a scratch** (``_gather_words``), when a group's units are too many for
one tile (units of a word or two: e.g. a fine-grained format pair at a large page): gather each
group into a scratch buffer, then write it back, in chunks of at most ``SCRATCH_BYTES`` (an L2's
worth, so the write-back mostly reads from L2): twice the launches, up to twice the traffic.

Block ids reach the GPU through the lane's pinned ring (``device.IdRing``), int32, one slot per
launch; page addresses are formed on the GPU from each region's base and block stride, so one
launch covers every region of a cache that shares a plan. Launches go to the lane's stream,
under ``Lane.launching()``. The same kernels run on the CPU under ``TRITON_INTERPRET=1``, which
is how the tests check them without a GPU.

**Variants, picked by measurement.** A program stores only after all its loads, so with one
program resident per SM (a 64 KiB tile of 16 warps) an SM either loads or stores, never both:
about half a copy's bandwidth, which is what the H200 run measured (39-55%). Smaller tiles
(``TILE_CHOICES``) leave several programs resident, one's stores overlapping another's loads,
at the price of more programs and narrower slices. Which size is fastest depends on the GPU and
the format pair, so ``tune`` times each on scratch pages when a cache is attached (the
attach worker's warm-up) and ``prepare`` uses the fastest for that plan from then on.

**Small batches: captured launches.** Triton's Python launcher and the block-id upload cost
about 20-40 us each per launch, several times the work of a few blocks. For a launch of at most
``GRAPH_GROUPS`` groups, ``Replay`` captures the id copy (from a pinned buffer of its own) and
the kernel in a CUDA graph once, at warm-up; a request then costs one graph launch. Warm-up
keeps the replays only where they measured faster than a direct launch.

What a GPU run must confirm (``.ci/device-check``): the kernels compile without spills
(``kernel_stats()``), the in-place path reaches the copy-bandwidth target on the benchmark's
128 KiB pages with the tile ``tune`` picks, and 1 to 4 blocks complete within twice a small
``copy_`` through a replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import triton
import triton.language as tl

from kvd.kernels.device import CudaEvent, Lane
from kvd.layout.planner import Plan

TILE_BYTES = 64 * 1024
"""Bytes a program of the in-place path holds unless ``tune`` chose otherwise for the plan: up
to 16 warps x 32 threads x 32 words."""
TILE_CHOICES = (64 * 1024, 32 * 1024, 16 * 1024)
"""The tile sizes ``tune`` measures (16, 8 and 4 warps for 256-byte units)."""
TUNE_BYTES = 128 << 20
"""Scratch ``tune`` times the variants on: well past an H100/H200 L2 (50 MiB), so that it
measures memory bandwidth, not the cache's."""
TUNE_REPEAT = 7
GRAPH_GROUPS = 4
"""Launches of at most this many groups replay a captured graph (``Replay``), where warm-up
measured that faster."""
WORDS_PER_THREAD = 32
WHOLE_UNIT_BYTES = 1024
"""Units at least this large are moved whole, by components; smaller ones in slices."""
COMPONENT_TILE_BYTES = 32 * 1024
COMPONENT_WORDS_PER_THREAD = 16
SCRATCH_BYTES = 16 << 20
"""Scratch of the two-pass path: about a third of an H100/H200 L2 (50 MiB)."""
_TWO_PASS_TILE_BYTES = 16 * 1024
_MAX_ALIGN = 16  # the widest vector load

_WORDS = {4: tl.int32, 2: tl.int16, 1: tl.uint8}


# Sizes that vary with the geometry are runtime arguments, not specialised on, so that one
# compiled kernel serves many geometries (compiling costs about a second each).
@triton.jit(do_not_specialize=["groups", "programs", "units", "units_per_page", "k"])
def _permute_units(
    ids_ptr,  # int32: k block ids per group
    bases_ptr,  # int64: byte address of block 0, per region
    strides_ptr,  # int64: bytes from one block to the next, per region
    src_ptr,  # int32 per unit: the unit it receives, -1 for zeros (== itself: in place)
    members_ptr,  # int32 (programs, BLOCK_U): the moving units of each program, -1 after them
    groups,
    programs,
    units,
    units_per_page,
    k,
    EVERY_UNIT: tl.constexpr,  # slices of every unit (one program per slice), not members
    UNIT: tl.constexpr,  # words per unit
    SLICE: tl.constexpr,  # words of each unit this program moves
    BLOCK_U: tl.constexpr,  # units per program (a power of two)
    ALIGN: tl.constexpr,  # bytes every row's first word is aligned to
    WORD: tl.constexpr,
    WIDTH: tl.constexpr,  # bytes per word
):
    # Adjacent programs: the slices of one set of units, then the sets of one group's pages.
    pid = tl.program_id(0).to(tl.int64)
    col = (pid % (UNIT // SLICE)) * (SLICE * WIDTH)
    rest = pid // (UNIT // SLICE)
    p = rest % programs
    rest = rest // programs
    g = rest % groups
    r = rest // groups
    base = tl.load(bases_ptr + r)
    stride = tl.load(strides_ptr + r)
    if EVERY_UNIT:
        u = tl.arange(0, BLOCK_U)
        src = tl.load(src_ptr + u, mask=u < units, other=0)
        moving = (u < units) & (src != u)
    else:
        u = tl.load(members_ptr + p * BLOCK_U + tl.arange(0, BLOCK_U))
        moving = u >= 0
        u = tl.where(moving, u, 0)
        src = tl.load(src_ptr + u, mask=moving, other=-1)
    loads = moving & (src >= 0)
    src = tl.where(loads, src, 0)
    src_block = tl.load(ids_ptr + g * k + src // units_per_page, mask=loads, other=0)
    dst_block = tl.load(ids_ptr + g * k + u // units_per_page, mask=moving, other=0)
    unit_bytes = UNIT * WIDTH
    src_row = base + src_block.to(tl.int64) * stride + (src % units_per_page) * unit_bytes + col
    dst_row = base + dst_block.to(tl.int64) * stride + (u % units_per_page) * unit_bytes + col
    src_row = tl.multiple_of(src_row, ALIGN)
    dst_row = tl.multiple_of(dst_row, ALIGN)
    c = tl.arange(0, SLICE)
    tile = tl.load(
        src_row.to(tl.pointer_type(WORD))[:, None] + c[None, :], mask=loads[:, None], other=0
    )
    # Every thread must hold its words before any thread overwrites words others still read.
    tl.debug_barrier()
    tl.store(dst_row.to(tl.pointer_type(WORD))[:, None] + c[None, :], tile, mask=moving[:, None])


@triton.jit(do_not_specialize=["groups", "group_words", "page_words", "k"])
def _gather_words(
    ids_ptr,
    bases_ptr,
    strides_ptr,
    index_ptr,  # int32 per word of a group: the landed word it receives, -1 for zero
    scratch_ptr,  # (groups x regions, group_words) words
    groups,
    group_words,
    page_words,
    k,
    TILE: tl.constexpr,
    WORD: tl.constexpr,
    WIDTH: tl.constexpr,
    TO_SCRATCH: tl.constexpr,
):
    """Words [tile * TILE, ...) of one group of one region: gathered into its scratch row, or
    written back from it."""
    row = tl.program_id(0).to(tl.int64)
    g = row % groups
    r = row // groups
    base = tl.load(bases_ptr + r)
    stride = tl.load(strides_ptr + r)
    i = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = i < group_words
    src = tl.load(index_ptr + i, mask=mask, other=0)
    moving = mask & (src != i)
    slot = scratch_ptr.to(tl.pointer_type(WORD)) + row * group_words
    if TO_SCRATCH:
        loads = moving & (src >= 0)
        src = tl.where(loads, src, 0)
        block = tl.load(ids_ptr + g * k + src // page_words, mask=loads, other=0).to(tl.int64)
        page = (base + block * stride).to(tl.pointer_type(WORD))
        tile = tl.load(page + src % page_words, mask=loads, other=0)
        tl.store(slot + i, tile, mask=moving)
    else:
        tile = tl.load(slot + i, mask=moving, other=0)
        block = tl.load(ids_ptr + g * k + i // page_words, mask=moving, other=0).to(tl.int64)
        page = (base + block * stride).to(tl.pointer_type(WORD))
        tl.store(page + i % page_words, tile, mask=moving)


@dataclass(frozen=True, eq=False)
class Prepared:
    """A plan's launch arguments on one device, made once and reused by every request.

    In place (``unit_words`` > 0): ``index`` is each unit's source unit, ``members`` the
    units of each program. Two-pass: ``index`` is each word's source word.
    """

    plan: Plan
    width: int
    index: torch.Tensor
    members: torch.Tensor | None = None  # None: slices of every unit
    programs: int = 1
    unit_words: int = 0
    slice_words: int = 0
    block_units: int = 0
    align: int = 1
    num_warps: int = 4
    tile_bytes: int = 0
    """The tile size it was prepared for (in place)."""

    @property
    def group_words(self) -> int:
        return self.plan.group_bytes // self.width

    @property
    def in_place(self) -> bool:
        return self.unit_words > 0

    @property
    def tile_words(self) -> int:
        """Words one program holds (in place)."""
        return self.block_units * self.slice_words

    @property
    def shape(self) -> tuple[int, ...]:
        """What tells two in-place preparations of a plan apart (tile sizes may coincide)."""
        return (self.unit_words, self.slice_words, self.block_units, self.programs, self.num_warps)


@dataclass(frozen=True, eq=False)
class Regions:
    """Regions that share a plan, on the device: each one's base address and block stride."""

    bases: torch.Tensor
    strides: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.bases.shape[0])


def regions(lane: Lane, bases: npt.NDArray[np.int64], strides: npt.NDArray[np.int64]) -> Regions:
    """Upload region bases and strides (under ``lane.launching()``)."""
    return Regions(lane.upload(bases, torch.int64), lane.upload(strides, torch.int64))


def unit_words(index: npt.NDArray[np.int64], page_words: int) -> int:
    """The largest power of two ``W`` dividing ``page_words`` such that ``index`` moves whole
    aligned units of ``W`` words: words ``[uW, uW + W)`` receive ``[sW, sW + W)`` in order, or
    are all zeroed."""
    w = page_words & -page_words
    while w > 1:
        rows = index.reshape(-1, w)
        first = rows[:, :1]
        zero = first < 0
        whole = np.where(zero, rows < 0, rows == first + np.arange(w))
        if whole.all() and (zero | (first % w == 0)).all():
            return w
        w //= 2
    return 1


def components(sources: npt.NDArray[np.int64]) -> list[list[int]]:
    """The moving units (``sources[u] != u``) grouped so that no unit is read by a unit of
    another group: the cycles and chains of ``u <- sources[u]``, largest first."""
    parent = list(range(len(sources)))

    def root(u: int) -> int:
        while parent[u] != u:
            parent[u] = parent[parent[u]]
            u = parent[u]
        return u

    moving = [u for u, s in enumerate(sources.tolist()) if s != u]
    is_moving = set(moving)
    for u in moving:
        s = int(sources[u])
        if s in is_moving:  # a source that stays put is never written: anyone may read it
            parent[root(u)] = root(s)
    found: dict[int, list[int]] = {}
    for u in moving:
        found.setdefault(root(u), []).append(u)
    return sorted(found.values(), key=len, reverse=True)


def pack(parts: list[list[int]], capacity: int) -> npt.NDArray[np.int32]:
    """``parts`` (largest first, none above ``capacity``) packed first-fit into rows of
    ``capacity`` units, padded with -1."""
    rows: list[list[int]] = []
    for part in parts:
        row = next((r for r in rows if len(r) + len(part) <= capacity), None)
        if row is None:
            rows.append(row := [])
        row += part
    table = np.full((max(1, len(rows)), capacity), -1, dtype=np.int32)
    for n, row in enumerate(rows):
        table[n, : len(row)] = row
    return table


def prepare(plan: Plan, lane: Lane, alignment: int, tile_bytes: int | None = None) -> Prepared:
    """``plan``'s launch arguments on ``lane``'s device, in the widest words every page address
    (all multiples of ``alignment``) and every run allow (under ``lane.launching()``).

    In-place programs hold at most ``tile_bytes``: by default what ``tune`` chose for the plan,
    else ``TILE_BYTES``; a plan whose closed sets do not fit goes through scratch (two passes).
    """
    if tile_bytes is None:
        tile_bytes = _tiles.get(plan, TILE_BYTES)
    width = min(plan.word_width(4), alignment & -alignment or 4, 4)
    index = plan.gather_index(width)
    if len(index) >= 2**31:
        raise ValueError(f"a group of {len(index)} words is too large for the CUDA kernels")
    page_words = plan.page_bytes // width
    unit = unit_words(np.asarray(index), page_words)
    units = len(index) // unit
    rows = np.asarray(index).reshape(units, unit)[:, 0]
    sources = np.where(rows < 0, -1, rows // unit)
    if unit * width < WHOLE_UNIT_BYTES:
        block_units = triton.next_power_of_2(units)
        tile = tile_bytes // width
        if block_units > tile:
            return Prepared(plan, width, lane.upload(np.asarray(index), torch.int32))
        slice_words = min(unit, tile // block_units)
        members, per_thread = None, WORDS_PER_THREAD
    else:
        parts = components(sources)
        largest = triton.next_power_of_2(max((len(p) for p in parts), default=1))
        tile = min(tile_bytes, COMPONENT_TILE_BYTES) // width
        if largest > tile:
            return Prepared(plan, width, lane.upload(np.asarray(index), torch.int32))
        # Whole units where a tile holds the largest component whole, else slices of them.
        slice_words = min(unit, tile // largest)
        block_units = max(largest, min(tile // slice_words, triton.next_power_of_2(units)))
        members, per_thread = pack(parts, block_units), COMPONENT_WORDS_PER_THREAD
    threads = max(32, block_units * slice_words // per_thread)
    return Prepared(
        plan,
        width,
        lane.upload(sources, torch.int32),
        members=None if members is None else lane.upload(members, torch.int32),
        programs=1 if members is None else len(members),
        unit_words=unit,
        slice_words=slice_words,
        block_units=block_units,
        align=min(alignment, slice_words * width, _MAX_ALIGN),
        num_warps=min(16, threads // 32),
        tile_bytes=tile_bytes,
    )


_stats: dict[str, dict[str, int]] = {}


def kernel_stats() -> dict[str, dict[str, int]]:
    """Registers and spills of each kernel compiled so far (empty under the interpreter)."""
    return dict(_stats)


def _note(compiled: Any, name: str) -> None:
    if compiled is not None and hasattr(compiled, "n_spills") and name not in _stats:
        _stats[name] = {"registers": int(compiled.n_regs), "spills": int(compiled.n_spills)}


def _launch_in_place(prepared: Prepared, where: Regions, ids: torch.Tensor, n: int) -> None:
    """One launch of the in-place kernel over ``n`` groups whose block ids are on the device."""
    plan, width = prepared.plan, prepared.width
    slices = prepared.unit_words // prepared.slice_words
    compiled = _permute_units[(slices * prepared.programs * n * where.count,)](
        ids,
        where.bases,
        where.strides,
        prepared.index,
        prepared.index if prepared.members is None else prepared.members,
        n,
        prepared.programs,
        prepared.group_words // prepared.unit_words,
        plan.page_bytes // width // prepared.unit_words,
        plan.pages_per_group,
        EVERY_UNIT=prepared.members is None,
        UNIT=prepared.unit_words,
        SLICE=prepared.slice_words,
        BLOCK_U=prepared.block_units,
        ALIGN=prepared.align,
        WORD=_WORDS[width],
        WIDTH=width,
        num_warps=prepared.num_warps,
    )
    _note(compiled, f"in_place tile={prepared.tile_words} words x {width} B")


def apply_runs(
    prepared: Prepared, where: Regions, groups: npt.NDArray[np.int64], lane: Lane
) -> None:
    """Apply the plan to every group (row of ``pages_per_group`` block ids) of every region of
    ``where``; asynchronous, on the lane's stream (call under ``lane.launching()``)."""
    if len(groups) == 0 or prepared.plan.is_identity:
        return
    plan, width = prepared.plan, prepared.width
    k = plan.pages_per_group
    ids = np.ascontiguousarray(groups, dtype=np.int32).reshape(-1)
    if prepared.in_place:
        per_launch = lane.ids.slot_ids // k
        for start in range(0, len(groups), per_launch):
            chunk = ids[start * k : (start + per_launch) * k]
            with lane.ids.slot(chunk) as on_device:
                _launch_in_place(prepared, where, on_device, len(chunk) // k)
        return
    group_words = prepared.group_words
    tile = min(triton.next_power_of_2(group_words), _TWO_PASS_TILE_BYTES // width)
    rows_bytes = plan.group_bytes * where.count
    per_chunk = max(1, min(SCRATCH_BYTES // rows_bytes, lane.ids.slot_ids // k))
    scratch = lane.scratch(min(len(groups), per_chunk) * rows_bytes)
    for start in range(0, len(groups), per_chunk):
        chunk = ids[start * k : (start + per_chunk) * k]
        n = len(chunk) // k
        with lane.ids.slot(chunk) as on_device:
            for to_scratch in (True, False):
                compiled = _gather_words[(n * where.count, triton.cdiv(group_words, tile))](
                    on_device,
                    where.bases,
                    where.strides,
                    prepared.index,
                    scratch,
                    n,
                    group_words,
                    plan.page_bytes // width,
                    k,
                    TILE=tile,
                    WORD=_WORDS[width],
                    WIDTH=width,
                    TO_SCRATCH=to_scratch,
                    num_warps=4,
                )
        _note(compiled, f"two_pass tile={tile} words x {width} B")


# -- variants, picked by measurement ---------------------------------------------------------

_tiles: dict[Plan, int] = {}
"""The tile size ``tune`` found fastest, per plan (plans are memoised: one entry per format
pair, sizes and coverage)."""
_measured: dict[Plan, dict[str, Any]] = {}
"""What ``tune`` and the replay trial measured, per plan (``choices``)."""


def tile_for(plan: Plan) -> int:
    """The tile size ``prepare`` uses for ``plan`` by default."""
    return _tiles.get(plan, TILE_BYTES)


def note_replay(plan: Plan, replay_ms: float | None, direct_ms: float | None) -> None:
    """Record the replay trial of ``plan`` (one group on scratch pages, call to complete)."""
    _measured.setdefault(plan, {}).update(
        replay_us=None if replay_ms is None else replay_ms * 1e3,
        direct_us=None if direct_ms is None else direct_ms * 1e3,
        replays=replay_ms is None or direct_ms is None or replay_ms < direct_ms,
    )


def choices(plan: Plan) -> dict[str, Any]:
    """What was measured for ``plan`` and chosen: ``tile_bytes`` with ``tile_gbps`` (GB/s per
    tile size), ``replays`` with ``replay_us`` and ``direct_us``; keys absent where nothing
    was measured."""
    out = dict(_measured.get(plan, {}))
    if plan in _tiles:
        out["tile_bytes"] = _tiles[plan]
    return out


def tune(plan: Plan, lane: Lane, alignment: int) -> dict[int, float]:
    """Time each in-place tile size of ``TILE_CHOICES`` on scratch pages (never a cache's; at
    most ``TUNE_BYTES``) and keep the fastest for ``plan``: ``prepare`` uses it from then on.

    Returns GB/s (listed bytes over the median time) per tile size measured (those that keep
    the plan in place); empty, choosing nothing, where the lane cannot time its work (the host
    stand-in under Triton's interpreter), or where fewer than two sizes make distinct in-place
    kernels. Compiles each variant (about a second each): for the attach worker's warm-up, not
    the executor. A plan is measured once per process. Under ``lane.launching()``.
    """
    if plan in _tiles:
        figures: dict[int, float] = _measured[plan]["tile_gbps"]
        return figures
    if lane.api.time_ms(lambda: None, 1) is None:
        return {}
    shapes: dict[tuple[int, ...], Prepared] = {}
    for tile in TILE_CHOICES:
        prepared = prepare(plan, lane, alignment, tile)
        if prepared.in_place:  # a tile too small for the plan's closed sets goes through scratch
            shapes.setdefault(prepared.shape, prepared)
    if len(shapes) < 2:
        return {}
    k = plan.pages_per_group
    groups = max(1, min(TUNE_BYTES // plan.group_bytes, lane.ids.slot_ids // k))
    scratch = lane.api.empty(groups * plan.group_bytes, lane.device)
    try:
        where = regions(
            lane,
            np.array([scratch.data_ptr()], dtype=np.int64),
            np.array([plan.page_bytes], dtype=np.int64),
        )
        ids = np.arange(groups * k, dtype=np.int64).reshape(groups, k)
        figures = {}
        for prepared in shapes.values():
            apply_runs(prepared, where, ids, lane)  # compiles it; the bytes are scratch

            def run(prepared: Prepared = prepared) -> None:
                apply_runs(prepared, where, ids, lane)

            ms = lane.api.time_ms(run, TUNE_REPEAT)
            assert ms is not None  # the lane timed work above
            figures[prepared.tile_bytes] = groups * plan.group_bytes / ms / 1e6
    finally:
        del scratch
        lane.api.free_cached(lane.device)
    _tiles[plan] = max(figures, key=lambda tile: figures[tile])
    _measured.setdefault(plan, {})["tile_gbps"] = figures
    return figures


class Replay:
    """One in-place launch of ``n`` groups over fixed regions, captured in a CUDA graph: the
    copy of the block ids from a pinned buffer of its own to the device, then the kernel. A
    call writes the ids and launches the graph on the lane's stream (under
    ``lane.launching()``): no Triton launcher, no separate upload.

    The buffer is written again only once the last launch's copy has run (an event recorded
    behind each launch). Holds the regions and the plan's arguments the graph reads.
    """

    def __init__(self, prepared: Prepared, where: Regions, lane: Lane, n: int) -> None:
        if not prepared.in_place:
            raise ValueError("only in-place launches are captured (two-pass ones use scratch)")
        self.prepared, self.where, self.lane, self.n = prepared, where, lane, n
        count = n * prepared.plan.pages_per_group
        api = lane.api
        self._host = api.pinned(4 * count).view(torch.int32)
        self._host_ids = self._host.numpy()
        self._ids = api.empty(4 * count, lane.device).view(torch.int32)
        self._done: CudaEvent | None = None

        def body() -> None:
            api.copy_async(self._ids, self._host)
            _launch_in_place(prepared, where, self._ids, n)

        self._launch = api.capture(body, lane.device)

    def __call__(self, groups: npt.NDArray[np.int64]) -> None:
        """Rewrite ``groups`` (``n`` rows of block ids) of the regions, asynchronously."""
        if self._done is not None and not self._done.query():
            self._done.synchronize()  # the last launch has not copied its ids yet
        self._host_ids[:] = groups.reshape(-1)
        self._launch()
        if self._done is None:
            self._done = self.lane.api.new_event()
        self._done.record(self.lane.stream)
