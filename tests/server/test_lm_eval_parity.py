"""lm-evaluation-harness through kvserve (issue 13): its `local-completions` backend scores a
small multiple-choice task (a JSON file and a task YAML, fully offline) with the same per-item
loglikelihoods as its `hf` backend on the same weights in float32, within 1e-3.

lm-eval is a heavy install (datasets, pandas, scikit-learn ...), so it is an extra of its own:
`pip install -e '.[lmeval]'`, then `pytest -m lmeval`. Without it these tests skip.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.tiny_server import MODEL, TinyServer, tiny_server

pytestmark = pytest.mark.lmeval

QUESTIONS = [
    ("The capital of France is", [" Paris", " Berlin", " Rome"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Fahrenheit", " Kelvin"], 0),
    ("The opposite of hot is", [" cold", " warm", " loud"], 0),
    ("Two plus two equals", [" four", " five", " seven"], 0),
    ("The sun rises in the", [" east", " west", " north"], 0),
    ("A paged KV cache splits memory into", [" blocks", " pages of a book", " nothing at all"], 0),
]
TASK = "kvserve_parity_mc"


def write_task(folder: Path) -> Path:
    """An lm-eval task over a local JSON file (no hub access)."""
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    return folder


def loglikelihoods(model: str, model_args: dict, task_dir: Path) -> tuple[list[float], float]:
    """Per (item, choice) loglikelihoods in document order, and the task's accuracy."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK],
                                      task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
                                      batch_size=1)
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    values = [float(resp[0]) for s in samples for resp in s["filtered_resps"]]
    return values, results["results"][TASK]["acc,none"]


@pytest.fixture(scope="module")
def lm_eval_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("lm_eval")
    return write_task(tmp_path_factory.mktemp("lm_eval_task"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, lm_eval_task) -> Iterator[TinyServer]:
    with tiny_server(tmp_path_factory.mktemp("lm_eval_server")) as running:
        yield running


def local_completions_args(url: str, model: str) -> dict:
    return {"base_url": f"{url}/v1/completions", "model": model, "tokenizer_backend": "remote",
            "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1}


def test_local_completions_matches_hf_backend_on_the_tiny_checkpoint(server, lm_eval_task):
    ours, our_acc = loglikelihoods("local-completions", local_completions_args(server.url, MODEL), lm_eval_task)
    hf, hf_acc = loglikelihoods("hf", {"pretrained": str(server.checkpoint), "dtype": "float32", "device": "cpu"},
                                lm_eval_task)
    assert len(ours) == sum(len(c) for _, c, _ in QUESTIONS)
    assert ours == pytest.approx(hf, abs=1e-3)
    assert our_acc == hf_acc


@pytest.mark.slow
def test_local_completions_matches_hf_backend_on_the_default_model(tmp_path_factory, lm_eval_task):
    from kvserve.engine.model.model_source import resolve_model

    source = resolve_model("SmolLM2-135M-Instruct")
    with tiny_server(tmp_path_factory.mktemp("smollm2"), model=source.path) as running:
        ours, our_acc = loglikelihoods("local-completions", local_completions_args(running.url, MODEL),
                                       lm_eval_task)
    hf, hf_acc = loglikelihoods("hf", {"pretrained": str(source.path.parent), "gguf_file": source.path.name,
                                       "dtype": "float32", "device": "cpu"}, lm_eval_task)
    print(f"lm-eval acc via kvserve {our_acc:.4f}, via hf {hf_acc:.4f}; loglikelihoods {ours} vs {hf}")
    assert ours == pytest.approx(hf, abs=1e-3)
    assert our_acc == hf_acc
