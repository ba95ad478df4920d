"""A real Prometheus server scrapes kvserve's metrics on loopback and PromQL sees the right totals.

Two targets: the ServerMetrics exporter behind a tiny HTTP server after the known workload (runs
now), and a live `kvserve serve` started from the Dockerfile's command after real completions
(skipped until the server's `serve` command exists).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.server.metrics import ServerMetrics
from tests.deploy.kvserve_process import RunningServer
from tests.deploy.prometheus_harness import PROMETHEUS_MISSING, prometheus_binary, running_prometheus, serving_metrics
from tests.server.metrics_workload import build_known_workload, feed

pytestmark = [pytest.mark.slow, pytest.mark.skipif(prometheus_binary() is None, reason=PROMETHEUS_MISSING)]

MODEL = "known-workload-model"


def test_prometheus_scrapes_the_exporter_and_promql_returns_the_generation_tokens(tmp_path: Path) -> None:
    metrics = ServerMetrics(MODEL, {"block_size": "16", "num_blocks": "64"})
    feed(metrics, build_known_workload())
    with serving_metrics(metrics.render) as target, running_prometheus(tmp_path, target) as prometheus:
        prometheus.wait_for_value(f'sum(kvserve_generation_tokens_total{{model_name="{MODEL}"}})', 54)
        prometheus.wait_for_value(f'kvserve_request_success_total{{model_name="{MODEL}",finished_reason="abort"}}', 2)
        prometheus.wait_for_value(f'kvserve_time_to_first_token_seconds_count{{model_name="{MODEL}"}}', 9)
        # the scrape itself was healthy (Prometheus' own per-target series)
        prometheus.wait_for_value(f'up{{instance="{target}"}}', 1)


def test_prometheus_scrapes_a_live_kvserve(image_server: RunningServer, tmp_path: Path) -> None:
    base_url = image_server.base_url
    model = httpx.get(f"{base_url}/v1/models", timeout=10.0).json()["data"][0]["id"]
    before = _generation_tokens(base_url, model)
    max_tokens, prompts = 5, ["Hello", "The capital of France is", "1, 2, 3,"]
    generated = 0
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120.0)
        assert response.status_code == 200, response.text
        generated += response.json()["usage"]["completion_tokens"]
    assert generated == max_tokens * len(prompts)
    with running_prometheus(tmp_path, base_url.removeprefix("http://")) as prometheus:
        prometheus.wait_for_value(f'sum(kvserve_generation_tokens_total{{model_name="{model}"}})', before + generated)


def _generation_tokens(base_url: str, model: str) -> float:
    """The counter as /metrics shows it now: the shared server may have served other tests."""
    text = httpx.get(f"{base_url}/metrics", timeout=10.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvserve_generation_tokens_total" and sample.labels.get("model_name") == model:
                return sample.value
    raise AssertionError(f"/metrics has no kvserve_generation_tokens_total for model {model!r}")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool absent: apt-get install prometheus")
def test_promtool_check_metrics_reports_nothing_on_a_live_scrape(image_server: RunningServer) -> None:
    httpx.get(f"{image_server.base_url}/no-such-route", timeout=10.0)  # an error series too
    response = httpx.get(f"{image_server.base_url}/metrics", timeout=10.0)
    assert response.status_code == 200
    result = subprocess.run(["promtool", "check", "metrics"], input=response.content, capture_output=True, timeout=30)
    report = (result.stdout + result.stderr).decode()
    assert result.returncode == 0 and report.strip() == "", report
