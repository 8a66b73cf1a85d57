"""kill -9 chaos: the Synchronizer SIGKILLed at random moments while learners train, against the
same run without kills.

A Synchronizer and 3 learners (2 in smoke mode) of a tiny bundled example (`demo.tiny`) in synchronous mode (every
learner in every round, strict overlap, no Dynamic Local Updates): such a run is reproducible bit
for bit, so the run with kills must end with exactly the parameters of the run without. The
Synchronizer is killed after a random 1-4 more rounds and a random 0-0.5 s (pushes, round closes
and checkpoints go on all the time: a kill lands mid-push, mid-round or mid-checkpoint) and
restarted on the same port and state directory. Checked on the way: the epoch never changes,
served versions never go back, no learner ever sees one version with two checksums, every
acknowledged push is merged exactly once (the final checkpoint's merged count against the
learners' acknowledged pushes).

    python -m bench.chaos [--quick | --smoke] [--kills N] [--steps S] [--json PATH]

Modes: full 20 kills, --quick 3 (the test suite runs 3 kills in 200 steps), --smoke 1 kill in 80 steps of 2 learners
(`SMOKE`: the smallest run that still kills the Synchronizer while the learners train).

`bench.durability` reports these figures; `tests/test_e2e.py` asserts them.
"""

from __future__ import annotations

import random
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import machine, parser, program, run_mode, say_mode, write_json
from demo.procs import Procs, read_json, start_synchronizer
from demo.tiny import NotInTime, final_pull, finish_ok, start_learner, versions, wait_until
from synchronizer import checkpoint

LEARNERS = 3
SMOKE = {"kills": 1, "steps": 80, "learners": 2}  # bench.durability's smoke runs this too
SYNCHRONIZER = (
    "--quorum",
    "0",
    "--lease-s",
    "5",
    "--checkpoint-interval-s",
    "1",
    "--checkpoint-log-ratio",  # a checkpoint every second, however little was logged since:
    "0",  # kills land mid-checkpoint as often as mid-push
    "--no-dynamic-local-updates",
    "--shutdown-grace-s",
    "1",
)


def _serve(procs: Procs, port: int, name: str) -> tuple[subprocess.Popen, dict[str, Any]]:
    try:
        return start_synchronizer(procs, SYNCHRONIZER, port=port, name=name)
    except RuntimeError as e:
        raise NotInTime(f"{e}\n{procs.tails()}") from None


def run(
    root: Path, kills: int, steps: int, seed: int = 0, learners: int = LEARNERS
) -> dict[str, Any]:
    """One run of `learners` learners under `root` with `kills` SIGKILLs of the Synchronizer;
    its figures. Raises
    NotInTime (with the logs' ends) when a process does not get where it should, and
    AssertionError when a served version went back or the epoch changed."""
    rng = random.Random(seed)
    procs = Procs(root)
    t0 = time.perf_counter()
    try:
        proc, info = _serve(procs, 0, "synchronizer")
        address, port, epoch = info["address"], info["port"], info["epoch"]
        together = ("--wait-for-learners", str(learners), "--strict-overlap")
        runs = [
            start_learner(procs, address, i, learners, steps, *together) for i in range(learners)
        ]
        wait_until(
            lambda: all(read_json(out).get("step", 0) > 0 for _, out in runs),
            120,
            "every learner training",
            procs,
        )
        checked = 0
        for k in range(kills):
            target = sum(versions(address)) + rng.randint(1, 4)

            def closed(target: int = target) -> bool:
                return sum(versions(address)) >= target

            wait_until(
                closed,
                120,
                f"rounds to close before kill {k + 1}",
                procs,
            )
            time.sleep(rng.uniform(0.0, 0.5))  # a random moment: pushes, rounds, checkpoints
            seen = versions(address)
            Procs.kill(proc)
            proc, info = _serve(procs, port, f"synchronizer-{k + 1}")
            assert info["epoch"] == epoch, f"kill {k + 1}: a new epoch; the log kept the history"
            back = versions(address)
            assert all(b >= s for b, s in zip(back, seen, strict=True)), (
                f"kill {k + 1}: served versions {seen} came back as {back}"
            )
            checked += len(seen)
        results = [finish_ok(procs, p, out, timeout_s=600) for p, out in runs]
        served = final_pull(procs, address)
        # Every acknowledged push merged exactly once across the restarts: the final checkpoint
        # (SIGTERM merges what is open) counts the contributions its rounds merged.
        Procs.signal(proc, signal.SIGTERM)
        if proc.wait(60) != 0:
            raise NotInTime(f"the Synchronizer did not exit cleanly\n{procs.tails()}")
        found = checkpoint.load_latest(root / "state")
        assert found is not None, "no final checkpoint"
        merged = sum(int(f["merged"]) for f in found[1]["fragments"])
    finally:
        procs.stop_all(grace_s=0)
    learned = [r["learner"] for r in results]
    acknowledged = sum(
        x["pushes"].get("accepted", 0) + x["pushes"].get("duplicate", 0) for x in learned
    )
    return {
        "kills": kills,
        "steps": steps,
        "versions_checked_across_restarts": checked,
        "versions_pulled_with_checksums": sum(x["versions_checked"] for x in learned),
        "version_conflicts": sum(x["version_conflicts"] for x in learned),
        "acknowledged": acknowledged,
        "merged": merged,
        "lost": acknowledged - merged,
        "eval_loss": served["eval_loss_end"],
        "param_hash": served["param_hash"],
        "learners": [
            {
                "eval_loss_start": r["eval_loss_start"],
                "eval_loss_end": r["eval_loss_end"],
                "param_hash": r["param_hash"],
                "pushes": r["learner"]["pushes"],
                "errors": r["learner"]["errors"],
            }
            for r in results
        ],
        "wall_s": time.perf_counter() - t0,
    }


