"""The vLLM bench's own plumbing, without vLLM: the ports it gives vLLM's instances, its
options, and how recorded times become figures and targets."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from kvd.bench.vllm import add_arguments, check_arguments, ephemeral_ports, free_port
from kvd.bench.vllm_report import (
    connector_figures,
    load_figures,
    repeated_report,
    repeated_table,
    targets,
)


def test_side_channel_ports_are_never_ones_the_kernel_gives_to_connections() -> None:
    ephemeral = ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert not [p for p in ports if p in ephemeral], ephemeral
    assert len(set(ports)) == len(ports), "a port was handed out twice"


def test_get_finished_splits_into_shared_polling_inline_post_process_and_additions() -> None:
    figures = connector_figures(
        {
            "whole_s": [0.004, 0.001],
            "whole_cpu_s": [0.003, 0.001],
            "poll_s": [0.003, 0.0005],
            "poll_cpu_s": [0.0025, 0.0004],
            "inline_s": [0.002, 0.0],
            "inline_cpu_s": [0.0015, 0.0],
            "moved": [True, False],
            "landed": 2,
            "landed_to_released_s": [0.0],
            "failed": 0,
        }
    )
    assert figures["get_finished_sum"] == pytest.approx(5.0)
    assert figures["shared_polling_sum"] == pytest.approx(1.5)
    assert figures["inline_post_process_sum"] == pytest.approx(2.0)
    assert figures["additions_sum"] == pytest.approx(1.5)
    # In CPU time: the engine thread's time preempted left out.
    assert figures["inline_post_process_cpu_sum"] == pytest.approx(1.5)
    assert figures["additions_cpu_sum"] == pytest.approx(1.1)
    # The second step moved nothing: its additions are the floor every step pays.
    assert figures["quiet_steps"] == 1
    assert figures["quiet_additions_cpu_sum"] == pytest.approx(0.6)
    assert figures["additions_cpu_per_request"] == pytest.approx(0.25)
    assert figures["inline_post_process_cpu_per_request"] == pytest.approx(0.75)
    assert figures["inline_post_process"]["p50"] == pytest.approx(2.0)  # steps that ran it
    assert figures["get_finished"]["max"] == pytest.approx(4.0)


def test_load_figures_time_running_gaps_arrival_ttft_and_forward_steps() -> None:
    run = {
        "requests": {
            "running-0": {
                "kind": "running",
                "added_at": 0.1,
                "token_at": [0.2, 0.21, 0.35],
            },
            "arrival-0": {
                "kind": "arrival",
                "added_at": 0.22,
                "token_at": [0.3, 0.31],
            },
            "arrival-1": {
                "kind": "arrival",
                "added_at": 0.4,
                "token_at": [0.45, 0.5],
            },
        },
        "step_s": [0.01, 0.0001, 0.04],
        "step_cpu_s": [0.01, 0.0001, 0.02],
        "step_produced": [True, False, True],
    }
    figures = load_figures(run)
    assert figures["engine_step"]["p50"] == pytest.approx(40.0)  # the idle step left out
    assert figures["engine_step_cpu"]["p50"] == pytest.approx(20.0)
    assert figures["running_inter_token"]["max"] == pytest.approx(140.0)
    assert figures["ttft"]["p50"] == pytest.approx(80.0)
    assert figures["request_latency"]["arrivals_p50"] == pytest.approx(100.0)  # from the add
    assert figures["arrivals_while_running"] == 1


def test_targets_are_met_or_missed_as_issue_19_states_them() -> None:
    def side(
        additions: float, inline: float, whole: float, worst: float, itl: float
    ) -> dict[str, Any]:
        connector = {
            "additions_sum": additions,
            "inline_post_process_sum": inline,
            "get_finished_sum": whole,
            "get_finished": {"max": worst},
        }
        return {
            "connector": connector,
            "request_latency": {"arrivals_p50": 100.0},
            "running_inter_token": {"p99": itl},
        }

    stock = side(additions=0.0, inline=10.0, whole=20.0, worst=5.0, itl=30.0)
    met = {t.name.split(" <")[0]: t.met for t in targets(stock, side(1.0, 0, 10.0, 5.0, 29.0))}
    assert all(met.values()), met
    missed = targets(stock, side(1.1, 0, 10.1, 5.1, 30.0))
    assert [t.met for t in missed] == [False, False, False, True, False]


def _run_report(latency: tuple[float, float], inter_token: tuple[float, float]) -> dict[str, Any]:
    """A load run's report as ``mode_report`` makes it: (stock, kvd) latency and p99."""

    def side(name: str, latency: float, inter_token: float) -> dict[str, Any]:
        connector = {
            "additions_sum": 0.5 if name == "stock" else 1.0,
            "inline_post_process_sum": 20.0 if name == "stock" else 0.0,
            "get_finished_sum": 30.0 if name == "stock" else 10.0,
            "get_finished": {"max": 5.0 if name == "stock" else 0.5},
            "landed_to_released": {"p50": 0.01 if name == "stock" else 4.0},
            "failed": 0,
        }
        return {
            "engine_step": {"p50": 4.0, "p99": 8.0},
            "running_inter_token": {"p99": inter_token},
            "ttft": {"p50": 20.0},
            "request_latency": {"arrivals_p50": latency},
            "connector": connector,
            "worst_stall_s": {"0": 0.01, "1": 0.02},
        }

    figures = {
        "stock": side("stock", latency[0], inter_token[0]),
        "kvd": side("kvd", latency[1], inter_token[1]),
    }
    found = targets(figures["stock"], figures["kvd"])
    return {
        "figures": figures,
        "targets": [{**dataclasses.asdict(t), "met": t.met} for t in found],
        "tokens_equal_to_baseline": {"stock": 0, "kvd": 40},
        "requests": 40,
    }


