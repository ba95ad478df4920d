"""`kvserve serve` refuses to start with exit code 2 and the option's name when a setting cannot
work once the model is known (a KV cache that does not fit the memory limit), and with exit code
1 when the model fails to load."""

from __future__ import annotations

import io

import pytest

from kvserve.engine.config import ConfigError, EngineConfig
from kvserve.server.serve import run_server
from kvserve.server.settings import ServerSettings


def fail_with(error: Exception):
    def factory(config, listeners):
        raise error
    return factory


@pytest.mark.parametrize("error,code,text", [
    (ConfigError("--kv-cache-memory", "the memory limit leaves no room; set --kv-cache-memory"), 2,
     "kvserve: error: the memory limit leaves no room; set --kv-cache-memory"),
    (OSError("truncated file"), 1, "kvserve: could not load the model: truncated file"),
])
def test_a_load_failure_exits_with_a_message(error: Exception, code: int, text: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    settings = ServerSettings(port=0, log_level="warning")
    assert run_server(EngineConfig(), settings, engine_factory=fail_with(error), out=io.StringIO()) == code
    assert text in capsys.readouterr().err
