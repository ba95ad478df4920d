"""LLM(...) ends with a full collection: what loading made (the model, compiled graphs, torch's
and the compiler's objects) is the collector's oldest generation by the time the caller generates,
so the first large generate does not pay a full collection over it."""

from __future__ import annotations

import gc

import pytest

from kvserve.engine import llm as llm_module


class _Loaded:
    """Stands in for a loaded engine: some thousands of objects that outlive loading."""

    def __init__(self) -> None:
        self.parts = [[i] for i in range(3000)]  # lists: always tracked by the collector


def test_objects_made_while_loading_are_the_oldest_generation_once_built(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[_Loaded] = []

    def load(config: object) -> _Loaded:
        made.append(_Loaded())
        return made[-1]

    monkeypatch.setattr(llm_module.LLMEngine, "from_config", staticmethod(load))
    gc.collect()
    llm = llm_module.LLM()
    oldest = gc.get_objects(generation=2)
    assert any(obj is made[0] for obj in oldest)
    assert any(obj is made[0].parts[-1] for obj in oldest)
    assert gc.get_count()[1:] == (0, 0)  # no younger collection has run since
    assert llm.engine is made[0]
