"""`python -m kvserve.server.healthcheck`: the container's HEALTHCHECK probe.

It must probe the port the server actually listens on, which the user may have chosen as an
argument (`docker run kvserve --port 8014`) or as `KVSERVE_PORT`. Inside the container the server
is (or is started by) PID 1, so the probe reads PID 1's command line and environment, applying
the CLI's precedence: `--port` argument, then KVSERVE_PORT, then the default. Exit 0 when /health
answers 200, 1 otherwise (Docker's contract: 0 healthy, 1 unhealthy).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

DEFAULT_PORT = 8000
_ANY_ADDRESS = ("", "0.0.0.0", "::")


def _option(argv: Sequence[str], name: str) -> str | None:
    """The last value given for `--name` (as `--name V` or `--name=V`): argparse's rule."""
    found = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(name + "="):
            found = arg.partition("=")[2]
    return found


def health_url(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    port = _option(argv, "--port") or environ.get("KVSERVE_PORT") or str(DEFAULT_PORT)
    host = _option(argv, "--host") or environ.get("KVSERVE_HOST", "")
    # A server listening on every interface is reached on loopback; one bound to a single
    # address only there.
    if host in _ANY_ADDRESS:
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{int(port)}/health"


def read_process(proc: Path) -> tuple[list[str], dict[str, str]]:
    """argv and environment of a process from /proc/<pid>/{cmdline,environ} (NUL-separated)."""
    argv = proc.joinpath("cmdline").read_bytes().decode(errors="replace").split("\0")
    try:
        raw_env = proc.joinpath("environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:  # not readable as another user: our own environment is the image's too
        raw_env = []
    environ = dict(item.partition("=")[::2] for item in raw_env if "=" in item)
    return [arg for arg in argv if arg], environ


def probe(url: str, timeout_s: float = 4.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(proc: Path = Path("/proc/1")) -> int:
    try:
        argv, environ = read_process(proc)
    except OSError:
        argv, environ = [], {}
    return 0 if probe(health_url(argv, {**os.environ, **environ})) else 1


if __name__ == "__main__":
    sys.exit(main())
