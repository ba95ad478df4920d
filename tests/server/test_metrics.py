"""ServerMetrics: exact counts after a known workload, naming rules, and promtool's lint."""

from __future__ import annotations

import shutil
import subprocess
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine import FinishReason
from kvserve.engine.stats import FinishedRequestStats
from kvserve.server.metrics import ServerMetrics
from tests.server.metrics_workload import STEP_S, build_known_workload, feed

MODEL = "SmolLM2-135M-Instruct"
INFO = {
    "block_size": "16",
    "num_blocks": "64",
    "dtype": "float32",
    "kv_dtype": "float32",
    "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "max_model_len": "8192",
    "prefix_caching": "true",
}


@pytest.fixture
def metrics() -> ServerMetrics:
    return ServerMetrics(MODEL, INFO)


@pytest.fixture
def fed(metrics: ServerMetrics) -> ServerMetrics:
    feed(metrics, build_known_workload())
    return metrics


def value(metrics: ServerMetrics, name: str, **labels: str) -> float:
    found = metrics.registry.get_sample_value(name, {"model_name": MODEL, **labels})
    assert found is not None, f"{name}{labels} is not exported"
    return found


def test_counters_equal_the_known_workload(fed: ServerMetrics) -> None:
    # Computed by hand from metrics_workload.SPECS (see its docstring).
    assert value(fed, "kvserve_prompt_tokens_total") == 348  # 274 uncached + 74 recomputed
    assert value(fed, "kvserve_generation_tokens_total") == 54
    assert value(fed, "kvserve_num_preemptions_total") == 1
    assert value(fed, "kvserve_prefix_cache_queries_total") == 524  # 450 prompts + 74 recomputed
    assert value(fed, "kvserve_prefix_cache_hits_total") == 176
    assert value(fed, "kvserve_request_success_total", finished_reason="stop") == 4
    assert value(fed, "kvserve_request_success_total", finished_reason="length") == 4
    assert value(fed, "kvserve_request_success_total", finished_reason="abort") == 2


def test_each_histogram_counts_each_request_or_token_once(fed: ServerMetrics) -> None:
    expected_counts = {
        # every finished request, aborted ones included
        "kvserve_e2e_request_latency_seconds": 10,
        "kvserve_request_prompt_tokens": 10,
        "kvserve_request_generation_tokens": 10,
        # the nine requests that were scheduled and produced a token (not the one aborted waiting)
        "kvserve_request_queue_time_seconds": 9,
        "kvserve_time_to_first_token_seconds": 9,
        "kvserve_request_prefill_time_seconds": 9,
        "kvserve_request_decode_time_seconds": 9,
        # one per gap between consecutive tokens: sum(output - 1) over the nine
        "kvserve_inter_token_latency_seconds": 45,
        # one per engine step: 9 prefills + 44 decodes + preemption + recompute + idle
        "kvserve_iteration_tokens": 56,
        "kvserve_step_duration_seconds": 56,
    }
    for name, count in expected_counts.items():
        assert value(fed, f"{name}_count") == count, name
        assert value(fed, f"{name}_bucket", le="+Inf") == count, name
    assert value(fed, "kvserve_request_prompt_tokens_sum") == 550
    assert value(fed, "kvserve_request_generation_tokens_sum") == 54
    assert value(fed, "kvserve_iteration_tokens_sum") == 392
    # 44 one-step gaps and the one gap across request 6's preemption, which spans two steps
    assert value(fed, "kvserve_inter_token_latency_seconds_sum") == pytest.approx(46 * STEP_S)
    assert value(fed, "kvserve_step_duration_seconds_sum") == pytest.approx(56 * STEP_S)


def test_latency_intervals_follow_their_definitions(metrics: ServerMetrics) -> None:
    metrics.on_request_finished(
        FinishedRequestStats(
            finish_reason="stop",
            arrival_time=10.0,
            first_scheduled_time=10.5,  # queue 0.5
            first_token_time=12.0,  # ttft 2.0, prefill 1.5
            last_token_time=14.0,  # decode 2.0, e2e 4.0
            finished_time=14.25,
            num_prompt_tokens=7,
            num_cached_tokens=0,
            num_generation_tokens=3,
            inter_token_latencies=(0.75, 1.25),
        )
    )
    assert value(metrics, "kvserve_request_queue_time_seconds_sum") == 0.5
    assert value(metrics, "kvserve_time_to_first_token_seconds_sum") == 2.0
    assert value(metrics, "kvserve_request_prefill_time_seconds_sum") == 1.5
    assert value(metrics, "kvserve_request_decode_time_seconds_sum") == 2.0
    assert value(metrics, "kvserve_e2e_request_latency_seconds_sum") == 4.0
    assert value(metrics, "kvserve_inter_token_latency_seconds_sum") == 2.0
    # 0.75 falls in le=0.75, not in le=0.5: buckets are cumulative upper bounds
    assert value(metrics, "kvserve_inter_token_latency_seconds_bucket", le="0.5") == 0
    assert value(metrics, "kvserve_inter_token_latency_seconds_bucket", le="0.75") == 1


def test_request_aborted_before_it_ran_counts_e2e_to_its_finish(metrics: ServerMetrics) -> None:
    metrics.on_request_finished(FinishedRequestStats("abort", 5.0, None, None, None, 6.5, 12, 0, 0, ()))
    assert value(metrics, "kvserve_e2e_request_latency_seconds_sum") == 1.5
    assert value(metrics, "kvserve_request_queue_time_seconds_count") == 0
    assert value(metrics, "kvserve_time_to_first_token_seconds_count") == 0


