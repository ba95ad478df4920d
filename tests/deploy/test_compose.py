"""deploy/: the compose stack parses, mounts only files that exist, and wires the pieces together."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.dockerfile import image_env
from tests.deploy.kvserve_process import DOCKERFILE, REPO

DEPLOY = REPO / "deploy"
COMPOSE_FILES = (DEPLOY / "docker-compose.yml", DEPLOY / "docker-compose.gpu.yml")


def load(path: Path) -> dict:
    document = yaml.safe_load(path.read_text())
    assert isinstance(document, dict), f"{path} is not a YAML mapping"
    return document


def host_paths(compose: dict) -> list[Path]:
    """Every host file a compose file names: build contexts, Dockerfiles and bind mounts."""
    paths = []
    for service in compose["services"].values():
        build = service.get("build")
        if isinstance(build, dict) and "context" in build:
            context = (DEPLOY / build["context"]).resolve()
            paths += [context, context / build.get("dockerfile", "Dockerfile")]
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):  # a bind mount, not a named volume
                paths.append((DEPLOY / source).resolve())
    return paths


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_file_parses_and_references_only_existing_files(path: Path) -> None:
    compose = load(path)
    assert compose["services"]
    for host_path in host_paths(compose):
        assert host_path.exists(), f"{path.name} references {host_path}, which does not exist"


def test_stack_has_kvserve_prometheus_and_grafana_wired_together() -> None:
    compose = load(DEPLOY / "docker-compose.yml")
    services = compose["services"]
    assert {"kvserve", "prometheus", "grafana"} <= set(services)
    assert "8000:8000" in services["kvserve"]["ports"]
    named_volumes = set(compose.get("volumes", {}))
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith((".", "/")) or source in named_volumes, f"undeclared volume {source}"
    # Prometheus scrapes the compose service by name on the port kvserve exposes.
    prometheus = load(DEPLOY / "prometheus.yml")
    (job,) = [job for job in prometheus["scrape_configs"] if job["job_name"] == "kvserve"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"][0]["targets"] == ["kvserve:8000"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]


def test_grafana_provisioning_points_at_the_mounted_dashboard_and_datasource() -> None:
    compose = load(DEPLOY / "docker-compose.yml")
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"] if v.startswith("."))
    provider = load(DEPLOY / "grafana/provisioning/dashboards/kvserve.yml")["providers"][0]
    dashboards_in_container = provider["options"]["path"]
    host_dashboards = {container: host for host, container in mounts.items()}[dashboards_in_container]
    assert (DEPLOY / host_dashboards / "kvserve.json").is_file()
    datasource = load(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"
    dashboard = json.loads((DEPLOY / "grafana/dashboards/kvserve.json").read_text())
    uids = {target["datasource"]["uid"] for panel in dashboard["panels"] for target in panel["targets"]}
    assert uids == {datasource["uid"]}


def test_compose_stop_grace_outlasts_the_server_drain() -> None:
    kvserve = load(DEPLOY / "docker-compose.yml")["services"]["kvserve"]
    grace = float(kvserve["environment"]["KVSERVE_SHUTDOWN_GRACE_PERIOD"])
    assert float(kvserve["stop_grace_period"].rstrip("s")) > grace


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool absent: apt-get install prometheus")
def test_promtool_accepts_the_prometheus_config() -> None:
    result = subprocess.run(["promtool", "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_kvserve_variable_set_in_the_image_or_stack_is_a_real_option() -> None:
    cli = pytest.importorskip("kvserve.server.cli", reason="the server CLI has not landed yet")
    _, _, actions = cli.build_parser()
    options = {cli.env_name(action) for action in actions}
    not_options = {"KVSERVE_CACHE"}  # where a missing default model is downloaded (engine/model/model_source.py)

    names = {name for name in image_env(DOCKERFILE) if name.startswith("KVSERVE_")}
    for path in COMPOSE_FILES:
        for service in load(path)["services"].values():
            names |= {name for name in service.get("environment", {}) if name.startswith("KVSERVE_")}
    unknown = names - options - not_options
    assert not unknown, f"{sorted(unknown)} are not `kvserve serve` options (a typo is silently ignored)"
