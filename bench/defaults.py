"""Choosing the defaults by measurement: candidate Synchronizer settings against synchronous FP32
DiLoCo in every cell of learners x H x learner speeds, at equal tokens, on the bundled example.

Arms (each a Synchronizer and M learner processes on their own links, see bench/jobs.py):

  sync              synchronous FP32 DiLoCo, the baseline a default must never lose to: quorum =
                    every live learner, P = 1, FP32 pushes, overwrite merge, outer Nesterov
                    (0.7, 0.9), no Dynamic Local Updates, each learner blocking one step after a
                    push until the round is back, each round a whole step (`--round-share full`:
                    what torchft's DiLoCo does with an all-reduce, also once a learner has left)
  default           no flags at all but H: whatever the installed defaults are
  default_grace2    the defaults with `--grace-max-s 2` (the cap before 2026-12-07: rounds wait
                    less for more pushes)
  default_peers     the defaults with `--grace peers` (rounds also wait for the learners of the
                    first pushers' pace that are due soon, not for slower ones)
  delayed_nesterov  the defaults with `--outer delayed_nesterov --no-dynamic-local-updates`
                    (momentum every outer_delay rounds: the defaults before this study)
  nesterov          the defaults with `--outer nesterov --no-dynamic-local-updates`
  nesterov_lr1      the same with `--outer-lr 1.0`
  quorum_all        the defaults with `--quorum 0 --outer nesterov` (synchronous rounds, INT4, P=4)
  nesterov_stale    the defaults with `--outer nesterov --staleness-weight poly`
  nesterov_dlu      the defaults with `--outer nesterov` and Dynamic Local Updates with the
                    Synchronizer's H (`--inner-steps H`: every learner's H scaled by its speed)
  grace_none        the defaults with `--grace none` (a round closes at its quorum)
  weight_uniform    the defaults with `--token-weight uniform` (every push weighs the same)
  weight_tokens     the defaults with `--token-weight tokens` (a push weighs its tokens)
  anchor_base       the defaults with `--anchor base` (a stale delta applied to its own base)
  share_full        the defaults with `--round-share full` (every round a whole outer step, however
                    few learners it holds: the defaults before 2026-12-04)
  merge_overwrite   the defaults, learners `--merge overwrite` (a fresh fragment replaces local)
  merge_rebase      the defaults, learners `--merge rebase`
  alpha_0.25        the defaults, learners `--alpha 0.25` (mix: the fresh fragment weighs 0.25)
  alpha_0.75        the defaults, learners `--alpha 0.75` (and 0.75)
  strict_tau10      the defaults, learners `--strict-overlap --overlap-steps 10` (each result
                    merged exactly 10 steps after its push: waited for when late)
  pulls_int8        the defaults, learners `--no-delta-pulls --pull-codec int8` (every pull the
                    whole fragment in INT8 blocks: about 1 byte per parameter, however many
                    versions were missed, against one INT8 update per version for a delta pull)
  no_dlu            the defaults with `--no-dynamic-local-updates` (every learner's H is H,
                    however slow: its H no longer follows measured step rates)
  no_dlu_strict     no_dlu, learners `--strict-overlap --overlap-steps 10` (neither H nor the
                    step a result is merged at depends on timing)
  dlu_levels8       the defaults with `--dlu-levels 8` (a slow learner's speed ratio told in
                    eighths, and changed only once its measured ratio moves 3/4 of one away)

Cells: M learners (2, 4, 8) x H (50, 100) x speeds: `equal`, or `slow` (the last learner runs 3x
slower and trains steps/3 steps, what it reaches while the others train theirs). Within a cell
every arm trains the same steps of the same data shards, so tokens are equal.

For each cell: every arm's eval loss of the global model (pulled after the last learner
finished; the mean over `--repeats` runs, with their `spread`: max - min over the mean), its
ratio to the best arm of the cell (`vs_best`) and to `sync` (`vs_sync`). The
summary names, per arm, the worst `vs_best` and `vs_sync` over the cells; an arm qualifies as a
default when it is within 1% of the best in every cell and never above `sync`. Top-level keys
`default_worst_vs_best` and `default_worst_vs_sync` are the `default` arm's.

    python -m bench.defaults [--quick | --smoke] [--json PATH] [--steps S] [--learners 2,4,8]
        [--sync-every 50,100] [--speeds equal,slow] [--arms sync,default,...] [--repeats R]
        [--seeds 0,1,2]
Modes: --smoke the bundled example, 2 learners, 300 steps, H 25, arms sync and default (the
suite's regression test of the defaults: the old default, Delayed Nesterov, ends 5% above sync
there, the defaults 4.5% below; a tiny model shows no difference); --quick 2 and 4 learners,
H 100, equal speeds, 500 steps; full: every cell, 1000 steps. `--seeds` runs every arm
`--repeats` times for each seed (model initialisation and data order, default 0 only): `sync`
ends alike in every run of one seed, so its spread over seeds is what a different seed alone
moves the loss by, the floor against which an asynchronous arm's spread is read. Each cell's
`by_seed` holds every arm's mean and spread per seed (printed when there are several seeds).
Each cell's `run_details` holds, per arm in the order of `runs`, what each run's rounds did
beside its loss (also printed with it): the Synchronizer's outer steps and accepted pushes, and
how far its learners of equal speed drifted apart in time (`drift_max_s`, `drift_mean_s`: at
each step they all reported, max - min of when each reached it): one cause of the spread of
issue 28's cell (docs/performance.md, "Seed 1 again, on a slower machine").
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import machine, parser, program, table, write_json
from bench.jobs import Decoupled, DilocoJob, Workload
from bench.net import open_links

SLOW_FACTOR = 3.0
WITHIN = 0.01  # a default is within 1% of the best arm in every cell


def _defaults(name: str, *args: str) -> Callable[[int], Decoupled]:
    return lambda h: Decoupled.with_defaults(name, h, synchronizer_args=list(args))


def _learner(name: str, *args: str) -> Callable[[int], Decoupled]:
    return lambda h: Decoupled.with_defaults(name, h, train_args=list(args))


ARMS: dict[str, Callable[[int], Decoupled]] = {
    "sync": lambda h: Decoupled(
        name="sync",
        quorum=0,
        sync_every=h,
        fragments=1,
        codec="fp32",
        merge="overwrite",
        strict_overlap=True,
        outer="nesterov",
        outer_lr=0.7,
        outer_momentum=0.9,
        round_share="full",
        synchronizer_args=["--no-dynamic-local-updates"],
    ),
    "default": _defaults("default"),
    "default_grace2": _defaults("default_grace2", "--grace-max-s", "2"),
    "default_peers": _defaults("default_peers", "--grace", "peers"),
    "delayed_nesterov": _defaults(
        "delayed_nesterov", "--outer", "delayed_nesterov", "--no-dynamic-local-updates"
    ),
    "nesterov": _defaults("nesterov", "--outer", "nesterov", "--no-dynamic-local-updates"),
    "nesterov_lr1": _defaults(
        "nesterov_lr1", "--outer", "nesterov", "--outer-lr", "1.0", "--no-dynamic-local-updates"
    ),
    "quorum_all": _defaults("quorum_all", "--quorum", "0", "--outer", "nesterov"),
    "nesterov_stale": _defaults(
        "nesterov_stale", "--outer", "nesterov", "--staleness-weight", "poly"
    ),
    "grace_none": _defaults("grace_none", "--grace", "none"),
    "weight_uniform": _defaults("weight_uniform", "--token-weight", "uniform"),
    "weight_tokens": _defaults("weight_tokens", "--token-weight", "tokens"),
    "anchor_base": _defaults("anchor_base", "--anchor", "base"),
    "share_full": _defaults("share_full", "--round-share", "full"),
    "merge_overwrite": _learner("merge_overwrite", "--merge", "overwrite"),
    "merge_rebase": _learner("merge_rebase", "--merge", "rebase"),
    "alpha_0.25": _learner("alpha_0.25", "--alpha", "0.25"),
    "alpha_0.75": _learner("alpha_0.75", "--alpha", "0.75"),
    "strict_tau10": _learner("strict_tau10", "--strict-overlap", "--overlap-steps", "10"),
    "no_final_push": _learner("no_final_push", "--no-final-push"),
    "pulls_int8": _learner("pulls_int8", "--no-delta-pulls", "--pull-codec", "int8"),
    "no_dlu": _defaults("no_dlu", "--no-dynamic-local-updates"),
    "dlu_levels8": _defaults("dlu_levels8", "--dlu-levels", "8"),
    "no_dlu_strict": lambda h: Decoupled.with_defaults(
        "no_dlu_strict",
        h,
        synchronizer_args=["--no-dynamic-local-updates"],
        train_args=["--strict-overlap", "--overlap-steps", "10"],
    ),
    "nesterov_dlu": lambda h: Decoupled.with_defaults(
        "nesterov_dlu",
        h,
        synchronizer_args=[
            "--outer",
            "nesterov",
            "--dynamic-local-updates",
            "--inner-steps",
            str(h),
        ],
    ),
}


def spread(losses: list[float]) -> float:
    """How far runs end apart: (max - min) / mean."""
    return (max(losses) - min(losses)) / statistics.mean(losses)


def pace_drift(results: list[list[dict]], slow: int) -> dict[str, float | None]:
    """How far the learners of equal speed (every slot but `slow`, -1: none) drifted apart in
    time: at every step that all of them reported, max - min of when each reached it (the
    seconds a round waits for the last of them, or splits); `max_s` and `mean_s` over those
    steps, None with fewer than two such learners or no common step. `results`: each slot's
    result files, one per incarnation (`DilocoJob.summarize`), the later ones' times kept."""
    times: list[dict[int, float]] = []
    for i, runs in enumerate(results):
        if i == slow:
            continue
        at: dict[int, float] = {}
        for r in runs:
            at |= {e["step"]: e["t"] for e in r.get("series") or []}
        times.append(at)
    common = sorted(set.intersection(*(set(t) for t in times))) if len(times) > 1 else []
    apart = [max(t[s] for t in times) - min(t[s] for t in times) for s in common]
    return {
        "max_s": max(apart) if apart else None,
        "mean_s": statistics.mean(apart) if apart else None,
    }


