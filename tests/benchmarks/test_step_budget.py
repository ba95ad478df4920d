"""benchmarks/step_budget.py's argument checks: a typo is a usage error before any server starts."""

import argparse

import pytest
from step_budget import budgets_arg


def test_budgets_are_comma_separated_token_counts() -> None:
    assert budgets_arg("1536,2048") == [1536, 2048]
    assert budgets_arg("1024") == [1024]


@pytest.mark.parametrize("text", ["", "0,2048", "1536,two", "-5"])
def test_bad_budgets_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        budgets_arg(text)
