#!/usr/bin/env bash
# Every kernel figure that needs a GPU, from one short run on a machine with its own torch and
# triton and no network. Installs nothing: kvserve is put on the import path from this checkout.
#
#   OUT=/some/folder bash benchmarks/gpu_checks.sh
#
# Writes into "$OUT": env.txt (versions, device), gpu_tests.log (pytest -m gpu tests/kernels),
# kernel_bench.log (benchmarks/kernels.py table) and status.txt (exit code of each step).
set -uo pipefail
OUT="${OUT:?set OUT to the folder that receives the logs}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$OUT"
cd "$ROOT"

# The package-dir mapping (kvserve.kernels -> kernels/) needs an install or this shim: a
# throwaway `kvserve` package whose submodules point at the checkout's folders.
SHIM="$(mktemp -d)"
mkdir -p "$SHIM/kvserve"
cat > "$SHIM/kvserve/__init__.py" <<PY
# Submodules resolve against the checkout: kvserve.kernels -> $ROOT/kernels, and so on.
__path__ = ["$ROOT"]
PY
if ! python -c "import kvserve.kernels" >/dev/null 2>&1; then
  export PYTHONPATH="$SHIM:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi

{
  date -u
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__); print(torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv 2>/dev/null
} > "$OUT/env.txt" 2>&1

timeout 300 python -m pytest -m gpu tests/kernels -q -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
tests_rc=$?
timeout 240 python benchmarks/kernels.py --device cuda > "$OUT/kernel_bench.log" 2>&1
bench_rc=$?
printf 'gpu_tests %s\nkernel_bench %s\n' "$tests_rc" "$bench_rc" | tee "$OUT/status.txt"
tail -n 3 "$OUT/gpu_tests.log"
cat "$OUT/kernel_bench.log"
exit $(( tests_rc || bench_rc ))
