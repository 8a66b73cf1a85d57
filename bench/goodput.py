"""Goodput under faults: one seeded fault schedule applied identically to Decoupled DiLoCo,
synchronous DiLoCo and lockstep data parallel, goodput computed the same way for all three.

The schedule (`schedule`, from `--seed`): one learner slot crashes (SIGKILL) and comes back
`restart_after_s` later (twice the lease), and two other slots run 3x and 2x slower for a while
(SIGSTOP/SIGCONT in 100 ms periods, so the machine is slower and its heartbeats and sockets
carry on, as with a throttled or shared GPU). Times count from the first training step, so the
same wall-clock faults hit every system; every slot trains the same `steps` (equal tokens).

  decoupled   bench/convergence.py's (c) with INT4 (K = 1 + adaptive grace, token weights,
              H = 100, P = 1): the crashed learner restarts from the step it had reached, under
              its old learner id
  sync        synchronous DiLoCo, bench/convergence.py's (b) (K = every live learner, FP32,
              P = 1, strict overlap: a learner waits for each round): the round waits for a
              dead learner until its lease lapses, and for slow ones always; the crashed
              learner restarts from its last sync boundary (a multiple of H), redoing the steps
              it had not pushed, so that its pushes line up with everyone else's rounds (P = 1
              as in DiLoCo)
  lockstep    data parallel (bench/dp.py), checkpointed after every step: a crash stops every
              rank; all restart together when the crashed one is back, from the last step

Goodput (DESIGN section 4) = merged compute seconds / capacity seconds, from the harness's own
records for all three:
- capacity: per slot, wall-clock from the first training step of the job to that slot's last
  step, dead or alive (a learner that finishes early stops counting, as when it leaves);
- merged compute: seconds of inner steps whose work reached the final model. Data parallel:
  the steps every rank completed and that were not lost to the crash (resumed from the
  checkpoint), times each rank's per-step compute (forward, backward, optimizer; not the
  all-reduce). DiLoCo: per learner process, the steps covered by its accepted pushes (fragment
  p's steps up to its last push; the rest of a killed or finished process's work never reached
  the Synchronizer), times its per-step compute (the Learner's own measure, which leaves out the
  time it waited for rounds), times the share of its pushes accepted.
The DiLoCo figures are cross-checked against the Synchronizer's own accounting
(`diloco_compute_seconds_total{bucket="merged"}` over `diloco_learner_capacity_seconds_total`).
Also the final eval loss (global model, or data parallel's model), and the effective goodput
(docs/protocol.md, "Evaluators and effective goodput"): the tokens a reference run needed to
reach that final loss over the training tokens the system consumed (every learner process's or
rank's tokens, redone ones included), for all three from the same curve. The curve is
`--reference FILE`, or else recorded first from a fault-free synchronous DiLoCo run of the same
workload (`bench.reference`; its points are in the JSON's `reference`); in --smoke, to stay fast,
the sync arm's own two points (its initial and final model), so there the sync arm's effective
goodput is about 1 by construction. With a curve given or recorded, each DiLoCo arm's
Synchronizer gets it (`--reference-curve`) and its own figure for the final model is kept
(`synchronizer_effective_goodput`, over the tokens its learners reported).

Both DiLoCo systems sync the whole model (P = 1), so that the comparison isolates the round
policy: with P = 4 fragments a learner process's last steps after each fragment's last push
(up to 3H/4 of them, 9% of a 400-step run) never reach the Synchronizer, which the short runs
would count against Decoupled (`--set fragments=4` measures it).

Headline: `goodput` (Decoupled), `goodput_sync`, `goodput_lockstep`; `effective_goodput`,
`effective_goodput_sync`, `effective_goodput_lockstep`; `eval_loss` of each.

    python -m bench.goodput [--quick | --smoke] [--json PATH] [--seed N] [--steps S] [--reference FILE]
Modes: --smoke a tiny model, 2 learners, 60 steps; --quick 400 steps (about 2 minutes here);
full 2000 steps (about 8 minutes).
"""

from __future__ import annotations

import dataclasses
import random
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import machine, parser, program, run_mode, say_mode, table, write_json
from bench.convergence import parse_set
from bench.dp import DPJob
from bench.jobs import Decoupled, DilocoJob, Slot, Workload
from bench.net import open_links
from bench.plots import goodput_timelines, png_path
from bench.reference import consumed_tokens, curve_of, record, synchronous, workload
from demo.procs import Procs, metric, rejoin_args, scrape
from synchronizer.evaluation import ReferenceCurve

