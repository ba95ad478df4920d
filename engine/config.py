"""The engine's settings: one frozen, self-validating dataclass; nothing here does I/O."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

from kvserve.engine.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from kvserve.paging import SUPPORTED_BLOCK_SIZES
from kvserve.scheduler import SchedulingPolicy

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
# auto: the model's dtype; fp8: e4m3 with per-tensor scales; int8: a scale per token and KV head.
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
SUPPORTED_QUANTIZATIONS = ("int8", "int4")  # weight-only, CPU (engine/quantization)
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """A setting is invalid; `option` names it as the CLI spells it."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, the faster measured choice on CPU
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    attention_backend: str = "auto"  # auto | torch | triton
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES: auto (= dtype) | fp8 | int8
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 128
    # Tokens per engine step (prefill chunks + decodes); None: by device (engine/step_tokens.py),
    # resolved when the engine is built.
    max_num_batched_tokens: int | None = None
    scheduling_policy: str = "fcfs"  # fcfs: arrival order | priority: a request's priority, then arrival
    long_prefill_token_threshold: int = 0  # most prompt tokens one request computes per step (0: no cap)
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes, over all tensor-parallel ranks together
    enable_prefix_caching: bool = True
    # Skip torch.compile and run the model eagerly (vLLM's name). Compiling applies on CPU only
    # so far (every tensor-parallel rank alike); CUDA runs eagerly either way.
    enforce_eager: bool = False
    seed: int = 0
    quantization: str | None = None  # None (the model dtype) | int8 | int4: weight-only, applied after loading
    cpu_threads: int | None = None  # torch intra-op threads; None: OMP_NUM_THREADS or the CPUs this process may use
    tensor_parallel_size: int = 1  # processes sharing each layer (engine/parallel); 1: no workers
    # Speculative decoding (engine/spec_decode): a SpeculativeConfig, or its dict / JSON text as
    # vLLM's speculative_config; None: off.
    speculative_config: SpeculativeConfig | None = None
    # Jump-forward decoding: text a request's grammar forces is appended in the tokenizer's own
    # tokens, at once, instead of being sampled token by token.
    jump_forward: bool = True

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        except SpeculativeConfigError as error:
            raise ConfigError("--speculative-config", f"--speculative-config: {error}") from None
        if self.dtype not in SUPPORTED_DTYPES:
            raise ConfigError("--dtype", f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}")
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ConfigError("--block-size", f"block size must be one of {SUPPORTED_BLOCK_SIZES}, got {self.block_size}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError("--attention-backend", f"attention backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError("--kv-cache-dtype", f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                                  f"got {self.kv_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in SUPPORTED_QUANTIZATIONS:
            raise ConfigError("--quantization", f"quantization must be one of {', '.join(SUPPORTED_QUANTIZATIONS)}, "
                                                f"got {self.quantization!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError("--cpu-threads", f"--cpu-threads must be at least 1, got {self.cpu_threads}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError("--device", f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for option, value in (("--max-num-seqs", self.max_num_seqs), ("--max-num-batched-tokens", self.max_num_batched_tokens),
                              ("--tensor-parallel-size", self.tensor_parallel_size)):
            if value is not None and value < 1:
                raise ConfigError(option, f"{option} must be at least 1, got {value}")
        policies = tuple(policy.value for policy in SchedulingPolicy)
        if self.scheduling_policy not in policies:
            raise ConfigError("--scheduling-policy", f"scheduling policy must be one of {', '.join(policies)}, "
                                                     f"got {self.scheduling_policy!r}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("--long-prefill-token-threshold",
                              f"--long-prefill-token-threshold must be at least 0, got {self.long_prefill_token_threshold}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("--max-model-len", f"--max-model-len must be at least 1, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError("--num-kv-blocks", f"--num-kv-blocks must be at least 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ConfigError("--kv-cache-memory", f"--kv-cache-memory must be positive, got {self.kv_cache_memory}")

    @property
    def model_name(self) -> str:
        """The name clients use in requests and see in responses: --served-model-name, else the
        model's own name. A path is served under its file stem (a folder under its name), as
        llama.cpp's server does: `/models/llama-3-8b.Q4_K_M.gguf` is "llama-3-8b.Q4_K_M", not a
        container-specific path that every client would have to repeat."""
        if self.served_model_name:
            return self.served_model_name
        path = PurePath(self.model)
        return (path.stem if path.suffix == ".gguf" else path.name) or self.model
