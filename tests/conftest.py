"""Shared fixtures: a real Synchronizer on port 0 with its own metrics registry per test, and TLS
certificates made by openssl; the container images' build started at collection."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from synchronizer.config import SynchronizerConfig
from synchronizer.metrics import Metrics
from synchronizer.server import RunningServer, serving
from tests.images import BUILD, CONTAINER_TESTS, ImageBuild


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked `cuda` run only where a GPU is present (`pytest -m cuda` selects them)."""
    if item.get_closest_marker("cuda") and not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """When the container tests are in the run (after deselection), start building their images
    now and run those tests last, so the build overlaps everything else (tests/images.py)."""
    container = [i for i in items if i.nodeid.startswith(CONTAINER_TESTS)]
    if not container or config.option.collectonly:
        return
    items[:] = [i for i in items if not i.nodeid.startswith(CONTAINER_TESTS)] + container
    config.stash[BUILD] = ImageBuild().start()


def pytest_unconfigure(config: pytest.Config) -> None:
    build = config.stash.get(BUILD, None)
    if build is not None:
        build.close()


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., RunningServer]]:
    """Starts servers with the given settings (port 0, metrics off unless asked); stops them all.

    Leases last 120 s unless a test sets `lease_s`: a test's learner that joins and then pushes
    without heartbeating must not lapse between the two on a busy machine (the default 10 s did,
    once, in CI). Tests of lapsing set their own short lease."""
    stack: list[Any] = []

    def start(**overrides: Any) -> RunningServer:
        settings: dict[str, Any] = {
            "port": 0,
            "metrics_port": -1,
            "state_dir": tmp_path / "state",
            "shutdown_grace_s": 1.0,
            "lease_s": 120.0,
        }
        settings.update(overrides)
        cm = serving(SynchronizerConfig(**settings), Metrics())
        running = cm.__enter__()
        stack.append(cm)
        return running

    yield start
    for cm in reversed(stack):
        cm.__exit__(None, None, None)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA (ca.pem) and the server and client certificates it signed ({server,client}.pem, .key),
    valid for 127.0.0.1 and localhost."""
    d = tmp_path_factory.mktemp("pki")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=test-ca",
        cwd=d,
    )
    for name in ("server", "client"):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        (d / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
            cwd=d,
        )
    return d
