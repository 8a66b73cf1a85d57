"""Byte-level text data for the bundled example, with a deterministic train/eval split by file.

By default the text is the running Python's own standard-library source (`*.py` under
`sysconfig.get_paths()["stdlib"]`, without site-packages): present on every machine, no download.
Any directory of text files can replace it (`root=`, the CLI's `--data`).

- Split: a file is held out for evaluation when a hash of its relative path falls in the lowest
  `eval_fraction` (about 5%) of the hash range, so the split never depends on which other files
  exist, on the platform, or on the order the filesystem lists them.
- Shards: the training files, ordered by that hash, are dealt round-robin to the M learners;
  learner m of M reads only its own, so the shards are disjoint.
- Bounded start-up: each learner reads at most `max_bytes` of its shard, the evaluation set at most
  `eval_bytes`; files containing NUL bytes (binaries) are skipped.
- Batches are random windows of `block + 1` bytes drawn by a seeded generator; evaluation uses a
  fixed set of windows drawn with a fixed seed, so every process evaluates on the same bytes.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import torch
from torch import nn

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class DataError(ValueError):
    """The data directory cannot provide what was asked for (missing, too small, ...)."""


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path, suffix: str | None) -> list[str]:
    """Relative POSIX paths of the files under root (optionally only `*suffix`), sorted."""
    if not root.is_dir():
        raise DataError(f"data directory {root} does not exist or is not a directory")
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("."))
        for f in files:
            if f.startswith(".") or (suffix and not f.endswith(suffix)):
                continue
            out.append(Path(d, f).relative_to(root).as_posix())
    return sorted(out)


def path_hash(rel: str) -> float:
    """A number in [0, 1) fixed by the relative path alone."""
    digest = hashlib.sha256(rel.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_files(files: list[str], eval_fraction: float = 0.05) -> tuple[list[str], list[str]]:
    """(train, eval): a file is held out when its path hash is below eval_fraction.

    Both lists come back ordered by path hash (a fixed pseudo-random order). At least one file is
    held out and at least one kept for training when there are two or more files.
    """
    ordered = sorted(files, key=lambda f: (path_hash(f), f))
    n_eval = sum(1 for f in ordered if path_hash(f) < eval_fraction)
    if len(ordered) >= 2:
        n_eval = min(max(n_eval, 1), len(ordered) - 1)
    return ordered[n_eval:], ordered[:n_eval]


def shard_files(train: list[str], learner: int, learners: int) -> list[str]:
    """Learner m of M gets every M-th training file, starting at m: disjoint, covering all."""
    if not 0 <= learner < learners:
        raise DataError(f"learner index {learner} is outside 0..{learners - 1}")
    if len(train) < learners:
        raise DataError(f"{len(train)} training files cannot be split among {learners} learners")
    return train[learner::learners]


def read_bytes(root: Path, files: list[str], budget: int) -> torch.Tensor:
    """The files' bytes concatenated in order, stopping at budget bytes; binaries skipped."""
    parts, total = [], 0
    for rel in files:
        if total >= budget:
            break
        try:
            raw = (root / rel).read_bytes()
        except OSError:
            continue
        if b"\0" in raw:
            continue
        raw = raw[: budget - total]
        parts.append(raw)
        total += len(raw)
    return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)


class ByteData:
    """One learner's training bytes and the shared evaluation bytes."""

    def __init__(
        self,
        root: str | Path | None = None,
        *,
        learner: int = 0,
        learners: int = 1,
        block: int = 128,
        max_bytes: int = 4 << 20,
        eval_bytes: int = 1 << 20,
        eval_fraction: float = 0.05,
    ) -> None:
        self.root = Path(root) if root is not None else stdlib_root()
        self.block = block
        files = list_files(self.root, ".py" if root is None else None)
        if len(files) < 2:
            raise DataError(
                f"data directory {self.root} needs at least 2 files (one is held out for evaluation), found {len(files)}"
            )
        train, held_out = split_files(files, eval_fraction)
        self.train_files = shard_files(train, learner, learners)
        self.eval_files = held_out
        self.train = read_bytes(self.root, self.train_files, max_bytes)
        self.eval = read_bytes(self.root, self.eval_files, eval_bytes)
        for name, data in (("training shard", self.train), ("evaluation set", self.eval)):
            if len(data) < block + 2:
                raise DataError(
                    f"the {name} under {self.root} has {len(data)} bytes of text; need at least {block + 2}"
                )

    @staticmethod
    def windows(
        data: torch.Tensor, n: int, block: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """n random windows of block+1 bytes: inputs (n, block) and next-byte targets (n, block)."""
        starts = torch.randint(0, len(data) - block, (n,), generator=generator)
        w = data[starts[:, None] + torch.arange(block + 1)].long()
        return w[:, :-1], w[:, 1:]

    def batch(
        self, batch_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.windows(self.train, batch_size, self.block, generator)

    def eval_set(self, n: int = 256, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed evaluation windows: the same n windows in every process."""
        return self.windows(self.eval, n, self.block, torch.Generator().manual_seed(seed))


@torch.no_grad()
def evaluate(
    model: nn.Module, eval_set: tuple[torch.Tensor, torch.Tensor], batch_size: int = 64
) -> float:
    """Mean cross-entropy (nats per byte) of model on the evaluation windows."""
    was_training = model.training
    model.eval()
    x, y = eval_set
    device = next(model.parameters()).device
    total = 0.0
    for i in range(0, len(x), batch_size):
        xb, yb = x[i : i + batch_size].to(device), y[i : i + batch_size].to(device)
        logits = model(xb)[0]
        total += nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), yb.reshape(-1), reduction="sum"
        ).item()
    model.train(was_training)
    return total / y.numel()
