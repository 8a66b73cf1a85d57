"""The main job's picture: training loss over time per learner, and goodput over time.

Needs matplotlib (the `plot` extra); the launcher imports this module only when it draws.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402


def plot_summary(summary: dict, path: Path) -> None:
    """Writes a two-panel PNG to path from a `diloco-learner local` summary."""
    per_learner = summary["per_learner"]
    t0 = summary.get("t0") or 0.0
    fig, (ax_loss, ax_good) = plt.subplots(1, 2, figsize=(12, 4.5))

    for i, (name, v) in enumerate(per_learner.items()):
        label = name + (f" (x{v['slow_factor']:g} slow)" if v["slow_factor"] > 1 else "")
        label += " (killed, restarted)" if v["killed_at_step"] is not None else ""
        color = f"C{i}"
        for run, pts in enumerate(v["series"]):  # a restarted learner has one curve per process
            ax_loss.plot(
                [p["t"] - t0 for p in pts],
                [p["loss"] for p in pts],
                color=color,
                lw=1,
                label=label if run == 0 else None,
            )
        if len(v["series"]) > 1 and v["series"][0] and v["series"][1]:  # shade the time it was dead
            ax_loss.axvspan(
                v["series"][0][-1]["t"] - t0, v["series"][1][0]["t"] - t0, color=color, alpha=0.15
            )
    if summary.get("eval_loss_end") is not None:
        ax_loss.axhline(
            summary["eval_loss_end"], color="k", ls="--", lw=1, label="final global model (eval)"
        )
    ax_loss.set_xlabel("seconds")
    ax_loss.set_ylabel("training loss (nats/byte)")
    ax_loss.set_title("Loss per learner")
    ax_loss.legend(fontsize=8)

    g = summary.get("goodput_series", [])
    ax_good.plot([p["t"] - t0 for p in g], [p["goodput"] for p in g], color="tab:green")
    ax_good.set_ylim(0, 1.05)
    ax_good.set_xlabel("seconds")
    ax_good.set_ylabel("goodput (merged compute / capacity)")
    ax_good.set_title(f"Goodput (final {summary.get('goodput') or 0:.1%})")

    fig.suptitle(
        f"Decoupled DiLoCo, {summary['learners']} learners: eval loss "
        f"{summary.get('eval_loss_start') or float('nan'):.3f} -> {summary.get('eval_loss_end') or float('nan'):.3f}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
