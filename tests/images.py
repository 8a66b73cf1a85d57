"""The container tests' images, built in the background from the start of the run.

Building the Debian base, the image (torch included) and the Prometheus image takes about three
minutes on two cores, mostly waiting on disk and the package mirror. When the run includes
tests/test_container.py, conftest.py starts `ImageBuild` as soon as the tests are collected and
moves the container tests to the end of the run, so the build overlaps the rest of the suite
instead of adding to it; the tests' `docker` fixture waits for it (or builds in the foreground
when run on its own, e.g. `pytest tests/test_container.py -k compose`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
IMAGE = "diloco:test"
PROMETHEUS_IMAGE = "diloco-prometheus:test"
CONTAINER_TESTS = "tests/test_container.py"

_spec = importlib.util.spec_from_file_location(
    "diloco_local_image", REPO / "deploy" / "docker" / "local_image.py"
)
assert _spec is not None and _spec.loader is not None
local_image = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(local_image)


def host_network_state() -> tuple[str, str | None]:
    """What a default dockerd would change: IP forwarding and iptables' FORWARD policy."""
    forward = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
    policy = None
    if shutil.which("iptables"):
        r = subprocess.run(
            ["iptables", "-S", "FORWARD"], capture_output=True, text=True, timeout=30
        )
        policy = r.stdout.splitlines()[0] if r.returncode == 0 and r.stdout else None
    return forward, policy


class ImageBuild:
    """A daemon (local_image.Docker) holding IMAGE and PROMETHEUS_IMAGE, made on a thread.

    `wait()` gives the daemon once both images are built; it raises `local_image.Unavailable`
    where containers cannot run here, and re-raises whatever else failed the build. `close()`
    stops the daemon (after the build ends, if it is still going)."""

    def __init__(self) -> None:
        self.before = host_network_state()
        self.seconds = 0.0
        self._stack = contextlib.ExitStack()
        self._daemon: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._build, name="image-build", daemon=True)

    def start(self) -> ImageBuild:
        self._thread.start()
        return self

    def _build(self) -> None:
        t0 = time.monotonic()
        try:
            daemon = self._stack.enter_context(local_image.docker_daemon())
            base = daemon.base_image()
            daemon.build_image(IMAGE, base, local_image.torch_wheel())
            daemon.build_prometheus(PROMETHEUS_IMAGE, base)
            self._daemon = daemon
        except BaseException as e:  # handed to the tests by wait()
            self._error = e
        self.seconds = time.monotonic() - t0

    def wait(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._daemon

    def close(self) -> None:
        self._thread.join()
        self._stack.close()


BUILD = pytest.StashKey[ImageBuild]()  # the run's build, in the pytest config's stash
