"""n-gram speculative decoding (prompt lookup) on an input-grounded workload, side by side with
the same engine decoding without drafts, alternating runs in one process (issue 24 item 3).

    python benchmarks/spec_decode.py                      # the default model, all three parts
    python benchmarks/spec_decode.py --rounds 1 --max-tokens 16 --skip-w64   # a quick smoke run

Three parts, each printed as a table:
1. Single stream: ms per output token with and without drafts on prompts that ask the model to
   repeat or edit a given passage (prose, code, a JSON record: what summarization and code
   editing look like to a drafter), the ratio, the acceptance rate, and whether the greedy
   outputs are identical (they must be).
2. Step time at 1..8 query tokens per request (1 + k drafts, all rejected, so every step does
   the full verification work and keeps one token), at 1 and 8 concurrent requests: what a
   draft costs when it is wrong, which says where drafting stops paying.
3. W64 (the fixed random-prompt workload of benchmarks/workload.py): output tok/s without drafts,
   with drafts on every step, and with disable_by_batch_size (no drafts in a step with more
   running requests than that).

Both systems are one LLM: its drafter is swapped in and out between runs, so compiled graphs,
KV cache and threads are the same; only the drafts differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import run_kvserve_continuous  # noqa: E402
from workload import fixed_workload  # noqa: E402

from kvserve.engine import LLM, SamplingParams  # noqa: E402
from kvserve.engine.spec_decode import NgramDrafter, SpeculativeConfig  # noqa: E402

PASSAGES = {
    "prose": (
        "Repeat the following paragraph exactly, word for word:\n\n"
        "The lighthouse keeper climbed the spiral stairs every evening at six. He wiped the great lens "
        "with a soft cloth, trimmed the wick, and lit the lamp. Ships passing in the night saw the beam "
        "sweep across the water once every ten seconds, and they knew the rocks were near. In the morning "
        "he wrote the weather in his logbook: the wind, the waves, the fog, and the ships he had seen."),
    "code": (
        "Rewrite this Python function with the variable `items` renamed to `values`. Output only the code.\n\n"
        "def average(items):\n"
        "    if not items:\n"
        "        raise ValueError('average of an empty list')\n"
        "    total = 0\n"
        "    for item in items:\n"
        "        total += item\n"
        "    return total / len(items)\n\n"
        "def spread(items):\n"
        "    low = min(items)\n"
        "    high = max(items)\n"
        "    return high - low\n"),
    "json": (
        "Copy this JSON record, changing only the city to \"Lyon\":\n\n"
        '{"name": "Ada Lovelace", "born": 1815, "city": "London", "fields": ["mathematics", "computing"], '
        '"notes": "wrote the first published algorithm for a machine", "languages": ["English", "French"]}'),
}


@dataclass
class StepLog:
    """A stats listener: the engine's step durations and its draft counters."""

    durations: list[float] = field(default_factory=list)
    draft_tokens: int = 0
    accepted: int = 0

    def on_step(self, stats) -> None:
        self.durations.append(stats.duration_s)
        self.draft_tokens += stats.spec_num_draft_tokens
        self.accepted += stats.spec_num_accepted_tokens

    def on_request_finished(self, stats) -> None:
        pass

    def reset(self) -> None:
        self.durations.clear()
        self.draft_tokens = self.accepted = 0


