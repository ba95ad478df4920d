"""`kvserve-bench` end to end against the fake OpenAI server on 127.0.0.1."""

import json
import socket
from pathlib import Path

import pytest

from kvserve.loadtest.cli import main

from .fake_openai_server import MODEL, Behaviour

SMALL = ["--random-input-len", "8", "--random-output-len", "4", "--disable-tqdm"]


def test_run_prints_a_table_and_saves_vllm_style_json(fake_server, tmp_path: Path, capsys) -> None:
    with fake_server() as server:
        code = main(["--base-url", server.base_url, "--num-prompts", "7", "--num-warmups", "1", "--ignore-eos",
                     "--goodput", "ttft:5000", "tpot:5000", "--save-result", "--save-detailed",
                     "--result-dir", str(tmp_path), "--result-filename", "r.json", *SMALL])
    assert code == 0
    assert "Successful requests" in capsys.readouterr().out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["model_id"] == MODEL  # discovered from /v1/models
    assert (data["completed"], data["failed"], data["total_output_tokens"]) == (7, 0, 28)
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    for key in ("total_input_tokens", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_ttft_ms", "std_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms",
                "p99_e2el_ms", "goodput", "request_rate", "max_concurrency"):
        assert key in data
    assert len(data["ttfts"]) == 7 and data["output_lens"] == [4] * 7
    assert all(body["model"] == MODEL and body["ignore_eos"] for body in server.bodies)


@pytest.mark.slow  # imports matplotlib and renders two figures
def test_sweep_writes_results_per_rate_and_plots(fake_server, tmp_path: Path) -> None:
    with fake_server(lambda i, body: Behaviour(ttft_s=0.01, itl_s=0.005)) as server:
        code = main(["--base-url", server.base_url, "--model", MODEL, "--num-prompts", "6",
                     "--request-rate-sweep", "50,inf", "--result-dir", str(tmp_path), *SMALL])
    assert code == 0
    assert len(server.bodies) == 1 + 2 * 6  # one warm-up, then the workload once per rate
    (result,) = tmp_path.glob("sweep-*.json")
    sweep = json.loads(result.read_text())["sweep"]
    assert [p["request_rate"] for p in sweep] == [50.0, "inf"] and all(p["completed"] == 6 for p in sweep)
    pngs = sorted(tmp_path.glob("*.png"))
    assert {p.name.removeprefix(result.stem + "-") for p in pngs} == {"latency_vs_throughput.png", "ttft_cdf.png"}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


@pytest.mark.parametrize("dataset", [["--dataset-name", "synthetic-chat", "--chat-input-median", "5",
                                      "--chat-output-median", "3", "--chat-max-output-len", "6"],
                                     ["--dataset-name", "prefix", "--prefix-len", "20", "--prefix-output-len", "2"]])
def test_chat_endpoint_with_generated_datasets(fake_server, dataset: list[str]) -> None:
    with fake_server() as server:
        code = main(["--base-url", server.base_url + "/v1", "--endpoint", "/v1/chat/completions",
                     "--model", MODEL, "--num-prompts", "5", "--num-warmups", "0", "--disable-tqdm", *dataset])
    assert code == 0
    assert len(server.bodies) == 5 and all("messages" in body for body in server.bodies)


def test_duration_cap_ends_the_run(fake_server, tmp_path: Path) -> None:
    with fake_server(lambda i, body: Behaviour(ttft_s=20.0)) as server:
        code = main(["--base-url", server.base_url, "--model", MODEL, "--num-prompts", "3", "--num-warmups", "0",
                     "--duration", "0.5", "--save-result", "--result-dir", str(tmp_path), *SMALL])
    assert code == 1  # nothing completed
    (saved,) = tmp_path.glob("bench-infqps-fake-model-*.json")
    data = json.loads(saved.read_text())
    assert data["hit_duration_cap"] is True and data["cancelled"] == 3 and data["completed"] == 0


def test_jsonl_dataset_through_the_cli(fake_server, tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a b c", "output_len": 2}\n{"prompt": [1, 2], "output_len": 3}\n')
    with fake_server() as server:
        code = main(["--base-url", server.base_url, "--model", MODEL, "--dataset-name", "jsonl",
                     "--dataset-path", str(path), "--num-prompts", "4", "--num-warmups", "0", "--disable-tqdm"])
    assert code == 0
    assert sorted(body["max_tokens"] for body in server.bodies) == [2, 2, 3, 3]


def test_user_errors_exit_2_with_a_message(capsys) -> None:
    assert main(["--model", "m", "--dataset-name", "jsonl"]) == 2
    assert "--dataset-path" in capsys.readouterr().err
    assert main(["--model", "m", "--goodput", "ttft"]) == 2
    assert "KEY:MS" in capsys.readouterr().err
    with socket.socket() as sock:  # a port on 127.0.0.1 that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", "1", *SMALL]) == 2
    assert "warm-up request" in capsys.readouterr().err


def test_the_client_imports_nothing_else_of_kvserve_nor_matplotlib() -> None:
    import subprocess
    import sys

    code = ("import sys, kvserve.loadtest, kvserve.loadtest.cli; "
            "print(sorted(m for m in sys.modules if m.startswith(('kvserve.', 'matplotlib', 'torch'))"
            " and not m.startswith('kvserve.loadtest')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
