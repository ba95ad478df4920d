"""Where one engine step's time goes: decode steps at 1/16/64/256 rows and a mixed prefill+decode step.

    python benchmarks/step_profile.py [--rows 1,16,64,256] [--prompt-len 128] [--steps 5] [--out step_profile.json]

Every timer wraps an existing call of the real engine (LLM with the default CPU settings, so the
compiled forward); no engine code changes. Categories (exclusive; milliseconds per step, mean of
--steps steps):
  linear layers      the matmul ops of every linear layer, lm_head included (torch profiler events:
                     packed_linear, mm, addmm, linear, kvserve's bf16 and int8/int4 kernels, torch's
                     weight-only ops)
  attention          the attention backend's write_kv_cache + paged_attention ops (profiler events)
  other model ops    the model forward minus the two above: embedding, norms, rope, SiLU, residuals
                     (in the compiled forward: inductor's fused kernels and the graph's glue)
  input prep         ModelRunner.prepare_inputs: token ids, positions, block tables, slot mapping
  sampler            the batched sampler
  scheduler+alloc    Scheduler.schedule + update_from_output (block allocator included)
  detokenize/output  the output tracker's incremental detokenizer and stop strings
  python glue        the rest of LLMEngine.step: the step total minus everything above
Linear layers and attention are read from torch.profiler's op events, not from module hooks:
hooks on modules inside the compiled layers would be traced into (and change) the compiled
graphs. The profiler's per-op bookkeeping (a few microseconds per op) inflates the step total a
little; compare rows within one run. A decode step at R rows has R requests with
--prompt-len-token prompts each already in the cache; the mixed step is 16 decoding requests plus
one --mixed-prompt-len-token prompt prefilled in the same step.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_ops import kvserve_op_category, outermost_op_seconds  # noqa: E402

from kvserve.engine import LLM, SamplingParams  # noqa: E402

CATEGORIES = ("linear layers", "attention", "other model ops", "input prep", "sampler", "scheduler+alloc",
              "detokenize/output", "python glue")


class Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start
        return timed

    def hook(self, module: nn.Module, key: str) -> None:
        """Adds the time of every `module(...)` call to `key` (forward hooks)."""
        start: list[float] = []
        module.register_forward_pre_hook(lambda _m, _i: start.append(time.perf_counter()))

        def post(_module: nn.Module, _inputs: Any, _output: Any) -> None:
            self.seconds[key] += time.perf_counter() - start.pop()
        module.register_forward_hook(post)


def profiled_op_seconds(events: Any) -> dict[str, float]:
    """Seconds of kvserve's linear and attention ops (outermost on each call stack)."""
    return outermost_op_seconds(events, kvserve_op_category)


class _TimedSampler:
    """The runner's sampler with its calls timed; its other attributes (the penalties' token
    counts, which the runner updates) pass through."""

    def __init__(self, sampler: Any, timed_call: Callable[..., Any]) -> None:
        self._sampler, self._timed_call = sampler, timed_call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed_call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sampler, name)


def instrument(llm: LLM) -> Timers:
    timers = Timers()
    engine = llm.engine
    runner = engine.executor.driver.runner
    # Hooks only on modules that run eagerly: the model itself (its layers are what is compiled)
    # and lm_head, which compute_logits calls outside the forward. A plain greedy step skips the
    # module call: the runner asks the head for the argmax (PackedLinear.greedy_tokens), timed alike.
    head = runner.model.lm_head
    timers.hook(head, "lm_head")
    if callable(getattr(head, "greedy_tokens", None)):
        head.greedy_tokens = timers.wrap(head.greedy_tokens, "lm_head")
    timers.hook(runner.model, "forward")
    runner.prepare_inputs = timers.wrap(runner.prepare_inputs, "input prep")
    runner.sampler = _TimedSampler(runner.sampler, timers.wrap(runner.sampler, "sampler"))
    engine.scheduler.schedule = timers.wrap(engine.scheduler.schedule, "scheduler+alloc")
    engine.scheduler.update_from_output = timers.wrap(engine.scheduler.update_from_output, "scheduler+alloc")
    engine.tracker.on_tokens = timers.wrap(engine.tracker.on_tokens, "detokenize/output")
    engine.tracker.on_finished = timers.wrap(engine.tracker.on_finished, "detokenize/output")
    engine.step = timers.wrap(engine.step, "step")
    return timers


def profiled_steps(timers: Timers, steps: Callable[[], None], top_ops: int = 0) -> dict[str, float]:
    """Runs `steps` under torch.profiler; returns the raw timer sums, linear and attention added.
    top_ops > 0 also prints the profiler's table of that many ops with the most self time."""
    timers.seconds.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        steps()
    if top_ops:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=top_ops), flush=True)
    return {**timers.seconds, **profiled_op_seconds(profiler.events())}