QUICK_IS_SMOKE = (
    "400 steps are too short for the goodput level (quick measured 0.832-0.839 where full's "
    "2,000 steps measure 0.973; the order against sync and lockstep holds in both)"
)


@dataclass
class Fault:
    kind: str  # "crash" or "slow"
    slot: int
    at_s: float  # seconds after the first training step
    duration_s: float = 0.0  # slow: how long
    factor: float = 1.0  # slow: how many times slower
    restart_after_s: float = 0.0  # crash: back after this long


def schedule(seed: int, learners: int, expected_s: float, restart_after_s: float) -> list[Fault]:
    """One crash and two slowdowns on distinct slots (fewer with fewer slots), seeded."""
    rng = random.Random(seed)
    slots = rng.sample(range(learners), min(3, learners))
    faults = [
        Fault(
            "crash",
            slots[0],
            round(rng.uniform(0.25, 0.4) * expected_s, 1),
            restart_after_s=restart_after_s,
        )
    ]
    if len(slots) > 1:
        faults.append(
            Fault(
                "slow",
                slots[1],
                round(rng.uniform(0.08, 0.2) * expected_s, 1),
                round(rng.uniform(0.15, 0.25) * expected_s, 1),
                3.0,
            )
        )
    if len(slots) > 2:
        faults.append(
            Fault(
                "slow",
                slots[2],
                round(rng.uniform(0.5, 0.6) * expected_s, 1),
                round(rng.uniform(0.15, 0.25) * expected_s, 1),
                2.0,
            )
        )
    return faults


class Injector:
    """Fires the schedule against one system: `procs(slot)` gives a slot's current process
    (the slowdowns stop and continue it), `crash(slot)` and `restart(slot)` are the system's."""

    def __init__(self, faults: list[Fault], procs: Any, crash: Any, restart: Any) -> None:
        self.faults, self.procs, self.crash, self.restart = faults, procs, crash, restart
        self.t0: float | None = None
        self.fired: set[tuple[int, str]] = set()
        self.log: list[dict] = []
        self.threads: list[threading.Thread] = []
        self.stopped = threading.Event()

    def tick(self, t0: float | None) -> None:
        if self.t0 is None:
            self.t0 = t0
        if self.t0 is None:
            return
        now = time.time() - self.t0
        for i, f in enumerate(self.faults):
            if f.kind == "crash" and now >= f.at_s and (i, "kill") not in self.fired:
                self.fired.add((i, "kill"))
                self.log.append(
                    {"t": now, "event": f"crash slot {f.slot}", "detail": self.crash(f.slot)}
                )
            if (
                f.kind == "crash"
                and now >= f.at_s + f.restart_after_s
                and (i, "kill") in self.fired
                and (i, "back") not in self.fired
            ):
                self.fired.add((i, "back"))
                self.log.append(
                    {"t": now, "event": f"restart slot {f.slot}", "detail": self.restart(f.slot)}
                )
            if f.kind == "slow" and now >= f.at_s and (i, "slow") not in self.fired:
                self.fired.add((i, "slow"))
                self.log.append(
                    {
                        "t": now,
                        "event": f"slot {f.slot} {f.factor:g}x slower for {f.duration_s:g} s",
                    }
                )
                th = threading.Thread(target=self._throttle, args=(f,), daemon=True)
                th.start()
                self.threads.append(th)

    def _throttle(self, f: Fault, period_s: float = 0.1) -> None:
        end = time.monotonic() + f.duration_s
        stop_s = period_s * (1 - 1 / f.factor)
        while time.monotonic() < end and not self.stopped.is_set():
            proc = self.procs(f.slot)
            if proc is None or proc.poll() is not None:
                time.sleep(period_s)
                continue
            Procs.signal(proc, signal.SIGSTOP)
            time.sleep(stop_s)
            Procs.signal(proc, signal.SIGCONT)
            time.sleep(period_s - stop_s)

    def close(self) -> None:
        self.stopped.set()
        for th in self.threads:
            th.join()


# DiLoCo ------------------------------------------------------------------------------------------


