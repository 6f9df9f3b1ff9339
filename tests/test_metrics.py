from __future__ import annotations

import pytest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.parser import text_string_to_metric_families

from kvd.daemon.metrics import Metrics
from kvd.daemon.metrics_http import CONTENT_TYPE


def test_prometheus_text() -> None:
    m = Metrics()
    m.ready.value += 3
    m.rejections.inc("unknown_cache", 2)
    m.read_done_to_ready.observe(30e-6)
    m.read_done_to_ready.observe(2.0)
    m.read_done_to_ready.observe(100.0)
    m.gauge("kvd_in_flight_requests", "In flight.", lambda: 4)
    text = m.render().decode()
    assert 'kvd_requests_total{outcome="ready"} 3.0' in text
    assert 'kvd_requests_total{outcome="failed"} 0.0' in text
    assert 'kvd_rejections_total{reason="unknown_cache"} 2.0' in text
    assert "kvd_in_flight_requests 4.0" in text
    assert 'kvd_read_done_to_ready_seconds_bucket{le="2.5e-05"} 0.0' in text
    assert 'kvd_read_done_to_ready_seconds_bucket{le="5e-05"} 1.0' in text
    assert 'kvd_read_done_to_ready_seconds_bucket{le="2.5"} 2.0' in text
    assert 'kvd_read_done_to_ready_seconds_bucket{le="+Inf"} 3.0' in text
    assert "kvd_read_done_to_ready_seconds_count 3.0" in text
    assert "# TYPE kvd_read_done_to_ready_seconds histogram" in text
    assert "# TYPE kvd_requests_total counter" in text
    assert m.counters()["ready"] == 3 and m.rejection_counts() == {"unknown_cache": 2}


def test_exposition_parses_and_reads_live_values() -> None:
    m = Metrics()
    state = {"caches": 1}
    m.gauge("kvd_attached_caches", "Caches attached.", lambda: state["caches"])
    m.batch_blocks.observe(3)
    m.blocks.value += 7

    def families() -> dict[str, object]:
        return {f.name: f for f in text_string_to_metric_families(m.render().decode())}

    first = families()
    # Counters lose _total in the parsed family name, as in any prometheus_client exposition.
    assert {"kvd_requests", "kvd_blocks_processed", "kvd_batch_blocks"} <= set(first)
    assert "process_cpu_seconds" in first, "the process collector is registered"
    state["caches"] = 5
    text = m.render().decode()
    assert "kvd_attached_caches 5.0" in text
    assert 'kvd_batch_blocks_bucket{le="2.0"} 0.0' in text
    assert 'kvd_batch_blocks_bucket{le="4.0"} 1.0' in text
    assert "kvd_blocks_processed_total 7.0" in text


def test_new_counters_take_one_line_and_show_in_status() -> None:
    m = Metrics(process=False)
    timeouts = m.counter("kvd_timeouts_total", "Waits that timed out.")
    drops = m.labelled_counter("kvd_drops_total", "Events dropped, by cause.", "cause")
    timeouts.value += 2
    drops.inc("hwm")
    text = m.render().decode()
    assert "kvd_timeouts_total 2.0" in text
    assert 'kvd_drops_total{cause="hwm"} 1.0' in text
    assert "process_" not in text
    counters = m.counters()
    assert counters["timeouts"] == 2 and list(counters)[:2] == ["ready", "failed"]
    with pytest.raises(ValueError, match="defined twice"):
        m.counter("kvd_timeouts_total", "again")


def test_content_type_is_what_generate_latest_writes() -> None:
    assert CONTENT_TYPE == CONTENT_TYPE_PLAIN_0_0_4
