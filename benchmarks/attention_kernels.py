"""Decode attention: the paged kernels next to SDPA on contiguous K/V of the same size.

    python benchmarks/attention_kernels.py            # CUDA if present, else CPU
    python benchmarks/attention_kernels.py --device cpu

CUDA: Triton paged decode (bf16 and fp8 KV) at batch {1,16,64,256} x context {512,4096,32768}
for a Llama-3-8B-like layer (32 query heads, 8 KV heads, head_dim 128, block 16), reporting the
achieved bandwidth (KV bytes read / time) and its share of the device's peak.
CPU: decode at SmolLM2-135M's layer shape (9 query heads, 3 KV heads, head_dim 64, block 16) for
batch {1,16,64,256} x context {128,512,2048}, plus one mixed step (decodes beside a prompt chunk):
the C++ kernel that reads the cache in place (the serving path, unvalidated as the backend calls
it) against the plain-torch path (gathers each context, then two matmuls; validated, as it was
served before), interleaved in one process (A, B, A, B, ... the minimum of each), next to SDPA on
contiguous K/V of the same size. Run it on a quiet machine; `--threads 1` is steadier on a busy one.
Every paged case scatters its blocks in a random order, as a long-running server would.

    python benchmarks/attention_kernels.py --device cpu --calls [--context 128] [--baseline main~3] [--huge-pages]

--calls: what one layer's attention costs per call as the engine makes it (KV write + attention,
SmolLM2's shape, the first of --dtypes (bf16 by default; fp8: bf16 queries on an e4m3 cache),
--context-token contexts (default 128), decode steps of 1/16/64/256 rows and a mixed step of
16 decodes + one 512-token prompt), microseconds per layer call, interleaved in one process,
each call on the next of up to 30 layers' caches (K/V come from memory, as in a forward);
--huge-pages puts each cache on transparent huge pages, as the engine allocates it
(engine/huge_pages.py), where the OS grants them:
  served      TorchAttentionBackend as the engine holds it (unvalidated: straight to the C++ ops)
  python op   the same kernels through the Python custom op and entry point (how they were served
              before the backend called the C++ ops directly)
  C++ ops     the two C++ ops alone (write + attention)
  baseline    with --baseline REV: the C++ kernel source of git revision REV, built beside this
              one under its own op namespace (old vs new kernel in one run); "est. before/served"
              = (baseline + python op - C++ ops) / served: REV's kernel as it was served, against now
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.engine import huge_pages as huge_pages_module
from kvserve.kernels import FP8_KV_DTYPE, AttentionMetadata, TorchAttentionBackend, custom_ops, paged_attention
from kvserve.kernels.cpu_attention import cpu_kernel_available
from kvserve.kernels.cpu_kernel_build import SOURCE, build_library, default_cache_dir
from kvserve.kernels.torch_attention import torch_paged_attention

PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}  # HBM bandwidth by device name


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16

    def kv_bytes(self, element_size: int) -> int:
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * element_size


def make_paged_decode(shape: DecodeShape, dtype: torch.dtype, kv_dtype: torch.dtype, device: str):
    blocks_per_seq = -(-shape.context // shape.block_size)  # a partly filled last block too
    num_blocks = shape.batch * blocks_per_seq
    cache_shape = (num_blocks, shape.num_kv_heads, shape.block_size, shape.head_dim)
    key_cache = torch.randn(cache_shape, dtype=dtype, device=device).to(kv_dtype)
    value_cache = torch.randn(cache_shape, dtype=dtype, device=device).to(kv_dtype)
    block_tables = torch.randperm(num_blocks, device=device).view(shape.batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(shape.batch + 1, dtype=torch.int32, device=device)
    query = torch.randn(shape.batch, shape.num_heads, shape.head_dim, dtype=dtype, device=device)
    return query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, shape.head_dim**-0.5


def make_contiguous_sdpa(shape: DecodeShape, dtype: torch.dtype, device: str) -> Callable[[], torch.Tensor]:
    # GQA as SDPA sees it without repeating K/V: a KV head's query heads become its query rows.
    group = shape.num_heads // shape.num_kv_heads
    q = torch.randn(shape.batch, shape.num_kv_heads, group, shape.head_dim, dtype=dtype, device=device)
    k = torch.randn(shape.batch, shape.num_kv_heads, shape.context, shape.head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    return lambda: F.scaled_dot_product_attention(q, k, v)


def cpu_time_ms(fn: Callable[[], object], min_seconds: float = 0.3) -> float:
    """The fastest of repeated runs: on a CPU shared with other work the minimum is the cost of
    the code, while the median mostly measures the neighbours."""
    fn()  # warm-up
    samples = []
    deadline = time.perf_counter() + min_seconds
    while time.perf_counter() < deadline or len(samples) < 3:
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return min(samples)


def interleaved_ms(candidates: list[Callable[[], object]], rounds: int = 4) -> list[float]:
    """Each candidate's best time over `rounds` alternating passes: neighbours' load hits all alike.
    Every other pass runs them in reverse order: in a fixed order the first of two identical
    kernels read 20-30% faster than the second on a busy machine."""
    best = [float("inf")] * len(candidates)
    for round_index in range(rounds):
        order = range(len(candidates)) if round_index % 2 == 0 else reversed(range(len(candidates)))
        for index in order:
            best[index] = min(best[index], cpu_time_ms(candidates[index], min_seconds=0.1))
    return best


def make_mixed_step(dtype: torch.dtype, kv_dtype: torch.dtype, decodes: int, context: int, chunk: int):
    """`decodes` single-query requests of `context` tokens, then one fresh prompt chunk of `chunk`."""
    shape = DecodeShape(decodes + 1, context, 9, 3, 64)
    query, key_cache, value_cache, block_tables, seq_lens, _, scale = make_paged_decode(shape, dtype, kv_dtype, "cpu")
    query = torch.randn(decodes + chunk, 9, 64, dtype=dtype)
    seq_lens[-1] = chunk
    query_start_loc = torch.tensor([*range(decodes + 1), decodes + chunk], dtype=torch.int32)
    return query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale


BATCHES = (1, 16, 64, 256)
CONTEXTS = (128, 512, 2048)
CPU_DTYPES = {"float32": (torch.float32, torch.float32), "bfloat16": (torch.bfloat16, torch.bfloat16),
              "float16": (torch.float16, torch.float16), "fp8": (torch.bfloat16, FP8_KV_DTYPE)}


def run_cpu(dtype_names: list[str], batches: tuple[int, ...] = BATCHES, contexts: tuple[int, ...] = CONTEXTS) -> None:
    started = time.perf_counter()
    if not cpu_kernel_available():
        raise SystemExit("the C++ CPU attention kernel could not be built here (see the log line above)")
    print(f"CPU, {torch.get_num_threads()} threads; C++ kernel ready in {time.perf_counter() - started:.1f} s (first use compiles it once per machine)")
    print("decode, 9 q heads / 3 KV heads / head_dim 64 / block 16 (SmolLM2-135M, one layer); GB/s = KV bytes read / C++ time")
    print(f"{'dtype':>8} {'batch':>5} {'ctx':>5} | {'C++ ms':>8} {'torch ms':>9} {'SDPA ms':>8} | {'torch/C++':>9} {'C++ GB/s':>8}")
    for name in dtype_names:
        dtype, kv_dtype = CPU_DTYPES[name]
        cases = [(batch, context) for batch in batches for context in contexts]
        for batch, context in [*cases, ("mixed", 256)]:
            if batch == "mixed":  # 63 decodes and a 256-token prompt chunk, as a W64 step with a newcomer
                args = make_mixed_step(dtype, kv_dtype, 63, context, 256)
                shape, hints = DecodeShape(63, context, 9, 3, 64), dict(max_query_len=256, max_seq_len=context, num_decodes=63)
            else:
                shape = DecodeShape(batch, context, 9, 3, 64)
                args = make_paged_decode(shape, dtype, kv_dtype, "cpu")
                hints = dict(max_query_len=1, max_seq_len=context, num_decodes=batch)
            k_scale = dict(k_scale=1.0, v_scale=1.0) if kv_dtype == FP8_KV_DTYPE else {}
            native, torch_path = interleaved_ms([
                lambda a=args: paged_attention(*a, **hints, **k_scale, validate=False),
                lambda a=args: torch_paged_attention(*a, **hints, **k_scale),
            ])
            sdpa = cpu_time_ms(make_contiguous_sdpa(shape, dtype, "cpu"), min_seconds=0.1)
            gbps = shape.kv_bytes(kv_dtype.itemsize) / native / 1e6
            print(f"{name:>8} {batch:>5} {context:>5} | {native:>8.3f} {torch_path:>9.3f} {sdpa:>8.3f} | {torch_path / native:>9.2f} {gbps:>8.1f}", flush=True)
            del args


def load_baseline(revision: str) -> object:
    """The kernel source of git `revision`, built (cached like the kernel) and loaded as the op
    namespace kvserve_cpu_baseline; returns torch.ops.kvserve_cpu_baseline."""
    relative = SOURCE.relative_to(SOURCE.parents[2])
    text = subprocess.run(["git", "show", f"{revision}:{relative}"], cwd=SOURCE.parents[2], check=True,
                          capture_output=True, text=True, timeout=60).stdout
    for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_IMPL"):
        text = text.replace(f"{macro}(kvserve_cpu,", f"{macro}(kvserve_cpu_baseline,")
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "cpu_paged_attention_baseline.cpp"
        source.write_text(text)
        torch.ops.load_library(str(build_library(default_cache_dir(), source=source).library))
    return torch.ops.kvserve_cpu_baseline


def make_engine_step(decodes: int, context: int, prompt: int, dtype: torch.dtype = torch.bfloat16,
                     kv_dtype: torch.dtype | None = None, huge_pages: bool = False):
    """One layer's inputs as the engine passes them: `decodes` single-query requests with
    `context` tokens, then (if `prompt`) one fresh prompt of `prompt` tokens; queries in `dtype`,
    the cache in `kv_dtype` (default: `dtype`), on huge pages if asked, SmolLM2's shape. Returns
    (key, value, slot_mapping, attention args, hints)."""
    shape = DecodeShape(decodes + (1 if prompt else 0), max(context, prompt), 9, 3, 64)
    query, key_cache, value_cache, block_tables, seq_lens, _, scale = make_paged_decode(shape, dtype, kv_dtype or dtype, "cpu")
    if huge_pages:
        key_cache = huge_pages_module.zeros(tuple(key_cache.shape), key_cache.dtype, "cpu").copy_(key_cache)
        value_cache = huge_pages_module.zeros(tuple(value_cache.shape), value_cache.dtype, "cpu").copy_(value_cache)
    seq_lens[:decodes] = context
    q_lens = [1] * decodes + ([prompt] if prompt else [])
    if prompt:
        seq_lens[-1] = prompt
    query = torch.randn(sum(q_lens), 9, 64, dtype=dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(length - q, length) for q, length in zip(q_lens, seq_lens.tolist(), strict=True)])
    rows = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    slots = block_tables[rows, positions // 16].long() * 16 + positions % 16
    key = torch.randn(sum(q_lens), 3, 64, dtype=dtype)
    hints = dict(max_query_len=max(q_lens), max_seq_len=int(seq_lens.max()), num_decodes=decodes)
    return key, torch.randn_like(key), slots, (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale), hints


CALL_CACHE_BUDGET = 512 << 20  # bytes of KV cache the per-call table cycles through


def run_cpu_calls(baseline: str | None, context: int = 128, dtype: torch.dtype = torch.bfloat16,
                  kv_dtype: torch.dtype | None = None, huge_pages: bool = False) -> None:
    if not cpu_kernel_available():
        raise SystemExit("the C++ CPU attention kernel could not be built here (see the log line above)")
    old = load_baseline(baseline) if baseline else None
    backend = TorchAttentionBackend(validate=False)
    print(f"CPU, {torch.get_num_threads()} threads: one layer's KV write + attention per call, us (min of interleaved runs); "
          f"SmolLM2 shape, {str(dtype).removeprefix('torch.')} queries, {str(kv_dtype or dtype).removeprefix('torch.')} cache, "
          f"{context}-token contexts" + ("; caches on huge pages" if huge_pages else "") + (f"; baseline = kernel at {baseline}" if baseline else ""))
    print("Calls cycle through up to 30 layers' caches (at most 512 MB), so K/V come from memory as in a forward.")
    columns = ["layers", "served", "python op", "C++ ops"] + (["baseline"] if old else [])
    # Before this change the engine ran the baseline kernel through the Python op: estimated as
    # baseline + (python op - C++ ops).
    print(f"{'step':>23} | " + " ".join(f"{c:>10}" for c in columns) + (" | est. before/served" if old else ""))
    for label, decodes, prompt in [("decode x1", 1, 0), ("decode x16", 16, 0), ("decode x64", 64, 0), ("decode x256", 256, 0),
                                   ("16 decode + 512 prefill", 16, 512)]:
        steps = [make_engine_step(decodes, context, prompt, dtype, kv_dtype, huge_pages)]
        layer_bytes = 2 * steps[0][3][1].nbytes
        while len(steps) < min(30, CALL_CACHE_BUDGET // layer_bytes):
            steps.append(make_engine_step(decodes, context, prompt, dtype, kv_dtype, huge_pages))
        turn = iter(range(1 << 62))
        # The engine builds a step's metadata once for all its layers: not part of a layer call.
        metas = [backend.prepare(AttentionMetadata(slots, args[3], args[4], args[5], **hints))
                 for _, _, slots, args, hints in steps]

        def served() -> None:
            i = next(turn) % len(steps)
            key, value, _, (query, key_cache, value_cache, *_, scale), _ = steps[i]
            backend.write_kv_cache(key, value, (key_cache, value_cache), metas[i])
            backend.paged_attention(query, (key_cache, value_cache), metas[i], scale)

        def python_op() -> None:
            key, value, slots, args, hints = steps[next(turn) % len(steps)]
            custom_ops.torch_write_kv_cache(key, value, args[1], args[2], slots, None, None, None, None, False)
            custom_ops.torch_paged_attention(*args, hints["max_query_len"], hints["max_seq_len"], decodes, None, None, 0, 0.0,
                                             None, None, False)

        def ops(namespace=torch.ops.kvserve_cpu) -> None:
            key, value, slots, (query, key_cache, value_cache, tables, seq_lens, starts, scale), _ = steps[next(turn) % len(steps)]
            namespace.write_kv_cache(key, value, key_cache, value_cache, slots, 1.0, 1.0)
            namespace.paged_attention(query, key_cache, value_cache, tables, seq_lens, starts, scale, 1.0)

        candidates = [served, python_op, ops] + ([lambda: ops(old)] if old else [])
        times = [ms * 1e3 for ms in interleaved_ms(candidates, rounds=6)]
        ratio = f" | {(times[3] + times[1] - times[2]) / times[0]:>18.2f}" if old else ""
        print(f"{label:>23} | {len(steps):>10} " + " ".join(f"{t:>10.1f}" for t in times) + ratio, flush=True)
        del steps


def run_cuda(peak_gbps: float | None) -> None:
    import triton.testing

    from kvserve.kernels.triton_attention import triton_paged_attention

    name = torch.cuda.get_device_name()
    peak = peak_gbps or next((gbps for key, gbps in PEAK_GBPS.items() if key in name), None)
    print(f"{name}: decode, 32 q heads / 8 KV heads / head_dim 128 / block 16, bf16 queries; GB/s = KV bytes read / time")
    print(f"peak HBM bandwidth assumed: {peak or 'unknown (pass --peak-gbps)'} GB/s")
    header = f"{'batch':>5} {'ctx':>6} | {'triton bf16 us':>14} {'GB/s':>7} {'%peak':>6} | {'triton fp8 us':>13} {'GB/s':>7} {'%peak':>6} | {'SDPA us':>8} {'GB/s':>7} {'%peak':>6}"
    print(header)

    def pct(gbps: float) -> str:
        return f"{100 * gbps / peak:>5.1f}%" if peak else f"{'-':>6}"

    for batch in (1, 16, 64, 256):
        for context in (512, 4096, 32768):
            shape = DecodeShape(batch, context, 32, 8, 128)
            cells = []
            for kv_dtype in (torch.bfloat16, FP8_KV_DTYPE):
                args = make_paged_decode(shape, torch.bfloat16, kv_dtype, "cuda")
                seconds = triton.testing.do_bench(lambda a=args: triton_paged_attention(*a, max_query_len=1, max_seq_len=context)) * 1e-3
                gbps = shape.kv_bytes(kv_dtype.itemsize) / seconds / 1e9
                cells.append((seconds * 1e6, gbps))
                del args
                torch.cuda.empty_cache()
            sdpa = make_contiguous_sdpa(shape, torch.bfloat16, "cuda")
            seconds = triton.testing.do_bench(sdpa) * 1e-3
            cells.append((seconds * 1e6, shape.kv_bytes(2) / seconds / 1e9))
            del sdpa
            torch.cuda.empty_cache()
            (t_bf16, g_bf16), (t_fp8, g_fp8), (t_sdpa, g_sdpa) = cells
            print(f"{batch:>5} {context:>6} | {t_bf16:>14.1f} {g_bf16:>7.0f} {pct(g_bf16)} | {t_fp8:>13.1f} {g_fp8:>7.0f} {pct(g_fp8)} | {t_sdpa:>8.1f} {g_sdpa:>7.0f} {pct(g_sdpa)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--peak-gbps", type=float, default=None, help="the device's peak memory bandwidth, if not an H100/H200/A100")
    parser.add_argument("--dtypes", default="bfloat16", help=f"CPU only: comma-separated, of {', '.join(CPU_DTYPES)} (fp8: bf16 queries, e4m3 cache)")
    parser.add_argument("--quick", action="store_true", help="CPU only: batch 16 and 64 at context 128 and 512, and the mixed step")
    parser.add_argument("--calls", action="store_true", help="CPU only: the per-call table (see above) instead of the decode sweep")
    parser.add_argument("--context", type=int, default=128, help="CPU --calls only: each decoding request's context length")
    parser.add_argument("--huge-pages", action="store_true", help="CPU --calls only: caches on transparent huge pages, as the engine's")
    parser.add_argument("--baseline", default=None, help="CPU --calls only: a git revision whose kernel to time beside this one")
    parser.add_argument("--threads", type=int, default=None, help="CPU only: torch threads (1 is steadier on a busy machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    if device == "cuda":
        run_cuda(args.peak_gbps)
    elif args.calls:
        dtype, kv_dtype = CPU_DTYPES[args.dtypes.split(",")[0]]
        run_cpu_calls(args.baseline, args.context, dtype, kv_dtype, args.huge_pages)
    else:
        run_cpu(args.dtypes.split(","), *(((16, 64), (128, 512)) if args.quick else ()))


if __name__ == "__main__":
    main()
