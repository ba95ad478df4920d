"""Offline throughput on the fixed workload: kvserve continuous batching vs the same engine with
static batching vs transformers `generate` with static batches (best of 8/16/32).

    python benchmarks/throughput.py [--num-requests 64] [--dtype auto] [--skip-transformers]

Prints a table of output tokens/s and the ratios. Useful tokens only: for static batches the
tokens a finished request keeps generating while its batch waits for the longest one are waste.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import WorkItem, fixed_workload  # noqa: E402

from kvserve.engine import LLM, SamplingParams  # noqa: E402
from kvserve.engine.model.model_source import resolve_model  # noqa: E402


def params_for(item: WorkItem) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=item.output_len, ignore_eos=True)


def run_kvserve_continuous(llm: LLM, items: list[WorkItem]) -> tuple[int, float]:
    start = time.perf_counter()
    outputs = llm.generate([i.prompt_token_ids for i in items], [params_for(i) for i in items], use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs), elapsed


def run_kvserve_static(llm: LLM, items: list[WorkItem], batch_size: int) -> tuple[int, float]:
    """A batch is admitted together and nothing new starts until all of it finishes."""
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(items), batch_size):
        batch = items[i : i + batch_size]
        outputs = llm.generate([b.prompt_token_ids for b in batch], [params_for(b) for b in batch], use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens, time.perf_counter() - start


def run_transformers_static(items: list[WorkItem], batch_size: int, dtype: torch.dtype) -> tuple[int, float]:
    from transformers import AutoModelForCausalLM

    source = resolve_model("SmolLM2-135M-Instruct")
    model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name, dtype=dtype)
    model.eval()
    pad = 2
    useful, start = 0, time.perf_counter()
    for i in range(0, len(items), batch_size):
        batch = items[i : i + batch_size]
        width = max(len(b.prompt_token_ids) for b in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, b in enumerate(batch):  # left padding, as generate expects for decoder-only models
            ids[row, width - len(b.prompt_token_ids) :] = torch.tensor(b.prompt_token_ids)
            mask[row, width - len(b.prompt_token_ids) :] = 1
        new_tokens = max(b.output_len for b in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=pad)
        useful += sum(b.output_len for b in batch)
    return useful, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help="kvserve dtype (auto = the CPU default)")
    parser.add_argument("--static-batch-size", type=int, default=32)
    parser.add_argument("--transformers-batch-sizes", default="8,16,32")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()

    items = fixed_workload(num_requests=args.num_requests)
    print(f"workload: {len(items)} requests, prompt tokens {sum(len(i.prompt_token_ids) for i in items)}, "
          f"output tokens {sum(i.output_len for i in items)}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    # Prefix caching off: the static run repeats the continuous run's prompts, which would make
    # its prefill free.
    llm = LLM(dtype=args.dtype, max_num_seqs=max(64, args.num_requests), max_num_batched_tokens=2048,
              enable_prefix_caching=False)
    llm.generate([items[0].prompt_token_ids], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up

    rows = []
    tokens, seconds = run_kvserve_continuous(llm, items)
    rows.append(("kvserve continuous batching", tokens, seconds))
    tokens, seconds = run_kvserve_static(llm, items, args.static_batch_size)
    rows.append((f"kvserve static batches of {args.static_batch_size}", tokens, seconds))
    if not args.skip_transformers:
        dtype = llm.engine.executor.driver.runner.model_dtype
        best = None
        for size in (int(s) for s in args.transformers_batch_sizes.split(",")):
            tokens, seconds = run_transformers_static(items, size, dtype)
            rows.append((f"transformers generate, static batches of {size}", tokens, seconds))
            if best is None or tokens / seconds > best[1] / best[2]:
                best = rows[-1]

    base = rows[0][1] / rows[0][2]
    print(f"\n| {'system':<44} | {'output tokens':>13} | {'seconds':>8} | {'tokens/s':>9} | {'kvserve cont. is':>16} |")
    print(f"|{'-' * 46}|{'-' * 15}|{'-' * 10}|{'-' * 11}|{'-' * 18}|")
    for name, tokens, seconds in rows:
        rate = tokens / seconds
        print(f"| {name:<44} | {tokens:>13} | {seconds:>8.1f} | {rate:>9.1f} | {base / rate:>15.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
