"""How long a batch may wait for more requests: the ``auto`` batching window.

Pure logic, driven by the caller's clock. The daemon reports each arrival (by batch key) and
each finished job (its blocks, and how long it kept the executor and the loop busy);
``window_ns`` answers how long a batch that opens now, with the executor idle, may wait.

The rule. Every job costs a fixed launch overhead ``c0`` (the loop's work to launch and finish
it, the journal records, the kernel call) plus ``c1`` per block; kvd fits both to recent jobs by
least squares. Cost is work (CPU time of the loop and the executor thread, or time on the GPU),
not wall time: waiting for the GIL or a wake-up overlaps with other work, and is not saved.
A request that joins a waiting batch saves one launch, ``c0``; waiting costs each request
already in the batch the time waited. With requests of the batch's key
arriving at rate ``λ``, the next instant ``dt`` of waiting brings ``λ dt`` requests, saving
``λ dt c0``, and costs the ``1 + λ W`` requests gathered after a wait ``W`` each ``dt``. Waiting
pays while ``λ c0 > 1 + λ W``: the window is ``W = c0 - 1/λ``, so nothing while requests come
more than a launch apart, and never more than one launch (nor ``max_ns``). ``1/λ`` is the
typical gap between requests: a geometric mean of recent gaps, so that a burst (a closed loop
answering a batch of events at once) counts as a burst. A batch that opens while the executor
is busy gets no window at all (``Batcher.add(idle=False)``): it fills anyway until the
executor is free, and goes then.

The rate holds only while requests keep coming: a closed loop of N clients sends N at most, and
waiting past the last saves nothing. So a waiting batch goes sooner: as soon as kvd holds as
many requests as it held at most lately (``all_in``: the loop has sent all it will send until
answered), else once no request came for two typical gaps (``patience_ns``): each arrival
moves its deadline, never past ``W``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable

Key = tuple[Hashable, ...]
"""A batch key (cache, remote format, remote block size)."""

MAX_AUTO_WINDOW_NS = 1_000_000
"""The auto window never exceeds 1 ms, whatever the estimates say."""

PATIENCE_GAPS = 2
"""A waiting batch goes when no request came for this many typical gaps."""

_FORGET = 1 / 64
"""Weight of the newest job in the fit (about the last 64 count)."""
_GAP_WEIGHT = 1 / 16
"""Weight of the newest gap in the typical gap (about the last 16 count)."""
_GAP_MIN_NS, _GAP_MAX_NS = 1_000, 10_000_000
"""Gaps are counted within [1 us, 10 ms]: one idle minute must not take an hour to forget."""
PEAK_ARRIVALS = 256
""""Lately", for the most requests held: the last 256 to 512 arrivals."""


class _Fit:
    """Exponentially weighted least squares of y = a + b x (x: blocks, y: ns)."""

    __slots__ = ("n", "x", "xx", "xy", "y")

    def __init__(self) -> None:
        self.n = 0
        self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float) -> None:
        w = max(_FORGET, 1 / (self.n + 1))  # plain means until enough points
        self.n += 1
        self.x += w * (x - self.x)
        self.y += w * (y - self.y)
        self.xx += w * (x * x - self.xx)
        self.xy += w * (x * y - self.xy)

    def line(self) -> tuple[float, float] | None:
        """(a, b), or None while the jobs' sizes hardly vary (then a and b cannot be told apart)."""
        var = self.xx - self.x * self.x
        if self.n < 8 or var <= 0.01 * self.x * self.x:
            return None
        b = max(0.0, (self.xy - self.x * self.y) / var)
        return max(0.0, self.y - b * self.x), b


class AutoWindow:
    """The estimates behind the auto window, and the window they give (see the module)."""

    def __init__(self, max_ns: int = MAX_AUTO_WINDOW_NS) -> None:
        self.max_ns = max_ns
        self._fit = _Fit()
        self._launch_ns = 0.0
        self._per_block_ns = 0.0
        self._last_arrival: dict[Key, int] = {}
        self._log_gap: dict[Key, float] = {}
        self.last_ns = 0
        """The window given to the latest batch that opened with the executor idle."""
        self._peaks = [0, 0]
        """The most requests held in the previous and in the current run of arrivals."""
        self._count = 0

    @property
    def launch_cost_ns(self) -> float:
        """``c0``: the fixed cost of one job, as last fitted (0 until jobs vary in size)."""
        return self._launch_ns

    @property
    def per_block_ns(self) -> float:
        return self._per_block_ns

    def arrival(self, key: Key, now_ns: int, held: int = 0) -> None:
        """A request of ``key`` was accepted at ``now_ns``; kvd holds ``held`` requests now
        (0: not said)."""
        self._count += 1
        if self._count >= PEAK_ARRIVALS:
            self._count = 0
            self._peaks = [self._peaks[1], 0]
        self._peaks[1] = max(self._peaks[1], held)
        last = self._last_arrival.get(key)
        self._last_arrival[key] = now_ns
        if last is None:
            return
        log_gap = math.log(min(max(now_ns - last, _GAP_MIN_NS), _GAP_MAX_NS))
        mean = self._log_gap.get(key)
        self._log_gap[key] = log_gap if mean is None else mean + _GAP_WEIGHT * (log_gap - mean)

    def typical_gap_ns(self, key: Key) -> float | None:
        """The geometric mean of recent gaps between requests of ``key`` (None: one so far)."""
        mean = self._log_gap.get(key)
        return None if mean is None else math.exp(mean)

    def job(self, blocks: int, duration_ns: int) -> None:
        """A job of ``blocks`` blocks occupied the executor for ``duration_ns``."""
        self._fit.add(blocks, duration_ns)
        line = self._fit.line()
        if line is not None:
            self._launch_ns, self._per_block_ns = line

    def window_ns(self, key: Key) -> int:
        """How long a batch of ``key`` opening now, with the executor idle, may wait."""
        gap = self.typical_gap_ns(key)
        window = 0 if gap is None else int(min(self.max_ns, max(0.0, self._launch_ns - gap)))
        self.last_ns = window
        return window

    def all_in(self, held: int) -> bool:
        """Whether holding ``held`` requests, kvd holds as many as it did at most lately: a
        closed loop has sent all it will until it is answered, and waiting saves nothing."""
        return held > 0 and held >= max(self._peaks)

    def patience_ns(self, key: Key) -> int:
        """How long a waiting batch of ``key`` waits for its next request: two typical gaps.
        When none comes by then, the requests have stopped coming (a closed loop's burst is
        over) and waiting longer saves nothing."""
        gap = self.typical_gap_ns(key)
        return 0 if gap is None else int(PATIENCE_GAPS * gap)

    def forget(self, which: Callable[[Key], bool]) -> None:
        """Drop what is known of the keys ``which`` selects (their cache was detached)."""
        for key in [k for k in self._last_arrival if which(k)]:
            del self._last_arrival[key]
            self._log_gap.pop(key, None)
