"""Convergence at equal tokens: M = 4 learners of the bundled example, DiLoCo variants against
data parallel and against one learner alone, with the bytes each learner put on its link.

Configurations, run one after another (each learner process on its own link, see bench/net.py;
every one trains `steps` inner steps of the same batch, so tokens are equal):

  dp              (a) gradients all-reduced every step (torch.distributed, gloo)
  diloco_sync     (b) synchronous DiLoCo: quorum = every live learner, FP32, P = 1, each learner
                      blocks one step after a push until the round is back (strict overlap)
  default             what a user gets with no flags, Synchronizer and learners, at the same H
  decoupled_fp32  (c) Decoupled DiLoCo: quorum 1 + adaptive grace, token weights, FP32, P = 1
  decoupled_int4  (c) the same with INT4 pushes (error feedback)
  streaming_int4  (d) (c) INT4 with P = 4 streaming fragments
  alone           (e) one learner, the same per-learner tokens, no syncing

All DiLoCo runs share H = 100 (`--sync-every`), the mix merge (alpha 0.5), outer Nesterov
(lr 1.0, momentum 0.9), anchoring at the current global fragment and INT8 delta pulls. The
adaptive grace is sized by the Synchronizer's tau (`--overlap-steps`) = H, capped at 5 s: a
learner needs fragment p back only before its next push of it, H steps later, so waiting half
of that for more pushes to share the round is free. One round per fragment and cycle is what
keeps each delta pull to one INT8 update (and the outer momentum to one step per cycle). These
settings were picked by measuring (docs/performance.md has the sweep).

Eval loss is the global model's (pulled from the Synchronizer after the last learner finished),
data parallel's final model, or the lone learner's. Bytes per step: sent + received on the
learner's link, mean over learners, in the steady state (between each learner's first and last
progress line: the rate a long run pays) and over the whole run (join, first full pull of the
model and final pull included).

Headline, for the best Decoupled configuration (the lowest eval loss among (c) and (d) that
reach 500x fewer bytes than data parallel, or the lowest eval loss if none does):
`bandwidth_ratio` = (a)'s steady bytes per step over its; `loss_gap` = its eval loss over (a)'s,
minus 1; `m1_gain` = (e)'s eval loss over its, minus 1. For the defaults: `default_vs_sync` =
the default arm's eval loss over (b)'s, `default_vs_dp` = over (a)'s (target <= 1.03),
`default_vs_best` = over the lowest of the DiLoCo arms'.

    python -m bench.convergence [--quick | --smoke] [--json PATH] [--steps S] [--sync-every H]
        [--only dp,streaming_int4,...] [--set field=value ...] [--net auto|netns|proxy]
        [--default-args FLAGS] [--default-train-args FLAGS] [--seed N]
        [--d-model D] [--n-layer L] [--lr LR]
Modes: --smoke a tiny model, 2 learners, 40 steps, without (c); --quick 300 steps (under 4 minutes here); full
3000 steps (18 minutes in the recorded run; up to about 27 when the machine is busier).
`--d-model 128` trains every arm at twice the width (about 3.7x the parameters; 11-12 minutes
per arm in full mode here).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from bench.common import machine, parser, program, run_mode, say_mode, table, write_json
from bench.dp import DPJob
from bench.jobs import SMOKE_SHORT, Decoupled, DilocoJob, Workload, alone
from bench.net import open_links
from bench.plots import loss_curves, png_path

TARGET_RATIO = 500
QUICK_IS_SMOKE = (
    "300 steps are too few for the loss figures (quick measured m1_gain -0.035 and loss_gap "
    "0.163 where full mode's 3,000 steps measure 0.108 and 0.049); bandwidth_ratio and "
    "default_vs_sync keep their direction"
)
DECOUPLED = Decoupled(
    name="decoupled_int4", quorum=1, grace="adaptive", sync_every=100, fragments=1, codec="int4"
)
BEST = DECOUPLED.with_(name="streaming_int4", fragments=4)  # what wan and goodput run


def configs(
    base: Decoupled, default_args: list[str], default_train: list[str]
) -> dict[str, Decoupled]:
    """The DiLoCo arms over `base`; the default arm takes only the flags given for it."""
    return {
        "diloco_sync": base.with_(
            name="diloco_sync", quorum=0, codec="fp32", strict_overlap=True, round_share="full"
        ),
        "default": Decoupled.with_defaults(
            "default",
            base.sync_every,
            synchronizer_args=default_args,
            train_args=default_train,
        ),
        "decoupled_fp32": base.with_(name="decoupled_fp32", codec="fp32"),
        "decoupled_int4": base.with_(name="decoupled_int4"),
        "streaming_int4": base.with_(name="streaming_int4", fragments=4),
    }


ORDER = [
    "dp",
    "diloco_sync",
    "default",
    "decoupled_fp32",
    "decoupled_int4",
    "streaming_int4",
    "alone",
]
SMOKE_ORDER = [n for n in ORDER if n not in ("decoupled_fp32", "decoupled_int4")]
CANDIDATES = ("decoupled_fp32", "decoupled_int4", "streaming_int4")


def parse_set(items: list[str], base: Decoupled) -> Decoupled:
    """--set field=value over the Decoupled settings (typed like the field's default)."""
    fields = {f.name: f for f in dataclasses.fields(Decoupled)}
    changes: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in fields or key == "name":
            raise SystemExit(
                f"--set {item!r}: expected field=value with field one of {sorted(set(fields) - {'name'})}"
            )
        default = getattr(base, key)
        if isinstance(default, bool):
            changes[key] = value.lower() in ("1", "true", "yes")
        elif isinstance(default, list):
            changes[key] = value.split()
        else:
            changes[key] = type(default)(value)
    return base.with_(**changes)


def workload(args: argparse.Namespace) -> tuple[Workload, Decoupled]:
    """What every arm trains (mode, steps, seed, model size, learning rate) and the DiLoCo
    arms' base, from the flags. A bad value raises ValueError saying what was expected."""
    for flag, value, least in (
        ("--seed", args.seed, 0),
        ("--steps", args.steps, 1),
        ("--sync-every", args.sync_every, 1),
        ("--d-model", args.d_model, 1),
        ("--n-layer", args.n_layer, 1),
    ):
        if value is not None and value < least:
            raise ValueError(f"{flag} takes a number >= {least}, got {value}")
    if args.lr is not None and not 0 < args.lr < float("inf"):
        raise ValueError(f"--lr takes a number > 0, got {args.lr}")
    if args.smoke:
        w, base = dataclasses.replace(SMOKE_SHORT), DECOUPLED.with_(sync_every=10)
    else:
        w, base = Workload(steps=300 if args.quick else 3000), DECOUPLED
    if args.d_model is not None:
        if args.d_model % w.n_head:
            raise ValueError(
                f"--d-model takes a multiple of the {w.n_head} heads, got {args.d_model}"
            )
        w.d_model = args.d_model
    if args.n_layer is not None:
        w.n_layer = args.n_layer
    if args.lr is not None:
        w.lr = args.lr
    if args.steps:
        w.steps = args.steps
    w.seed = args.seed
    if args.sync_every:
        base = base.with_(sync_every=args.sync_every)
    return w, base


def headline(rows: dict[str, dict]) -> dict[str, Any]:
    dp = rows.get("dp")

    def per_step(r: dict) -> float | None:
        return r.get("steady_bytes_per_step") or r.get("bytes_per_step")

    for r in rows.values():
        dp_bytes, r_bytes = (per_step(dp) if dp else None), per_step(r)
        if dp and r is not dp and dp_bytes and r_bytes:
            r["dp_over_bytes"] = dp_bytes / r_bytes
            r["dp_over_bytes_total"] = (
                dp["bytes_per_step"] / r["bytes_per_step"] if r.get("bytes_per_step") else None
            )
        if dp and r is not dp:
            r["gap_to_dp"] = r["eval_loss"] / dp["eval_loss"] - 1
    out: dict[str, Any] = {}
    if "default" in rows:
        diloco = [r for n, r in rows.items() if n not in ("dp", "alone")]
        best_arm = min(diloco, key=lambda r: r["eval_loss"])
        if "diloco_sync" in rows:
            out["default_vs_sync"] = rows["default"]["eval_loss"] / rows["diloco_sync"]["eval_loss"]
        if dp:
            out["default_vs_dp"] = rows["default"]["eval_loss"] / dp["eval_loss"]
        out["default_vs_best"] = rows["default"]["eval_loss"] / best_arm["eval_loss"]
        out["default_best_arm"] = best_arm["name"]
    candidates = [rows[n] for n in CANDIDATES if n in rows]
    if not candidates:
        return out
    eligible = [
        r for r in candidates if (r.get("dp_over_bytes") or 0) >= TARGET_RATIO
    ] or candidates
    best = min(eligible, key=lambda r: r["eval_loss"])
    out.update(best=best["name"], best_config=best["config"])
    if dp:
        out["bandwidth_ratio"] = best.get("dp_over_bytes")
        out["bandwidth_ratio_total"] = best.get("dp_over_bytes_total")
        out["loss_gap"] = best["eval_loss"] / dp["eval_loss"] - 1
    if "alone" in rows:
        out["m1_gain"] = rows["alone"]["eval_loss"] / best["eval_loss"] - 1
    return out


def arguments() -> argparse.ArgumentParser:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, help="inner steps per learner")
    p.add_argument("--sync-every", type=int, help="H for every DiLoCo configuration")
    p.add_argument("--only", help=f"comma-separated subset of {','.join(ORDER)}")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a Decoupled setting for every DiLoCo configuration (e.g. alpha=0.7, grace=fixed)",
    )
    p.add_argument(
        "--default-args",
        default="",
        metavar="FLAGS",
        help="Synchronizer flags for the default arm only (--set does not reach it), e.g. "
        "'--outer-lr 1.0': how a candidate default is measured",
    )
    p.add_argument(
        "--default-train-args",
        default="",
        metavar="FLAGS",
        help="learner flags for the default arm only, e.g. '--alpha 0.25'",
    )
    p.add_argument(
        "--net",
        choices=("auto", "netns", "proxy"),
        default="auto",
        help="links: namespaces (root) or proxies",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="model initialisation and data order of every arm (data parallel's too)",
    )
    p.add_argument(
        "--d-model",
        type=int,
        help=f"the model's width for every arm (default {Workload.d_model}); a multiple of "
        f"its {Workload.n_head} heads",
    )
    p.add_argument(
        "--n-layer", type=int, help=f"the model's depth for every arm (default {Workload.n_layer})"
    )
    p.add_argument(
        "--lr",
        type=float,
        help=f"the inner peak learning rate of every arm, data parallel's too (default "
        f"{Workload.lr}); --default-train-args=--lr changes the default arm's alone",
    )
    p.add_argument("--out", type=Path, help="keep the runs' logs and result files here")
    return p


