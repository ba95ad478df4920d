"""`kvserve` flags and KVSERVE_* variables: mapped onto the configs, bad values exit 2 before
anything loads."""

from __future__ import annotations

import pytest

from kvserve.server.cli import apply_environment, build_parser, configs_from_args, main


def configs(argv: list[str], environ: dict[str, str] | None = None):
    parser, serve_parser, actions = build_parser()
    apply_environment(serve_parser, actions, environ or {})
    return configs_from_args(serve_parser, parser.parse_args(["serve", *argv]))


def test_defaults() -> None:
    engine, settings = configs([])
    assert (engine.model, engine.dtype, engine.block_size) == ("SmolLM2-135M-Instruct", "auto", 16)
    assert (settings.host, settings.port, settings.api_key) == ("127.0.0.1", 8000, None)


def test_flags_map_onto_configs() -> None:
    engine, settings = configs([
        "--served-model-name", "smol", "--dtype", "float32", "--device", "cpu", "--block-size", "32",
        "--max-model-len", "2048", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
        "--num-kv-blocks", "100", "--kv-cache-memory", "1GiB", "--no-enable-prefix-caching",
        "--host", "0.0.0.0", "--port", "9000", "--api-key", "k", "--max-queued-requests", "5",
        "--shutdown-grace-period", "2.5", "--log-level", "debug", "--max-n", "3", "--max-request-body-bytes", "1MB"])
    assert engine.model_name == "smol" and engine.dtype == "float32" and engine.block_size == 32
    assert (engine.max_model_len, engine.max_num_seqs, engine.max_num_batched_tokens) == (2048, 8, 512)
    assert (engine.num_kv_blocks, engine.kv_cache_memory, engine.enable_prefix_caching) == (100, 2**30, False)
    assert (settings.host, settings.port, settings.api_key, settings.max_queued_requests) == ("0.0.0.0", 9000, "k", 5)
    assert settings.shutdown_grace_period == 2.5 and settings.log_level == "debug"
    assert settings.limits.max_n == 3 and settings.limits.max_body_bytes == 10**6


def test_environment_sets_every_option_and_flags_win() -> None:
    env = {"KVSERVE_MAX_MODEL_LEN": "1024", "KVSERVE_API_KEY": "from-env", "KVSERVE_ENABLE_PREFIX_CACHING": "false",
           "KVSERVE_PORT": "7000", "KVSERVE_HOST": "0.0.0.0", "KVSERVE_SHUTDOWN_GRACE_PERIOD": "3"}
    engine, settings = configs(["--port", "7001"], env)
    assert engine.max_model_len == 1024 and engine.enable_prefix_caching is False
    assert settings.api_key == "from-env" and settings.host == "0.0.0.0" and settings.port == 7001
    assert settings.shutdown_grace_period == 3.0


def test_quantization_and_threads_from_flags_and_environment() -> None:
    engine, _ = configs(["--quantization", "int4", "--cpu-threads", "3"])
    assert (engine.quantization, engine.cpu_threads) == ("int4", 3)
    engine, _ = configs([], {"KVSERVE_QUANTIZATION": "int8", "KVSERVE_CPU_THREADS": "2"})
    assert (engine.quantization, engine.cpu_threads) == ("int8", 2)
    engine, _ = configs([])
    assert (engine.quantization, engine.cpu_threads) == (None, None)


def test_kv_cache_dtype_choices_reach_the_engine_config() -> None:
    for choice in ("auto", "fp8", "int8"):
        assert configs(["--kv-cache-dtype", choice])[0].kv_cache_dtype == choice
    assert configs([], {"KVSERVE_KV_CACHE_DTYPE": "int8"})[0].kv_cache_dtype == "int8"


def test_scheduling_flags_reach_the_engine_config() -> None:
    engine, _ = configs(["--scheduling-policy", "priority", "--long-prefill-token-threshold", "256"])
    assert (engine.scheduling_policy, engine.long_prefill_token_threshold) == ("priority", 256)
    engine, _ = configs([], {"KVSERVE_SCHEDULING_POLICY": "priority"})
    assert engine.scheduling_policy == "priority"
    engine, _ = configs([])
    assert (engine.scheduling_policy, engine.long_prefill_token_threshold) == ("fcfs", 0)


