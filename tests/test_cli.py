"""The ``kvd`` command's own behaviour: version flags, usage errors, environment warnings."""

from __future__ import annotations

import pytest

from kvd import __version__
from kvd.daemon_process import DaemonProcess
from tests.daemon_helpers import kvd


@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_version(flag: str) -> None:
    done = kvd(flag)
    assert (done.returncode, done.stdout) == (0, f"kvd {__version__}\n")


@pytest.mark.parametrize(
    ("args", "usage"),
    [
        (["serve", "--bogus"], "usage: kvd serve [-h] [--config PATH]"),
        (["status", "--bogus", "x"], "usage: kvd status [-h]"),
        (["bench", "pipeline", "--bogus"], "usage: kvd bench pipeline [-h]"),
        (["bench", "chaos", "--bogus"], "usage: kvd bench chaos [-h]"),
        (["tune", "--bogus"], "usage: kvd tune [-h]"),
    ],
)
def test_a_bad_flag_prints_its_commands_usage(args: list[str], usage: str) -> None:
    done = kvd(*args)
    assert done.returncode == 2
    assert done.stderr.startswith(usage), done.stderr
    assert "error: unrecognized arguments: --bogus" in done.stderr
    assert "usage: kvd [-h]" not in done.stderr


def test_a_command_without_its_subcommand_prints_its_help() -> None:
    done = kvd("bench")
    assert done.returncode == 2 and done.stdout.startswith("usage: kvd bench")


def test_serve_warns_about_unknown_kvd_variables() -> None:
    env = {"KVD_BATCH_WINDOW": "50", "KVD_NO_UVLOOP": "1"}
    with DaemonProcess(env=env) as daemon:
        log = daemon.log_path.read_text()
    assert "KVD_BATCH_WINDOW is not a kvd setting and is ignored; did you mean" in log
    assert "KVD_BATCH_WINDOW_US?" in log
    assert "KVD_NO_UVLOOP" not in log
