"""What every benchmark shares: the command line, a table printer and the JSON result file."""

from __future__ import annotations

import argparse
import json
import platform
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def program(main: Callable[[], T]) -> T:
    """Runs a benchmark's `main` as a program: SIGTERM (what `timeout`, a CI runner or a job
    scheduler sends) unwinds like Ctrl-C, through the `finally`s that stop the benchmark's
    Synchronizers and learners (each in a session of its own, out of reach of a signal to the
    benchmark's process group) and remove its network namespaces. Killed by the default
    action instead, a benchmark left them all behind, to load whatever ran next."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return main()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--quick", action="store_true", help="the small mode (at most a few minutes on 2 cores)"
    )
    p.add_argument("--smoke", action="store_true", help="the smallest mode, for the test suite")
    p.add_argument("--json", type=Path, help="write the results as one JSON object to this path")
    return p


def run_mode(args: argparse.Namespace, quick_is_smoke: str = "") -> dict[str, Any]:
    """The run's mode, for its JSON (merge it in) and its output (`say_mode`). A benchmark whose
    quick mode is too short to show what its full mode shows passes `quick_is_smoke`, why: its
    quick runs then call themselves smoke runs, like `--smoke`, so nobody reads their figures as
    the benchmark's (`smoke_run` true in the JSON)."""
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    out: dict[str, Any] = {"mode": mode, "smoke_run": mode == "smoke"}
    if mode == "quick" and quick_is_smoke:
        out |= {"smoke_run": True, "smoke_reason": quick_is_smoke}
    return out


def say_mode(mode: dict[str, Any]) -> None:
    """One line, printed first and last, when the run's figures are not the benchmark's."""
    if mode["smoke_run"]:
        why = f": {mode['smoke_reason']}" if "smoke_reason" in mode else ""
        print(
            f"SMOKE RUN ({mode['mode']} mode): these figures do not show what full mode shows{why}",
            flush=True,
        )


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": torch.get_num_threads(),
        "platform": platform.platform(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        if v is None:  # a figure whose baseline could not be measured
            return "missing"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def dir_bytes(path: Path) -> int:
    """The bytes of every file under `path` (files deleted while it walks count nothing)."""
    total = 0
    for p in path.rglob("*"):
        try:
            total += p.stat().st_size if p.is_file() else 0
        except OSError:  # released while walking
            pass
    return total


def write_json(path: Path | None, result: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
