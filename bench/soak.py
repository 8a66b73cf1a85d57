"""Soak: the main job's shape for an hour, with faults, and whether anything grows without bound.

A Synchronizer with the main job's settings (`demo.local.synchronizer_flags`: quorum 2, adaptive
grace, 3 s leases) and three learners of the bundled example (a tiny model, each throttled with
`--slow` so the job takes well under a core; one three times slower than the others, as in the
main job) train for `--minutes` (60; 5 in quick mode, under one in smoke mode) while:

- one learner at a time, in turn, is SIGKILLed every few minutes (3; 30 s quick; 8 s smoke) and
  started again 5 s later (past its lease) as itself: the learner id and session secret its last
  result file names are passed through the environment (`DILOCO_LEARNER_ID`,
  `DILOCO_LEARNER_SESSION`), never on the command line, where every local user could read them;
- the Synchronizer gets SIGTERM every 10 minutes (100 s; 16 s): it checkpoints and exits, and is
  started again on the same port and state directory. Learners re-join by themselves.

Every 10 s (2 s; 0.25 s) it samples: the Synchronizer's resident memory, open file descriptors
(`/proc/PID/fd`) and threads; the write-ahead log's segments on disk (`wal/wal-N.log`, see
`synchronizer.wal`), the complete checkpoints and the state directory's bytes; the learner
records the Synchronizer keeps (`diloco_learners`, alive, dead and left together); and each
learner's resident memory.

How a series is judged. A least-squares slope over the second half of the run (the first half
is the run getting to its steady state), per series:

- Restarts are not growth. A restarted process starts again from its own level, so each of a
  process's series (memory, descriptors, threads) is fitted per incarnation: one slope shared by
  all incarnations, each with its own intercept (the pooled within-incarnation slope: the sum
  over incarnations of sum((t - mean t) * (y - mean y)), over the same sum of (t - mean t)^2).
  A restart's step, up or down, then moves no slope; growth inside every incarnation does. What
  outlives a restart (log segments, checkpoints, the state directory, the learner records the
  checkpoint keeps) is one line across the whole second half: a segment or a record that every
  restart leaves behind shows as growth.
- Warm-up. Samples taken less than the warm-up (90 s; 30 s; 5 s) after their process began
  (a Synchronizer: once it serves, by its ready file; a learner: once it trains, by its first
  progress line) are left out: the learners re-joining a restarted Synchronizer (gRPC starting
  a thread for each new concurrent call), the first pulls, and the first checkpoint releasing
  the replayed log segments are start-up, not the steady state. The warm-up is longer than
  the checkpoint interval (the default 60 s; quick and smoke modes set 10 s and 2 s).
- Threshold. A series grows without bound when its slope is above `per_h` and the rise that
  slope gives over the time its fitted samples span is above `floor`, the series' noise (what
  the run cannot tell from churn). `per_h`, `floor`:
  - resident memory (Synchronizer, each learner): 30 MB per hour (a leak that fills 720 MB a
    day), 4 MB (arenas and the garbage collector move a Python process's RSS by a few MB);
  - file descriptors: any steady growth, 3 (a learner killed or reconnecting holds one or two
    connections for a moment);
  - threads: any, 2 (gRPC's pool starts a thread when concurrency peaks, up to its bound);
  - log segments, checkpoints, learner records: any, 1 (counts that must come back to their
    level; one more kept for good is a leak);
  - the state directory: 10 MB per hour, 2 MB (the log grows between checkpoints and is then
    released: a saw-tooth).
  The smallest growth a run can flag is max(per_h, floor / span): `detectable_per_h` in the
  table. Full mode fits about 25 minutes of each process series (three incarnations), so it
  flags memory growing 30 MB an hour; quick mode fits about two minutes and flags only gross
  leaks (memory above about 100 MB an hour, a descriptor or thread more every minute or so).
  A series with fewer than MIN_SAMPLES fitted samples was not measured, which fails too.
  Beside the slope, `late_slope_per_h` fits only the later half of each incarnation's samples:
  memory filling caches or allocator arenas towards a level slows down (a late slope well under
  the slope), a leak does not. It is shown, not judged. Most of what a Synchronizer's memory
  gains in its first minutes is glibc's malloc arenas, one per thread that allocates (up to 8
  per core; a grace timer is a thread of its own): `MALLOC_ARENA_MAX=2 python -m bench.soak`
  (the children inherit the environment) shows how much.

The run also fails when a process fails: a learner that exits by itself, a Synchronizer that
exits unasked, does not exit within SIGTERM_WAIT_S of SIGTERM or exits non-zero, or a restarted
learner that comes back under another id. The run's time 0 is when every learner trains (the
start-up before is not soaked). Smoke mode (27 s, one restart) has no steady state: it shows its
slopes without judging them and fails only on a process's failure.

    python -m bench.soak [--minutes M] [--quick | --smoke] [--json PATH] [--root DIR]

Exit status 0 when every series stays bounded, 1 otherwise (the failing series are named).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import dir_bytes, machine, parser, program, run_mode, say_mode, table, write_json
from demo.local import Slot, learner_cmd, synchronizer_flags
from demo.options import LocalOptions
from demo.procs import Procs, read_json, scrape, start_synchronizer
from synchronizer import checkpoint, wal

LEARNERS = 3
THROTTLE = 10.0  # --slow of every learner: a tiny model's step takes ~4 ms, so ~0.1 core each
SLOW_FACTOR = 3.0  # learner 1 runs this many times slower still, as in the main job
MODEL = [  # the bundled GPT, tiny: a step takes milliseconds on one thread
    "--n-layer",
    "1",
    "--d-model",
    "32",
    "--n-head",
    "2",
    "--context",
    "32",
    "--batch-size",
    "8",
    "--max-bytes",
    str(1 << 18),
    "--eval-windows",
    "32",
    "--retry-max-s",
    "2",
]
STEPS = 10**9  # learners train until the soak ends
STARTUP_S = 180.0  # every learner must be training within this of the start
RESTART_AFTER_S = 5.0  # a killed learner is started again this long after (past its lease)
SIGTERM_WAIT_S = 30.0  # a Synchronizer must have checkpointed and exited within this
MIN_SAMPLES = 5


@dataclass(frozen=True)
class Schedule:
    minutes: float
    restart_every_s: float  # the Synchronizer's SIGTERM and restart
    kill_every_s: float  # a learner's SIGKILL (each in turn)
    sample_every_s: float
    checkpoint_s: float  # the Synchronizer's checkpoint interval; 0: its default
    warmup_s: float  # samples this soon after their process began serving or training: not fitted


SCHEDULES = {
    "full": Schedule(60, 600, 180, 10, 0, 90),
    "quick": Schedule(5, 100, 30, 2, 10, 30),
    # smoke: the smallest run with a restart past the middle (its first incarnation's samples
    # after the middle fill the fit) and time left for the restarted one to be sampled
    "smoke": Schedule(0.45, 16, 8, 0.25, 2, 5),
}


@dataclass(frozen=True)
class Limit:
    """When a series grows without bound: slope above `per_h` (units per hour) and the rise it
    gives over the fitted span above `floor` (units); see the module's docstring."""

    unit: str
    per_h: float
    floor: float
    per_incarnation: bool  # True: a process's own series (a restart starts it afresh)


