"""One kvserve started from the Dockerfile's command, shared by the tests that need a live server
(loading the model takes tens of seconds on a CPU, so it is loaded once per session)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.deploy.kvserve_process import RunningServer, missing_serve_command, run_image_command


@pytest.fixture(scope="session")
def image_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    reason = missing_serve_command()
    if reason is not None:
        pytest.skip(reason)
    with run_image_command(tmp_path_factory.mktemp("kvserve")) as server:
        yield server