def breakdown(seconds: dict[str, float], steps: int) -> dict[str, float]:
    """Raw timer sums -> exclusive milliseconds per step for CATEGORIES, plus 'step total'."""
    ms = defaultdict(float, {key: value * 1e3 / steps for key, value in seconds.items()})
    out = {"linear layers": ms["linear"], "attention": ms["attention"],
           "other model ops": max(0.0, ms["forward"] - (ms["linear"] - ms["lm_head"]) - ms["attention"])}
    for key in ("input prep", "sampler", "scheduler+alloc", "detokenize/output"):
        out[key] = ms[key]
    out["python glue"] = max(0.0, ms["step"] - sum(out.values()))
    out["step total"] = ms["step"]
    return out


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(17, 49152) for _ in range(length)]


def run_until_decoding(llm: LLM, ids: list[str]) -> None:
    """Step until every request in `ids` has its first token (its prompt is in the cache)."""
    started: set[str] = set()
    while not set(ids) <= started:
        started |= {o.request_id for o in llm.engine.step() if o.outputs and o.outputs[0].token_ids}


def profile_steps(llm: LLM, timers: Timers, steps: int, top_ops: int = 0) -> dict[str, float]:
    def run() -> None:
        for _ in range(steps):
            llm.engine.step()
    return breakdown(profiled_steps(timers, run, top_ops), steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--mixed-prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, help="int8 or int4 (default: none)")
    parser.add_argument("--out", type=Path, help="JSON file to write")
    parser.add_argument("--top-ops", type=int, default=0,
                        help="also print the N ops with the most self time of each decode row count")
    parser.add_argument("--skip-mixed", action="store_true", help="decode steps only")
    args = parser.parse_args(argv)
    row_counts = [int(r) for r in args.rows.split(",")]
    max_rows = max(row_counts + [17])
    max_tokens = args.steps + 8
    blocks = max_rows * -(-(args.prompt_len + max_tokens) // 16) + 4 * -(-(args.mixed_prompt_len + max_tokens) // 16)
    max_model_len = max(args.prompt_len, args.mixed_prompt_len) + max_tokens
    llm = LLM(dtype=args.dtype, quantization=args.quantization, max_num_seqs=max_rows + 4,
              max_num_batched_tokens=2048, enable_prefix_caching=False, num_kv_blocks=blocks + 16,
              max_model_len=max_model_len)
    timers = instrument(llm)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {llm.engine.executor.driver.runner.model_dtype}, "
          f"quantization {args.quantization or 'none'}, prompts of {args.prompt_len} tokens", flush=True)

    results: dict[str, dict[str, float]] = {}
    for rows in row_counts:
        ids = [f"d{rows}-{i}" for i in range(rows)]
        for request_id in ids:
            llm.engine.add_request(request_id, _prompt(rng, args.prompt_len), params)
        run_until_decoding(llm, ids)
        if args.top_ops:
            print(f"decode x{rows}: the {args.top_ops} ops with the most self time over {args.steps} steps")
        results[f"decode x{rows}"] = profile_steps(llm, timers, args.steps, args.top_ops)
        llm.engine.abort_request(ids)
        print(f"decode x{rows}: {results[f'decode x{rows}']['step total']:.1f} ms/step", flush=True)

    ids = [] if args.skip_mixed else [f"m-{i}" for i in range(16)]
    for request_id in ids:
        llm.engine.add_request(request_id, _prompt(rng, args.prompt_len), params)
    run_until_decoding(llm, ids)

    def mixed() -> None:
        for i in range(3):  # each step: the 16 decodes (and earlier mixed requests) + one new prompt, whole
            llm.engine.add_request(f"p-{i}", _prompt(rng, args.mixed_prompt_len), params)
            llm.engine.step()
    if not args.skip_mixed:
        name = f"mixed 16 decode + {args.mixed_prompt_len} prefill"
        results[name] = breakdown(profiled_steps(timers, mixed), 3)
        print(f"{name}: {results[name]['step total']:.1f} ms/step", flush=True)

    columns = list(results)
    print("\nms per step (% of the step)")
    print("| | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for category in (*CATEGORIES, "step total"):
        cells = []
        for column in columns:
            value, total = results[column][category], results[column]["step total"]
            cells.append(f"{value:.2f}" + ("" if category == "step total" else f" ({100 * value / total:.0f}%)"))
        print(f"| {category} | " + " | ".join(cells) + " |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "prompt_len": args.prompt_len,
                                        "quantization": args.quantization, "steps": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