def main(argv: list[str] | None = None) -> dict:
    p = arguments()
    args = p.parse_args(argv)
    try:
        w, base = workload(args)
    except ValueError as e:
        p.error(str(e))
    mode = run_mode(args, QUICK_IS_SMOKE)
    say_mode(mode)
    base = parse_set(args.set, base)
    # The smoke leaves out (c) FP32 and INT4 with P = 1: (d) runs the same code with P = 4.
    names = args.only.split(",") if args.only else SMOKE_ORDER if args.smoke else ORDER
    unknown = set(names) - set(ORDER)
    if unknown:
        raise SystemExit(f"--only: unknown {sorted(unknown)}; choose from {ORDER}")
    decoupled = configs(base, args.default_args.split(), args.default_train_args.split())

    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-convergence-") as tmp:
        root = args.out or Path(tmp)
        with open_links(args.net, w.learners) as links:
            print(
                f"{w.learners} learners x {w.steps} steps, model d_model {w.d_model} x "
                f"{w.n_layer} layers, lr {w.lr:g}, seed {w.seed}, links: {links.kind}",
                flush=True,
            )
            for name in [n for n in ORDER if n in names]:
                if name == "dp":
                    rows[name] = DPJob(
                        w, links, root / name, eval_every=max(1, w.steps // 10)
                    ).run()
                elif name == "alone":
                    rows[name] = alone(w, root / name)
                else:
                    rows[name] = DilocoJob(decoupled[name], w, links, root / name).run()
                r = rows[name]
                print(
                    f"  {name:15s} eval loss {r['eval_loss']:.4f}  {r.get('steady_bytes_per_step') or 0:12,.0f} B/step  {r['wall_s']:6.1f} s",
                    flush=True,
                )
    head = headline(rows)
    print()
    print(
        table(
            list(rows.values()),
            [
                "name",
                "eval_loss",
                "gap_to_dp",
                "steady_bytes_per_step",
                "bytes_per_step",
                "dp_over_bytes",
                "dp_over_bytes_total",
                "wall_s",
                "steps_per_s",
                "config",
            ],
        )
    )
    print()
    print(
        "  ".join(
            f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in head.items()
        )
    )
    tokens_per_step = w.batch_size * w.context
    loss_curves(
        list(rows.values()),
        png_path(args.json, ""),
        f"Equal tokens: {w.learners} learners x {w.steps} steps",
        tokens_per_step,
    )
    for r in rows.values():
        r.pop("results", None)
    say_mode(mode)
    result = {
        **head,
        **mode,
        "steps": w.steps,
        "learners": w.learners,
        "workload": dataclasses.asdict(w),
        "decoupled": dataclasses.asdict(base),
        "runs": rows,
        "machine": machine(),
    }
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    program(main)
