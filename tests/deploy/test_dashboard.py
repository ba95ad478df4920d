"""The Grafana dashboard asks only for metrics that ServerMetrics exports, and shows what issue 7 lists."""

from __future__ import annotations

import json
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.server.metrics import ServerMetrics
from tests.deploy.kvserve_process import REPO

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "kvserve.json"

# PromQL words that look like identifiers but are not metric names.
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless", "inf", "nan"}
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created"), "info": ("_info",)}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (a small lexer, enough for dashboard queries)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery windows
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables
    names = set()
    # The look-behind skips the unit of a duration ("5m") and the exponent of a number ("1e3").
    for match in re.finditer(r"(?<![A-Za-z0-9_:.])[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group()
        is_function = re.match(r"\s*\(", text[match.end():]) is not None
        if not is_function and word.lower() not in PROMQL_KEYWORDS:
            names.add(word)
    return names


def exported_names() -> set[str]:
    """Every series name ServerMetrics can emit, derived from its rendered families and types."""
    text = ServerMetrics("m", {"block_size": "16"}).render()[0].decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return queries


def test_lexer_finds_metric_names_and_skips_functions_labels_and_variables() -> None:
    expr = 'histogram_quantile(0.9, sum by (le, model_name) (rate(a_seconds_bucket{model_name=~"$model_name", x="rate(b)"}[$__rate_interval]))) / on(job) c_total offset 5m'
    assert metric_names(expr) == {"a_seconds_bucket", "c_total"}
    assert metric_names("label_values(kvserve_num_requests_running, model_name)") == {"kvserve_num_requests_running", "model_name"}


@pytest.mark.parametrize("expr", dashboard_queries())
def test_every_query_names_only_exported_metrics(expr: str) -> None:
    names = metric_names(expr)
    if expr.startswith("label_values("):
        names.discard("model_name")  # label_values' second argument is a label, not a metric
    assert names, f"no metric in {expr!r}"
    unknown = names - exported_names()
    assert not unknown, f"{expr!r} names {sorted(unknown)}, which ServerMetrics does not export"


def test_dashboard_shows_what_operators_need() -> None:
    text = "\n".join(dashboard_queries())
    for quantile in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le) (rate(kvserve_time_to_first_token_seconds_bucket" in text
        assert f"histogram_quantile({quantile}, sum by (le) (rate(kvserve_inter_token_latency_seconds_bucket" in text
    for needed in (
        "rate(kvserve_generation_tokens_total",
        "rate(kvserve_prompt_tokens_total",
        "sum by (finished_reason) (rate(kvserve_request_success_total",
        "kvserve_num_requests_running",
        "kvserve_num_requests_waiting",
        "kvserve_kv_cache_usage_ratio",
        "rate(kvserve_num_preemptions_total",
        "rate(kvserve_prefix_cache_hits_total",
        "rate(kvserve_request_errors_total",
    ):
        assert needed in text, needed


def test_panels_do_not_overlap() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        area = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not (area & cells), f"panel {panel['title']!r} overlaps another"
        cells |= area
    assert len({p["id"] for p in panels}) == len(panels)
