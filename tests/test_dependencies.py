"""DESIGN.md's dependency rules, checked on every run: the import-linter contracts in pyproject.toml.

server -> engine -> scheduler -> paging and engine -> kernels, one way; the server reaches the
layers below the engine only through `kvserve.engine`; paging and scheduler never import torch;
kernels and loadtest import nothing else of kvserve.
"""

from pathlib import Path

import pytest

# A dev dependency (pyproject's `dev` extra); a venv without it skips rather than errors.
cli = pytest.importorskip("importlinter.cli", reason="import-linter is not installed (pip install -e '.[dev]')")

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_import_contracts_hold(capsys: pytest.CaptureFixture[str]) -> None:
    exit_code = cli.lint_imports(config_filenames=(str(PYPROJECT),), no_cache=True, no_logo=True)
    report = capsys.readouterr().out
    assert exit_code == 0, report
    assert ", 0 broken." in report, report
