"""The fixed workload every throughput comparison uses (issue 5 / issue 8):
seed 0, 64 requests, prompts of 16-256 random token ids, outputs of 16-256 tokens, EOS ignored."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkItem:
    prompt_token_ids: list[int]
    output_len: int


def fixed_workload(
    num_requests: int = 64,
    prompt_len: tuple[int, int] = (16, 256),
    output_len: tuple[int, int] = (16, 256),
    vocab_size: int = 49152,
    seed: int = 0,
    first_token_id: int = 17,  # skip SmolLM2's 17 control tokens
) -> list[WorkItem]:
    rng = random.Random(seed)
    items = []
    for _ in range(num_requests):
        n_prompt = rng.randint(*prompt_len)
        items.append(
            WorkItem(
                prompt_token_ids=[rng.randrange(first_token_id, vocab_size) for _ in range(n_prompt)],
                output_len=rng.randint(*output_len),
            )
        )
    return items


def kv_blocks(items: list[WorkItem], block_size: int = 16, spare: int = 64) -> int:
    """A KV cache that holds every request at once (prompt and output), plus `spare` blocks: the
    benchmarks size the cache to the workload, not to free memory, so a run does not depend on
    what else the machine holds."""
    return sum(math.ceil((len(i.prompt_token_ids) + i.output_len) / block_size) for i in items) + spare
