"""DESIGN.md's dependency rules, checked on every run: the import-linter contracts in pyproject.toml.

server -> engine -> scheduler -> paging and engine -> kernels, one way; the server reaches the
layers below the engine only through `kvserve.engine`; paging and scheduler never import torch;
kernels and loadtest import nothing else of kvserve; the server imports only `kvserve.engine`'s
public names.

import-linter is a dev dependency (pyproject's `dev` extra). Without it this test fails rather
than skips: a skipped contract check reads as a kept one.
"""

from pathlib import Path

import pytest

try:
    from importlinter import cli
except ImportError:
    cli = None

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_import_contracts_hold(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli is not None, "import-linter is not installed, so the contracts cannot be checked: pip install -e '.[dev]'"
    exit_code = cli.lint_imports(config_filenames=(str(PYPROJECT),), no_cache=True, no_logo=True)
    report = capsys.readouterr().out
    assert exit_code == 0, report
    assert ", 0 broken." in report, report
