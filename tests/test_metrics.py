from __future__ import annotations

from kvd.daemon.metrics import Metrics


def test_prometheus_text() -> None:
    m = Metrics()
    m.ready.value += 3
    m.rejections.inc("unknown_cache", 2)
    m.read_done_to_ready.observe(30e-6)
    m.read_done_to_ready.observe(2.0)
    m.read_done_to_ready.observe(100.0)
    m.gauge("kvd_in_flight_requests", "In flight.", lambda: 4)
    text = m.render()
    assert 'kvd_requests_total{outcome="ready"} 3' in text
    assert 'kvd_requests_total{outcome="failed"} 0' in text
    assert 'kvd_rejections_total{reason="unknown_cache"} 2' in text
    assert "kvd_in_flight_requests 4" in text
    assert 'kvd_read_done_to_ready_seconds_bucket{le="2.5e-05"} 0' in text
    assert 'kvd_read_done_to_ready_seconds_bucket{le="5e-05"} 1' in text
    assert 'kvd_read_done_to_ready_seconds_bucket{le="2.5"} 2' in text
    assert 'kvd_read_done_to_ready_seconds_bucket{le="+Inf"} 3' in text
    assert "kvd_read_done_to_ready_seconds_count 3" in text
    assert "# TYPE kvd_read_done_to_ready_seconds histogram" in text
    assert m.counters()["ready"] == 3 and m.rejection_counts() == {"unknown_cache": 2}