def test_several_runs_are_judged_on_their_medians_with_each_runs_verdict() -> None:
    """Three runs where kvd's latency is 1.10x, 1.04x and 1.00x stock's (median met, met in
    two) and its inter-token p99 higher in two (median missed, met in one)."""
    runs = [
        _run_report((100.0, 110.0), (7.0, 8.0)),
        _run_report((100.0, 104.0), (7.0, 6.0)),
        _run_report((96.0, 96.0), (7.0, 7.5)),
    ]
    report = repeated_report(runs)
    by_name = {t["name"].split(" <")[0]: t for t in report["targets"]}
    latency = by_name["request latency arrivals p50"]
    assert latency["kvd"] == 104.0 and latency["limit"] == pytest.approx(105.0)
    assert latency["met"] and latency["met_in"] == 2
    inter_token = by_name["inter-token p99 of running requests"]
    assert inter_token["kvd"] == 7.5 and not inter_token["met"] and inter_token["met_in"] == 1
    assert report["tokens_equal_to_baseline"] == {"stock": 0, "kvd": 120}
    assert report["requests"] == 120

    lines = repeated_table("load", report)
    assert lines[0].split()[-7:] == ["run", "1", "run", "2", "run", "3", "median"]
    latency_row = next(line for line in lines if line.startswith("request latency p50"))
    assert latency_row.split()[-3:] == ["100.00", "/", "104.00"]  # the medians
    assert "met    request latency arrivals p50 <= 1.05x stock's (ms): medians kvd 104.000" in (
        "\n".join(lines)
    )
    assert any(line.startswith("MISSED inter-token") and "met in 1 of 3" in line for line in lines)


@pytest.mark.parametrize(
    ("option", "value", "reason"),
    [
        ("running", 0, "--running: 0 is not a positive integer"),
        ("runs", 0, "--runs: 0 is not a positive integer"),
        ("arrival_prompt_tokens", 1010, "--arrival-prompt-tokens 1010 + --arrival-tokens 16"),
        ("decode_block_size", 48, "--decode-block-size: 48 is not a multiple of"),
        ("arrivals", 901, "--arrival-prompt-tokens: 900 is below --arrivals 901"),
        ("kvd_io_cpus", "cpu7", "--kvd-io-cpus: 'cpu7' is not a CPU list"),
    ],
)
def test_bad_sizes_are_refused_naming_the_option(
    option: str, value: int | str, reason: str
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([f"--{option.replace('_', '-')}", str(value)])
    problem = check_arguments(args)
    assert problem is not None and problem.startswith(reason), problem
