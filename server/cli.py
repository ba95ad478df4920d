"""The `kvserve` console script: `kvserve serve ...` and `kvserve kv-size ...`.

Serve flags are named as vLLM names them. Every serve flag can also be set from the environment
as KVSERVE_<FLAG> (e.g. KVSERVE_MAX_MODEL_LEN=4096, KVSERVE_ENABLE_PREFIX_CACHING=false); a flag
on the command line wins. Every value is checked, and the configs are built, before the model
loads: a bad value prints a clear message and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from kvserve.engine import (
    DEFAULT_MODEL, KV_CACHE_DTYPES, SUPPORTED_BLOCK_SIZES, SUPPORTED_DTYPES, SUPPORTED_QUANTIZATIONS, ConfigError, EngineConfig,
    ModelNotFoundError, check_tensor_parallel, load_model_config, parse_memory_size, resolve_model,
)
from kvserve.server import kv_size_command
from kvserve.server.limits import ServerLimits
from kvserve.server.reasoning import REASONING_PARSERS
from kvserve.server.settings import LOG_LEVELS, ServerSettings
from kvserve.server.tool_parsers import TOOL_CALL_PARSERS

ENV_PREFIX = "KVSERVE_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default, unless there is none or its help already says what it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default is None or "(default:" in help_text:
            return help_text
        return super()._get_help_string(action)


def main(argv: Sequence[str] | None = None) -> int:
    parser, serve_parser, serve_actions = build_parser()
    apply_environment(serve_parser, serve_actions, os.environ)
    args = parser.parse_args(argv)
    if args.command == "kv-size":
        return kv_size_command.run(args)
    engine_config, settings = configs_from_args(serve_parser, args)
    # Imported here so `kvserve --help` and bad flags answer without importing torch and uvicorn.
    from kvserve.server.serve import run_server

    return run_server(engine_config, settings)


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, list[argparse.Action]]:
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: an LLM inference server with a paged KV cache.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{serve,kv-size}")
    serve_parser = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Run the OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/responses, "
                    "/v1/messages, /v1/models, "
                    "/health, /metrics, /tokenize, /detokenize).",
        epilog=f"Every option can also be set by an environment variable {ENV_PREFIX}<OPTION>, e.g. "
               f"{ENV_PREFIX}MAX_MODEL_LEN=4096 or {ENV_PREFIX}ENABLE_PREFIX_CACHING=false; a flag given on the "
               "command line wins. On SIGTERM the server stops admitting (503), lets in-flight requests finish "
               "within --shutdown-grace-period, aborts the rest and exits 0.",
        formatter_class=_DefaultsHelpFormatter)
    actions = _add_serve_options(serve_parser)
    kv_size_command.add_parser(subparsers)
    return parser, serve_parser, actions


def _add_serve_options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    defaults = EngineConfig()
    server = ServerSettings()
    limits = ServerLimits()
    flag = argparse.BooleanOptionalAction
    model = p.add_argument_group("model")
    cache = p.add_argument_group("KV cache and batching")
    http = p.add_argument_group("HTTP")
    caps = p.add_argument_group("per-request caps (a single request must not exhaust the server)")
    tools = p.add_argument_group("tool calls and reasoning")
    return [
        model.add_argument("--model", default=defaults.model,
                           help=f"{DEFAULT_MODEL!r} (bundled), a .gguf file or a local Hugging Face directory"),
        model.add_argument("--served-model-name", default=None,
                           help="the name clients pass as 'model' and see in responses (default: --model)"),
        model.add_argument("--dtype", choices=SUPPORTED_DTYPES, default=defaults.dtype,
                           help="weights and activations dtype; auto: bfloat16 on CUDA, on CPUs with bf16 arithmetic "
                                "(AVX-512 BF16, AMX) and on other AVX-512 CPUs (kvserve's bf16 kernel), float32 on "
                                "AVX2-only x86 CPUs: the faster of the two"),
        model.add_argument("--device", default=defaults.device, help="auto, cpu, cuda or cuda:N"),
        model.add_argument("--attention-backend", choices=("auto", "torch", "triton"), default=defaults.attention_backend,
                           help="paged-attention implementation"),
        model.add_argument("--quantization", choices=SUPPORTED_QUANTIZATIONS, default=None,
                           help="weight-only quantization of the linear layers, on CPU: int8 (per channel) or int4 "
                                "(groups of 32), on kvserve's VNNI kernels where the CPU has AVX-512 VNNI; faster for few "
                                "concurrent streams (default: none, the --dtype weights)"),
        model.add_argument("--cpu-threads", type=_positive_int, default=None,
                           help="torch intra-op threads (default: $OMP_NUM_THREADS if set, else the CPUs this process "
                                "may use: its affinity mask, capped by its cgroup CPU quota)"),
        model.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=defaults.tensor_parallel_size,
                           help="processes that split each layer (Megatron-style): heads and KV cache divided "
                                "among them; must divide the model's attention and KV heads"),
        model.add_argument("--enforce-eager", action=flag, default=defaults.enforce_eager,
                           help="run the model eagerly instead of compiling it with torch.compile at start-up "
                                "(compiled artifacts are cached under $KVSERVE_CACHE, default ~/.cache/kvserve)"),
        model.add_argument("--seed", type=_non_negative_int, default=defaults.seed,
                           help="seed for requests that do not give one"),
        model.add_argument("--enable-jump-forward", action=flag, default=defaults.jump_forward,
                           help="append text a request's grammar forces (a tool-call wrapper, a JSON key) in the "
                                "tokenizer's own tokens at once instead of sampling it token by token "
                                "(jump-forward decoding; --no-enable-jump-forward: sample every token)"),
        model.add_argument("--speculative-config", default=None, metavar="JSON",
                           help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4, '
                                '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (prompt lookup: drafts copied from '
                                'where the text last repeated; greedy output unchanged) plus optional '
                                '"disable_by_batch_size": N (no drafts while more than N requests run)'),
        cache.add_argument("--block-size", type=int, choices=SUPPORTED_BLOCK_SIZES, default=defaults.block_size,
                           help="tokens per KV-cache block"),
        cache.add_argument("--max-model-len", type=_positive_int, default=None,
                           help="longest prompt + completion in tokens (default: the model's context length)"),
        cache.add_argument("--max-num-seqs", type=_positive_int, default=defaults.max_num_seqs,
                           help="most requests running in one batch"),
        cache.add_argument("--max-num-batched-tokens", type=_positive_int, default=defaults.max_num_batched_tokens,
                           help="token budget of one engine step (prefill chunks + decodes); default: 2048 on "
                                "a GPU; on a CPU with AMX serving bf16 768 per thread between 1536 and 2048; on "
                                "other CPUs 256 per thread between 512 and 2048 (a CPU step's time grows with its "
                                "tokens), at least --max-num-seqs"),
        cache.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=defaults.scheduling_policy,
                           help="order of admission: fcfs (arrival) or priority (the request's 'priority' field, "
                                "lower first, then arrival; preemption takes the lowest priority first)"),
        cache.add_argument("--long-prefill-token-threshold", type=_non_negative_int,
                           default=defaults.long_prefill_token_threshold,
                           help="most prompt tokens one request computes per step, so a long prompt does not take "
                                "a whole step from the prompts behind it (0: no cap)"),
        cache.add_argument("--num-kv-blocks", type=_positive_int, default=None,
                           help="KV-cache blocks to allocate (overrides --kv-cache-memory)"),
        cache.add_argument("--kv-cache-memory", type=_byte_size, default=None, metavar="SIZE",
                           help="memory for the KV cache, e.g. 4GiB, 512MB or bytes (default: sized from free memory)"),
        cache.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=defaults.kv_cache_dtype,
                           help="KV-cache element type; auto follows --dtype, fp8 is e4m3 with per-tensor scales, "
                                "int8 has a scale per token and KV head"),
        cache.add_argument("--enable-prefix-caching", action=flag, default=defaults.enable_prefix_caching,
                           help="reuse the KV blocks of shared prompt prefixes"),
        http.add_argument("--host", default=server.host, help="address to bind (0.0.0.0 for all interfaces)"),
        http.add_argument("--port", type=_port, default=server.port, help="port to bind (0: any free port)"),
        http.add_argument("--api-key", default=None,
                          help="require 'Authorization: Bearer <key>' (or 'x-api-key: <key>') on every route but /health, "
                               "/metrics, /version and the API docs (also KVSERVE_API_KEY)"),
        http.add_argument("--max-queued-requests", type=_non_negative_int, default=server.max_queued_requests,
                          help="sequences that may wait beyond --max-num-seqs; past that, 503 + Retry-After"),
        http.add_argument("--max-connections", type=_positive_int, default=server.max_connections,
                          help="most open HTTP connections; one more is answered 503 and closed at once (keep it "
                               "below the process's file-descriptor limit, ulimit -n)"),
        http.add_argument("--header-timeout", type=_positive_float, default=server.header_timeout, metavar="SECONDS",
                          help="a connection that has not sent a request's complete headers this long after it "
                               "opened (or after its first byte following a keep-alive pause) is closed (408)"),
        http.add_argument("--shutdown-grace-period", type=_non_negative_float, default=server.shutdown_grace_period,
                          metavar="SECONDS", help="on SIGTERM, how long in-flight requests may take to finish"),
        http.add_argument("--log-level", choices=LOG_LEVELS, default=server.log_level, help="logging verbosity"),
        tools.add_argument("--enable-auto-tool-choice", action=flag, default=server.enable_auto_tool_choice,
                           help='accept tool_choice "auto" (the default when a request gives tools): the model '
                                "decides whether to call, and its calls are parsed from its text by "
                                "--tool-call-parser; without it such requests get a 400"),
        tools.add_argument("--tool-call-parser", choices=tuple(TOOL_CALL_PARSERS), default=None,
                           help="how the model family writes a call: hermes (Hermes, Qwen: <tool_call>{...}"
                                "</tool_call>), llama3_json (Llama 3.x: JSON, optionally after <|python_tag|>, "
                                "several separated by ;), mistral ([TOOL_CALLS][{...}], or name[ARGS]{...} per "
                                "[TOOL_CALLS] from tokenizer v11)"),
        tools.add_argument("--reasoning-parser", choices=tuple(REASONING_PARSERS), default=None,
                           help="split a reasoning model's <think>...</think> from its answer (message.reasoning, "
                                "Responses reasoning items, Messages thinking blocks); tool calls and output "
                                "grammars apply to the answer: deepseek_r1 (the output starts inside the reasoning) "
                                "or qwen3 (the output opens <think> itself, or the prompt does)"),
        http.add_argument("--enable-responses-store", action=flag, default=server.enable_responses_store,
                          help="keep finished /v1/responses in memory for previous_response_id and "
                               "GET/DELETE /v1/responses/{id}; off, those get a 400"),
        http.add_argument("--responses-store-max-responses", type=_positive_int,
                          default=server.responses_store_max_responses,
                          help="most stored responses (least recently used dropped first)"),
        http.add_argument("--responses-store-max-bytes", type=_byte_size, default=server.responses_store_max_bytes,
                          metavar="SIZE", help="most memory the stored responses take, as their JSON"),
        caps.add_argument("--max-n", type=_positive_int, default=limits.max_n, help="largest n per request"),
        caps.add_argument("--max-logprobs", type=_non_negative_int, default=limits.max_logprobs,
                          help="largest logprobs / top_logprobs"),
        caps.add_argument("--max-stop-strings", type=_positive_int, default=limits.max_stop_strings,
                          help="most stop strings (and stop_token_ids) per request"),
        caps.add_argument("--max-stop-string-length", type=_positive_int, default=limits.max_stop_string_length,
                          help="longest stop string, in characters"),
        caps.add_argument("--max-tokens-per-request", type=_positive_int, default=limits.max_tokens,
                          help="most tokens one completion may have: a larger max_tokens is refused, an omitted "
                               "one capped here"),
        caps.add_argument("--max-prompts-per-request", type=_positive_int, default=limits.max_prompts_per_request,
                          help="most prompts in one /v1/completions request"),
        caps.add_argument("--max-logit-bias", type=_positive_int, default=limits.max_logit_bias,
                          help="most logit_bias entries per request"),
        caps.add_argument("--max-request-body-bytes", type=_byte_size, default=limits.max_body_bytes, metavar="SIZE",
                          help="largest request body (413 beyond it)"),
    ]


def env_name(action: argparse.Action) -> str:
    long_flag = next(s for s in action.option_strings if s.startswith("--"))
    return ENV_PREFIX + long_flag[2:].upper().replace("-", "_")


def apply_environment(parser: argparse.ArgumentParser, actions: Sequence[argparse.Action],
                      environ: Mapping[str, str]) -> None:
    """KVSERVE_<OPTION> values become the options' defaults, checked exactly like flags."""
    for action in actions:
        name = env_name(action)
        raw = environ.get(name)
        if raw is None:
            continue
        try:
            value = _convert_env(action, raw)
        except (ValueError, argparse.ArgumentTypeError) as error:
            parser.error(f"environment variable {name}={raw!r}: {error}")
        parser.set_defaults(**{action.dest: value})


