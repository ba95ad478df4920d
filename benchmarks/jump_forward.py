"""Jump-forward decoding: output tokens, engine steps and time per constrained call with and
without it, alternating in one process on the default model (issue 25 item 4).

    python benchmarks/jump_forward.py [--rounds 3] [--enforce-eager]

The calls are what agents and structured-output libraries send: the tool-call wrapper that
pydantic-ai's tool_choice "required" forces (the grammar fixes `[{"name": "final_result",
"parameters": ` and the key names), a JSON record with fixed keys, and a choice among long
strings. Each row: output tokens and steps per call, ms per call (median), and whether the
parsed answers are equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvserve.engine import LLM, GrammarKind, SamplingParams, StructuredOutputParams

WRAPPER = {"type": "array", "minItems": 1, "maxItems": 1, "items": {
    "type": "object", "properties": {
        "name": {"const": "final_result"},
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                         "country": {"type": "string", "maxLength": 16}},
                       "required": ["city", "country"], "additionalProperties": False}},
    "required": ["name", "parameters"], "additionalProperties": False}}
RECORD = {"type": "object", "properties": {
    "monument_name": {"type": "string", "maxLength": 24}, "year_of_completion": {"type": "integer"},
    "height_in_metres": {"type": "integer"}, "designed_by_architect": {"type": "string", "maxLength": 24}},
    "required": ["monument_name", "year_of_completion", "height_in_metres", "designed_by_architect"],
    "additionalProperties": False}
CALLS = {
    "tool-call wrapper": (GrammarKind.JSON_SCHEMA, json.dumps(WRAPPER), "Where is the Eiffel tower?"),
    "record with fixed keys": (GrammarKind.JSON_SCHEMA, json.dumps(RECORD), "Describe the Eiffel tower."),
    "choice": (GrammarKind.CHOICE, json.dumps(["a wrought-iron lattice tower in Paris, France",
                                               "a wrought-iron lattice tower in Lyon, France"]),
               "What is the Eiffel tower?"),
}


class StepCount:
    def __init__(self) -> None:
        self.steps = 0

    def on_step(self, stats) -> None:
        self.steps += 1

    def on_request_finished(self, stats) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()

    llm = LLM(dtype=args.dtype, enforce_eager=args.enforce_eager, max_model_len=1024, num_kv_blocks=128)
    counter = StepCount()
    llm.engine.stats_listeners.append(counter)
    tokenizer = llm.get_tokenizer()
    print("| call | mode | output tokens | steps | ms per call (median) | answer |")
    print("|---|---|---|---|---|---|")
    for name, (kind, spec, question) in CALLS.items():
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}])
        params = SamplingParams(temperature=0.0, max_tokens=160,
                                structured_output=StructuredOutputParams(kind, spec))
        results: dict[bool, dict] = {False: {"ms": []}, True: {"ms": []}}
        for _ in range(args.rounds):
            for jump in (False, True):  # alternating: the machine's drift hits both alike
                llm.engine.config = _with_jump(llm.engine.config, jump)
                counter.steps = 0
                start = time.perf_counter()
                out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
                results[jump]["ms"].append(1000 * (time.perf_counter() - start))
                results[jump].update(tokens=len(out.token_ids), steps=counter.steps, text=out.text)
        for jump in (False, True):
            r = results[jump]
            print(f"| {name} | {'jump-forward' if jump else 'token by token'} | {r['tokens']} | {r['steps']} "
                  f"| {statistics.median(r['ms']):.0f} | `{r['text'][:70]}` |", flush=True)
        same = _parsed(results[False]["text"], kind) == _parsed(results[True]["text"], kind)
        print(f"| {name} | answers equal | {same} | | | |")


def _with_jump(config, jump: bool):
    import dataclasses

    return dataclasses.replace(config, jump_forward=jump)


def _parsed(text: str, kind: GrammarKind):
    return json.loads(text) if kind is GrammarKind.JSON_SCHEMA else text


if __name__ == "__main__":
    main()
