"""The auto batching window on an explicit clock: what it learns and the window it gives."""

from __future__ import annotations

import pytest

from kvd.daemon.window import PEAK_ARRIVALS, AutoWindow

US = 1000
KEY = ("c0", "HND", 16)


def learnt(launch_us: float, per_block_us: float, sizes: range = range(1, 9)) -> AutoWindow:
    """An AutoWindow that saw jobs of ``sizes`` blocks cost launch + per_block x blocks."""
    auto = AutoWindow()
    for _ in range(8):
        for blocks in sizes:
            auto.job(blocks, int((launch_us + per_block_us * blocks) * US))
    return auto


def arrivals(auto: AutoWindow, gaps_us: list[float], key: tuple[str, ...] = KEY) -> None:
    now = 0
    auto.arrival(key, now)
    for gap in gaps_us:
        now += int(gap * US)
        auto.arrival(key, now)


def test_it_fits_the_launch_cost_and_the_cost_per_block() -> None:
    auto = learnt(120, 15)
    assert auto.launch_cost_ns == pytest.approx(120 * US)
    assert auto.per_block_ns == pytest.approx(15 * US)


def test_jobs_of_one_size_say_nothing_of_the_launch_cost() -> None:
    auto = learnt(120, 15, sizes=range(4, 5))
    assert auto.launch_cost_ns == 0
    arrivals(auto, [1] * 50)
    assert auto.window_ns(KEY) == 0, "no window before kvd knows what a launch costs"


def test_the_window_is_the_launch_cost_less_the_typical_gap() -> None:
    auto = learnt(120, 15)
    arrivals(auto, [20] * 100)
    assert auto.window_ns(KEY) == pytest.approx(100 * US, abs=1 * US)
    assert auto.last_ns == auto.window_ns(KEY)


def test_a_batch_waits_two_typical_gaps_for_the_next_request() -> None:
    auto = learnt(120, 15)
    assert auto.patience_ns(KEY) == 0
    arrivals(auto, [20] * 100)
    assert auto.patience_ns(KEY) == pytest.approx(40 * US, abs=1 * US)


def test_no_window_when_requests_come_more_than_a_launch_apart() -> None:
    auto = learnt(120, 15)
    arrivals(auto, [300] * 100)
    assert auto.window_ns(KEY) == 0
    assert auto.window_ns(("other", "HND", 16)) == 0, "a key never seen"


def test_a_burst_counts_as_a_burst() -> None:
    # A closed loop of 8: seven requests 10 us apart, then a pause while their batch runs.
    auto = learnt(120, 15)
    arrivals(auto, ([10] * 7 + [800]) * 20)
    gap = auto.typical_gap_ns(KEY)
    assert gap is not None and gap < 40 * US, "the mean gap (109 us) would hide the burst"
    assert auto.window_ns(KEY) > 80 * US


def test_the_window_is_bounded() -> None:
    auto = learnt(5000, 1)
    arrivals(auto, [1] * 100)
    assert auto.window_ns(KEY) == auto.max_ns == 1000 * US


def test_forget_drops_a_detached_caches_keys() -> None:
    auto = learnt(120, 15)
    arrivals(auto, [20] * 100)
    arrivals(auto, [20] * 100, key=("c1", "HND", 16))
    auto.forget(lambda key: key[0] == "c0")
    assert auto.typical_gap_ns(KEY) is None
    assert auto.typical_gap_ns(("c1", "HND", 16)) is not None


def test_all_in_is_holding_as_many_requests_as_lately_at_most() -> None:
    auto = AutoWindow()
    for held in [1, 2, 3, 4] * 10:
        auto.arrival(KEY, held * 10 * US, held)
    assert not auto.all_in(3)
    assert auto.all_in(4)
    # The most held is forgotten after two runs of PEAK_ARRIVALS arrivals with fewer.
    for n in range(2 * PEAK_ARRIVALS):
        auto.arrival(KEY, n * US, 2)
    assert auto.all_in(2)
    assert not auto.all_in(0), "held unknown: never"
