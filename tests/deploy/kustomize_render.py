"""Render deploy/kubernetes overlays with `kubectl kustomize` and index the objects."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
KUSTOMIZE_ROOT = REPO / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu")

Manifest = dict[str, Any]


def kubectl() -> str | None:
    return shutil.which("kubectl")


def render(overlay: str) -> list[Manifest]:
    binary = kubectl()
    assert binary is not None
    result = subprocess.run([binary, "kustomize", str(KUSTOMIZE_ROOT / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def find(objects: list[Manifest], kind: str, name: str) -> Manifest:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def container(deployment: Manifest, name: str) -> Manifest:
    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    return containers[name]


def env_value(container_spec: Manifest, name: str) -> Manifest:
    entries = {e["name"]: e for e in container_spec.get("env", [])}
    return entries[name]


def port_number(container_spec: Manifest, port: int | str) -> int:
    """A probe's or Service's port (a number, or the name of one of the container's ports)."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container_spec["ports"] if "name" in p}
    assert port in named, f"port {port!r} is not one of the container's named ports {sorted(named)}"
    return named[port]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())
