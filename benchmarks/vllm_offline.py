"""vLLM's offline throughput on the fixed workload, as offline.py measures kvserve: one process,
`LLM.generate` on every request at once, greedy, EOS ignored, prefix caching off, after a warm-up.

Runs with the vLLM venv's Python (benchmarks/peers.py installs it), never kvserve's: it imports
only vLLM and workload.py (standard library only).

    VENV/bin/python benchmarks/vllm_offline.py --model HF_FOLDER --out offline-vllm.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

# Not on the import path: this folder's scripts (serving.py, report.py, ...) are named like
# modules vLLM or its dependencies may import. workload.py is loaded by its file name instead.
BENCHMARKS = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCHMARKS]
_spec = importlib.util.spec_from_file_location("workload", BENCHMARKS / "workload.py")
workload = sys.modules["workload"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workload)
fixed_workload = workload.fixed_workload


def _pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the Hugging Face folder (bf16) kvserve also loads")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=_pair, default=(16, 256))
    parser.add_argument("--output-len", type=_pair, default=(16, 256))
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="as kvserve's offline run")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="float32 on a CPU without bf16 arithmetic, where kvserve's --dtype auto picks it")
    parser.add_argument("--speculative-config", type=json.loads,
                        help="vLLM's JSON object, e.g. n-gram speculation (as offline.py's)")
    args = parser.parse_args()
    speculative = args.speculative_config

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    items = fixed_workload(num_requests=args.num_requests, prompt_len=args.prompt_len, output_len=args.output_len)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=max(64, len(items)),
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False, seed=0,
              speculative_config=speculative)
    prompts = [TokensPrompt(prompt_token_ids=i.prompt_token_ids) for i in items]
    params = [SamplingParams(temperature=0.0, max_tokens=i.output_len, ignore_eos=True) for i in items]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(i.output_len for i in items)
    if tokens != expected:
        raise SystemExit(f"vLLM returned {tokens} output tokens for a workload of {expected} with EOS ignored")
    print(f"vLLM {vllm.__version__} offline: {tokens / seconds:.1f} tokens/s", flush=True)
    name = f"vLLM {vllm.__version__} LLM.generate ({args.dtype})"
    if speculative:
        name += f", speculative {json.dumps(speculative, sort_keys=True)}"
    row = {"name": name, "kind": "vllm", "output_tokens": tokens,
           "seconds": seconds, "tokens_per_s": tokens / seconds}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"system": "vllm", "version": vllm.__version__, "rows": [row]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":  # vLLM's engine spawns its engine-core process: the guard is required
    raise SystemExit(main())