def test_enforce_eager_from_flag_or_environment() -> None:
    assert configs([])[0].enforce_eager is False
    assert configs(["--enforce-eager"])[0].enforce_eager is True
    assert configs([], {"KVSERVE_ENFORCE_EAGER": "true"})[0].enforce_eager is True
    assert configs(["--no-enforce-eager"], {"KVSERVE_ENFORCE_EAGER": "1"})[0].enforce_eager is False


def test_tool_call_flags_reach_the_settings() -> None:
    settings = configs(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])[1]
    assert (settings.enable_auto_tool_choice, settings.tool_call_parser) == (True, "llama3_json")
    assert settings.auto_tool_parser is not None
    settings = configs(["--tool-call-parser", "mistral"])[1]  # a parser alone does not enable "auto"
    assert settings.auto_tool_parser is None
    settings = configs([], {"KVSERVE_ENABLE_AUTO_TOOL_CHOICE": "1", "KVSERVE_TOOL_CALL_PARSER": "hermes"})[1]
    assert settings.auto_tool_parser is not None


def test_every_serve_option_has_an_environment_variable() -> None:
    from kvserve.server.cli import env_name

    _, _, actions = build_parser()
    names = {env_name(a) for a in actions}
    assert {"KVSERVE_MODEL", "KVSERVE_MAX_NUM_SEQS", "KVSERVE_API_KEY", "KVSERVE_LOG_LEVEL"} <= names
    assert len(names) == len(actions)


@pytest.mark.parametrize("argv,env,needle", [
    (["--block-size", "7"], {}, "--block-size"),
    (["--port", "70000"], {}, "port"),
    (["--max-model-len", "0"], {}, "positive"),
    (["--dtype", "int3"], {}, "--dtype"),
    (["--device", "tpu"], {}, "--device"),
    (["--kv-cache-memory", "lots"], {}, "memory size"),
    (["--shutdown-grace-period", "-1"], {}, "grace"),
    (["--api-key", " "], {}, "--api-key"),
    (["--model", "/no/such/model.gguf"], {}, "--model"),
    (["--log-level", "loud"], {}, "--log-level"),
    ([], {"KVSERVE_MAX_NUM_SEQS": "lots"}, "KVSERVE_MAX_NUM_SEQS"),
    ([], {"KVSERVE_ENABLE_PREFIX_CACHING": "maybe"}, "KVSERVE_ENABLE_PREFIX_CACHING"),
    ([], {"KVSERVE_DTYPE": "int3"}, "KVSERVE_DTYPE"),
    (["--quantization", "int3"], {}, "--quantization"),
    (["--kv-cache-dtype", "int4"], {}, "--kv-cache-dtype"),
    ([], {"KVSERVE_KV_CACHE_DTYPE": "fp16"}, "KVSERVE_KV_CACHE_DTYPE"),
    ([], {"KVSERVE_QUANTIZATION": "fp4"}, "KVSERVE_QUANTIZATION"),
    (["--cpu-threads", "0"], {}, "--cpu-threads"),
    (["--cpu-threads", "-2"], {}, "--cpu-threads"),
    ([], {"KVSERVE_CPU_THREADS": "0"}, "KVSERVE_CPU_THREADS"),
    (["--scheduling-policy", "lifo"], {}, "--scheduling-policy"),
    (["--long-prefill-token-threshold", "-1"], {}, "--long-prefill-token-threshold"),
    ([], {"KVSERVE_ENFORCE_EAGER": "sometimes"}, "KVSERVE_ENFORCE_EAGER"),
    (["--tool-call-parser", "pythonic"], {}, "--tool-call-parser"),
    (["--enable-auto-tool-choice"], {}, "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--speculative-config", "{not json"], {}, "--speculative-config"),
    (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'], {}, "ngram"),
    (["--speculative-config", '{"method": "ngram"}'], {}, "num_speculative_tokens"),
])
def test_bad_values_exit_2_with_a_message(argv, env, needle, capsys, monkeypatch) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


def test_kv_size_subcommand_is_registered(capsys) -> None:
    assert main(["kv-size", "--model", "smollm2-135m", "--tokens", "1024"]) == 0
    assert "1,024" in capsys.readouterr().out


def test_the_flag_turns_jump_forward_off():
    parser, _, _ = build_parser()
    for argv, expected in ((["serve"], True), (["serve", "--no-enable-jump-forward"], False)):
        args = parser.parse_args(argv)
        assert configs_from_args(parser, args)[0].jump_forward is expected
