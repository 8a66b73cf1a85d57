"""The external tools some tests drive for real (promtool and Prometheus, docker-compose, kubectl,
dockerd, debootstrap, iptables and tc), which pip does not install.

Where one is missing, the test that needs it is skipped with the tool's name and how to install
it (`bash deploy/ci/install-tools.sh`), so the suite passes on a fresh machine. With
`DILOCO_REQUIRE_TOOLS=1` (CI sets it once install-tools.sh has run) a missing tool fails the test
instead, so those tests can never be skipped there without anyone noticing.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import NoReturn

import pytest

REQUIRE = "DILOCO_REQUIRE_TOOLS"
DEBIAN = "install it with `bash deploy/ci/install-tools.sh` (Debian's {} package)"


def required() -> bool:
    """Whether a missing tool fails the test (`DILOCO_REQUIRE_TOOLS=1`) rather than skips it."""
    value = os.environ.get(REQUIRE, "")
    if value not in ("", "0", "1"):
        pytest.fail(
            f"{REQUIRE}={value!r}: set it to 1 (a missing tool fails its test) or 0 (skips it)",
            pytrace=False,
        )
    return value == "1"


def unavailable(why: str) -> NoReturn:
    """Skips the running test, saying why; fails it instead under `DILOCO_REQUIRE_TOOLS=1`."""
    if required():
        pytest.fail(f"{why} ({REQUIRE}=1 requires it)", pytrace=False)
    pytest.skip(why)


def tool(name: str, how: str) -> str:
    """The path of command `name`, from PATH or this venv's bin/; where it is in neither, the
    test is skipped (or failed: `unavailable`) with `how` to install it."""
    required()  # a bad DILOCO_REQUIRE_TOOLS fails even where the tool is there
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        unavailable(f"`{name}` is not installed: {how}")
    return found
