"""Atomic checkpoints of the Synchronizer's state, and restoring the newest complete one.

A checkpoint is one safetensors file (tensors by name, plus a JSON document of everything else in
its metadata; never pickle). It is written to a temporary name, fsynced, renamed into place and
the directory fsynced, so a crash at any moment leaves either the previous set of checkpoints or
the new one, never a torn file under a final name. The last `keep` are kept; on start the newest
that loads cleanly wins, and a damaged one is skipped with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

NAME = re.compile(r"^ckpt-(\d{10})\.safetensors$")
META_KEY = "diloco"


def fsync_dir(path: Path) -> None:
    """Makes a directory's entries (a rename, a new or deleted file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(state_dir: Path) -> list[tuple[int, Path]]:
    """(number, path) of every complete-named checkpoint, oldest first."""
    if not state_dir.is_dir():
        return []
    found = []
    for p in state_dir.iterdir():
        m = NAME.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def save(
    state_dir: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any], keep: int
) -> Path:
    """Writes the next numbered checkpoint atomically and prunes all but the newest `keep`."""
    state_dir.mkdir(parents=True, exist_ok=True)
    existing = list_checkpoints(state_dir)
    number = existing[-1][0] + 1 if existing else 1
    final = state_dir / f"ckpt-{number:010d}.safetensors"
    tmp = state_dir / f".tmp-{final.name}-{os.getpid()}"
    try:
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(tmp),
            metadata={META_KEY: json.dumps(meta)},
        )
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a half-written file must not fill the disk further
        raise
    fsync_dir(state_dir)
    for _, old in list_checkpoints(state_dir)[:-keep]:
        old.unlink(missing_ok=True)
    for stray in state_dir.glob(".tmp-ckpt-*"):
        if stray != tmp:
            stray.unlink(missing_ok=True)
    return final


def load_latest(state_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], Path] | None:
    """The newest checkpoint that loads cleanly, or None when there is none."""
    for _, path in reversed(list_checkpoints(state_dir)):
        try:
            tensors = load_file(str(path))
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {})[META_KEY])
            return tensors, meta, path
        except (SafetensorError, OSError, KeyError, ValueError) as e:
            logger.warning("skipping damaged checkpoint %s: %s", path, e)
    return None
