"""Decode throughput of a full batch with and without structured-output rows (issue 13): the
grammar mask must not slow the rows that do not ask for one.

Runs the engine offline over W prompts (default 64), each decoding --output-len tokens with
ignore_eos, either all unconstrained or with --constrained of them under a JSON-schema grammar.
The variants run interleaved in one process (A, B, A, B, ...) and the best time of each is
reported, so a loaded machine disturbs both alike.

The comparison is per output token on the same work: every row of every variant emits exactly
--output-len tokens (ignore_eos; a row whose JSON completes early goes on unconstrained, checked
below), from the same prompts, so each variant runs the same forward passes over the same
sequence lengths and differs only in what the grammar costs: filling the constrained rows'
bitmasks, masking their logits, and advancing their matchers. The ratio column is each
variant's throughput over the first variant's (list 0 first).

    python benchmarks/structured_output.py                     # W64: 0 and 8 constrained rows
    python benchmarks/structured_output.py --width 64 --constrained 0 8 32 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import time

from kvserve.engine import LLM, GrammarKind, SamplingParams, StructuredOutputParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}


def run(llm: LLM, prompts: list[str], output_len: int, constrained: int) -> float:
    """Seconds to generate `output_len` tokens for every prompt, the first `constrained` rows
    under SCHEMA's grammar."""
    free = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    grammar = StructuredOutputParams(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    bound = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, structured_output=grammar)
    params = [bound if i < constrained else free for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    # Equal work: the same number of tokens per row whatever the grammar did.
    if not all(len(o.outputs[0].token_ids) == output_len for o in outputs):
        raise RuntimeError("a row stopped before --output-len tokens: the variants would not compare")
    opening = '{"name": "'  # SCHEMA's object as the grammar (compact, properties in order) opens it
    for output in outputs[:constrained]:
        text = output.outputs[0].text
        if not (text.startswith(opening) or opening.startswith(text)):
            raise RuntimeError(f"a constrained row left its grammar: {text!r}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--constrained", type=int, nargs="+", default=[0, 8])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if any(not 0 <= c <= args.width for c in args.constrained):
        parser.error("--constrained counts must lie in [0, --width]")
    llm = LLM(args.model, max_num_seqs=args.width)
    prompts = [f"Describe person number {i} as JSON:" for i in range(args.width)]
    run(llm, prompts[:4], 4, 2)  # warm up, and compile the grammar once
    best = {c: float("inf") for c in args.constrained}
    for _ in range(args.repeats):
        for c in args.constrained:
            best[c] = min(best[c], run(llm, prompts, args.output_len, c))
    tokens = args.width * args.output_len
    first = best[args.constrained[0]]
    for c, seconds in best.items():
        print(f"W{args.width}, {c:3d} constrained rows: {tokens / seconds:8.1f} output tokens/s "
              f"(best of {args.repeats}), {first / seconds:.3f}x")


if __name__ == "__main__":
    main()
