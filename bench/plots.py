"""The benchmarks' PNG pictures, written next to the JSON (needs matplotlib, the `plot` extra;
without it the benchmarks skip the pictures and say so)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_path(json_path: Path | None, suffix: str) -> Path | None:
    return None if json_path is None else json_path.with_name(f"{json_path.stem}{suffix}.png")


def loss_curves(runs: list[dict], path: Path | None, title: str, tokens_per_step: int) -> None:
    """Two panels: training loss (mean over learners) against tokens per learner and against
    wall-clock, with each run's eval points (the global model's for DiLoCo) marked."""
    plt = _plt()
    if path is None or plt is None:
        return
    fig, (ax_tok, ax_t) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, r in enumerate(runs):
        color = f"C{i}"
        series = _mean_series(r)
        if series:
            steps, ts, losses = zip(*series, strict=True)
            ax_tok.plot(
                [s * tokens_per_step for s in steps],
                losses,
                color=color,
                lw=1,
                alpha=0.7,
                label=f"{r['name']} (train)",
            )
            ax_t.plot(ts, losses, color=color, lw=1, alpha=0.7)
        ev = r.get("eval_series") or []
        if ev:
            ax_t.plot(
                [e["t"] for e in ev],
                [e["eval_loss"] for e in ev],
                color=color,
                marker="o",
                ms=4,
                ls="--",
                label=f"{r['name']} (eval {r['eval_loss']:.3f})",
            )
            tok = [e["step"] * tokens_per_step for e in ev if "step" in e] or [
                r["steps"] * tokens_per_step
            ]
            ax_tok.plot(
                tok,
                [e["eval_loss"] for e in ev][-len(tok) :],
                color=color,
                marker="o",
                ms=4,
                ls="--",
            )
    ax_tok.set_xlabel("tokens per learner")
    ax_t.set_xlabel("seconds of training")
    for ax in (ax_tok, ax_t):
        ax.set_ylabel("loss (nats/byte)")
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=7)
    ax_tok.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _mean_series(r: dict) -> list[tuple[int, float, float]]:
    """(step, seconds since the run started, mean training loss over learners) per progress line."""
    per = [rs[-1].get("series") or [] for rs in r.get("results", []) if rs]
    if not per or not all(per):
        return []
    t0 = r.get("t_start") or per[0][0]["t"]
    n = min(len(s) for s in per)

    def seconds(k: int) -> float:  # data parallel's own clock leaves out its evaluations
        return per[0][k]["t_train"] if "t_train" in per[0][k] else max(s[k]["t"] for s in per) - t0

    return [
        (per[0][k]["step"], seconds(k), sum(s[k]["loss"] for s in per) / len(per)) for k in range(n)
    ]


def goodput_timelines(runs: list[dict], path: Path | None, title: str) -> None:
    """Per system, the cumulative goodput over time, with the fault windows shaded."""
    plt = _plt()
    if path is None or plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, r in enumerate(runs):
        tl = r.get("timeline") or []
        if tl:
            source = f", {r['timeline_source']}" if r.get("timeline_source") else ""
            ax.plot(
                [p[0] for p in tl],
                [p[1] for p in tl],
                color=f"C{i}",
                label=f"{r['name']} (final {r['goodput']:.2f}{source})",
            )
    for f in runs[0].get("faults", []) if runs else []:
        crash = f["kind"] == "crash"
        end = f["at_s"] + (f["restart_after_s"] if crash else f["duration_s"])
        ax.axvspan(
            f["at_s"],
            end,
            color="red" if crash else "orange",
            alpha=0.12,
            label=f"slot {f['slot']} " + ("down" if crash else f"{f['factor']:g}x slower"),
        )
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("seconds since training started")
    ax.set_ylabel("goodput so far (merged compute / capacity)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