def compare(
    root: Path, kills: int, steps: int, seed: int = 0, learners: int = LEARNERS
) -> dict[str, Any]:
    """The run without kills, then the run with `kills`, under `root`; both runs' figures and
    how the second ended against the first."""
    reference = run(root / "reference", 0, steps, seed, learners)
    chaos = run(root / "chaos", kills, steps, seed, learners)
    return {
        **{k: chaos[k] for k in ("kills", "steps", "acknowledged", "merged", "lost")},
        "learner_count": learners,
        "versions_checked": chaos["versions_checked_across_restarts"]
        + chaos["versions_pulled_with_checksums"],
        "version_conflicts": chaos["version_conflicts"],
        "eval_loss": chaos["eval_loss"],
        "eval_loss_without_kills": reference["eval_loss"],
        "loss_vs_no_kills": chaos["eval_loss"] / reference["eval_loss"],
        "same_parameters": chaos["param_hash"] == reference["param_hash"],
        "chaos": chaos,
        "reference": reference,
    }


def summary(c: dict[str, Any]) -> str:
    return (
        f"{c['kills']} kills, {c['learner_count']} learners x {c['steps']} steps: {c['versions_checked']} versions checked "
        f"({c['version_conflicts']} served with two contents); pushes acknowledged "
        f"{c['acknowledged']}, merged {c['merged']}, lost {c['lost']}; eval loss "
        f"{c['eval_loss']:.4f} against {c['eval_loss_without_kills']:.4f} without kills "
        f"(ratio {c['loss_vs_no_kills']:.4f}; same parameters: {c['same_parameters']})"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--kills", type=int, default=None, help="SIGKILLs of the Synchronizer (default: by mode)"
    )
    p.add_argument("--steps", type=int, default=0, help="inner steps per learner (0: by kills)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    p.add_argument("--root", type=Path, default=None, help="keep the runs' files here")
    args = p.parse_args(argv)
    mode = run_mode(args)
    default = SMOKE["kills"] if args.smoke else 3 if args.quick else 20
    kills = args.kills if args.kills is not None else default
    if kills < 0 or args.steps < 0:
        p.error("--kills and --steps take a number >= 0")
    steps = args.steps or (SMOKE["steps"] if args.smoke else steps_for(kills))
    learners = SMOKE["learners"] if args.smoke else LEARNERS
    say_mode(mode)
    with tempfile.TemporaryDirectory() as d:
        c = compare(args.root or Path(d), kills, steps, args.seed, learners)
    print(summary(c))
    say_mode(mode)
    c |= mode | {"machine": machine()}
    write_json(args.json, c)
    return c


def steps_for(kills: int) -> int:
    """Enough steps for `kills` kills a few rounds apart, with rounds left after the last."""
    return 300 + 60 * kills


if __name__ == "__main__":
    program(main)
