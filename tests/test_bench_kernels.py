"""``kvd bench kernels`` runs every case end to end (tiny sizes: speed is not checked here)."""

from __future__ import annotations

import json
import os

import pytest

from kvd.bench.kernels import CASES
from kvd.cli import build_parser
from tests.daemon_helpers import kvd


def test_bench_kernels_reports_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(
        [
            "bench",
            "kernels",
            "--json",
            "--layers=2",
            "--num-blocks=16",
            "--blocks=8",
            "--block-size=16",
            "--heads=2",
            "--head-dim=16",
            "--repeat=1",
        ]
    )
    assert args.run(args) == 0
    captured = capsys.readouterr()
    assert captured.err == "", "quiet under --json"
    report = json.loads(captured.out)
    assert [r["case"] for r in report["rows"]] == [c.label for c in CASES]
    assert all(r["kvd_gbps"] > 0 for r in report["rows"])
    with_chain = {r["case"] for r in report["rows"] if r["vllm_over_kvd"] is not None}
    assert "HND->NHD r=1 bfloat16" in with_chain and "LBHNC r=4 bfloat16" in with_chain
    assert all(r["meets_target"] is not None for r in report["rows"] if "bfloat16" in r["case"])


TINY = ["--layers=1", "--num-blocks=8", "--blocks=4", "--block-size=16", "--heads=2"]


@pytest.mark.parametrize(("given", "in_force"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_kvd_sets_idle_openmp_workers_to_sleep_unless_told_otherwise(
    given: str | None, in_force: str
) -> None:
    """The policy must be in the environment before torch loads OpenMP: a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    done = kvd("bench", "kernels", "--json", "--repeat=1", *TINY, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["omp_wait_policy"] == in_force


@pytest.mark.parametrize(
    "command",
    [
        ["bench", "kernels"],
        ["bench", "pipeline"],
        ["bench", "chaos"],
        ["bench", "vllm"],
        ["tune"],
        ["demo"],
    ],
)
def test_every_long_command_takes_no_progress(command: list[str]) -> None:
    args = build_parser().parse_args([*command, "--no-progress"])
    assert args.no_progress