def test_gauges_show_the_last_step(fed: ServerMetrics) -> None:
    assert value(fed, "kvserve_num_requests_running") == 0
    assert value(fed, "kvserve_num_requests_waiting") == 0
    assert value(fed, "kvserve_kv_cache_usage_ratio") == 0
    assert value(fed, "kvserve_kv_cache_blocks", state="used") == 0
    assert value(fed, "kvserve_kv_cache_blocks", state="cached") == 10
    assert value(fed, "kvserve_kv_cache_blocks", state="free") == 54


def test_kv_usage_ratio_is_used_over_total(metrics: ServerMetrics) -> None:
    step = build_known_workload().steps[0]  # one running request holding 8 of 64 blocks
    metrics.on_step(step)
    assert value(metrics, "kvserve_kv_cache_usage_ratio") == 8 / 64
    assert value(metrics, "kvserve_num_requests_running") == 1
    assert value(metrics, "kvserve_num_requests_waiting") == 9


def test_info_metric_carries_the_configuration(metrics: ServerMetrics) -> None:
    assert value(metrics, "kvserve_cache_config_info", **INFO) == 1


def test_config_info_can_be_replaced_once_the_model_has_loaded(metrics: ServerMetrics) -> None:
    resolved = {**INFO, "num_blocks": "4096", "dtype": "bfloat16"}
    metrics.set_config_info(resolved)
    assert value(metrics, "kvserve_cache_config_info", **resolved) == 1
    assert metrics.registry.get_sample_value("kvserve_cache_config_info", {"model_name": MODEL, **INFO}) is None


def test_http_and_error_counters(metrics: ServerMetrics) -> None:
    metrics.observe_http("/v1/completions", "post", 200, 0.3)
    metrics.observe_http("/v1/completions", "POST", 200, 0.7)
    metrics.observe_http("/v1/chat/completions", "POST", 400, 0.01)
    metrics.count_error(400)
    metrics.count_error(400)
    metrics.count_error(503)
    completions = {"route": "/v1/completions", "method": "POST", "status": "200"}
    assert value(metrics, "kvserve_http_requests_total", **completions) == 2
    assert value(metrics, "kvserve_http_request_duration_seconds_sum", **completions) == pytest.approx(1.0)
    assert value(metrics, "kvserve_http_requests_total", route="/v1/chat/completions", method="POST", status="400") == 1
    assert value(metrics, "kvserve_request_errors_total", code="400") == 2
    assert value(metrics, "kvserve_request_errors_total", code="503") == 1


def test_every_series_is_prefixed_and_labelled_with_the_model(fed: ServerMetrics) -> None:
    fed.observe_http("/health", "GET", 200, 0.001)
    fed.count_error(500)
    body, content_type = fed.render()
    assert content_type.startswith("text/plain")
    families = list(text_string_to_metric_families(body.decode()))
    assert len(families) >= 20
    for family in families:
        assert family.name.startswith("kvserve_"), family.name
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL, sample


def test_two_instances_do_not_share_series() -> None:
    first, second = ServerMetrics("a", INFO), ServerMetrics("b", INFO)
    feed(first, build_known_workload())
    assert second.registry.get_sample_value("kvserve_generation_tokens_total", {"model_name": "b"}) == 0
    assert b'model_name="a"' not in second.render()[0]


def test_concurrent_feeders_lose_no_increment(metrics: ServerMetrics) -> None:
    step = build_known_workload().steps[0]  # 1 generated token per step

    def feed_steps() -> None:
        for _ in range(500):
            metrics.on_step(step)

    threads = [threading.Thread(target=feed_steps) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert value(metrics, "kvserve_generation_tokens_total") == 2000
    assert value(metrics, "kvserve_step_duration_seconds_count") == 2000


def test_every_finish_reason_is_a_series_from_the_start_labelled_as_the_api_spells_it(metrics: ServerMetrics) -> None:
    assert all(value(metrics, "kvserve_request_success_total", finished_reason=r.value) == 0 for r in FinishReason)
    metrics.on_request_finished(FinishedRequestStats(FinishReason.LENGTH, 0.0, None, None, None, 1.0, 1, 0, 0, ()))
    assert value(metrics, "kvserve_request_success_total", finished_reason="length") == 1


def test_empty_model_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="model_name"):
        ServerMetrics("", INFO)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool absent: apt-get install prometheus")
def test_promtool_check_metrics_reports_nothing(fed: ServerMetrics) -> None:
    fed.observe_http("/v1/completions", "POST", 200, 0.2)
    fed.count_error(429)
    body, _ = fed.render()
    result = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30)
    report = (result.stdout + result.stderr).decode()
    assert result.returncode == 0, report
    assert report.strip() == "", report


def test_speculative_decoding_counters_follow_the_steps(metrics: ServerMetrics) -> None:
    import dataclasses

    from tests.server.metrics_workload import build_known_workload

    step = build_known_workload().steps[0]
    metrics.on_step(dataclasses.replace(step, spec_num_drafts=3, spec_num_draft_tokens=12,
                                        spec_num_accepted_tokens=5, spec_accepted_per_position=(3, 1, 1, 0)))
    metrics.on_step(dataclasses.replace(step, spec_num_drafts=1, spec_num_draft_tokens=4,
                                        spec_num_accepted_tokens=4, spec_accepted_per_position=(1, 1, 1, 1)))
    assert value(metrics, "kvserve_spec_decode_num_drafts_total") == 4
    assert value(metrics, "kvserve_spec_decode_num_draft_tokens_total") == 16
    assert value(metrics, "kvserve_spec_decode_num_accepted_tokens_total") == 9
    per_position = [value(metrics, "kvserve_spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
                    for p in range(4)]
    assert per_position == [4, 2, 2, 1]
