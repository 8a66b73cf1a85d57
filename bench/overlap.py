"""Overlap: a learner's inner steps per second with syncing on, against the same loop with
syncing off, in the same run.

One Synchronizer stays up for the whole run; one learner process at a time trains the bundled
example on one torch thread, alternately with syncing on (`learner train`, the Decoupled
configuration of bench/convergence.py: H = 100, P = 4, INT4 pushes, INT8 delta pulls) and off
(`learner train --no-sync`: the same loop, no Learner), the order swapped every repetition so
that drift on this shared machine hits both alike. Each process's steps/s counts its training
loop only (start-up, evaluation and the final pull excluded). `overlap_ratio` = median steps/s
on / median steps/s off (target >= 0.97). A second, harder setting syncs a fragment every step
(H = 4, P = 4) to show what the background work costs when it never pauses.

One learner, not four: with four on 2 cores the learners themselves would take the spare core
the background sync threads are meant to use, and the figure would measure CPU sharing.

    python -m bench.overlap [--quick | --smoke] [--json PATH] [--repeats N] [--steps S]
Modes: --smoke a tiny model, 1 repetition of 40 steps; --quick 3 repetitions of 400 steps
(about 1.5 minutes here); full 4 repetitions of 800 steps, plus the H = 4 setting (about
7 minutes).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.common import machine, parser, program, table, write_json
from bench.convergence import BEST, parse_set
from bench.jobs import SMOKE_SHORT, Decoupled, JobError, Workload, learner_cmd
from demo.procs import Procs, read_json, start_synchronizer


def measure(cfg: Decoupled, w: Workload, repeats: int, out: Path) -> dict[str, Any]:
    procs = Procs(out)
    on: list[float] = []
    off: list[float] = []
    try:
        _, info = start_synchronizer(procs, cfg.synchronizer_flags())
        address = f"127.0.0.1:{info['port']}"
        n = 0
        for rep in range(repeats):
            for syncing in (True, False) if rep % 2 == 0 else (False, True):
                path = out / f"run{n}-{'on' if syncing else 'off'}.json"
                cmd = learner_cmd(cfg if syncing else None, w, 0, path, address)
                proc = procs.start(f"run{n}", cmd)
                if proc.wait() != 0:
                    raise JobError(
                        f"learner run {n} exited with code {proc.returncode}; see {procs.log(f'run{n}')}"
                    )
                r = read_json(path)
                (on if syncing else off).append(r["steps_per_s"])
                n += 1
                print(
                    f"  {cfg.name:10s} syncing {'on ' if syncing else 'off'} {r['steps_per_s']:7.2f} steps/s"
                    + (
                        f"  (pushes {r['learner'].get('pushes')}, blocked {r['blocked_s']:.2f} s)"
                        if syncing
                        else ""
                    ),
                    flush=True,
                )
    finally:
        procs.stop_all()
    return {
        "name": cfg.name,
        "config": cfg.describe(),
        "steps": w.steps,
        "repeats": repeats,
        "on_steps_per_s": on,
        "off_steps_per_s": off,
        "on_median": statistics.median(on),
        "off_median": statistics.median(off),
        "overlap_ratio": statistics.median(on) / statistics.median(off),
    }


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, help="on/off pairs")
    p.add_argument("--steps", type=int, help="inner steps per run")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a setting of the Decoupled configuration",
    )
    p.add_argument("--out", type=Path, help="keep the runs' logs and result files here")
    args = p.parse_args(argv)
    base = parse_set(args.set, BEST.with_(name="H=100"))
    if args.smoke:
        w, repeats, settings = (
            dataclasses.replace(SMOKE_SHORT, learners=1),
            1,
            [base.with_(sync_every=10, name="H=10")],
        )
    elif args.quick:
        w, repeats, settings = Workload(learners=1, steps=400), 3, [base]
    else:
        w, repeats, settings = (
            Workload(learners=1, steps=800),
            4,
            [base, base.with_(sync_every=4, name="H=4")],
        )
    if args.steps:
        w.steps = args.steps
    repeats = args.repeats or repeats
    cells = []
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as tmp:
        root = args.out or Path(tmp)
        for cfg in settings:
            cells.append(measure(cfg, w, repeats, root / cfg.name.replace("=", "")))
    print()
    print(
        table(
            cells,
            ["name", "on_median", "off_median", "overlap_ratio", "repeats", "steps", "config"],
        )
    )
    result = {
        "overlap_ratio": cells[0]["overlap_ratio"],
        "settings": cells,
        "workload": dataclasses.asdict(w),
        "machine": machine(),
    }
    print(f"\noverlap_ratio = {result['overlap_ratio']:.3f} ({cells[0]['config']})")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    program(main)
