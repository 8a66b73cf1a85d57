"""Slow links: data parallel against the best Decoupled configuration when every learner's link
is limited to a set rate, eval loss against wall-clock for both.

The same M = 4 learners and tokens as bench/convergence.py, (a) data parallel and the Decoupled
configuration it picks (`bench.convergence.BEST`: K = 1 + adaptive grace, H = 100, P = 4, INT4
pushes, INT8 delta pulls), each learner process in its own network namespace whose veth is
shaped by `tc tbf` in both directions (root; see bench/net.py), or, without root, behind a
rate-limiting proxy (then only the Decoupled learners are limited: gloo cannot be proxied, so
data parallel runs unshaped on loopback and the result says `"shaped": false`).

Eval loss against wall-clock: data parallel's rank 0 evaluates every steps/40 steps, and those
seconds are taken out of its clock (it runs after the Decoupled run and stops at the first eval
at or below the Decoupled run's final loss: nothing after that changes the headline); the Decoupled run's global model is pulled and evaluated
in this process every few seconds while the learners train (on the same 2 cores: that slows
the learners, not data parallel, so it errs against Decoupled). Wall-clock runs from the first
training step to the last, start-up excluded for both.

Headline `wan_speedup` (at the first rate, 50 Mbit/s by default): the wall time data parallel
needs to reach the eval loss the Decoupled run ends with (interpolated between its eval points)
over the Decoupled run's wall time. If data parallel never gets there, its whole run is used and
the result says `"dp_reached": false` (then the speedup is a lower bound).

    python -m bench.wan [--quick | --smoke] [--json PATH] [--rates-mbit 50,1000] [--steps S]
        [--net auto|netns|proxy]
Modes: --smoke a tiny model, 2 learners, 100 steps, 50 Mbit/s; --quick 400 steps at 50 Mbit/s
(about 1.5 minutes here); full 3000 steps (the convergence run's length) at 50 Mbit/s and
1 Gbit/s (about 17 minutes).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from bench.common import machine, parser, table, write_json
from bench.convergence import BEST, parse_set
from bench.dp import DPJob
from bench.jobs import SMOKE, Decoupled, DilocoJob, GlobalModel, Workload
from bench.net import open_links
from bench.plots import loss_curves, png_path


def reach_time(series: list[dict], target: float) -> float | None:
    """The first time an eval series gets to `target` or below, interpolated linearly between
    the eval points around the crossing; None if it never does."""
    for a, b in zip(series, series[1:], strict=False):
        if b["eval_loss"] <= target:
            if a["eval_loss"] <= target:
                return a["t"]
            f = (a["eval_loss"] - target) / (a["eval_loss"] - b["eval_loss"])
            return a["t"] + f * (b["t"] - a["t"])
    return series[0]["t"] if series and series[0]["eval_loss"] <= target else None


def at_rate(rate_mbit: float, w: Workload, cfg: Decoupled, net: str, root: Path) -> dict[str, Any]:
    with open_links(net, w.learners, rate_mbit * 1e6) as links:
        expected_s = w.steps / 10  # about 10 steps/s per learner with 4 learners on 2 cores
        dec = DilocoJob(cfg, w, links, root / "decoupled").run(
            evaluator=GlobalModel(w, cfg.fragments), eval_every_s=max(1.0, expected_s / 8)
        )
        # data parallel stops at its first eval at or below the Decoupled run's final loss
        dp = DPJob(
            w, links, root / "dp", eval_every=max(1, w.steps // 40), target_loss=dec["eval_loss"]
        ).run()
    t_dp = reach_time(dp["eval_series"], dec["eval_loss"])
    dp["name"], dec["name"] = f"dp @{rate_mbit:g}Mbit", f"decoupled @{rate_mbit:g}Mbit"
    return {
        "rate_mbit": rate_mbit,
        "links": links.kind,
        "dp_shaped": dp["shaped"],
        "dp_reached": t_dp is not None,
        "dp_time_to_decoupled_loss_s": t_dp if t_dp is not None else dp["wall_s"],
        "wan_speedup": (t_dp if t_dp is not None else dp["wall_s"]) / dec["wall_s"],
        "dp": dp,
        "decoupled": dec,
    }


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--rates-mbit", help="comma-separated link rates in Mbit/s (the first gives the headline)"
    )
    p.add_argument("--steps", type=int, help="inner steps per learner")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a setting of the Decoupled configuration",
    )
    p.add_argument(
        "--net",
        choices=("auto", "netns", "proxy"),
        default="auto",
        help="links: namespaces (root) or proxies",
    )
    p.add_argument("--out", type=Path, help="keep the runs' logs and result files here")
    args = p.parse_args(argv)
    if args.smoke:
        w, cfg, rates = dataclasses.replace(SMOKE), BEST.with_(sync_every=10), [50.0]
    else:
        w, cfg, rates = (
            Workload(steps=400 if args.quick else 3000),
            BEST,
            [50.0] if args.quick else [50.0, 1000.0],
        )
    if args.steps:
        w.steps = args.steps
    if args.rates_mbit:
        rates = [float(r) for r in args.rates_mbit.split(",")]
    cfg = parse_set(args.set, cfg)
    cells = []
    with tempfile.TemporaryDirectory(prefix="bench-wan-") as tmp:
        root = args.out or Path(tmp)
        for rate in rates:
            print(
                f"{w.learners} learners x {w.steps} steps, links limited to {rate:g} Mbit/s",
                flush=True,
            )
            cells.append(at_rate(rate, w, cfg, args.net, root / f"{rate:g}mbit"))
            c = cells[-1]
            print(
                f"  wan_speedup {c['wan_speedup']:.2f}"
                + ("" if c["dp_reached"] else " (lower bound: data parallel never reached it)"),
                flush=True,
            )
    rows = []
    for c in cells:
        for kind in ("dp", "decoupled"):
            r = c[kind]
            rows.append(
                {
                    "run": r["name"],
                    "eval_loss": r["eval_loss"],
                    "wall_s": r["wall_s"],
                    "steps_per_s": r["steps_per_s"],
                    "bytes_per_step": r.get("steady_bytes_per_step") or r.get("bytes_per_step"),
                    "dp_time_to_its_loss_s": c["dp_time_to_decoupled_loss_s"]
                    if kind == "decoupled"
                    else "",
                    "wan_speedup": c["wan_speedup"] if kind == "decoupled" else "",
                }
            )
    print()
    print(
        table(
            rows,
            [
                "run",
                "eval_loss",
                "wall_s",
                "steps_per_s",
                "bytes_per_step",
                "dp_time_to_its_loss_s",
                "wan_speedup",
            ],
        )
    )
    for c in cells:
        json_path = (
            args.json.with_name(f"{args.json.stem}-{c['rate_mbit']:g}mbit.json")
            if args.json
            else None
        )
        loss_curves(
            [c["dp"], c["decoupled"]],
            png_path(json_path, ""),
            f"{w.learners} learners over {c['rate_mbit']:g} Mbit/s links",
            w.batch_size * w.context,
        )
        for kind in ("dp", "decoupled"):
            c[kind].pop("results", None)
    head = cells[0]
    result: dict[str, Any] = {
        "wan_speedup": head["wan_speedup"],
        "wan_rate_mbit": head["rate_mbit"],
        "wan_lower_bound": not head["dp_reached"],
        "wan_dp_shaped": head["dp_shaped"],
        **{f"wan_speedup_{c['rate_mbit']:g}mbit": c["wan_speedup"] for c in cells},
        "steps": w.steps,
        "learners": w.learners,
        "decoupled": dataclasses.asdict(cfg),
        "cells": cells,
        "machine": machine(),
    }
    print(
        f"\nwan_speedup = {result['wan_speedup']:.3f} at {head['rate_mbit']:g} Mbit/s"
        + (" (lower bound)" if result["wan_lower_bound"] else "")
    )
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
