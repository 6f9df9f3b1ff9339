"""``kvd bench serve``'s report: figures from ``vllm bench serve``'s results, medians, targets."""

from __future__ import annotations

import argparse
import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from kvd.bench.serve import Server, _proxy, load_cores, place, prompt_seed
from kvd.bench.serve_report import (
    CONNECTORS,
    connector_figures,
    median_interval,
    repeated_report,
    run_report,
    table,
)


def measured(throughput: float, ttft_ms: float, ttfts_s: list[float]) -> dict[str, Any]:
    result = {
        "request_throughput": throughput,
        "output_throughput": throughput * 48,
        "median_ttft_ms": ttft_ms,
        "p99_ttft_ms": ttft_ms * 2,
        "median_tpot_ms": 5.0,
        "p99_tpot_ms": 9.0,
        "median_itl_ms": 5.0,
        "p99_itl_ms": 40.0,
        "median_e2el_ms": ttft_ms + 240,
        "p99_e2el_ms": ttft_ms * 2 + 300,
        "ttfts": ttfts_s,
        "completed": 24,
        "failed": 0,
    }
    return {"result": result, "legs": [], "stalls": {"0": 0.01, "1": 0.02}, "kvd_cpu_s": 0.5}


def three_runs() -> list[dict[str, Any]]:
    # kvd faster in two runs of three, slower in one: the medians decide.
    pairs = [((2.0, 500), (2.2, 450)), ((2.0, 500), (1.0, 900)), ((2.0, 500), (2.1, 480))]
    return [
        run_report(
            {
                "stock": measured(s[0], s[1], [s[1] / 1000, 2.5]),
                "kvd": measured(k[0], k[1], [k[1] / 1000, 1.5]),
            },
            CONNECTORS,
        )
        for s, k in pairs
    ]


def test_targets_are_judged_on_the_medians_with_the_runs_that_met_each() -> None:
    report = repeated_report(three_runs(), {}, {}, stale_reads=False, released=False)
    assert report["medians"]["kvd"]["req_s"] == 2.1
    assert report["medians"]["kvd"]["ttft_max"] == 1500.0
    throughput = report["targets"][0]
    assert throughput["met"] and throughput["runs_met"] == 2
    assert abs(throughput["ratio"] - 1.05) < 1e-9


def test_targets_are_judged_on_the_median_of_the_runs_paired_ratios() -> None:
    """Each run pairs the two servers: a machine twice as fast in one run moves both. kvd at
    1.2x, 0.9x and 1.0x stock's throughput in three runs meets 1.0x (the median run), where
    the ratio of the two medians (1.8 / 2.0) would call it 0.9x."""
    runs = [
        run_report(
            {"stock": measured(stock, 500, [0.5]), "kvd": measured(kvd, 500, [0.5])},
            CONNECTORS,
        )
        for stock, kvd in ((1.0, 1.2), (2.0, 1.8), (3.0, 3.0))
    ]
    report = repeated_report(runs, {}, {}, stale_reads=False, released=True)
    throughput = report["targets"][0]
    assert throughput["met"] and abs(throughput["ratio"] - 1.0) < 1e-9, throughput
    assert abs(report["ratios"]["req_s"] - 1.0) < 1e-9


def test_the_table_names_misses_failures_and_what_the_machine_did() -> None:
    runs = three_runs()
    runs[1]["kvd"]["failed"] = 2
    runs[2]["stock"]["worst_stall_s"] = 3.0
    report = repeated_report(
        runs, {"kvd": {"equal": 16, "of": 16}}, {"kvd serve": "on 0"}, stale_reads=True,
        released=False,
    )  # fmt: skip
    args = argparse.Namespace(
        num_prompts=24, input_len=600, output_len=48, concurrency=4, prefill_block=32,
        decode_block=64, prompts="distinct",
    )  # fmt: skip
    text = "\n".join(table(report, args))
    assert "medians of 3 runs; 24 requests (distinct prompts) of 600 -> 48 tokens" in text
    assert "met    request throughput >= 1.0x stock: 1.05x (2 of 3 runs)" in text
    assert "failed requests: stock 0, kvd 2" in text
    assert "greedy text equal to a single instance's, kvd: 16 of 16" in text
    assert "kept a ready thread off its core for 3.0s" in text
    assert "reads of blocks past their lease" in text
    assert "left its cache attached to kvd" in text


def test_the_median_s_interval_is_the_order_statistics_the_binomial_law_gives() -> None:
    # 5 runs: the smallest and largest hold the median with 1 - 2/32; 10 runs: the second
    # smallest and largest, 1 - 2 * 11/1024 (the third, 89%, is under 90%).
    assert median_interval([1.1, 0.9, 1.0, 1.3, 0.8]) == (0.8, 1.3, 1 - 2 / 32)
    assert median_interval([float(i) for i in range(10)]) == (1.0, 8.0, 1 - 2 * 11 / 1024)
    assert median_interval([1.0, 1.1, 0.9, 1.2]) is None


def test_a_miss_says_whether_the_runs_noise_covers_it() -> None:
    """Five runs whose throughput ratios straddle 1.0 miss within the noise; five that all
    fall short miss beyond it."""
    args = argparse.Namespace(
        num_prompts=24, input_len=600, output_len=48, concurrency=4, prefill_block=32,
        decode_block=64, prompts="distinct",
    )  # fmt: skip
    for kvd_rates, expected in (
        (
            [1.8, 1.9, 2.2, 1.7, 1.9],
            "1 of 5 runs; 94% interval 0.85x-1.10x: within the runs' noise",
        ),
        (
            [1.8, 1.9, 1.9, 1.7, 1.9],
            "0 of 5 runs; 94% interval 0.85x-0.95x: beyond the runs' noise",
        ),
    ):
        runs = [
            run_report(
                {"stock": measured(2.0, 500, [0.5]), "kvd": measured(rate, 500, [0.5])},
                CONNECTORS,
            )
            for rate in kvd_rates
        ]
        report = repeated_report(runs, {}, {}, stale_reads=False, released=True)
        text = "\n".join(table(report, args))
        assert f"MISSED request throughput >= 1.0x stock: 0.95x ({expected})" in text, text


