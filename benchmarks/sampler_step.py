"""Sampler cost per decode step: building the SamplingBatch (the per-request Python work) and
running the Sampler on [rows, vocab] logits, for batches that mix what requests ask for. The
grammar-masked mix also applies a structured-output token mask (a random bitmask, as xgrammar
fills it) to every 8th row before sampling, timed in the sampler column.

Every row starts with a 128-token prompt and `--output-len` output tokens and gains one token per
step, as in steady decode, so any per-step work that grows with the output so far shows up.

    python benchmarks/sampler_step.py                        # 64 and 256 rows, SmolLM2's vocab
    python benchmarks/sampler_step.py --rows 256 --steps 50
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.engine.sampling.sampler import Sampler, SamplingBatch
from kvserve.engine.structured_output.token_mask import TokenMask, apply_token_mask
from kvserve.engine.input_batch import CachedRequestState
from kvserve.scheduler.sampling_params import SamplingParams

VOCAB_SIZE = 49152
EOS = (2,)
GREEDY = SamplingParams(temperature=0.0, max_tokens=None)
RANDOM = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=None)
PENALTIES = SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
                           max_tokens=None)
LOGPROBS = SamplingParams(temperature=0.0, logprobs=5, max_tokens=None)

# name -> params of row i
MIXES = {
    "all greedy": lambda i: GREEDY,
    "half top-p sampling": lambda i: RANDOM if i % 2 else GREEDY,
    "1/4 penalties, rest greedy": lambda i: PENALTIES if i % 4 == 0 else GREEDY,
    "1/8 logprobs, rest greedy": lambda i: LOGPROBS if i % 8 == 0 else GREEDY,
    "1/8 grammar-masked, greedy": lambda i: GREEDY,
}
# Mixes whose every 8th row is under a grammar's token mask.
MASKED_MIXES = {"1/8 grammar-masked, greedy"}


def make_rows(num_rows: int, output_len: int, params_of) -> list[CachedRequestState]:
    """The runner's states of `num_rows` decoding requests (128-token prompts, `output_len` outputs)."""
    rows = []
    for i in range(num_rows):
        prompt = [(i * 7919 + j * 104729) % VOCAB_SIZE for j in range(128)]
        output = [(i * 31 + j * 977) % VOCAB_SIZE for j in range(output_len)]
        state = CachedRequestState(f"r{i}", len(prompt), params_of(i), seed=i, block_ids=[[0]])
        state.append_tokens(prompt + output)
        state.num_computed_tokens, state.num_new_tokens, state.samples = len(prompt) + output_len - 1, 1, True
        rows.append(state)
    return rows


def measure(num_rows: int, params_of, masked: bool, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    generator = torch.Generator().manual_seed(0)
    # Peaked like a language model's: a top-0.95 nucleus of tens to hundreds of tokens, not 40k.
    logits = torch.randn(num_rows, VOCAB_SIZE, generator=generator) * 4
    mask_rows = torch.arange(0, num_rows, 8)
    mask = TokenMask(mask_rows, torch.randint(-2**31, 2**31 - 1, (len(mask_rows), VOCAB_SIZE // 32), dtype=torch.int32,
                                              generator=generator)) if masked else None
    rows = make_rows(num_rows, args.output_len, params_of)
    sampler = Sampler()
    build, sample = [], []
    for step in range(args.warmup_steps + args.steps):
        start = time.perf_counter()
        batch = SamplingBatch.from_requests(rows, VOCAB_SIZE, EOS, torch.device("cpu"))
        built = time.perf_counter()
        out = sampler(logits if mask is None else apply_token_mask(logits, mask), batch)
        done = time.perf_counter()
        for row, token in zip(rows, out.token_ids):  # the next step's diff brings the sampled token
            row.append_tokens([token])
        if step >= args.warmup_steps:
            build.append(built - start)
            sample.append(done - built)
    return build, sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--output-len", type=int, default=256, help="output tokens each row starts with")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=3)
    args = parser.parse_args()
    print(f"sampler per decode step, vocab {VOCAB_SIZE}, {args.steps} steps, min / median ms")
    for num_rows in args.rows:
        for name, params_of in MIXES.items():
            build, sample = measure(num_rows, params_of, name in MASKED_MIXES, args)
            print(f"  {num_rows:4d} rows  {name:28s} batch {min(build) * 1e3:7.3f} / {statistics.median(build) * 1e3:7.3f}"
                  f"   sampler {min(sample) * 1e3:7.3f} / {statistics.median(sample) * 1e3:7.3f}")


if __name__ == "__main__":
    main()