MEMORY = Limit("MB", 30.0, 4.0, True)
LIMITS = {
    "sync_rss": MEMORY,
    "sync_fds": Limit("fds", 0.0, 3.0, True),
    "sync_threads": Limit("threads", 0.0, 2.0, True),
    "wal_segments": Limit("segments", 0.0, 1.0, False),
    "checkpoints": Limit("files", 0.0, 1.0, False),
    "state_dir": Limit("MB", 10.0, 2.0, False),
    "learner_records": Limit("records", 0.0, 1.0, False),
    **{f"l{i}_rss": MEMORY for i in range(LEARNERS)},
}


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the run began
    value: float
    incarnation: int  # of its process (for what outlives a process: the Synchronizer's)
    age_s: float  # seconds since that incarnation started


@dataclass(frozen=True)
class Fit:
    slope_per_h: float
    rise: float  # the slope times span_s
    span_s: float  # the time the fitted samples span, summed over incarnations
    samples: int


def fit(
    samples: Sequence[Sample],
    since_s: float,
    warmup_s: float,
    per_incarnation: bool,
    late: bool = False,
) -> Fit:
    """The least-squares slope of the samples taken from `since_s` on, each at least `warmup_s`
    into its incarnation; per incarnation (a shared slope, an intercept each) or as one line.
    `late`: only the later half (in time) of each incarnation's fitted samples."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        if s.t >= since_s and s.age_s >= warmup_s:
            groups.setdefault(s.incarnation if per_incarnation else 0, []).append(s)
    sxy = sxx = span = 0.0
    n = 0
    for g in groups.values():
        if late:
            middle = (g[0].t + g[-1].t) / 2
            g = [s for s in g if s.t >= middle]
        n += len(g)
        mt = sum(s.t for s in g) / len(g)
        my = sum(s.value for s in g) / len(g)
        sxy += sum((s.t - mt) * (s.value - my) for s in g)
        sxx += sum((s.t - mt) ** 2 for s in g)
        span += max(s.t for s in g) - min(s.t for s in g)
    slope = sxy / sxx if sxx > 0 else 0.0
    return Fit(slope * 3600, slope * span, span, n)


def judge(name: str, samples: Sequence[Sample], since_s: float, warmup_s: float) -> dict[str, Any]:
    """One row of the table: the series' fit against its limit and the verdict ("bounded",
    "grows" or "not measured")."""
    limit = LIMITS[name]
    f = fit(samples, since_s, warmup_s, limit.per_incarnation)
    late = fit(samples, since_s, warmup_s, limit.per_incarnation, late=True)
    if f.samples < MIN_SAMPLES or f.span_s <= 0:
        verdict = "not measured"
    elif f.slope_per_h > limit.per_h and f.rise > limit.floor:
        verdict = "grows"
    else:
        verdict = "bounded"
    values = [s.value for s in samples]
    return {
        "series": name,
        "unit": limit.unit,
        "samples": f.samples,
        "span_s": f.span_s,
        "first": values[0] if values else None,
        "last": values[-1] if values else None,
        "slope_per_h": f.slope_per_h,
        "rise": f.rise,
        # growth that slows down to a level shows a late slope well under the slope; a leak not
        "late_slope_per_h": late.slope_per_h,
        "limit_per_h": limit.per_h,
        "floor": limit.floor,
        "detectable_per_h": max(limit.per_h, limit.floor / f.span_s * 3600)
        if f.span_s > 0
        else None,
        "verdict": verdict,
    }


def process_figures(pid: int) -> tuple[float, int, int] | None:
    """(resident MB, open file descriptors, threads) of a running process; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, fds, int(fields["Threads"])