class WrongDrafter:
    """Proposes k drafts that are never right (a token the request just produced, repeated), so
    every step verifies 1 + k query tokens and keeps one."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, requests, num_running, validate=None) -> None:
        for request in requests:
            request.spec_token_ids = [request.all_token_ids[-1]] * self.k

    def forget(self, request_ids) -> None:
        pass


def single_stream(llm: LLM, drafter: NgramDrafter, log: StepLog, rounds: int, max_tokens: int) -> None:
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    print("\n## Single stream, input-grounded prompts (greedy)\n")
    print("| passage | output tokens | ms/token without | ms/token with drafts | speed-up | accepted / drafted | identical |")
    print("|---|---|---|---|---|---|---|")
    speedups = []
    for name, text in PASSAGES.items():
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        times: dict[str, list[float]] = {"without": [], "with": []}
        outputs: dict[str, list[int]] = {}
        accepted = drafted = 0
        for _ in range(rounds):
            for mode in ("without", "with"):  # alternating: the machine's drift hits both alike
                llm.engine.drafter = drafter if mode == "with" else None
                log.reset()
                start = time.perf_counter()
                completion = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
                elapsed = time.perf_counter() - start
                times[mode].append(1000 * elapsed / len(completion.token_ids))
                outputs[mode] = completion.token_ids
                if mode == "with":
                    accepted, drafted = accepted + log.accepted, drafted + log.draft_tokens
        without, with_drafts = statistics.median(times["without"]), statistics.median(times["with"])
        speedups.append(without / with_drafts)
        print(f"| {name} | {len(outputs['with'])} | {without:.1f} | {with_drafts:.1f} | {without / with_drafts:.2f}x "
              f"| {accepted} / {drafted} | {outputs['with'] == outputs['without']} |", flush=True)
    print(f"\nmedian speed-up over the passages: {statistics.median(speedups):.2f}x")


def step_times(llm: LLM, log: StepLog, concurrencies: list[int], max_query: int, steps: int) -> None:
    print("\n## Step time by query tokens per request (1 + k drafts, all rejected)\n")
    print("| requests | " + " | ".join(f"q={q}" for q in range(1, max_query + 1)) + " |")
    print("|---|" + "---|" * max_query)
    prompt = list(range(1000, 1064))
    for concurrency in concurrencies:
        cells = []
        base = None
        for query in range(1, max_query + 1):
            llm.engine.drafter = WrongDrafter(query - 1) if query > 1 else None
            params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
            llm.generate([prompt] * concurrency, params, use_tqdm=False)  # warm-up: the graphs for this shape
            log.reset()
            llm.generate([prompt] * concurrency, params, use_tqdm=False)
            decode = sorted(log.durations[1:])  # the first step is the prompts' prefill
            ms = 1000 * statistics.median(decode)
            base = base or ms
            cells.append(f"{ms:.1f} ms ({ms / base:.2f}x)")
        print(f"| {concurrency} | " + " | ".join(cells) + " |", flush=True)
    llm.engine.drafter = None


def w64(llm: LLM, spec: SpeculativeConfig, disable_by: int, rounds: int) -> None:
    items = fixed_workload()
    print(f"\n## W64 (fixed workload, {len(items)} requests), output tok/s\n")
    modes = {"without drafts": None, "drafts every step": NgramDrafter(spec),
             f"disable_by_batch_size={disable_by}": NgramDrafter(
                 dataclasses.replace(spec, disable_by_batch_size=disable_by))}
    rates: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(rounds):
        for name, drafter in modes.items():
            llm.engine.drafter = drafter
            tokens, seconds = run_kvserve_continuous(llm, items)
            rates[name].append(tokens / seconds)
    base = statistics.median(rates["without drafts"])
    print("| mode | tok/s (median) | runs | vs without |")
    print("|---|---|---|---|")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} | {', '.join(f'{v:.0f}' for v in values)} | {median / base:.3f}x |")
    llm.engine.drafter = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path or name (default: the default model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per system")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-query", type=int, default=8)
    parser.add_argument("--step-concurrency", default="1,8")
    parser.add_argument("--disable-by-batch-size", type=int, default=8)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--skip-w64", action="store_true")
    args = parser.parse_args()

    spec = SpeculativeConfig(num_speculative_tokens=args.num_speculative_tokens, prompt_lookup_max=args.prompt_lookup_max)
    kwargs = {"model": args.model} if args.model else {}
    # Sized for W64 (64 requests of at most 256 + 256 tokens resident at once), not to free memory.
    llm = LLM(**kwargs, dtype=args.dtype, enforce_eager=args.enforce_eager, max_num_seqs=64,
              enable_prefix_caching=False, max_model_len=1024, num_kv_blocks=64 * 32 + 64)
    log = StepLog()
    llm.engine.stats_listeners.append(log)
    print(f"speculative config: {spec}")
    single_stream(llm, NgramDrafter(spec), log, args.rounds, args.max_tokens)
    if not args.skip_steps:
        step_times(llm, log, [int(c) for c in args.step_concurrency.split(",")], args.max_query, steps=16)
    if not args.skip_w64:
        w64(llm, spec, args.disable_by_batch_size, args.rounds)


if __name__ == "__main__":
    main()
