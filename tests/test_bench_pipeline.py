"""``kvd bench pipeline`` at a tiny size: a bar on a terminal, one JSON object under --json."""

from __future__ import annotations

import json
import sys

import pytest

from tests.daemon_helpers import kvd
from tests.tty import run_on_tty

TINY = ["bench", "pipeline", "--rounds", "1", "--messages", "300", "--latency-samples", "30"]


@pytest.mark.slow
def test_bar_on_a_terminal_then_the_table() -> None:
    code, out = run_on_tty([sys.executable, "-m", "kvd", *TINY])
    assert code == 0, out
    assert "kvd bench pipeline:" in out and "run/s]" in out, "a tqdm bar"
    assert "round 1/1 kvd" in out, "each run's figures above the bar"
    assert "throughput (msg/s)" in out and "meets targets:" in out


@pytest.mark.slow
def test_json_is_quiet() -> None:
    done = kvd(*TINY, "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    report = json.loads(done.stdout)
    assert report["figures"]["kvd"]["throughput"] > 0 and report["rounds"] == 1


@pytest.mark.slow
def test_windows_compare_fixed_windows_with_auto_at_each_load() -> None:
    done = kvd(
        *("bench", "pipeline", "--windows", "0,100,auto", "--transform", "merge"),
        *("--concurrency", "1,4", "--rounds", "2", "--messages", "100", "--json"),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    report = json.loads(done.stdout)
    assert report["transform"] == "merge" and report["block_size_ratio"] == 4
    assert [entry["load"] for entry in report["loads"]] == ["1 in flight", "4 in flight"]
    for entry in report["loads"]:
        assert list(entry["windows"]) == ["0", "100", "auto"]
        assert all(w["throughput"] > 0 and w["failed"] == 0 for w in entry["windows"].values())
        auto = entry["auto"]
        assert len(auto["chose_us"]) == 2, "the window auto chose, each round"
        assert auto["best_throughput_window"] in (0, 100) and auto["throughput_ratio"] > 0
        assert entry["noise"] >= 0


def test_windows_arguments_that_cannot_work_are_usage_errors() -> None:
    done = kvd("bench", "pipeline", "--windows", "0,0", timeout=60)
    assert done.returncode == 2 and "--windows: give two or more distinct windows" in done.stderr


@pytest.mark.slow
def test_layout_reports_the_kernel_time_beside_the_latency() -> None:
    done = kvd(*TINY, "--transform", "layout", "--blocks", "2", "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    kvd_figures = report["figures"]["kvd"]
    assert kvd_figures["failed"] == 0 and kvd_figures["kernel_us"] > 0
    assert report["figures"]["relay-api"]["kernel_us"] == 0
    beyond = report["beyond_kernel"]
    assert set(beyond) == {"kvd_p50_less_kernel_us", "over_relay_api_us"}


@pytest.mark.slow
@pytest.mark.parametrize("transform", ["none", "layout"])
def test_groups_split_each_notification_across_kv_cache_groups(transform: str) -> None:
    """``--groups 2``: every ReadDone is a v2 one with two groups of the 4 blocks; kvd answers
    each with a Ready (a missing event fails the run, a Failed one counts in ``failed``)."""
    done = kvd(
        *TINY, "--transform", transform, "--blocks", "4", "--groups", "2", "--json", timeout=300
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["groups"] == 2 and report["blocks_per_notification"] == 4
    assert all(f["failed"] == 0 for f in report["figures"].values()), report["figures"]
    assert report["figures"]["kvd"]["throughput"] > 0
    if transform == "layout":
        assert report["figures"]["kvd"]["kernel_us"] > 0, "the groups were rewritten"


def test_groups_split_the_blocks_as_evenly_as_they_can() -> None:
    from kvd.bench.pipeline import group_split

    assert group_split(16, 1) == (), "one group: a plain v1 ReadDone"
    assert group_split(16, 2) == ((8, 0), (8, 0))
    assert group_split(16, 3) == ((6, 0), (5, 0), (5, 0))
    assert group_split(2, 2) == ((1, 0), (1, 0))


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--groups", "0"], "argument --groups: expected 1 or more, got 0"),
        (["--blocks", "4", "--groups", "5"], "--groups must be in [1, --blocks] (4)"),
        (["--groups", "2", "--soak", "100"], "--groups is for the relay comparison, not --soak"),
        (
            ["--groups", "2", "--windows", "0,100", "--transform", "layout"],
            "--groups is for the relay comparison, not --windows",
        ),
    ],
)
def test_groups_that_cannot_work_are_usage_errors(flags: list[str], says: str) -> None:
    done = kvd("bench", "pipeline", *flags, timeout=60)
    assert done.returncode == 2 and says in done.stderr, done.stderr


@pytest.mark.slow
def test_soak_prints_the_rss_after_the_warm_up_and_at_the_end() -> None:
    done = kvd("bench", "pipeline", "--soak", "3000", "--soak-warmup", "1000", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["notifications"], report["warmup"], report["failed"]) == (3000, 1000, 0)
    growth = report["rss_at_end_bytes"] - report["rss_after_warmup_bytes"]
    assert report["rss_after_warmup_bytes"] > 0 and report["growth_bytes"] == growth
    assert report["meets_targets"] and growth <= report["growth_limit_bytes"]


def test_a_soak_warm_up_as_long_as_the_soak_is_a_usage_error() -> None:
    done = kvd("bench", "pipeline", "--soak", "100", "--soak-warmup", "100", timeout=60)
    assert done.returncode == 2 and "--soak-warmup must be in [1, --soak)" in done.stderr


def test_an_event_the_target_dropped_fails_the_run_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A target that publishes fewer events than it was sent (a queue that overflowed) ends
    the measurement with MixError after the event timeout; the bench once waited for ever."""
    import zmq

    from kvd.bench import pipeline

    monkeypatch.setattr(pipeline, "EVENT_TIMEOUT_S", 0.2)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull, pub = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
    ingest = f"inproc://ingest-{id(ctx)}"
    events = f"inproc://events-{id(ctx)}"
    pull.bind(ingest)
    pub.bind(events)
    target = pipeline.Target(ctx, ingest, events)
    try:
        # Connected: one event goes through, then the target stays silent.
        while not target.sub.poll(10):
            pub.send_multipart([pipeline.CACHE_ID.encode(), b"\0" * 8, b"x"])
        assert pipeline._next_event(target, 0, 2) == b"x"
        with pytest.raises(pipeline.MixError, match="after 1 of 2"):
            while True:
                pipeline._next_event(target, 1, 2)
    finally:
        target.close()
        pull.close()
        pub.close()
        ctx.term()
