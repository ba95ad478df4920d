from __future__ import annotations

import pytest

from kvserve.paging import KVCacheManager, KVCacheTooSmallError
from kvserve.scheduler import Scheduler, SchedulerConfig, SchedulerConfigError, SchedulingPolicy
from kvserve.scheduler.request_queue import RequestQueue, order_key
from tests.scheduler.harness import make_request


def test_config_defaults_and_policy_spelling() -> None:
    config = SchedulerConfig()
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len) == (128, 2048, 8192)
    assert config.policy is SchedulingPolicy.FCFS and config.policy == "fcfs"
    assert SchedulerConfig(policy="priority").policy is SchedulingPolicy.PRIORITY


@pytest.mark.parametrize(
    ("overrides", "field_name"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_model_len": -1}, "max_model_len"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"max_num_seqs": 2.5}, "max_num_seqs"),
        ({"policy": "lifo"}, "policy"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(overrides: dict, field_name: str) -> None:
    with pytest.raises(SchedulerConfigError, match=field_name) as error:
        SchedulerConfig(**overrides)
    assert error.value.field_name == field_name


def test_scheduler_refuses_a_cache_too_small_for_one_max_len_request() -> None:
    with pytest.raises(KVCacheTooSmallError, match="max_model_len=8192"):
        Scheduler(SchedulerConfig(), KVCacheManager(num_blocks=16, block_size=16))


def test_queue_orders_by_key_and_breaks_ties_by_sequence() -> None:
    queue = RequestQueue()
    requests = {rid: make_request(rid, 2, arrival=arrival) for rid, arrival in [("b", 1.0), ("a", 0.0), ("c", 1.0)]}
    keys = {rid: order_key(SchedulingPolicy.FCFS, r, seq) for seq, (rid, r) in enumerate(requests.items())}
    for rid, request in requests.items():
        queue.push(request, keys[rid])
    assert [r.request_id for r in queue] == ["a", "b", "c"]
    queue.remove(requests["b"], keys["b"])
    assert queue.pop_back().request_id == "c"
    assert queue.front().request_id == "a" and len(queue) == 1
    with pytest.raises(KeyError):
        queue.remove(requests["b"], keys["b"])
    queue.pop_front()
    with pytest.raises(IndexError, match="empty"):
        queue.pop_front()


def test_priority_key_puts_lower_priority_values_first() -> None:
    urgent = make_request("u", 2, arrival=5.0, priority=-1)
    normal = make_request("n", 2, arrival=1.0, priority=0)
    assert order_key(SchedulingPolicy.PRIORITY, urgent, 1) < order_key(SchedulingPolicy.PRIORITY, normal, 0)
    assert order_key(SchedulingPolicy.FCFS, urgent, 1) > order_key(SchedulingPolicy.FCFS, normal, 0)