def kill_learner(slot: Slot, steps: int) -> dict | None:
    """SIGKILLs the slot's learner process and marks the slot down; returns its last result,
    with `step` the step it had reached. None, and nothing killed, when it has already finished
    (or reached `steps`)."""
    if not slot.running():
        return None
    r = slot.runs[-1].result()
    if r.get("step", 0) >= steps:
        return None
    Procs.signal(slot.proc, signal.SIGKILL)
    slot.proc.wait()
    slot.down = True
    return {**r, "step": r.get("step", slot.runs[-1].start_step)}


def run_diloco(
    cfg: Decoupled, w: Workload, faults: list[Fault], net: str, out: Path, align_restart: bool
) -> dict:
    timeline: list[tuple[float, float]] = []
    crashed: dict[int, tuple[int, list[str]]] = {}  # slot -> (step reached, flags to rejoin)
    job: DilocoJob  # made below, once the links are open; the callbacks run after that

    def crash(i: int) -> str:
        r = kill_learner(job.slots[i], w.steps)
        if r is None:
            return "already finished"
        crashed[i] = (r["step"], rejoin_args(r))
        return f"at step {r['step']}"

    def restart(i: int) -> str:
        if i not in crashed:
            return "not down"
        step, rejoin = crashed.pop(i)
        if align_restart:  # back on the sync boundary, so its pushes join everyone's rounds
            step = step // cfg.sync_every * cfg.sync_every
        job.start_learner(job.slots[i], start_step=step, rejoin=rejoin)
        return f"from step {step}"

    injector = Injector(faults, lambda i: job.slots[i].proc, crash, restart)
    last_scrape = [0.0]

    def tick(j: DilocoJob) -> None:
        injector.tick(
            _t0([s.runs[0].result() for s in j.slots if s.runs])
            if injector.t0 is None
            else injector.t0
        )
        if injector.t0 is not None and time.time() - last_scrape[0] >= 1.0:
            last_scrape[0] = time.time()
            try:
                timeline.append(
                    (
                        time.time() - injector.t0,
                        metric(scrape(j.metrics_url), "diloco_goodput_ratio"),
                    )
                )
            except OSError:
                pass

    with open_links(net, w.learners) as links:
        job = DilocoJob(cfg, w, links, out)
        try:
            summary = job.run(tick=tick)
        finally:
            injector.close()
    return {
        **summary,
        **diloco_goodput(cfg, w, job.slots, summary),
        "consumed_tokens": consumed_tokens(summary),
        "timeline": timeline,
        "timeline_source": "curve: the Synchronizer's gauge",
        "events": injector.log,
    }


def _t0(first_results: list[dict]) -> float | None:
    starts = [r.get("started_at") for r in first_results]
    return min(starts) if starts and all(starts) else None  # type: ignore[type-var]


def pushed_fraction(steps: int, sync_every: int, fragments: int) -> float:
    """The share of `steps` inner steps (counted from 1 in one learner process) that its pushes
    covered: fragment p pushes at steps p*H//P + k*H, so what follows its last push is left."""
    if steps <= 0:
        return 0.0
    covered = 0
    for p in range(fragments):
        off = p * sync_every // fragments
        last = off + (steps - off) // sync_every * sync_every if steps >= off else 0
        covered += last if last >= 1 else 0
    return covered / (fragments * steps)


def diloco_goodput(cfg: Decoupled, w: Workload, slots: list[Slot], summary: dict) -> dict:
    t0 = summary["t_start"]
    merged = capacity = 0.0
    per_slot = []
    for s in slots:
        results = [r.result() for r in s.runs]
        end = results[-1]["series"][-1]["t"]
        slot_merged = 0.0
        for r in results:
            stats = r.get("learner") or {}
            n = stats.get("step", 0)  # inner steps of this process (the Learner's own count)
            if n <= 0:
                continue
            per_step = stats.get("compute_s", 0.0) / n
            pushes = stats.get("pushes") or {}
            judged = sum(
                pushes.get(k, 0) for k in ("accepted", "dropped_stale", "refused_norm", "rejected")
            )
            accepted = pushes.get("accepted", 0) / judged if judged else 0.0
            slot_merged += (
                per_step * n * pushed_fraction(n, cfg.sync_every, cfg.fragments) * accepted
            )
        merged += slot_merged
        capacity += end - t0
        per_slot.append(
            {
                "slot": s.index,
                "capacity_s": end - t0,
                "merged_compute_s": slot_merged,
                "processes": len(s.runs),
            }
        )
    return {
        "goodput": merged / capacity if capacity else 0.0,
        "merged_compute_s_harness": merged,
        "capacity_s_harness": capacity,
        "synchronizer_goodput_from_totals": summary["merged_compute_s"] / summary["capacity_s"]
        if summary["capacity_s"]
        else None,
        "per_slot": per_slot,
    }


