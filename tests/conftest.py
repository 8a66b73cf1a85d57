"""Shared fixtures: a real Synchronizer on port 0 with its own metrics registry per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from synchronizer.config import SynchronizerConfig
from synchronizer.metrics import Metrics
from synchronizer.server import RunningServer, serving


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., RunningServer]]:
    """Starts servers with the given settings (port 0, metrics off unless asked); stops them all."""
    stack: list[Any] = []

    def start(**overrides: Any) -> RunningServer:
        settings: dict[str, Any] = {"port": 0, "metrics_port": -1, "state_dir": tmp_path / "state", "shutdown_grace_s": 1.0}
        settings.update(overrides)
        cm = serving(SynchronizerConfig(**settings), Metrics())
        running = cm.__enter__()
        stack.append(cm)
        return running

    yield start
    for cm in reversed(stack):
        cm.__exit__(None, None, None)
