"""Only who should can reach kvd or make it write: shared memory, the runtime directory, the
sockets, and who may detach a cache. Real files, real sockets, a real ``kvd serve``."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvd.client import Client, KvdError, ShmCache
from kvd.daemon_process import DaemonProcess
from kvd.protocol import ShmRef

NOBODY = 65534


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess() as d:
        yield d


def serve(runtime_dir: Path) -> subprocess.CompletedProcess[str]:
    """``kvd serve`` on ``runtime_dir``, expected to refuse to start (it would serve forever)."""
    return subprocess.run(
        [sys.executable, "-m", "kvd", "serve", "--runtime-dir", str(runtime_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_symlink_in_dev_shm_is_never_followed(daemon: DaemonProcess, tmp_path: Path) -> None:
    cache = ShmCache.create(num_layers=1, num_blocks=4, block_size=8, num_heads=2, head_dim=8)
    outside = tmp_path / "not-shared-memory"
    outside.write_bytes(b"\x07" * os.path.getsize(cache.path))
    link = Path("/dev/shm") / f"kvd-link-{os.getpid()}"
    link.symlink_to(outside)
    try:
        spec = msgspec.structs.replace(cache.specs[0], memory=ShmRef(name=link.name))
        with daemon.client() as client, pytest.raises(KvdError) as refused:
            client.attach("through-a-link", [spec])
        assert refused.value.code == "memory_unavailable"
        assert "symbolic link" in refused.value.message
        assert outside.read_bytes() == b"\x07" * os.path.getsize(cache.path)
    finally:
        link.unlink()
        cache.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file another user's")
def test_shared_memory_of_another_user_and_group_is_refused(daemon: DaemonProcess) -> None:
    cache = ShmCache.create(num_layers=1, num_blocks=4, block_size=8, num_heads=2, head_dim=8)
    try:
        os.chown(cache.path, NOBODY, NOBODY)
        with daemon.client() as client, pytest.raises(KvdError) as refused:
            client.attach("foreign", cache.specs)
        assert refused.value.code == "memory_unavailable"
        assert f"uid {NOBODY}" in refused.value.message
    finally:
        cache.close()


def test_a_fifo_is_not_memory(daemon: DaemonProcess) -> None:
    fifo = Path("/dev/shm") / f"kvd-fifo-{os.getpid()}"
    os.mkfifo(fifo)
    try:
        cache = ShmCache.create(num_layers=1, num_blocks=4, block_size=8, num_heads=2, head_dim=8)
        spec = msgspec.structs.replace(cache.specs[0], memory=ShmRef(name=fifo.name))
        cache.close()
        with daemon.client() as client, pytest.raises(KvdError) as refused:
            client.attach("fifo", [spec])
        assert "not a regular file" in refused.value.message
    finally:
        fifo.unlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory another user's")
def test_a_runtime_directory_someone_else_created_is_refused(short_tmp: Path) -> None:
    planted = short_tmp / "kvd"
    planted.mkdir()
    os.chown(planted, NOBODY, NOBODY)
    refused = serve(planted)
    assert refused.returncode == 2
    assert f"belongs to uid {NOBODY}" in refused.stderr
    assert list(planted.iterdir()) == []


def test_a_world_writable_runtime_directory_is_refused(short_tmp: Path) -> None:
    shared = short_tmp / "kvd"
    shared.mkdir()
    shared.chmod(0o777)
    refused = serve(shared)
    assert refused.returncode == 2 and "writable by every user" in refused.stderr


def test_planted_symlinks_in_the_runtime_directory_are_not_followed(
    short_tmp: Path, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    runtime_dir = short_tmp / "kvd"
    runtime_dir.mkdir(mode=0o750)
    (runtime_dir / "kvd.lock").symlink_to(victim)
    refused = serve(runtime_dir)
    assert refused.returncode == 2 and "kvd.lock" in refused.stderr
    assert victim.read_text() == "precious\n"


def test_ipc_sockets_are_for_kvds_user_and_group_only(daemon: DaemonProcess) -> None:
    for name in ("control", "ingest", "events", "replay"):
        mode = stat.S_IMODE(os.stat(daemon.runtime_dir / f"{name}.sock").st_mode)
        assert mode & 0o007 == 0, f"{name}.sock is {mode:o}"
    assert stat.S_IMODE(os.stat(daemon.runtime_dir).st_mode) & 0o002 == 0


def test_only_the_owner_or_an_operator_may_detach(daemon: DaemonProcess) -> None:
    cache = ShmCache.create(num_layers=1, num_blocks=4, block_size=8, num_heads=2, head_dim=8)
    try:
        with daemon.client() as owner, daemon.client() as other:
            owner.attach("owned", cache.specs, engine_id="engine-a")
            with pytest.raises(KvdError) as refused:
                other.detach("owned")
            assert refused.value.code == "not_owner" and "engine-a" in refused.value.message
            with pytest.raises(KvdError):
                other.detach("owned", engine_id="engine-b")
            other.detach("owned", engine_id="engine-a")  # the engine, from a new connection

            owner.attach("owned", cache.specs)
            other.detach("owned", force=True)  # an operator: this process runs as kvd's user
            owner.attach("owned", cache.specs)
            owner.detach("owned")
    finally:
        cache.close()


def test_a_forced_detach_over_tcp_is_refused(short_tmp: Path) -> None:
    cache = ShmCache.create(num_layers=1, num_blocks=4, block_size=8, num_heads=2, head_dim=8)
    tcp = ("--control-endpoint", "tcp://127.0.0.1:0")
    try:
        with (
            DaemonProcess(*tcp, runtime_dir=short_tmp) as d,
            d.client() as owner,
            Client(d.runtime_dir) as other,
        ):
            owner.attach("remote", cache.specs)
            with pytest.raises(KvdError) as refused:
                other.detach("remote", force=True)
            assert refused.value.code == "not_owner" and "ipc" in refused.value.message
    finally:
        cache.close()