def _convert_env(action: argparse.Action, raw: str) -> object:
    if isinstance(action, argparse.BooleanOptionalAction):
        if raw.strip().lower() in _TRUE:
            return True
        if raw.strip().lower() in _FALSE:
            return False
        raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")
    value = action.type(raw) if callable(action.type) else raw
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"invalid choice; choose from {', '.join(map(str, action.choices))}")
    return value


def configs_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[EngineConfig, ServerSettings]:
    """Builds (and so validates) both configs; any bad value exits with status 2 here."""
    try:
        engine_config = EngineConfig(
            model=args.model, served_model_name=args.served_model_name, dtype=args.dtype, device=args.device,
            attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
            block_size=args.block_size, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, scheduling_policy=args.scheduling_policy,
            long_prefill_token_threshold=args.long_prefill_token_threshold, num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=args.enable_prefix_caching,
            enforce_eager=args.enforce_eager, seed=args.seed, quantization=args.quantization, cpu_threads=args.cpu_threads,
            tensor_parallel_size=args.tensor_parallel_size, speculative_config=args.speculative_config,
            jump_forward=args.enable_jump_forward)
        limits = ServerLimits(
            max_n=args.max_n, max_logprobs=args.max_logprobs, max_stop_strings=args.max_stop_strings,
            max_stop_string_length=args.max_stop_string_length, max_tokens=args.max_tokens_per_request,
            max_prompts_per_request=args.max_prompts_per_request, max_body_bytes=args.max_request_body_bytes,
            max_logit_bias=args.max_logit_bias)
        settings = ServerSettings(
            host=args.host, port=args.port, api_key=args.api_key, max_queued_requests=args.max_queued_requests,
            shutdown_grace_period=args.shutdown_grace_period, max_connections=args.max_connections,
            header_timeout=args.header_timeout, log_level=args.log_level, limits=limits,
            enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser, enable_responses_store=args.enable_responses_store,
            responses_store_max_responses=args.responses_store_max_responses,
            responses_store_max_bytes=args.responses_store_max_bytes)
    except ConfigError as error:
        parser.error(f"{error.option}: {error}")
    if args.model != DEFAULT_MODEL:  # the default is resolved (and fetched if need be) at load time
        try:
            resolve_model(args.model)
        except ModelNotFoundError as error:
            parser.error(f"--model: {error}")
    if engine_config.tensor_parallel_size > 1:
        _check_tensor_parallel(parser, engine_config)
    return engine_config, settings


def _check_tensor_parallel(parser: argparse.ArgumentParser, config: EngineConfig) -> None:
    """A size that does not divide the model's heads is a usage error (exit 2), found from the
    model's metadata before any weight loads or worker starts."""
    try:
        check_tensor_parallel(load_model_config(resolve_model(config.model).path), config.tensor_parallel_size)
    except ConfigError as error:
        parser.error(f"{error.option}: {error}")
    except ModelNotFoundError as error:
        parser.error(f"--model: {error}")


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in [0, 65535], got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def _byte_size(text: str) -> int:
    try:
        return parse_memory_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


if __name__ == "__main__":
    sys.exit(main())