# Lockstep data parallel -------------------------------------------------------------------------


def run_lockstep(w: Workload, faults: list[Fault], net: str, out: Path) -> dict:
    job: DPJob  # made below, once the links are open; the callbacks run after that

    def crash(i: int) -> str:
        if job.down or job.done():
            return "already finished"
        return f"every rank stopped; resumes from step {job.kill()}"

    def restart(i: int) -> str:
        if not job.down:
            return "not down"
        job.start()
        return f"every rank restarted from step {job.resumes[-1]}"

    injector = Injector(faults, lambda i: job.procs[i] if not job.down else None, crash, restart)

    def tick(j: DPJob) -> None:
        injector.tick(_t0([j.results()[0][0]]) if injector.t0 is None else injector.t0)

    with open_links(net, w.learners) as links:
        job = DPJob(w, links, out, checkpoint=True)
        try:
            summary = job.run(tick=tick)
        finally:
            injector.close()
    return {**summary, **lockstep_goodput(w, job), "events": injector.log}


def lockstep_goodput(w: Workload, job: DPJob) -> dict:
    """Each start's steps count up to the step the next start resumed from (the rest was redone),
    each at its rank's per-step compute. Also the goodput so far at each of rank 0's progress
    lines, for the picture."""
    starts = job.results()
    t0 = starts[0][0]["started_at"]
    kept = job.resumes + [w.steps]
    merged = 0.0
    steps = 0  # every rank's steps of every start, redone ones included
    timeline: list[tuple[float, float]] = []
    for k, ranks in enumerate(starts):
        series = [r.get("series") or [] for r in ranks]
        if not all(series):
            continue
        first = ranks[0]["start_step"]
        for idx, e in enumerate(series[0]):
            if e["step"] <= kept[k] and e["t"] > t0:
                now = sum(s[min(idx, len(s) - 1)]["compute_s"] for s in series)
                timeline.append((e["t"] - t0, (merged + now) / (w.learners * (e["t"] - t0))))
        for s in series:
            steps += s[-1]["step"] - first
            per_step = s[-1]["compute_s"] / max(1, s[-1]["step"] - first)
            merged += per_step * max(0, min(kept[k], s[-1]["step"]) - first)
    capacity = w.learners * (starts[-1][0]["series"][-1]["t"] - t0)
    return {
        "goodput": merged / capacity if capacity else 0.0,
        "wall_s": capacity / w.learners,
        "merged_compute_s_harness": merged,
        "capacity_s_harness": capacity,
        "consumed_tokens": steps * w.batch_size * w.context,
        "timeline": timeline,
    }


