"""The container's health probe follows the port the server was started with: `--port` argument
over KVSERVE_PORT over the default, read from PID 1's command line and environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.server.app import build_app
from kvserve.server.healthcheck import health_url, main
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import FakeEngine
from tests.server.live_server import live_server


@pytest.mark.parametrize("argv,environ,url", [
    (["kvserve", "serve"], {}, "http://127.0.0.1:8000/health"),
    (["kvserve", "serve"], {"KVSERVE_PORT": "9001"}, "http://127.0.0.1:9001/health"),
    (["kvserve", "serve", "--port", "8014"], {"KVSERVE_PORT": "8000"}, "http://127.0.0.1:8014/health"),
    (["/sbin/docker-init", "--", "kvserve", "serve", "--port=8015"], {}, "http://127.0.0.1:8015/health"),
    (["kvserve", "serve", "--port", "1", "--port", "2"], {}, "http://127.0.0.1:2/health"),
    (["kvserve", "serve", "--host", "10.1.2.3"], {"KVSERVE_HOST": "0.0.0.0"}, "http://10.1.2.3:8000/health"),
    (["kvserve", "serve"], {"KVSERVE_HOST": "::"}, "http://127.0.0.1:8000/health"),
    (["kvserve", "serve", "--host", "::1"], {}, "http://[::1]:8000/health"),
])
def test_health_url_follows_the_cli_precedence(argv: list[str], environ: dict[str, str], url: str) -> None:
    assert health_url(argv, environ) == url


def fake_proc(tmp_path: Path, argv: list[str], environ: dict[str, str]) -> Path:
    (tmp_path / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (tmp_path / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in environ.items()) + b"\0")
    return tmp_path


def test_probe_is_healthy_on_the_served_port_and_not_on_another(tmp_path: Path) -> None:
    with live_server(build_app(FakeEngine(), ServerSettings())) as url:
        port = url.rsplit(":", 1)[1]
        assert main(fake_proc(_dir(tmp_path, "a"), ["kvserve", "serve", "--port", port], {"KVSERVE_PORT": "1"})) == 0
        assert main(fake_proc(_dir(tmp_path, "b"), ["kvserve", "serve"], {"KVSERVE_PORT": port})) == 0
        assert main(fake_proc(_dir(tmp_path, "c"), ["kvserve", "serve", "--port", "1"], {"KVSERVE_PORT": port})) == 1


def test_probe_is_unhealthy_while_loading(tmp_path: Path) -> None:
    with live_server(build_app(None, ServerSettings())) as url:
        port = url.rsplit(":", 1)[1]
        assert main(fake_proc(tmp_path, ["kvserve", "serve", "--port", port], {})) == 1


def _dir(root: Path, name: str) -> Path:
    (root / name).mkdir()
    return root / name