def identity(result: dict[str, Any]) -> tuple[str, str]:
    """The learner id and session secret a result file names ("" while it names none): the
    session is in the result, or in the file it names."""
    info = result.get("learner") or {}
    session = info.get("session") or ""
    if not session and result.get("session_file"):
        try:
            session = Path(result["session_file"]).read_text().strip()
        except OSError:
            session = ""
    return info.get("learner_id") or "", session


class SoakError(RuntimeError):
    """A process of the soak failed; the message names its log."""


@dataclass
class Learner:
    slot: Slot
    # when each incarnation began training (its first progress line), None before
    training: list[float | None] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    restart_at: float | None = None  # killed: start again at this time


class Soak:
    """The running job: its processes, the fault schedule and the samples."""

    def __init__(self, root: Path, schedule: Schedule) -> None:
        self.root, self.schedule = root, schedule
        self.procs = Procs(root)
        self.state = root / "state"
        self.options = LocalOptions(
            learners=LEARNERS,
            steps=STEPS,
            sync_every=50,
            log_every=25,
            out=root,
            train_args=MODEL,
        )
        self.learners = [
            Learner(Slot(i, STEPS, THROTTLE * (SLOW_FACTOR if i == 1 else 1.0)))
            for i in range(LEARNERS)
        ]
        self.series: dict[str, list[Sample]] = {name: [] for name in LIMITS}
        self.restarts: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.begin = 0.0  # when every learner was training (the soak's time 0)
        self.sync: subprocess.Popen | None = None
        self.sync_ready = 0.0
        self.port = 0
        self.address = ""
        self.metrics_url = ""

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start_synchronizer(self) -> None:
        flags = [*synchronizer_flags(self.options), "--log-level", "WARNING"]
        if self.schedule.checkpoint_s:
            flags += ["--checkpoint-interval-s", str(self.schedule.checkpoint_s)]
        name = f"synchronizer-{len(self.restarts)}"
        try:
            self.sync, info = start_synchronizer(
                self.procs, flags, state_dir=self.state, port=self.port, name=name
            )
        except RuntimeError as e:  # it exited, or was not ready in time: the log says why
            raise SoakError(str(e)) from None
        self.sync_ready = self.now()  # its warm-up runs from here
        self.port, self.address = info["port"], info["address"]
        self.metrics_url = f"http://127.0.0.1:{info['metrics_port']}/metrics"

    def restart_synchronizer(self) -> None:
        """SIGTERM (it checkpoints and exits), then a new one on the same port and state."""
        assert self.sync is not None
        t = self.now()
        Procs.signal(self.sync, signal.SIGTERM)
        try:
            rc = self.sync.wait(timeout=SIGTERM_WAIT_S)
        except subprocess.TimeoutExpired:
            raise SoakError(
                f"the Synchronizer did not exit within {SIGTERM_WAIT_S:g} s of SIGTERM; see {self.procs.log(f'synchronizer-{len(self.restarts)}')}"
            ) from None
        if rc != 0:
            raise SoakError(
                f"the Synchronizer exited with code {rc} on SIGTERM; see {self.procs.log(f'synchronizer-{len(self.restarts)}')}"
            )
        stopped = self.now()
        self.restarts.append({"at_s": t - self.begin, "stop_s": stopped - t})
        self.start_synchronizer()
        self.restarts[-1]["start_s"] = self.now() - stopped

    def start_learner(self, learner: Learner, env: dict[str, str] | None = None) -> None:
        slot = learner.slot
        out = self.root / f"learner-{slot.index}.run{len(slot.runs)}.json"
        out.unlink(missing_ok=True)
        start_step = read_json(slot.runs[-1]).get("step", 0) if slot.runs else 0
        slot.runs.append(out)
        cmd = learner_cmd(self.options, self.address, slot, out, start_step)
        slot.proc = self.procs.start(f"learner-{slot.index}", cmd, env=env)
        learner.training.append(None)
        learner.restart_at = None

    def kill(self, learner: Learner) -> bool:
        """SIGKILLs the learner once its result names its id; False while it does not yet."""
        slot = learner.slot
        result = read_json(slot.runs[-1])
        learner_id, session = identity(result)
        if not learner_id or not session or slot.proc is None:
            return False
        Procs.kill(slot.proc)
        learner.kills.append(
            {
                "at_s": self.now() - self.begin,
                "step": result.get("step", 0),
                "learner_id": learner_id,
            }
        )
        learner.restart_at = self.now() + RESTART_AFTER_S
        return True

    def restart_learner(self, learner: Learner) -> None:
        """Starts it again as itself: its id and session through the environment."""
        learner_id, session = identity(read_json(learner.slot.runs[-1]))
        self.start_learner(
            learner,
            env={**os.environ, "DILOCO_LEARNER_ID": learner_id, "DILOCO_LEARNER_SESSION": session},
        )

    def check(self) -> None:
        assert self.sync is not None
        if self.sync.poll() is not None:
            raise SoakError(
                f"the Synchronizer exited with code {self.sync.returncode}; see {self.procs.log(f'synchronizer-{len(self.restarts)}')}"
            )
        for learner in self.learners:
            p = learner.slot.proc
            if learner.restart_at is None and p is not None and p.poll() is not None:
                raise SoakError(
                    f"learner {learner.slot.index} exited with code {p.returncode}; see {self.procs.log(f'learner-{learner.slot.index}')}"
                )

    def sample(self) -> None:
        assert self.sync is not None
        now = self.now()
        t, incarnation, age = now - self.begin, len(self.restarts), now - self.sync_ready
        figures = process_figures(self.sync.pid)
        if figures is not None:
            for name, value in zip(("sync_rss", "sync_fds", "sync_threads"), figures, strict=True):
                self.series[name].append(Sample(t, value, incarnation, age))
        disk = {
            "wal_segments": len(wal.list_segments(self.state / "wal")),
            "checkpoints": len(checkpoint.list_checkpoints(self.state)),
            "state_dir": dir_bytes(self.state) / 1e6,
        }
        try:
            samples = scrape(self.metrics_url)
            disk["learner_records"] = sum(samples.get("diloco_learners", {}).values())
        except OSError:  # not serving at this moment: no sample
            pass
        for name, value in disk.items():
            self.series[name].append(Sample(t, value, incarnation, age))
        for learner in self.learners:
            p, since = learner.slot.proc, learner.training[-1]
            if learner.restart_at is None and p is not None and since is not None:
                figures = process_figures(p.pid)
                if figures is not None:
                    self.series[f"l{learner.slot.index}_rss"].append(
                        Sample(t, figures[0], len(learner.training) - 1, now - since)
                    )

    def note_training(self) -> bool:
        """Notes when each learner's current incarnation began training (its result names its
        id); True when every learner is training."""
        for learner in self.learners:
            if learner.restart_at is None and learner.training[-1] is None:
                if identity(read_json(learner.slot.runs[-1]))[0]:
                    learner.training[-1] = self.now()
        return all(lr.restart_at is None and lr.training[-1] is not None for lr in self.learners)

    def wait_for_training(self) -> None:
        """Until every learner has reported its id, from its first progress line."""
        deadline = time.monotonic() + STARTUP_S
        while not self.note_training():
            self.check()
            if time.monotonic() > deadline:
                raise SoakError(
                    f"the learners were not all training within {STARTUP_S:g} s; see {self.root / 'logs'}"
                )
            time.sleep(0.1)  # other processes' files: nothing to wait on

    def run(self) -> None:
        """Starts the job and, once every learner trains, runs the schedule for its minutes
        (the run's time 0 is then: start-up is not the soak)."""
        s = self.schedule
        self.start_synchronizer()
        for learner in self.learners:
            self.start_learner(learner)
        self.wait_for_training()
        self.begin = self.now()
        end = s.minutes * 60
        # a restart too late for its incarnation to pass the warm-up would leave nothing to fit
        last_restart = end - s.warmup_s - MIN_SAMPLES * s.sample_every_s
        # kills fall half an interval after the run's start, away from the restarts
        next_sample, next_restart, next_kill, victim = 0.0, s.restart_every_s, s.kill_every_s / 2, 0
        while (t := self.now() - self.begin) < end:
            self.check()
            self.note_training()
            if t >= next_restart and t < last_restart:
                self.restart_synchronizer()
                next_restart += s.restart_every_s
            if t >= next_kill and self.kill(self.learners[victim]):
                victim = (victim + 1) % LEARNERS
                # a kill put off (its learner had no id yet) does not bring the next one closer
                next_kill = max(next_kill + s.kill_every_s, t + s.kill_every_s / 2)
            for learner in self.learners:
                if learner.restart_at is not None and self.now() >= learner.restart_at:
                    self.restart_learner(learner)
            if t >= next_sample:
                self.sample()
                next_sample += s.sample_every_s
            time.sleep(0.05)  # other processes' files and clocks: nothing to wait on

    def came_back(self) -> list[dict[str, Any]]:
        """Every kill, with the id its learner's next incarnation joined under ("" if it
        reported none before the end)."""
        out = []
        for learner in self.learners:
            runs = learner.slot.runs
            for k, kill in enumerate(learner.kills):
                after = identity(read_json(runs[k + 1]))[0] if k + 1 < len(runs) else ""
                out.append({"learner": learner.slot.index, **kill, "came_back_as": after})
        return sorted(out, key=lambda k: k["at_s"])

    def learner_totals(self) -> dict[str, Any]:
        steps, pushes, errors = 0, 0, 0
        for learner in self.learners:
            for run in learner.slot.runs:
                r = read_json(run)
                steps += r.get("step", 0) - r.get("start_step", 0)
                info = r.get("learner") or {}
                pushes += (info.get("pushes") or {}).get("accepted", 0)
                errors += info.get("errors", 0)
        return {"learner_steps": steps, "pushes_accepted": pushes, "learner_errors": errors}


