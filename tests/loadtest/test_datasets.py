import json
from pathlib import Path

import numpy as np
import pytest

from kvserve.loadtest.datasets import DatasetError, PrefixDataset, RandomDataset, SyntheticChatDataset
from kvserve.loadtest.jsonl_dataset import JsonlDataset


def test_random_text_lengths_are_in_range_and_seeded() -> None:
    dataset = RandomDataset(input_len=100, output_len=50, range_ratio=0.2)
    requests = dataset.sample(200, seed=0)
    assert len(requests) == 200
    assert all(80 <= r.prompt_len <= 120 and 40 <= r.output_len <= 60 for r in requests)
    assert all(len(r.prompt.split()) == r.prompt_len for r in requests)  # one word per estimated token
    assert requests == dataset.sample(200, seed=0)
    assert requests != dataset.sample(200, seed=1)


def test_random_token_ids_have_exact_lengths_and_share_the_prefix() -> None:
    dataset = RandomDataset(input_len=30, output_len=5, prefix_len=10, token_ids=True, vocab_size=500)
    requests = dataset.sample(20, seed=3)
    for r in requests:
        assert r.is_token_ids and not r.is_messages
        assert len(r.prompt) == r.prompt_len == 40
        assert all(100 <= t < 500 for t in r.prompt)
        assert r.prompt[:10] == requests[0].prompt[:10]
    assert len({r.prompt[10:] for r in requests}) == 20


def test_synthetic_chat_lengths_are_long_tailed_around_the_median() -> None:
    requests = SyntheticChatDataset(input_median=100, output_median=40, sigma=1.0).sample(2000, seed=0)
    inputs = np.array([r.prompt_len for r in requests])
    outputs = np.array([r.output_len for r in requests])
    assert np.median(inputs) == pytest.approx(100, rel=0.1)
    assert np.median(outputs) == pytest.approx(40, rel=0.1)
    assert inputs.mean() > 1.3 * np.median(inputs)  # right-skewed: the tail pulls the mean up
    assert inputs.max() > 8 * np.median(inputs)
    assert inputs.max() <= 4096 and outputs.min() >= 1


def test_prefix_requests_share_one_of_the_prefixes() -> None:
    requests = PrefixDataset(prefix_len=50, suffix_len=5, output_len=7, num_prefixes=2).sample(10, seed=0)
    prefixes = {" ".join(r.prompt.split()[:50]) for r in requests}
    assert len(prefixes) == 2
    assert all(len(r.prompt.split()) == 55 and r.output_len == 7 for r in requests)
    assert len({r.prompt for r in requests}) == 10


@pytest.mark.parametrize(
    "make",
    [
        lambda: RandomDataset(input_len=0),
        lambda: RandomDataset(range_ratio=1.0),
        lambda: SyntheticChatDataset(sigma=0),
        lambda: PrefixDataset(num_prefixes=0),
    ],
)
def test_invalid_options_raise_dataset_errors(make) -> None:
    with pytest.raises(DatasetError):
        make()


def test_jsonl_reads_prompts_token_ids_and_messages(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "hello there world", "output_len": 4},
        {"prompt": [1, 2, 3], "max_tokens": 2},
        {"messages": [{"role": "user", "content": "hi you"}]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    requests = JsonlDataset(path, default_output_len=9).load()
    assert [(r.prompt_len, r.output_len) for r in requests] == [(3, 4), (3, 2), (2, 9)]
    assert requests[1].is_token_ids and requests[2].is_messages


def test_jsonl_sample_reuses_a_short_file_evenly(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"p{i}"}) for i in range(3)))
    picked = JsonlDataset(path).sample(7, seed=0)
    counts = {p: sum(r.prompt == p for r in picked) for p in ("p0", "p1", "p2")}
    assert sorted(counts.values()) == [2, 2, 3]


@pytest.mark.parametrize("line, message", [("{not json", "not valid JSON"), ('{"x": 1}', "needs a non-empty"),
                                           ('{"prompt": "a", "output_len": 0}', "positive integer")])
def test_jsonl_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(DatasetError, match=rf"bad.jsonl:2: .*{message}"):
        JsonlDataset(path).load()
