"""A workload read from a JSONL file: one request per line, for traffic the generators cannot model.

Each line is an object with either `"prompt"` (text, or a list of token ids) or `"messages"`
(OpenAI chat messages), and optionally `"output_len"` (or `"max_tokens"`) for the tokens to ask for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .datasets import BenchRequest, DatasetError, Prompt


def _estimate_tokens(text: str) -> int:
    # Without a tokenizer, words are the honest estimate; the server's usage replaces it.
    return max(1, len(text.split()))


def _parse_line(obj: object, where: str, default_output_len: int) -> BenchRequest:
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    output_len = obj.get("output_len", obj.get("max_tokens", default_output_len))
    if not isinstance(output_len, int) or output_len < 1:
        raise DatasetError(f"{where}: output_len/max_tokens must be a positive integer, got {output_len!r}")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
            for m in messages
        ):
            raise DatasetError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        prompt: Prompt = tuple({"role": m["role"], "content": m["content"]} for m in messages)
        prompt_len = sum(_estimate_tokens(m["content"]) for m in messages)
    elif isinstance(obj.get("prompt"), str) and obj["prompt"]:
        prompt = obj["prompt"]
        prompt_len = _estimate_tokens(prompt)
    elif isinstance(obj.get("prompt"), list) and obj["prompt"] and all(isinstance(t, int) for t in obj["prompt"]):
        prompt = tuple(obj["prompt"])
        prompt_len = len(prompt)
    else:
        raise DatasetError(f"{where}: needs a non-empty 'prompt' (text or token ids) or 'messages'")
    return BenchRequest(prompt=prompt, prompt_len=prompt_len, output_len=output_len)


@dataclass(frozen=True)
class JsonlDataset:
    path: Path
    default_output_len: int = 128

    def __post_init__(self) -> None:
        if self.default_output_len < 1:
            raise DatasetError(f"--jsonl-output-len must be >= 1, got {self.default_output_len}")

    def load(self) -> list[BenchRequest]:
        if not self.path.is_file():
            raise DatasetError(f"--dataset-path {self.path} is not a file")
        requests = []
        with self.path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{self.path}:{number}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{where}: not valid JSON ({e.msg})") from e
                requests.append(_parse_line(obj, where, self.default_output_len))
        if not requests:
            raise DatasetError(f"--dataset-path {self.path} holds no requests")
        return requests

    def sample(self, num_requests: int, seed: int) -> list[BenchRequest]:
        """`num_requests` lines in a seeded order; a short file is reused, every line once per pass."""
        lines = self.load()
        rng = np.random.default_rng(seed)
        picked: list[BenchRequest] = []
        while len(picked) < num_requests:
            picked.extend(lines[i] for i in rng.permutation(len(lines)))
        return picked[:num_requests]
