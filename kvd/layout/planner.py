"""The one planner: which bytes of landed pages move where, for any pair of formats and sizes.

A *group* is what one NIXL READ fills. With remote block size ``nP`` no larger than the local
``nD`` (``r = nD / nP``), the READ lands ``r`` remote pages back to back in one local page:
remote page ``s`` at bytes ``[s * P, (s + 1) * P)``, holding local tokens ``s * nP ..``. With
``nP > nD`` (``k = nP / nD``) it lands one remote page across ``k`` local pages of the request,
chunk ``j`` of its bytes in the ``j``-th, which holds local tokens ``j * nD ..``. Either way the
landed bytes, read page after page, are the remote pages back to back, so a plan maps every byte
of a group (its local pages end to end) to the landed byte it must receive.

One exception, ``remote_ranks`` R > 1 with nP > nD: the group was read from R remote ranks, one
READ each, and each rank's page (its heads, nP tokens) landed in ``k`` pieces, piece ``j`` of
every rank side by side in the ``j``-th local page, rank by rank (what vLLM's reads from a
prefill of R times the decode's TP leave). With heads outermost in the remote format, the R
rank pages back to back are one remote page of every local head, so the plan is the usual one
with each landed offset moved to where that byte of that rank's piece sits (``_interleaved``).

A ``Plan`` is that map as runs of contiguous bytes, computed once per (formats, sizes, nP,
covered) and memoised: planning cost never depends on how many blocks a request lists. It is
built with numpy at the granularity of the largest piece contiguous on both sides (a head_dim
row when C is innermost in both formats, whole stretches of tokens when N is too, single
elements only when nothing else is), then adjacent pieces are merged.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvd.layout.formats import (
    KV,
    FormatError,
    PageLayout,
    PageSizes,
    page_bytes,
    page_layout,
)
from kvd.layout.geometry import group_shape
from kvd.protocol import Axis, PageFormat

MAX_PLAN_UNITS = 1 << 22
"""The most pieces one group may be planned in. Planning costs about 100 ns and 50 bytes of
memory per piece, so this bounds one plan near half a second and 200 MB; a pair that needs more
(a 16 MiB page moved byte by byte once took 5 s and 1.35 GB) is refused with ``PlanError``."""

Runs = npt.NDArray[np.int64]

ZERO = -1
"""``src_page`` of a run that writes zeros (bytes the READ did not cover)."""


class PlanError(ValueError):
    """A plan kvd will not build (too many pieces); the message says why."""


@dataclass(frozen=True, eq=False)
class Plan:
    """The byte moves of one group: ``runs`` rows (dst, src_page, src_offset, nbytes).

    ``dst`` is a byte offset into the group (its ``pages_per_group`` local pages end to end);
    ``src_page`` is the local page of the group holding the landed source bytes (``ZERO`` for
    zero-fill) and ``src_offset`` their offset in it. Runs are sorted by ``dst``, cover the group
    exactly once, never straddle a page boundary on either side, and adjacent ones are merged.
    Arrays are read-only: plans are shared.
    """

    runs: Runs
    pages_per_group: int
    page_bytes: int

    @property
    def group_bytes(self) -> int:
        return self.pages_per_group * self.page_bytes

    @functools.cached_property
    def _identity_mask(self) -> npt.NDArray[np.bool_]:
        dst, page, offset = self.runs[:, 0], self.runs[:, 1], self.runs[:, 2]
        same: npt.NDArray[np.bool_] = (page != ZERO) & (page * self.page_bytes + offset == dst)
        return same

    def same_moves(self, other: Plan) -> bool:
        """Whether ``other`` moves the same bytes of groups of the same shape."""
        return (
            self.pages_per_group == other.pages_per_group
            and self.page_bytes == other.page_bytes
            and np.array_equal(self.runs, other.runs)
        )

    @property
    def is_identity(self) -> bool:
        """Every byte already sits where it belongs: nothing to do."""
        return bool(self._identity_mask.all())

    @functools.cached_property
    def moves(self) -> Runs:
        """The runs that change bytes: all but those whose source is their destination.

        Each landed byte is the source of at most one run, so a byte that stays put is never
        needed elsewhere and kernels may skip it both ways.
        """
        return _frozen(np.ascontiguousarray(self.runs[~self._identity_mask]))

    @functools.cached_property
    def write_back(self) -> Runs:
        """Rows (offset in group, nbytes): the ranges ``moves`` write, merged, split at pages.

        A kernel that gathers ``moves`` into a scratch copy of the group copies these back.
        """
        moves = self.moves
        if not len(moves):
            return _frozen(np.zeros((0, 2), dtype=np.int64))
        start, length = moves[:, 0], moves[:, 3]
        joins = (start[1:] == start[:-1] + length[:-1]) & (start[1:] % self.page_bytes != 0)
        heads = np.flatnonzero(np.concatenate(([True], ~joins)))
        out = np.empty((len(heads), 2), dtype=np.int64)
        out[:, 0] = start[heads]
        out[:, 1] = np.add.reduceat(length, heads)
        return _frozen(out)

    def gather_index(self, width: int) -> npt.NDArray[np.int64]:
        """For each ``width``-byte word of the group, the landed word it receives (-1: zero).

        Landed word ``i`` is word ``i % (page_bytes / width)`` of page ``i // (...)``. For
        kernels that move words rather than runs; ``width`` must divide every run.
        """
        return _gather_index(self, width)

    def word_width(self, limit: int = 8) -> int:
        """The widest power of two up to ``limit`` dividing every offset and length."""
        every = np.bitwise_or.reduce(self.runs[:, [0, 2, 3]].reshape(-1)) | self.page_bytes
        width = limit
        while every % width:
            width //= 2
        return width


@functools.lru_cache(maxsize=64)
def _gather_index(plan: Plan, width: int) -> npt.NDArray[np.int64]:
    runs = plan.runs
    if (np.bitwise_or.reduce(runs[:, [0, 2, 3]].reshape(-1)) | plan.page_bytes) % width:
        raise ValueError(f"word width {width} does not divide the plan's runs")
    words = runs[:, 3] // width
    src = np.where(runs[:, 1] == ZERO, -1, (runs[:, 1] * plan.page_bytes + runs[:, 2]) // width)
    starts = np.repeat(src, words)
    steps = np.arange(int(words.sum()), dtype=np.int64) - np.repeat(np.cumsum(words) - words, words)
    index = np.where(starts < 0, -1, starts + steps)
    return _frozen(index)


def _frozen(a: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    a.setflags(write=False)
    return a


def plan(
    remote: PageFormat,
    local: PageFormat,
    sizes: PageSizes,
    remote_block_size: int,
    *,
    covered: int = 0,
    kv: KV = "k",
    remote_ranks: int = 1,
) -> Plan:
    """The plan that rewrites one group of ``local`` pages landed in the ``remote`` format.

    ``sizes`` are the local page's (``sizes.block_size`` is nD); ``remote_block_size`` is nP.
    ``covered`` (only for nP < nD) is how many remote pages landed in the group, 0 meaning all:
    the plan then moves those and zeroes every local element of a token at or past
    ``covered * nP``, never reading the uncovered bytes. ``kv`` picks the K or V region of a
    ``regions="kv"`` format (both sides the same region). ``remote_ranks`` (nP > nD only; 1
    otherwise) is how many remote ranks' pages landed interleaved in the group (module
    docstring). Memoised; formats must be checked (``formats.resolve``).

    Raises ``FormatError`` when the two formats do not hold the same elements (other regions,
    parts or axes) or R ranks' pages are not one remote page, ``ValueError`` for block sizes or
    ``covered`` that do not fit, ``PlanError`` when the plan would exceed ``MAX_PLAN_UNITS``
    pieces.
    """
    covered = _covered(sizes, remote_block_size, covered)
    ranks = _ranks(remote, sizes, remote_block_size, remote_ranks, kv)
    return _plan(remote, local, sizes, remote_block_size, covered=covered, kv=kv, ranks=ranks)


def needs_work(
    remote: PageFormat,
    local: PageFormat,
    sizes: PageSizes,
    remote_block_size: int,
    *,
    covered: int = 0,
    kv: KV = "k",
    remote_ranks: int = 1,
) -> bool:
    """Whether ``plan(...)`` with the same arguments moves or zeroes anything.

    Structural and cheap (no plan is built): true when a partly covered group needs zeroes, or
    ranks' pages landed interleaved, or when the formats differ once axes of size 1 are
    dropped, or when the block sizes differ and the token axis is not outermost in the larger
    page (only then do smaller pages back to back make it). Raises as ``plan``.
    """
    if _covered(sizes, remote_block_size, covered):
        return True
    r_layout, l_layout = _check_pair(remote, local, kv)
    if _ranks(remote, sizes, remote_block_size, remote_ranks, kv) > 1:
        return True
    nD, nP = sizes.block_size, remote_block_size
    if _normalized(r_layout, sizes, min(nP, nD)) != _normalized(l_layout, sizes, min(nP, nD)):
        return True
    if nP == nD:
        return False
    # Pages back to back make one page only when the larger page has its tokens outermost.
    outer, orders = _normalized(r_layout if nP > nD else l_layout, sizes, max(nP, nD))
    outermost = orders[0] if len(orders) == 1 else outer
    return not outermost or outermost[0] != "N"


def _covered(sizes: PageSizes, remote_block_size: int, covered: int) -> int:
    """``covered`` normalised: 0 when the whole group landed, else 1 <= covered < r."""
    _, remote_pages = group_shape(sizes.block_size, remote_block_size)
    if covered < 0 or covered > remote_pages:
        raise ValueError(f"covered must be in [0, {remote_pages}], got {covered}")
    return 0 if covered == remote_pages else covered


def _ranks(
    remote: PageFormat, sizes: PageSizes, remote_block_size: int, remote_ranks: int, kv: KV
) -> int:
    """``remote_ranks`` normalised: 1 when nothing landed interleaved (one rank, or nP <= nD,
    where each rank's page lands whole); else checked to make one remote page of the ranks'."""
    if remote_ranks < 1:
        raise ValueError(f"remote_ranks must be >= 1, got {remote_ranks}")
    if remote_ranks == 1 or remote_block_size <= sizes.block_size:
        return 1
    outer, orders = _normalized(page_layout(remote, kv), sizes, remote_block_size)
    outermost = (outer or orders[0])[0]
    if outermost != "H":
        raise FormatError(
            f"remote_ranks: {remote_ranks} ranks' pages make one page only with heads outermost "
            f"in the remote format, which has {outermost} outermost"
        )
    if sizes.num_heads % remote_ranks:
        raise FormatError(
            f"remote_ranks: {remote_ranks} ranks do not share the page's {sizes.num_heads} "
            "heads evenly"
        )
    return remote_ranks


def _check_pair(remote: PageFormat, local: PageFormat, kv: KV) -> tuple[PageLayout, PageLayout]:
    if remote.regions != local.regions:
        raise FormatError(
            f"remote_format: regions {remote.regions!r} differ from the local {local.regions!r}"
        )
    r_layout, l_layout = page_layout(remote, kv), page_layout(local, kv)
    if len(r_layout.parts) != len(l_layout.parts):
        raise FormatError(
            f"remote_format: its pages hold {len(r_layout.parts)} of K and V, the local pages "
            f"{len(l_layout.parts)}"
        )
    r_axes = set(r_layout.outer) | set(r_layout.parts[0])
    l_axes = set(l_layout.outer) | set(l_layout.parts[0])
    if r_axes != l_axes:
        raise FormatError(
            f"remote_format: its pages hold axes {sorted(r_axes)}, the local pages {sorted(l_axes)}"
        )
    return r_layout, l_layout


def _normalized(
    layout: PageLayout, sizes: PageSizes, block_size: int
) -> tuple[tuple[Axis, ...], tuple[tuple[Axis, ...], ...]]:
    """The layout of a page of ``block_size`` tokens without its axes of size 1; a one-part
    page as one row-major order. Two layouts place every element alike iff these are equal."""

    def keep(axes: tuple[Axis, ...]) -> tuple[Axis, ...]:
        return tuple(a for a in axes if sizes.of(a, block_size) > 1)

    if len(layout.parts) == 1:
        return (), (keep(layout.outer + layout.parts[0]),)
    return keep(layout.outer), tuple(keep(p) for p in layout.parts)


@functools.lru_cache(maxsize=256)
def _plan(
    remote: PageFormat,
    local: PageFormat,
    sizes: PageSizes,
    remote_block_size: int,
    *,
    covered: int,
    kv: KV,
    ranks: int = 1,
) -> Plan:
    r_layout, l_layout = _check_pair(remote, local, kv)
    pages, _ = group_shape(sizes.block_size, remote_block_size)
    dst, src, length = _pieces(r_layout, l_layout, sizes, remote_block_size, covered)
    page = page_bytes(local, sizes)
    if ranks > 1:
        dst, src, length = _interleaved(
            (dst, src, length), ranks=ranks, chunks=pages, page=page // sizes.itemsize
        )
    runs = _merge(dst * sizes.itemsize, src * sizes.itemsize, length * sizes.itemsize, page)
    return Plan(_frozen(runs), pages, page)


def _strides(
    layout: PageLayout, sizes: PageSizes, block_size: int
) -> tuple[list[dict[Axis, int]], int, int]:
    """Per part, each axis's stride in elements; the elements of one part and of the page."""
    part_size = math.prod(sizes.of(a, block_size) for a in layout.parts[0])
    step = len(layout.parts) * part_size
    outer: dict[Axis, int] = {}
    for axis in reversed(layout.outer):
        outer[axis] = step
        step *= sizes.of(axis, block_size)
    out = []
    for order in layout.parts:
        strides = dict(outer)
        inner = 1
        for axis in reversed(order):
            strides[axis] = inner
            inner *= sizes.of(axis, block_size)
        out.append(strides)
    return out, part_size, step


_Dim = tuple[str, int, int, int]
"""(name, extent, local stride, remote stride), strides in elements."""


def _pieces(
    r_layout: PageLayout, l_layout: PageLayout, sizes: PageSizes, nP: int, covered: int
) -> tuple[Runs, Runs, Runs]:
    """(dst, src, length) of every piece of the group, in elements, sorted by dst.

    The group's tokens are (q, u): chunk q of min(nP, nD) tokens, token u inside it. On the
    side with one page per group the token is q * chunk + u; on the other, q picks the page.
    Landed offsets are on the remote side (its pages back to back); src is -1 where zeroes go.
    """
    nD = sizes.block_size
    chunk, chunks = min(nP, nD), max(nP, nD) // min(nP, nD)
    l_strides, l_part, l_page = _strides(l_layout, sizes, nD)
    r_strides, r_part, r_page = _strides(r_layout, sizes, nP)
    others = [a for a in l_layout.outer + l_layout.parts[0] if a != "N"]
    plans: list[tuple[int, int, list[_Dim]]] = []
    for p in range(len(l_layout.parts)):
        ls, rs = l_strides[p], r_strides[p]
        q_strides = (l_page, chunk * rs["N"]) if nP > nD else (chunk * ls["N"], r_page)
        dims: list[_Dim] = [("q", chunks, *q_strides), ("u", chunk, ls["N"], rs["N"])]
        dims += [(a, sizes.of(a), ls[a], rs[a]) for a in others]
        dims = [d for d in dims if d[1] > 1]
        # The piece: the axes contiguous on both sides, innermost first. Chunks stay apart
        # when they are pages (a piece never spans two) or when some are zeroed.
        keep_chunks = covered or nP > nD
        unit = 1
        while nxt := next(
            (d for d in dims if d[2] == d[3] == unit and not (keep_chunks and d[0] == "q")), None
        ):
            unit *= nxt[1]
            dims.remove(nxt)
        plans.append((p, unit, dims))
    count = sum(math.prod(d[1] for d in dims) for _, _, dims in plans)
    if count > MAX_PLAN_UNITS:
        raise PlanError(
            f"one group of this format pair is {count} pieces (of "
            f"{min(u for _, u, _ in plans) * sizes.itemsize} bytes and up), more than "
            f"MAX_PLAN_UNITS ({MAX_PLAN_UNITS})"
        )
    dsts, srcs, lengths = [], [], []
    for p, unit, dims in plans:
        dst = np.full((), p * l_part, dtype=np.int64)
        src = np.full((), p * r_part, dtype=np.int64)
        zero = np.zeros((), dtype=bool)
        for name, extent, l_stride, r_stride in dims:
            index = np.arange(extent, dtype=np.int64)
            dst = np.add.outer(dst, index * l_stride)
            src = np.add.outer(src, index * r_stride)
            zero = np.logical_or.outer(zero, (index >= covered) & bool(covered and name == "q"))
        dsts.append(dst.reshape(-1))
        srcs.append(np.where(zero, -1, src).reshape(-1))
        lengths.append(np.full(dsts[-1].shape, unit, dtype=np.int64))
    dst, src, length = np.concatenate(dsts), np.concatenate(srcs), np.concatenate(lengths)
    order = np.argsort(dst, kind="stable")
    return dst[order], src[order], length[order]


def _interleaved(
    pieces: tuple[Runs, Runs, Runs], *, ranks: int, chunks: int, page: int
) -> tuple[Runs, Runs, Runs]:
    """``_pieces`` (dst, src, length) of a group whose ``ranks`` rank pages landed interleaved:
    each landed offset (in elements, of the ranks' pages back to back) moved to chunk ``j`` of
    its rank's page in local page ``j`` of ``chunks``, at the rank's slot (``page / ranks``
    elements each). Pieces are first cut so that none crosses a slot's end."""
    dst, src, length = pieces
    slot = page // ranks
    starts = src[src >= 0]
    cut = math.gcd(slot, int(np.gcd.reduce(length)), int(np.gcd.reduce(starts)))
    if cut < int(length.max()):
        count = length // cut
        total = int(count.sum())
        if total > MAX_PLAN_UNITS:
            raise PlanError(
                f"one group of {ranks} ranks' interleaved pages is {total} pieces of {cut} "
                f"elements, more than MAX_PLAN_UNITS ({MAX_PLAN_UNITS})"
            )
        step = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        dst = np.repeat(dst, count) + step * cut
        src = np.repeat(src, count)
        src = np.where(src < 0, -1, src + step * cut)
        length = np.full(dst.shape, cut, dtype=np.int64)
    rank, within = np.divmod(src, chunks * slot)
    chunk, offset = np.divmod(within, slot)
    return dst, np.where(src < 0, -1, chunk * page + rank * slot + offset), length


def _merge(dst: Runs, src: Runs, length: Runs, page: int) -> Runs:
    """Runs of contiguous pieces: (dst, src_page, src_offset, nbytes), split at page bounds."""
    zero = src < 0
    after = dst[:-1] + length[:-1]
    joins = (dst[1:] == after) & (dst[1:] % page != 0)
    joins &= (zero[1:] & zero[:-1]) | (
        ~zero[1:] & ~zero[:-1] & (src[1:] == src[:-1] + length[:-1]) & (src[1:] % page != 0)
    )
    heads = np.flatnonzero(np.concatenate(([True], ~joins)))
    out = np.empty((len(heads), 4), dtype=np.int64)
    first = src[heads]
    out[:, 0] = dst[heads]
    out[:, 1] = np.where(first < 0, ZERO, first // page)
    out[:, 2] = np.where(first < 0, 0, first % page)
    out[:, 3] = np.add.reduceat(length, heads)
    return out


@functools.lru_cache(maxsize=16)
def zero_plan(page_bytes: int) -> Plan:
    """Zeroes one whole page: for pages a READ did not reach at all."""
    return Plan(_frozen(np.array([[0, ZERO, 0, page_bytes]], dtype=np.int64)), 1, page_bytes)
