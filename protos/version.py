"""The installed package's version, for `--version` and the `diloco_build_info` metric.

Read from the installed distribution's metadata (pyproject.toml's `version`); a source tree run
without being installed reports "unknown" rather than failing.
"""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "decoupled-diloco"


def version() -> str:
    """The installed decoupled-diloco version, or "unknown" when it is not installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"
