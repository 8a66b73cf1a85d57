"""A loss-to-tokens curve of synchronous DiLoCo on the bundled example: the reference run of the
effective goodput (docs/protocol.md, "Evaluators and effective goodput").

It trains bench.goodput's workload with bench.goodput's synchronous DiLoCo (K = every live
learner, FP32, P = 1, strict overlap), with no faults, and evaluates the served model every few
seconds (an evaluator: it counts as no learner). Each point is (training tokens the learners had
consumed when the model was pulled, as the Synchronizer counts them from their heartbeats, so
up to a heartbeat interval behind; its eval loss on the held-out windows), from the initial
model at 0 tokens to the final one, whose tokens are the learner processes' own count (what
bench.goodput counts for every arm).

    python -m bench.reference [--quick | --smoke] [--json PATH] [--steps S] [--points N]

`--json` writes `{"points": [[tokens, eval_loss], ...], ...}`, which `diloco-synchronizer serve
--reference-curve PATH` and `bench.goodput --reference PATH` read. Modes as bench.goodput's:
--smoke a tiny model, 2 learners, 60 steps; --quick 400 steps; full 2000.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from bench.common import machine, parser, program, run_mode, say_mode, write_json
from bench.convergence import BEST
from bench.jobs import SMOKE_SHORT, Decoupled, DilocoJob, GlobalModel, Workload
from bench.net import open_links

STEPS_PER_S = 16  # per learner, about, 4 learners on 2 cores here: how often to evaluate
LEASE_S = 3.0


def workload(args: argparse.Namespace) -> tuple[Workload, Decoupled]:
    """bench.goodput's workload and Decoupled configuration for the mode `args` asks for."""
    if args.smoke:
        w = dataclasses.replace(SMOKE_SHORT, steps=60)
        cfg = BEST.with_(sync_every=10, fragments=1, lease_s=1.0)
    else:
        w = Workload(steps=400 if args.quick else 2000)
        cfg = BEST.with_(fragments=1, lease_s=LEASE_S)
    if args.steps:
        w.steps = args.steps
    return w, cfg


def synchronous(cfg: Decoupled) -> Decoupled:
    """Synchronous DiLoCo, bench/convergence.py's (b): FP32, P = 1, every learner each round."""
    return cfg.with_(
        name="sync", quorum=0, strict_overlap=True, fragments=1, codec="fp32", round_share="full"
    )


def consumed_tokens(run: dict[str, Any]) -> int:
    """Tokens every learner process of a DiLoCo run trained (redone steps of a restarted one
    included), from their own results."""
    return sum(r.get("tokens", 0) for incarnations in run["results"] for r in incarnations)


def curve_of(run: dict[str, Any]) -> list[list[float]]:
    """[tokens, eval_loss] of a DiLoCo run's evaluations, from its initial model at 0 tokens
    (every learner's start loss: they start from one model) to its final model at the tokens
    its processes trained; points whose tokens do not grow are left out."""
    start = run["results"][0][0]["eval_loss_start"]
    points = [[0.0, float(start)]]
    final = run["eval_series"][-1]
    total = float(consumed_tokens(run))
    for e in run["eval_series"][:-1]:
        if e.get("tokens") and points[-1][0] < e["tokens"] < total:
            points.append([float(e["tokens"]), float(e["eval_loss"])])
    if total > points[-1][0]:
        points.append([total, float(final["eval_loss"])])
    return points


def record(w: Workload, cfg: Decoupled, net: str, out: Path, points: int = 12) -> dict[str, Any]:
    """Runs synchronous DiLoCo of `w` with no faults, evaluating about `points` times."""
    sync = synchronous(cfg)
    with open_links(net, w.learners) as links:
        job = DilocoJob(sync, w, links, out)
        run = job.run(
            evaluator=GlobalModel(w, sync.fragments),
            eval_every_s=max(0.5, w.steps / STEPS_PER_S / points),
        )
    curve = curve_of(run)
    return {
        "points": curve,
        "eval_loss": run["eval_loss"],
        "wall_s": run["wall_s"],
        "config": sync.describe(),
        "workload": dataclasses.asdict(w),
    }


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, help="inner steps per learner")
    p.add_argument("--points", type=int, default=12, help="evaluations during the run, about")
    p.add_argument("--net", choices=("auto", "netns", "proxy"), default="auto", help="links")
    p.add_argument("--out", type=Path, help="keep the run's logs and result files here")
    args = p.parse_args(argv)
    mode = run_mode(args)
    say_mode(mode)
    w, cfg = workload(args)
    with tempfile.TemporaryDirectory(prefix="bench-reference-") as tmp:
        ref = record(w, cfg, args.net, args.out or Path(tmp), args.points)
    for tokens, loss in ref["points"]:
        print(f"  {tokens:12,.0f} tokens  eval loss {loss:.4f}", flush=True)
    result = {**ref, **mode, "machine": machine()}
    say_mode(mode)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    program(main)