def effective(run: dict, curve: ReferenceCurve) -> dict:
    """The effective goodput of a finished run: the curve's tokens to reach its final eval loss
    over the tokens it consumed."""
    tokens, below = curve.tokens_to_reach(run["eval_loss"])
    consumed = run["consumed_tokens"]
    return {
        "effective_goodput": tokens / consumed if consumed else None,
        "reference_tokens": tokens,
        "below_reference": below,
    }


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0, help="fault schedule seed")
    p.add_argument("--steps", type=int, help="inner steps per learner slot")
    p.add_argument("--only", help="comma-separated subset of decoupled,sync,lockstep")
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
    p.add_argument(
        "--reference",
        type=Path,
        metavar="FILE",
        help="loss-to-tokens curve to score effective goodput against (JSON or CSV, as "
        "--reference-curve reads; bench.reference writes one); default: recorded first from a "
        "fault-free synchronous DiLoCo run (in --smoke: the sync arm's own)",
    )
    args = p.parse_args(argv)
    mode = run_mode(args, QUICK_IS_SMOKE)
    say_mode(mode)
    w, cfg = workload(args)  # bench.reference's, so its curves fit these runs
    restart_s = 2 * cfg.lease_s
    cfg = parse_set(args.set, cfg)
    # 11-20 steps/s per learner here, 4 learners on 2 cores
    expected_s = 1.0 if args.smoke else w.steps / 16
    faults = schedule(args.seed, w.learners, expected_s, restart_s)
    systems = args.only.split(",") if args.only else ["decoupled", "sync", "lockstep"]
    print(
        f"{w.learners} learner slots x {w.steps} steps; faults (seconds after the first step):",
        flush=True,
    )
    for f in faults:
        print(f"  {f}", flush=True)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp:
        root = args.out or Path(tmp)
        curve_path, reference = args.reference, None
        if curve_path is None and not args.smoke:
            print("reference: fault-free synchronous DiLoCo (bench.reference)", flush=True)
            reference = record(w, cfg, args.net, root / "reference")
            curve_path = root / "reference.json"
            write_json(curve_path, {"points": reference["points"]})
        curve = ReferenceCurve.load(curve_path) if curve_path else None
        if curve_path:  # each Synchronizer scores its final model too
            given = ["--reference-curve", str(curve_path.resolve())]
            cfg = cfg.with_(synchronizer_args=[*cfg.synchronizer_args, *given])
        for name in systems:
            if name == "decoupled":
                runs[name] = run_diloco(
                    cfg.with_(name="decoupled"),
                    w,
                    faults,
                    args.net,
                    root / name,
                    align_restart=False,
                )
            elif name == "sync":  # convergence's (b): FP32, P = 1, strict overlap
                sync = synchronous(cfg)
                runs[name] = run_diloco(sync, w, faults, args.net, root / name, align_restart=True)
            elif name == "lockstep":
                runs[name] = run_lockstep(w, faults, args.net, root / name)
            else:
                raise SystemExit(f"--only: unknown system {name!r}")
            r = runs[name]
            r["name"] = name
            r["faults"] = [dataclasses.asdict(f) for f in faults]
            print(
                f"  {name:9s} goodput {r['goodput']:.3f}  eval loss {r['eval_loss']:.4f}  wall {r['wall_s']:.1f} s",
                flush=True,
            )
        if curve is None and "sync" in runs:  # --smoke: the sync arm's own start and end
            points = curve_of(runs["sync"])
            try:
                curve = ReferenceCurve.from_points(points)
                reference = {"points": points, "source": "the sync arm's own (smoke)"}
            except ValueError as e:  # no tokens reported: say why the figures are missing
                reference = {"points": points, "missing": str(e)}
        for r in runs.values():
            r.update(effective(r, curve) if curve else {"effective_goodput": None})
    rows = [
        {
            "system": n,
            "goodput": r["goodput"],
            "effective_goodput": r["effective_goodput"],
            "eval_loss": r["eval_loss"],
            "wall_s": r["wall_s"],
            "merged_compute_s": r["merged_compute_s_harness"],
            "capacity_s": r["capacity_s_harness"],
            "synchronizer_goodput": r.get("synchronizer_goodput_from_totals", ""),
        }
        for n, r in runs.items()
    ]
    print()
    print(
        table(
            rows,
            [
                "system",
                "goodput",
                "effective_goodput",
                "eval_loss",
                "wall_s",
                "merged_compute_s",
                "capacity_s",
                "synchronizer_goodput",
            ],
        )
    )
    goodput_timelines(
        list(runs.values()),
        png_path(args.json, ""),
        f"Goodput under one fault schedule (seed {args.seed})",
    )
    for r in runs.values():
        r.pop("results", None)
    result: dict[str, Any] = {
        "goodput": runs["decoupled"]["goodput"] if "decoupled" in runs else None,
        "goodput_sync": runs["sync"]["goodput"] if "sync" in runs else None,
        "goodput_lockstep": runs["lockstep"]["goodput"] if "lockstep" in runs else None,
        **{
            f"effective_goodput{suffix}": runs[n]["effective_goodput"] if n in runs else None
            for n, suffix in (("decoupled", ""), ("sync", "_sync"), ("lockstep", "_lockstep"))
        },
        "eval_loss": {n: r["eval_loss"] for n, r in runs.items()},
        "reference": reference
        or (
            {"points": [list(p) for p in zip(curve.tokens, curve.best, strict=True)]}
            if curve
            else None
        ),
        **mode,
        "seed": args.seed,
        "steps": w.steps,
        "learners": w.learners,
        "faults": [dataclasses.asdict(f) for f in faults],
        "decoupled": dataclasses.asdict(cfg),
        "runs": runs,
        "machine": machine(),
    }
    print(
        "\n"
        + "  ".join(
            f"{k} = {result[k]:.3f}"
            for k in (
                "goodput",
                "goodput_sync",
                "goodput_lockstep",
                "effective_goodput",
                "effective_goodput_sync",
                "effective_goodput_lockstep",
            )
            if result[k] is not None
        )
    )
    say_mode(mode)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    program(main)
