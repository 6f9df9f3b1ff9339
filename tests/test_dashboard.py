"""``dashboards/kvd.json``: importable, and every query names metrics a real kvd exports."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvd.client import ShmCache
from kvd.daemon_process import DaemonProcess
from tests.daemon_helpers import EventTap

DASHBOARD = Path(__file__).parent.parent / "dashboards" / "kvd.json"

# PromQL words that are not metric names when not followed by "(".
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
_LABELS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_GROUPINGS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_NAMES = re.compile(r"(?<![\w$.])([A-Za-z_:][\w:]*)\b(?!\s*\()")


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for item in items:
        yield item
        yield from panels(item.get("panels", []))


def queries(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dashboard["panels"]) for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (no label values, functions, groupings, numbers)."""
    text = _STRINGS.sub('""', expr)
    text = _LABELS.sub("", text)
    text = _RANGES.sub("", text)
    text = _GROUPINGS.sub("", text)
    return {n for n in _NAMES.findall(text) if n not in _KEYWORDS}


def grouping_labels(expr: str) -> set[str]:
    return {
        label.strip()
        for _, labels in _GROUPINGS.findall(_STRINGS.sub('""', expr))
        for label in labels.split(",")
        if label.strip()
    }


def test_the_query_parser() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (instance, le) (rate(kvd_x_seconds_bucket{job=~"$job",'
        ' instance=~"a{b}"}[$__rate_interval]))) / on (instance) kvd_y offset 5m'
    )
    assert metric_names(expr) == {"kvd_x_seconds_bucket", "kvd_y"}
    assert grouping_labels(expr) == {"instance", "le"}


def exported(url: str) -> tuple[set[str], set[str]]:
    """Sample names a scrape may carry, and every label name seen."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    names, labels = set(), set()
    for family in text_string_to_metric_families(text):
        suffixes = {
            "counter": ["_total"],
            "histogram": ["", "_bucket", "_sum", "_count"],
        }.get(family.type, [""])
        names |= {family.name + s for s in suffixes}
        for sample in family.samples:
            names.add(sample.name)
            labels |= set(sample.labels)
    return names, labels


def test_dashboard_queries_name_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] == "kvd" and dashboard["uid"]
    used = {n for q in queries(dashboard) for n in metric_names(q)}
    variables = dashboard["templating"]["list"]
    for v in variables:
        if v["type"] == "query":  # label_values(SELECTOR, LABEL)
            selector = re.fullmatch(r"label_values\((.*),\s*\w+\)", v["definition"])
            assert selector, v["definition"]
            used |= metric_names(selector[1])
    assert {
        "kvd_requests_total",
        "kvd_rejections_total",
        "kvd_read_done_to_ready_seconds_bucket",
        "kvd_queue_wait_seconds_bucket",
        "kvd_transform_seconds_bucket",
        "kvd_batch_blocks_bucket",
        "kvd_in_flight_requests",
        "kvd_attached_caches",
        "kvd_batch_window_seconds",
    } <= used, "the panels the dashboard promises"

    with DaemonProcess("--metrics-addr", "127.0.0.1:0") as daemon, daemon.client() as client:
        cache = ShmCache.create(num_layers=1, num_blocks=8, block_size=8, num_heads=2, head_dim=4)
        try:
            client.attach("dash", cache.specs)
            with EventTap(client, "dash") as tap:
                client.read_done("d-bad", "dash", [99], remote_layout="HND", block_size_ratio=1)
                tap.events(1)  # a rejection, so kvd_rejections_total has its reason label
            names, labels = exported(daemon.endpoints().metrics)
        finally:
            cache.close()

    assert used <= names, f"not exported by kvd: {sorted(used - names)}"
    grouped = {label for q in queries(dashboard) for label in grouping_labels(q)}
    # instance and job are added by Prometheus at scrape time.
    assert grouped <= labels | {"instance", "job"}, sorted(grouped - labels)


def test_every_panel_uses_the_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in panels(dashboard["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            assert '{job=~"$job", instance=~"$instance"}' in t["expr"], t["expr"]