COLUMNS = [
    "series",
    "unit",
    "samples",
    "first",
    "last",
    "slope_per_h",
    "late_slope_per_h",
    "rise",
    "limit_per_h",
    "floor",
    "detectable_per_h",
    "verdict",
]


def soak(root: Path, schedule: Schedule, judged: bool = True) -> dict[str, Any]:
    """Runs the soak under `root`; its figures and verdicts. `passed` is false when a process
    failed (`run_failures`) or, where `judged`, a series grows (`series_failures`)."""
    job = Soak(root, schedule)
    run_failures: list[str] = []
    try:
        job.run()
    except SoakError as e:
        run_failures.append(str(e))
    finally:
        job.procs.stop_all()
    since = schedule.minutes * 60 / 2
    rows = [judge(name, samples, since, schedule.warmup_s) for name, samples in job.series.items()]
    series_failures = [
        f"{r['series']} {r['verdict']}: {r['slope_per_h']:+.3g} {r['unit']}/h, {r['rise']:+.3g} {r['unit']} over {r['span_s']:.0f} s"
        for r in rows
        if r["verdict"] != "bounded"
    ]
    kills = job.came_back()
    run_failures += [
        f"learner {k['learner']} came back as {k['came_back_as']!r}, not {k['learner_id']!r}"
        for k in kills
        if k["came_back_as"] and k["came_back_as"] != k["learner_id"]
    ]
    return {
        "schedule": dataclasses.asdict(schedule),
        "startup_s": job.begin,
        "rows": rows,
        "judged": judged,
        "passed": not run_failures and not (judged and series_failures),
        "run_failures": run_failures,
        "series_failures": series_failures,
        "kills": kills,
        "rejoined_as_itself": sum(1 for k in kills if k["came_back_as"] == k["learner_id"]),
        "restarts": job.restarts,
        **job.learner_totals(),
        "samples": {
            name: [[round(s.t, 2), round(s.value, 3), s.incarnation] for s in samples]
            for name, samples in job.series.items()
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="how long the soak runs (default: 60; 5 with --quick, 0.45 with --smoke)",
    )
    p.add_argument(
        "--root", type=Path, default=None, help="keep the run's logs and state directory here"
    )
    args = p.parse_args(argv)
    mode = run_mode(args)
    schedule = SCHEDULES[mode["mode"]]
    if args.minutes is not None:
        schedule = dataclasses.replace(schedule, minutes=args.minutes)
    shortest = 2 * (schedule.warmup_s + MIN_SAMPLES * schedule.sample_every_s) / 60
    if not schedule.minutes >= shortest:
        p.error(
            f"--minutes {schedule.minutes:g} leaves too little to fit: the second half must hold "
            f"{MIN_SAMPLES} samples past the {schedule.warmup_s:g} s warm-up; at least {shortest:.2g}"
        )
    say_mode(mode)
    print(
        f"soak: {schedule.minutes:g} min, Synchronizer restarted every {schedule.restart_every_s:g} s, "
        f"a learner killed every {schedule.kill_every_s:g} s, sampled every {schedule.sample_every_s:g} s",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="diloco-soak-") as d:
        root = args.root or Path(d)
        result = {**mode, "machine": machine(), **soak(root, schedule, not args.smoke)}
    print(table(result["rows"], COLUMNS))
    print(
        f"{len(result['restarts'])} Synchronizer restarts, {len(result['kills'])} learner kills "
        f"({result['rejoined_as_itself']} came back as themselves), "
        f"{result['learner_steps']} steps, {result['pushes_accepted']} pushes accepted"
    )
    failures = result["run_failures"] + result["series_failures"]
    if not result["judged"]:
        print("smoke mode has no steady state: its slopes are shown, not judged")
        failures = result["run_failures"]
    print("PASSED" if result["passed"] else "FAILED:\n  " + "\n  ".join(failures))
    say_mode(mode)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    sys.exit(0 if program(main)["passed"] else 1)
