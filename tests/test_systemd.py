"""The systemd unit: systemd-analyze verifies it and rates its exposure; it keeps the settings
the deployment relies on; its example configuration loads.

systemd-analyze works without systemd running (Debian: ``apt-get install systemd``). The unit is
checked as installed: a copy whose ExecStart is this environment's real ``kvd``, since verify
fails on a command that does not exist.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvd.cli import build_parser
from kvd.daemon.config import load_config

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "kvd@.service"
EXAMPLE = ROOT / "systemd" / "kvd.toml.example"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze is not installed (Debian: apt-get install systemd)"
)
# systemd-analyze security rates exposure from 0.0 (locked down) to 10.0; it prints the
# threshold's scale times ten. 2.5 leaves room for what CUDA and RDMA need.
EXPOSURE_THRESHOLD = 25


def directives(text: str) -> dict[str, list[str]]:
    """``{"Section.Key": [values in order]}``; keys may repeat in systemd units."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


UNIT_TEXT = UNIT.read_text()
SERVICE = directives(UNIT_TEXT)


def one(key: str) -> str:
    values = SERVICE.get(f"Service.{key}", [])
    assert len(values) == 1, f"{key}: {values}"
    return values[0]


@pytest.fixture
def installed(tmp_path: Path) -> Path:
    """The unit in a directory of its own, ExecStart pointing at this environment's kvd."""
    kvd = Path(sys.executable).with_name("kvd")
    assert kvd.is_file(), f"{kvd}: the kvd console script is not installed (pip install -e .)"
    text, count = re.subn(r"^ExecStart=\S+", f"ExecStart={kvd}", UNIT_TEXT, flags=re.M)
    assert count == 1
    (tmp_path / UNIT.name).write_text(text)
    return tmp_path


@needs_analyze
@pytest.mark.parametrize("name", ["kvd@.service", "kvd@0.service"])
def test_systemd_analyze_verify(installed: Path, name: str) -> None:
    """The template, and an instance (which resolves to the template in the same directory).

    --recursive-errors=yes turns warnings (unknown keys, bad values) into a failure."""
    assert ANALYZE is not None
    result = subprocess.run(
        [
            *(ANALYZE, "verify", "--man=no", "--generators=no", "--recursive-errors=yes"),
            f"./{name}",
        ],
        cwd=installed,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr


@needs_analyze
def test_systemd_analyze_security_exposure(installed: Path) -> None:
    assert ANALYZE is not None
    result = subprocess.run(
        [
            *(ANALYZE, "security", "--offline=yes", f"--threshold={EXPOSURE_THRESHOLD}"),
            f"./{UNIT.name}",
        ],
        cwd=installed,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    overall = re.search(r"Overall exposure level for \S+: (\S+ \S+)", result.stdout)
    assert overall, result.stdout + result.stderr
    assert result.returncode == 0, f"exposure {overall[1]}, threshold {EXPOSURE_THRESHOLD / 10}"


def test_service_contract() -> None:
    assert one("Type") == "notify" and one("NotifyAccess") == "main"
    assert one("WatchdogSec") and one("Restart") == "on-failure"
    assert one("User") == "kvd" and one("Group") == "kvd"
    assert one("RuntimeDirectory") == "kvd/%i"
    # The group (the engine) can traverse the directory and connect to the sockets.
    assert one("RuntimeDirectoryMode") == "0750" and one("UMask") == "0007"
    for key in ("NoNewPrivileges", "PrivateTmp", "ProtectHome"):
        assert one(key) == "yes", key
    assert one("ProtectSystem") == "strict"
    assert one("LimitMEMLOCK") == "infinity"
    assert set(one("RestrictAddressFamilies").split()) == {
        "AF_UNIX",
        "AF_INET",
        "AF_INET6",
        "AF_NETLINK",
    }


def test_sandbox_keeps_gpu_and_rdma_reachable() -> None:
    assert "Service.PrivateDevices" not in SERVICE, "PrivateDevices hides /dev/nvidia*"
    assert "Service.MemoryDenyWriteExecute" not in SERVICE, "breaks torch's CPU JIT and Triton"
    assert "Service.ProcSubset" not in SERVICE, "hides /proc/driver/nvidia"
    allowed = [v.split()[0] for v in SERVICE["Service.DeviceAllow"]]
    assert "char-nvidia*" in allowed and "char-infiniband_verbs" in allowed
    # systemd matches globs only in device group names; a path glob matches no device.
    assert not [d for d in allowed if d.startswith("/") and "*" in d]
    assert one("DevicePolicy") == "closed"


def test_exec_start_is_a_valid_kvd_command() -> None:
    argv = shlex.split(one("ExecStart").replace("%i", "0"))
    assert Path(argv[0]).name == "kvd", "kvd itself is the main process (NotifyAccess=main)"
    args = build_parser().parse_args(argv[1:])
    assert (args.gpu, args.config) == ("0", "/etc/kvd/kvd@0.toml")


def test_example_config_loads_and_shows_the_service_settings() -> None:
    config = load_config(EXAMPLE, environ={})
    text = EXAMPLE.read_text()
    for key in ("metrics_addr", "drain_timeout_s", "batch_window_us", "device"):
        assert re.search(rf"^#? ?{key} = ", text, flags=re.M), key
    assert config.drain_timeout_s > 0
