"""One full prefill step, kvserve or vLLM: N fresh prompts of L random tokens through the engine's
own `LLM.generate` with max_tokens=1, so with N x L = the step budget (2048 by default) all of
them go through the model in one step, as the first steps of a burst of requests do (TTFT at 64
streams is a few such steps). Prints the wall time of each burst and where one burst's time goes,
by torch.profiler op events sorted into the same categories for both engines:

  linear layers       kvserve: its linear ops (profile_ops.py, as step_profile.py); vLLM: onednn_mm,
                      weight_packed_linear
  attention           kvserve: paged_attention (SDPA and its gathers inside it included) +
                      write_kv_cache; vLLM: cpu_attention_with_kv_cache, cpu_attn_reshape_and_cache
                      and their wrappers
  (an op counts whole, what it calls included, unless an op of its own category encloses it)
  fused elementwise   the self time of the compiled graphs' calls: inductor's fused kernels
                      (norms, rope, SiLU x mul, residual adds)
  everything else     the rest of the burst's wall time (scheduling, input prep, sampling, glue)

Runs with either engine's Python; it imports nothing of kvserve at module level, so vLLM's venv
(benchmarks/peers.py installs it) runs it too. Alternate the two on a quiet machine:

    python benchmarks/prefill_step.py --engine kvserve
    VLLM_VENV/bin/python benchmarks/prefill_step.py --engine vllm --model HF_FOLDER
    (vLLM: VLLM_ENABLE_V1_MULTIPROCESSING=0 is set here, so its engine runs in this process and
    the profiler sees it; its usual CPU settings apply: benchmarks/peers.py's vllm_environment.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

from profile_ops import KVSERVE_ATTENTION_OP_PREFIXES, KVSERVE_LINEAR_OPS, outermost_op_seconds

# vLLM's ops; kvserve's come from profile_ops.py. aten's SDPA counts as attention wherever it runs.
VLLM_LINEAR_OPS = ("_C::onednn_mm", "_C::weight_packed_linear")
OTHER_ATTENTION_OPS = ("scaled_dot_product", "_C::cpu_attention_with_kv_cache", "_C::cpu_attn_reshape_and_cache",
                       "vllm::unified_attention", "vllm::unified_kv_cache_update")
COMPILED_GRAPH = "CompiledFxGraph"


def category(op_name: str) -> str:
    if op_name.startswith(KVSERVE_ATTENTION_OP_PREFIXES) or any(key in op_name for key in OTHER_ATTENTION_OPS):
        return "attention"
    if op_name in KVSERVE_LINEAR_OPS or any(key in op_name for key in VLLM_LINEAR_OPS):
        return "linear layers"
    if COMPILED_GRAPH in op_name:
        return "fused elementwise"
    return "everything else"


def _op_category(op_name: str) -> str | None:
    name = category(op_name)
    return name if name in ("linear layers", "attention") else None


def categorize(events: Any) -> dict[str, float]:
    """Milliseconds by category from torch.profiler's FunctionEvents: a linear or attention op
    counts whole, what it calls inside included (SDPA's gathers and views, oneDNN's reorders),
    unless another such op encloses it (profile_ops.py); a compiled graph's call counts its own
    time only (its fused kernels, not the linear and attention ops it calls)."""
    by_category = {name: seconds * 1e3 for name, seconds in outermost_op_seconds(events, _op_category).items()}
    by_category["fused elementwise"] = sum(event.self_cpu_time_total / 1e3 for event in events
                                          if category(event.name) == "fused elementwise")
    return by_category


def random_prompts(seed: int, count: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def kvserve_generate(args: argparse.Namespace) -> Callable[[list[list[int]]], None]:
    from kvserve.engine import LLM, SamplingParams

    options: dict[str, Any] = {"max_num_seqs": max(64, args.num_prompts), "max_model_len": 1024,
                               "enable_prefix_caching": False, "max_num_batched_tokens": args.max_num_batched_tokens}
    if args.model:
        options["model"] = args.model
    llm = LLM(**options)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    return lambda prompts: llm.generate(prompts, params, use_tqdm=False)


def vllm_generate(args: argparse.Namespace) -> Callable[[list[list[int]]], None]:
    if not args.model:
        sys.exit("--engine vllm needs --model HF_FOLDER (the bf16 folder kvserve also loads)")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=1024, max_num_seqs=max(64, args.num_prompts),
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False, seed=0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    return lambda prompts: llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("kvserve", "vllm"), required=True)
    parser.add_argument("--model", default=None, help="kvserve: any model it loads (default: the default model); "
                                                      "vLLM: the bf16 Hugging Face folder")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--bursts", type=int, default=6, help="timed bursts (after two warm-ups)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    if args.num_prompts * args.prompt_len > args.max_num_batched_tokens:
        sys.exit(f"{args.num_prompts} x {args.prompt_len} tokens do not fit one step of "
                 f"{args.max_num_batched_tokens}: the burst would take several steps")

    # This folder off the import path: its scripts (serving.py, report.py, ...) are named like
    # modules vLLM or its dependencies may import, and this script needs none of them.
    here = Path(__file__).resolve().parent
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != here]
    generate = (kvserve_generate if args.engine == "kvserve" else vllm_generate)(args)
    import torch
    from torch.profiler import ProfilerActivity, profile

    for seed in range(2):  # warm-up: compiles, allocates
        generate(random_prompts(seed, args.num_prompts, args.prompt_len))
    walls = []
    for seed in range(2, 2 + args.bursts):
        prompts = random_prompts(seed, args.num_prompts, args.prompt_len)
        start = time.perf_counter()
        generate(prompts)
        walls.append(time.perf_counter() - start)

    prompts = random_prompts(99, args.num_prompts, args.prompt_len)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        generate(prompts)
        profiled_wall = time.perf_counter() - start
    by_category = categorize(prof.events())
    by_category["everything else"] = profiled_wall * 1e3 - sum(by_category.values())

    walls_ms = [round(w * 1e3, 1) for w in walls]
    print(f"{args.engine} (torch {torch.__version__}, {torch.get_num_threads()} threads): "
          f"{args.num_prompts} prompts x {args.prompt_len} tokens, one step of {args.max_num_batched_tokens}")
    print(f"burst wall ms: {walls_ms} (min {min(walls_ms)})")
    print(f"one profiled burst, {profiled_wall * 1e3:.1f} ms (the profiler adds a little):")
    for name in ("linear layers", "attention", "fused elementwise", "everything else"):
        print(f"  {name:<18} {by_category[name]:8.1f} ms")
    if args.out:
        args.out.write_text(json.dumps({"engine": args.engine, "num_prompts": args.num_prompts,
                                        "prompt_len": args.prompt_len, "burst_wall_ms": walls_ms,
                                        "profiled_ms": round(profiled_wall * 1e3, 1),
                                        "categories_ms": {k: round(v, 1) for k, v in by_category.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