def run_detail(run: dict, slow: int) -> dict[str, Any]:
    """What a run's rounds did, beside its loss: the Synchronizer's outer steps and accepted
    pushes (rounds of fewer pushes mean more outer steps for the same pushes), and how far its
    learners of equal speed drifted apart (`pace_drift`)."""
    drift = pace_drift(run["results"], slow)
    return {
        "outer_steps": run["outer_steps"],
        "pushes_accepted": run["pushes"].get("accepted", 0.0),
        "drift_max_s": drift["max_s"],
        "drift_mean_s": drift["mean_s"],
    }


def by_seed(
    losses: dict[str, list[float]], seeds: dict[str, list[int]]
) -> dict[str, dict[str, dict[str, float]]]:
    """Per arm and seed: the mean and spread of that seed's runs (the runs of one seed differ
    only by timing; the spread over all runs also holds what the seed moves)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for arm, runs in losses.items():
        grouped: dict[int, list[float]] = {}
        for seed, loss in zip(seeds[arm], runs, strict=True):
            grouped.setdefault(seed, []).append(loss)
        out[arm] = {
            str(seed): {"mean": statistics.mean(v), "spread": spread(v)}
            for seed, v in grouped.items()
        }
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def summarize(cells: list[dict]) -> dict[str, dict[str, Any]]:
    """Per arm: the worst ratio to the best arm and to `sync` over the cells, and whether it
    qualifies as a default (within WITHIN of the best everywhere, never above sync)."""
    out: dict[str, dict[str, Any]] = {}
    for arm in cells[0]["loss"]:
        vs_best = [c["vs_best"][arm] for c in cells]
        vs_sync = [c["vs_sync"][arm] for c in cells if "vs_sync" in c]
        out[arm] = {
            "worst_vs_best": max(vs_best),
            "mean_vs_best": statistics.mean(vs_best),
            "worst_vs_sync": max(vs_sync) if vs_sync else None,
            "worst_spread": max(c["spread"][arm] for c in cells),
            "qualifies": max(vs_best) <= 1 + WITHIN and (not vs_sync or max(vs_sync) <= 1.0),
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, help="inner steps per (fast) learner")
    p.add_argument("--learners", type=_ints, help="comma-separated learner counts M")
    p.add_argument("--sync-every", type=_ints, help="comma-separated H values")
    p.add_argument("--speeds", help="comma-separated: equal, slow")
    p.add_argument("--arms", help=f"comma-separated subset of {','.join(ARMS)}")
    p.add_argument("--repeats", type=int, default=1, help="runs of each arm per cell (mean)")
    p.add_argument(
        "--seeds",
        type=_ints,
        default=[0],
        help="comma-separated seeds (model initialisation, data order): --repeats runs of each",
    )
    p.add_argument(
        "--net", choices=("auto", "netns", "proxy"), default="auto", help="links to learners"
    )
    p.add_argument("--out", type=Path, help="keep the runs' logs and result files here")
    args = p.parse_args(argv)
    if args.smoke:
        base, learners, hs, speeds = Workload(learners=2, steps=300), [2], [25], ["equal"]
        arms = ["sync", "default"]
    elif args.quick:
        base, learners, hs, speeds = Workload(steps=500), [2, 4], [100], ["equal"]
        arms = ["sync", "default", "delayed_nesterov", "nesterov"]
    else:
        base, learners, hs, speeds = Workload(steps=1000), [2, 4, 8], [50, 100], ["equal", "slow"]
        arms = ["sync", "default", "delayed_nesterov", "nesterov", "nesterov_lr1"]
    if args.steps:
        base.steps = args.steps
    learners = args.learners or learners
    hs = args.sync_every or hs
    speeds = args.speeds.split(",") if args.speeds else speeds
    arms = args.arms.split(",") if args.arms else arms
    if not args.seeds or min(args.seeds) < 0:
        raise SystemExit(f"--seeds: integers >= 0, got {args.seeds}")
    unknown = sorted(set(arms) - set(ARMS)) + sorted(set(speeds) - {"equal", "slow"})
    if unknown:
        raise SystemExit(
            f"unknown arms or speeds {unknown}; arms: {list(ARMS)}; speeds: equal, slow"
        )

    cells: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-defaults-") as tmp:
        root = args.out or Path(tmp)
        for m in learners:
            with open_links(args.net, m) as links:
                for h in hs:
                    for speed in speeds:
                        w = dataclasses.replace(
                            base,
                            learners=m,
                            slow_learner=m - 1 if speed == "slow" else -1,
                            slow_factor=SLOW_FACTOR if speed == "slow" else 1.0,
                        )
                        cell: dict[str, Any] = {"learners": m, "H": h, "speed": speed}
                        losses: dict[str, list[float]] = {}
                        seeds: dict[str, list[int]] = {}
                        details: dict[str, list[dict[str, Any]]] = {}
                        for arm in arms:
                            for seed in args.seeds:
                                for r in range(args.repeats):
                                    run = DilocoJob(
                                        ARMS[arm](h),
                                        dataclasses.replace(w, seed=seed),
                                        links,
                                        root / f"m{m}-h{h}-{speed}-{arm}-s{seed}-{r}",
                                    ).run()
                                    losses.setdefault(arm, []).append(run["eval_loss"])
                                    seeds.setdefault(arm, []).append(seed)
                                    detail = run_detail(run, w.slow_learner)
                                    details.setdefault(arm, []).append(detail)
                                    drift = detail["drift_max_s"]
                                    apart = "-" if drift is None else f"{drift:.2f} s"
                                    print(
                                        f"  M={m} H={h} {speed:5s} {arm:16s} seed {seed} "
                                        f"eval loss {run['eval_loss']:.4f}  "
                                        f"{run['wall_s']:6.1f} s  "
                                        f"outer steps {detail['outer_steps']:.0f}, "
                                        f"pushes {detail['pushes_accepted']:.0f}, "
                                        f"apart at most {apart}  ({run['config']})",
                                        flush=True,
                                    )
                        loss = {a: statistics.mean(v) for a, v in losses.items()}
                        best = min(loss.values())
                        cell["loss"] = loss
                        cell["runs"] = losses
                        cell["seeds"] = seeds  # the seed of each run, in the order of `runs`
                        cell["run_details"] = details  # what each run's rounds did, same order
                        # how far runs of one arm end apart: (max - min) / mean
                        cell["spread"] = {a: spread(v) for a, v in losses.items()}
                        cell["by_seed"] = by_seed(losses, seeds)
                        cell["best"] = min(loss, key=loss.__getitem__)
                        cell["vs_best"] = {a: v / best for a, v in loss.items()}
                        if "sync" in loss:
                            cell["vs_sync"] = {a: v / loss["sync"] for a, v in loss.items()}
                        cells.append(cell)
    summary = summarize(cells)
    rows = [
        {
            "cell": f"M={c['learners']} H={c['H']} {c['speed']}",
            **{a: c["loss"][a] for a in arms},
            "best": c["best"],
        }
        for c in cells
    ]
    print()
    print(table(rows, ["cell", *arms, "best"]))
    if len(args.seeds) > 1:
        print()
        print(
            table(
                [
                    {
                        "cell": r["cell"],
                        "arm": a,
                        "seed": seed,
                        "mean": f"{figures['mean']:.4f}",
                        "spread": f"{figures['spread']:.2%}",
                    }
                    for r, c in zip(rows, cells, strict=True)
                    for a, per_seed in c["by_seed"].items()
                    for seed, figures in per_seed.items()
                ],
                ["cell", "arm", "seed", "mean", "spread"],
            )
        )
    print()
    print(
        table(
            [{"arm": a, **s} for a, s in summary.items()],
            ["arm", "worst_vs_best", "mean_vs_best", "worst_vs_sync", "worst_spread", "qualifies"],
        )
    )
    result: dict[str, Any] = {}
    if "default" in summary:
        result["default_worst_vs_best"] = summary["default"]["worst_vs_best"]
        result["default_worst_vs_sync"] = summary["default"]["worst_vs_sync"]
    result |= {
        "qualifying": [a for a, s in summary.items() if s["qualifies"]],
        "summary": summary,
        "cells": cells,
        "arms": {a: ARMS[a](hs[0]).describe() for a in arms},
        "workload": dataclasses.asdict(base),
        "machine": machine(),
    }
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    program(main)
