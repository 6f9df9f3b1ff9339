"""The window, live: ``Configure`` and ``kvd set`` change the batching of a running kvd, only
for kvd's own user over ipc, and ``kvd status`` and the metrics show the value in force."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvd.client import Client, KvdError, ShmCache
from kvd.daemon_process import DaemonProcess
from kvd.protocol import Ready
from tests.daemon_helpers import by_req, collect, kvd
from tests.test_metrics_http import scrape


def test_kvd_set_changes_the_window_of_a_running_kvd(short_tmp: Path) -> None:
    with (
        DaemonProcess("--metrics-addr", "127.0.0.1:0", runtime_dir=short_tmp) as d,
        d.client() as client,
    ):
        rt = ("--runtime-dir", str(d.runtime_dir))
        url = d.endpoints().metrics
        assert scrape(url)["kvd_batch_window_seconds"] == 0
        done = kvd("set", "batch-window-us", "300000", *rt)
        assert (done.returncode, done.stdout) == (
            0,
            "batch window 300000 us, max 8192 blocks per batch\n",
        ), done.stderr
        assert scrape(url)["kvd_batch_window_seconds"] == 0.3
        assert "batch window 300000 us, max 8192" in kvd("status", *rt).stdout

        cache = ShmCache.create(num_layers=1, num_blocks=16, block_size=8, num_heads=2, head_dim=4)
        try:
            client.attach("live", cache.specs)
            sub = client.subscribe(["live"])
            for i in range(6):
                client.read_done(f"w{i}", "live", [i], remote_layout="HND", block_size_ratio=2)
            events = by_req(collect(sub, 6))
            assert all(isinstance(e, Ready) for e in events.values())
            assert client.status().counters["batches"] == 1, "six within one 300 ms window"
            sub.close()
        finally:
            cache.close()

        done = kvd("set", "batch-window-us", "auto", *rt)
        assert done.returncode == 0 and "(auto)" in done.stdout
        status = client.status()
        assert status.batch_window_auto
        assert "(auto)" in kvd("status", *rt).stdout
        assert kvd("set", "max-batch-blocks", "64", *rt).returncode == 0
        assert client.configure().max_batch_blocks == 64


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["batch-window-us", "soon"], "expected an integer or 'auto', got 'soon'"),
        (["max-batch-blocks", "auto"], "expected an integer, got 'auto'"),
    ],
)
def test_bad_values_are_usage_errors(args: list[str], message: str, short_tmp: Path) -> None:
    done = kvd("set", *args, "--runtime-dir", str(short_tmp))
    assert done.returncode == 2 and message in done.stderr


def test_out_of_range_values_are_refused_naming_the_field() -> None:
    with DaemonProcess() as d, d.client() as client:
        for value, field in (("2000000", "batch_window_us"), ("-1", "batch_window_us")):
            done = kvd("set", "batch-window-us", value, "--runtime-dir", str(d.runtime_dir))
            assert done.returncode == 1
            assert "invalid_message: Expected `int`" in done.stderr
            assert f"at `$.{field}`" in done.stderr
        done = kvd("set", "max-batch-blocks", "0", "--runtime-dir", str(d.runtime_dir))
        assert done.returncode == 1 and "at `$.max_batch_blocks`" in done.stderr
        assert client.configure().batch_window_us == 0, "nothing changed"


def test_only_kvds_user_over_ipc_may_change_settings(short_tmp: Path) -> None:
    tcp = ("--control-endpoint", "tcp://127.0.0.1:0")
    with DaemonProcess(*tcp, runtime_dir=short_tmp) as d, Client(d.runtime_dir) as client:
        assert client.configure().batch_window_us == 0, "asking is for everyone"
        with pytest.raises(KvdError) as refused:
            client.configure(batch_window_us=50)
        assert refused.value.code == "not_permitted"
        assert refused.value.message.startswith("batch_window_us: only kvd's user or root")
        assert client.status().batch_window_us == 0
