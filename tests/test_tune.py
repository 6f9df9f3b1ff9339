"""``kvd tune``: the recommendation rule, argument checks, and a tiny real sweep."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvd.bench.tune import TuneError, WindowResult, parse_windows, recommend
from tests.daemon_helpers import kvd
from tests.tty import run_on_tty

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def result(window: int, throughput: float, p50: float, p99: float) -> WindowResult:
    return WindowResult(window, throughput, p50, p99, failed=0)


SWEEP = [
    result(0, 10_000, 300, 1_000),
    result(100, 12_000, 400, 1_080),  # p99 within 10% of the best, more throughput
    result(500, 15_000, 900, 3_000),  # the most throughput, p99 far off
    result(1000, 9_000, 250, 1_200),
]


def test_balanced_takes_the_most_throughput_within_the_p99_slack() -> None:
    choice = recommend(SWEEP, tie=0.0)
    assert choice.window_us == 100 and choice.objective == "balanced"
    assert "p99 is within 10% of the best p99 (1,000 us)" in choice.rule
    assert "within 0% of the highest of them (12,000/s)" in choice.rule
    assert recommend(SWEEP, p99_slack=0.0).window_us == 0
    assert recommend(SWEEP, p99_slack=5.0, tie=0.0).window_us == 500


def test_balanced_prefers_the_smaller_window_when_throughputs_tie() -> None:
    # 10,000/s is within 20% of 12,000/s: the smaller window wins.
    assert recommend(SWEEP, tie=0.2).window_us == 0
    assert recommend(SWEEP, tie=0.1).window_us == 100
    assert recommend(SWEEP, p99_slack=5.0, tie=0.2).window_us == 100  # 12,000 >= 0.8 * 15,000


def test_single_objectives() -> None:
    assert recommend(SWEEP, "throughput").window_us == 500
    assert recommend(SWEEP, "p50").window_us == 1000
    assert recommend(SWEEP, "p99").window_us == 0
    tie = [result(200, 1, 1, 1), result(50, 1, 1, 1)]
    assert recommend(tie, "throughput").window_us == 50, "ties go to the smaller window"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0,x", "comma-separated"),
        ("", "at least one"),
        ("0,2000000", "0..1000000"),
        ("5,5", "repeats"),
    ],
)
def test_bad_windows(text: str, message: str) -> None:
    with pytest.raises(TuneError, match=message):
        parse_windows(text)
    assert parse_windows("0, 50,100") == [0, 50, 100]


def test_arguments_that_cannot_work_are_usage_errors() -> None:
    done = kvd("tune", "--block-size", "16", "--ratio", "3")
    assert done.returncode == 2 and "--ratio 3 does not divide --block-size 16" in done.stderr
    done = kvd("tune", "--num-blocks", "16", "--blocks", "4", "--concurrency", "8")
    assert done.returncode == 2 and "--concurrency 8 needs 32 blocks" in done.stderr


TINY = [
    *("tune", "--windows", "0,300", "--messages", "60", "--warmup", "10"),
    *("--layers", "1", "--num-blocks", "128", "--block-size", "16", "--ratio", "2"),
    *("--heads", "2", "--head-dim", "32", "--blocks", "2", "--concurrency", "4"),
]


@pytest.mark.slow
def test_a_tiny_sweep_prints_a_table_json_and_a_png(tmp_path: Path) -> None:
    # On a terminal: the progress bar, the table, the recommendation and the plot.
    plot = tmp_path / "sweep.png"
    code, out = run_on_tty([sys.executable, "-m", "kvd", *TINY, "--plot", str(plot)])
    assert code == 0, out
    lines = out.replace("\r\n", "\n").splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("window us"))
    assert lines[header].split() == [
        "window",
        "us",
        "notifications/s",
        "p50",
        "us",
        "p99",
        "us",
        "failed",
    ]
    rows = [lines[header + 1].split(), lines[header + 2].split()]
    assert [r[0] for r in rows] == ["0", "300"]
    assert all(float(r[1].replace(",", "")) > 0 and r[4] == "0" for r in rows)
    assert sum("<- recommended" in lines[header + i] for i in (1, 2)) == 1
    assert any(line.startswith("recommended: batch_window_us = ") for line in lines)
    assert any(line.startswith("rule (balanced): among windows whose p99") for line in lines)
    assert "kvd tune:" in out and "msg/s]" in out, "a tqdm bar with its rate"
    data = plot.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000

    # --json: one object on stdout, nothing on stderr (no bar off a terminal either).
    done = kvd(*TINY, "--json", "--plot", str(tmp_path / "json.png"), "--objective", "p99")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    report = json.loads(done.stdout)
    assert [w["window_us"] for w in report["windows"]] == [0, 300]
    assert all(w["throughput"] > 0 and w["p50_us"] <= w["p99_us"] for w in report["windows"])
    assert all(w["failed"] == 0 for w in report["windows"])
    choice = report["recommendation"]
    assert choice["objective"] == "p99" and choice["rule"] == "the lowest p99"
    best = min(report["windows"], key=lambda w: w["p99_us"])
    assert choice["window_us"] == best["window_us"]
    assert report["geometry"]["ratio"] == 2 and report["mix"]["concurrency"] == 4

    import matplotlib.image

    image = matplotlib.image.imread(tmp_path / "json.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