def test_a_ratio_that_rounds_to_its_limit_is_shown_to_three_places() -> None:
    """ITL p99 at 1.003x stock's misses 1.0x: the verdict must not read "MISSED ... 1.00x"."""
    args = argparse.Namespace(
        num_prompts=24, input_len=600, output_len=48, concurrency=4, prefill_block=32,
        decode_block=64, prompts="distinct",
    )  # fmt: skip
    runs = [
        run_report({"stock": measured(2.0, 500, [0.5]), "kvd": measured(2.0, 500, [0.5])},
                   CONNECTORS)
    ]  # fmt: skip
    runs[0]["kvd"]["itl_p99"] = runs[0]["stock"]["itl_p99"] * 1.003
    text = "\n".join(table(repeated_report(runs, {}, {}, stale_reads=False, released=True), args))
    assert "MISSED ITL p99 <= 1.0x stock: 1.003x (0 of 1 runs)" in text, text
    assert "met    request throughput >= 1.0x stock: 1.00x (1 of 1 runs)" in text, text


def test_requests_handed_off_at_a_steps_end_are_this_runs() -> None:
    """The connector's stats count from the server's start: a run's are the difference."""
    run = measured(2.0, 500, [0.5])
    run["connector_before"] = {"requests": 10, "early": 8}
    run["connector_after"] = {"requests": 30, "early": 25}
    figures = connector_figures("kvd", run)
    assert (figures["kvd_requests"], figures["late_requests"]) == (20, 3)


def test_distinct_prompts_are_new_to_every_run_and_server() -> None:
    """Distinct prompts never repeat (no prefix-cache hit on either side); repeated ones do."""
    seeds = [
        prompt_seed(argparse.Namespace(seed=7, prompts="distinct"), index, connector)
        for index in range(3)
        for connector in CONNECTORS
    ]
    assert len(set(seeds)) == len(seeds) and 7 not in seeds
    repeated = argparse.Namespace(seed=7, prompts="repeated")
    assert {prompt_seed(repeated, i, c) for i in range(3) for c in CONNECTORS} == {7}


def test_kvd_runs_apart_from_the_decode_unless_asked_to_share_its_core() -> None:
    """As deployed: kvd on a third core where there is one, else the prefill's; never the
    decode's unless --kvd-core decode asks to measure that."""
    assert place([0, 1, 2, 3], "apart") == {"prefill": 0, "stock": 3, "kvd": 3, "kvd serve": 1}
    assert place([4, 5], "apart") == {"prefill": 4, "stock": 5, "kvd": 5, "kvd serve": 4}
    assert place([4, 5], "decode")["kvd serve"] == 5
    assert place([2], "apart") == {"prefill": 2, "stock": 2, "kvd": 2, "kvd serve": 2}


def test_the_load_client_and_proxy_run_off_the_decodes_core() -> None:
    """As deployed, where they are on other machines: a spare core where there is one, else the
    other servers' cores; the decode's only on a machine of one core."""
    four = place([0, 1, 2, 3], "apart")
    assert load_cores([0, 1, 2, 3], four) == {2}
    assert load_cores([4, 5], place([4, 5], "apart")) == {4}
    assert load_cores([4, 5], place([4, 5], "decode")) == {4}
    assert load_cores([0, 1, 2], place([0, 1, 2], "apart")) == {0, 1}
    assert load_cores([2], place([2], "apart")) == {2}


def test_the_proxy_runs_on_the_cores_it_is_given(tmp_path: Path) -> None:
    """A real proxy process, before a healthy server (its /health asks the server's): its
    affinity is the cores given, not this process's."""
    cores = frozenset(sorted(os.sched_getaffinity(0))[:1])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    before = _children()
    try:
        with _proxy(tmp_path, url, url, cores):
            started = _children() - before
            assert [os.sched_getaffinity(pid) for pid in started] == [cores]
    finally:
        server.shutdown()
        server.server_close()


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _children() -> set[int]:
    return {
        int(pid)
        for task in Path("/proc/self/task").iterdir()
        for pid in (task / "children").read_text().split()
    }


@pytest.mark.parametrize(("code", "quiet"), [("time.sleep(60)", True), ("while True: pass", False)])
def test_a_turn_waits_for_the_other_decode_server_to_go_quiet(
    code: str, quiet: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real processes: one asleep is quiet at the first look; one that keeps a core busy is
    still busy when the wait gives up (a turn then shares the core, and the report says so)."""
    monkeypatch.setattr("kvd.bench.serve.QUIET_S", 1.5)
    server = object.__new__(Server)
    server.proc = subprocess.Popen([sys.executable, "-c", f"import time\n{code}"])
    try:
        waited, went_quiet = server.wait_quiet()
        assert went_quiet is quiet, waited
    finally:
        server.proc.kill()
        server.proc.wait()


def test_bad_sizes_are_usage_errors_naming_the_option() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvd", "bench", "serve", "--concurrency", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "--concurrency: must be at least 1, not 0" in done.stderr
