"""Running one benchmark job: a Synchronizer and M learner processes (or M data-parallel ranks,
see bench/dp.py) over `bench.net` links, and what every benchmark reads off a finished job.

- `Workload`: the model, data and inner optimizer every configuration of a benchmark shares
  (the bundled example's defaults, or a tiny one for `--smoke`), as `diloco-learner train` flags.
- `Decoupled`: one Synchronizer-plus-learners configuration (quorum, grace, H, P, codec, merge).
- `DilocoJob`: starts the Synchronizer (`python -m synchronizer serve`, bound where the links
  say) and the learners (`python -m demo train`, each on its own link), lets a `tick` hook
  inject faults, and collects per-learner results, bytes on the wire (whole run and steady state)
  and the Synchronizer's metrics. `GlobalModel` pulls the served model into this process and
  evaluates it (the final loss of a DiLoCo run is the global model's, not a learner's), as an
  evaluator: it counts as no learner, and reports the loss, so the Synchronizer's effective
  goodput (with `--reference-curve`) and its count of tokens consumed come back with it.
- `alone`: one learner with the same per-learner tokens and no syncing.

Every process runs in its own process group (`demo.procs.Procs`) and is ended when the job ends,
however it ends.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.net import Links
from demo.procs import Procs, metric, read_json, scrape, start_synchronizer
from demo.train import TrainOptions, build
from learner.client import SyncClient
from learner.config import LearnerConfig
from learner.fragments import FragmentPlan
from protos import diloco_pb2 as pb
from synchronizer.config import SynchronizerConfig


@dataclass
class Workload:
    """What every run of a benchmark trains: the same model, data, schedule and tokens."""

    learners: int = 4
    steps: int = 1000
    n_layer: int = 2
    d_model: int = 64
    n_head: int = 2
    context: int = 128
    batch_size: int = 16
    max_bytes: int = 4 << 20
    lr: float = 8e-3
    warmup_steps: int = 50
    eval_windows: int = 256
    seed: int = 0
    log_every: int = 10
    slow_learner: int = -1  # this learner runs slow_factor times slower and trains
    slow_factor: float = 1.0  # steps / slow_factor steps (the others' wall time); -1: none

    def steps_of(self, index: int) -> int:
        """Inner steps learner `index` trains: the slow one as many as it reaches in the
        time the others take for all of theirs."""
        if index == self.slow_learner and self.slow_factor > 1:
            return max(1, round(self.steps / self.slow_factor))
        return self.steps

    def train_flags(self) -> list[str]:
        return [
            "--n-layer",
            str(self.n_layer),
            "--d-model",
            str(self.d_model),
            "--n-head",
            str(self.n_head),
            "--context",
            str(self.context),
            "--batch-size",
            str(self.batch_size),
            "--max-bytes",
            str(self.max_bytes),
            "--lr",
            str(self.lr),
            "--warmup-steps",
            str(self.warmup_steps),
            "--eval-windows",
            str(self.eval_windows),
            "--seed",
            str(self.seed),
            "--log-every",
            str(self.log_every),
            "--threads",
            "1",
        ]

    def options(self, learner_index: int = 0, **overrides: Any) -> TrainOptions:
        """The same settings as TrainOptions (for data-parallel ranks and the evaluator)."""
        return TrainOptions(
            steps=self.steps,
            n_layer=self.n_layer,
            d_model=self.d_model,
            n_head=self.n_head,
            block=self.context,
            batch_size=self.batch_size,
            max_bytes=self.max_bytes,
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            eval_windows=self.eval_windows,
            seed=self.seed,
            log_every=self.log_every,
            sync=None,
            learner_index=learner_index,
            learners=self.learners,
            threads=1,
            **overrides,
        )


# The smallest mode, for the test suite: a tiny model, 2 learners, about a second of training.
# Not much less: learners start together by polling for each other (train.wait_for_learners
# counts live learners), so a run shorter than a poll could finish and leave unseen.
SMOKE = Workload(
    learners=2,
    steps=100,
    n_layer=1,
    d_model=32,
    n_head=2,
    context=32,
    batch_size=8,
    max_bytes=1 << 18,
    warmup_steps=5,
    eval_windows=32,
    log_every=5,
)
# What the benchmarks' own `--smoke` runs train: they prove that a benchmark runs and writes its
# figures, not what it measures, so a few syncs (H = 10) are enough; 40 steps still last several
# of wait_for_learners' polls.
SMOKE_SHORT = dataclasses.replace(SMOKE, steps=40)


@dataclass
class Decoupled:
    """One Synchronizer + learners configuration."""

    name: str
    quorum: int = 1  # 0: every live learner (synchronous DiLoCo)
    grace: str = "adaptive"
    grace_max_s: float = 5.0
    grace_tau: int = 0  # the Synchronizer's tau (--overlap-steps) sizing the adaptive
    # grace; 0 = H: fragment p is needed back before its next push
    sync_every: int = 100  # H
    fragments: int = 1  # P
    codec: str = "int4"
    merge: str = "mix"
    alpha: float = 0.5
    strict_overlap: bool = False  # block tau steps after a push until the round is back
    token_weight: str = "tokens2_per_step"
    outer: str = "nesterov"
    outer_lr: float = 1.0
    outer_momentum: float = 0.9
    # work: a round steps by its share of the learners' work; full: every round a whole step
    # (what synchronous DiLoCo, torchft's included, does when a learner has left)
    round_share: str = "work"
    lease_s: float = 10.0
    # True: the Synchronizer and the learners get none of the settings above but H (what a user
    # who passes no flags gets, at the benchmark's H); see `with_defaults`
    defaults: bool = False
    synchronizer_args: list[str] = field(default_factory=list)
    train_args: list[str] = field(default_factory=list)

    @classmethod
    def with_defaults(cls, name: str, sync_every: int, **changes: Any) -> Decoupled:
        """The configuration no flags give, at H = `sync_every`: the fields read from the
        Synchronizer's and the learner's defaults (for `describe` and the evaluator), no setting
        flags passed (`synchronizer_args` / `train_args` may still add some)."""
        s, lc = SynchronizerConfig.model_fields, LearnerConfig.model_fields
        return cls(
            name=name,
            defaults=True,
            sync_every=sync_every,
            quorum=s["quorum"].default,
            grace=s["grace"].default,
            grace_max_s=s["grace_max_s"].default,
            grace_tau=s["overlap_steps"].default,
            fragments=lc["fragments"].default,
            codec=lc["codec"].default,
            merge=lc["merge"].default,
            alpha=lc["alpha"].default,
            strict_overlap=lc["strict_overlap"].default,
            token_weight=s["token_weight"].default,
            outer=s["outer"].default,
            outer_lr=s["outer_lr"].default,
            outer_momentum=s["outer_momentum"].default,
            round_share=s["round_share"].default,
            lease_s=s["lease_s"].default,
            **changes,
        )

    def describe(self) -> str:
        if self.defaults:
            extra = " ".join([*self.synchronizer_args, *self.train_args])
            return f"defaults H={self.sync_every}" + (f" {extra}" if extra else "")
        k = "all" if self.quorum == 0 else str(self.quorum)
        s = f"K={k} H={self.sync_every} P={self.fragments} {self.codec} {self.merge}"
        if self.merge == "mix":
            s += f" a={self.alpha:g}"
        s += f" outer={self.outer}({self.outer_lr:g},{self.outer_momentum:g})"
        if self.quorum:
            s += f" grace={self.grace}" + (
                f"(tau={self.grace_tau or self.sync_every},max={self.grace_max_s:g}s)"
                if self.grace == "adaptive"
                else f"({self.grace_max_s:g}s)"
            )
        s += " share=full" if self.round_share == "full" else ""
        return s + (" strict" if self.strict_overlap else "")

    def with_(self, **changes: Any) -> Decoupled:
        return dataclasses.replace(self, **changes)

    def synchronizer_flags(self, host: str = "127.0.0.1") -> list[str]:
        """`synchronizer serve` flags of this configuration (bound to host, quiet logs)."""
        run = [
            "--host",
            host,
            "--goodput-window-s",
            "3600",
            "--checkpoint-interval-s",
            "0",
            "--shutdown-grace-s",
            "1",
            "--log-level",
            "WARNING",
        ]
        if self.defaults:
            return [*run, *self.synchronizer_args]
        return [
            *run,
            "--quorum",
            str(self.quorum),
            "--grace",
            self.grace,
            "--grace-max-s",
            str(self.grace_max_s),
            "--overlap-steps",
            str(self.grace_tau or self.sync_every),
            "--lease-s",
            str(self.lease_s),
            "--forget-after-s",
            str(max(10.0, 3 * self.lease_s)),
            "--token-weight",
            self.token_weight,
            "--outer",
            self.outer,
            "--outer-lr",
            str(self.outer_lr),
            "--outer-momentum",
            str(self.outer_momentum),
            "--round-share",
            self.round_share,
            *self.synchronizer_args,
        ]


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


class JobError(RuntimeError):
    """A benchmark job failed; the message names the log to read."""


def learner_cmd(
    c: Decoupled | None,
    w: Workload,
    index: int,
    out: Path,
    address: str = "",
    *,
    start_step: int = 0,
    rejoin: list[str] | None = None,
    wait_for: int = 0,
) -> list[str]:
    """`python -m demo train` for learner `index` of the workload; c None: without syncing."""
    cmd = python(
        "-m",
        "demo",
        "train",
        "--learner-index",
        str(index),
        "--learners",
        str(w.learners),
        "--steps",
        str(w.steps_of(index)),
        "--start-step",
        str(start_step),
        "--out",
        str(out),
        *w.train_flags(),
    )
    if index == w.slow_learner and w.slow_factor > 1:
        cmd += ["--slow", str(w.slow_factor)]
    if c is None:
        return [*cmd, "--no-sync"]
    cmd += ["--synchronizer", address, "--name", f"l{index}", "--sync-every", str(c.sync_every)]
    if c.defaults:
        cmd += c.train_args
    else:
        cmd += [
            "--fragments",
            str(c.fragments),
            "--codec",
            c.codec,
            "--merge",
            c.merge,
            "--alpha",
            str(c.alpha),
            "--retry-max-s",
            "2",
            *c.train_args,
        ]
    if c.strict_overlap and not c.defaults:
        cmd += ["--strict-overlap"]
    if wait_for:
        cmd += ["--wait-for-learners", str(wait_for)]
    return cmd + (rejoin or [])


@dataclass
class Incarnation:
    """One learner process on a slot: a restarted learner has several."""

    proc: Any
    out: Path
    start_step: int

    def result(self) -> dict:
        return read_json(self.out)


@dataclass
class Slot:
    index: int
    runs: list[Incarnation] = field(default_factory=list)
    down: bool = False  # killed on purpose and not restarted yet

    @property
    def proc(self) -> Any:
        return self.runs[-1].proc if self.runs else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def finished(self) -> bool:
        return bool(self.runs) and not self.down and self.proc.poll() == 0


class DilocoJob:
    """A Synchronizer and `workload.learners` learner processes, one per link."""

    def __init__(self, cfg: Decoupled, workload: Workload, links: Links, out: Path) -> None:
        self.cfg, self.workload, self.links, self.out = cfg, workload, links, out
        self.children = Procs(out)
        self.slots = [Slot(i) for i in range(workload.learners)]
        self.address = ""
        self.metrics_url = ""
        self.sync_proc: Any = None

    def start(self) -> None:
        self.sync_proc, info = start_synchronizer(
            self.children, self.cfg.synchronizer_flags(self.links.bind_host())
        )
        self.port = info["port"]
        self.address = f"{self.links.bind_host()}:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{info['metrics_port']}/metrics"
        for s in self.slots:
            self.start_learner(s, wait_for=self.workload.learners)

    def start_learner(
        self,
        slot: Slot,
        start_step: int = 0,
        rejoin: list[str] | None = None,
        wait_for: int = 0,
    ) -> None:
        out = self.out / f"learner-{slot.index}.run{len(slot.runs)}.json"
        out.unlink(missing_ok=True)
        cmd = learner_cmd(
            self.cfg,
            self.workload,
            slot.index,
            out,
            self.links.synchronizer_address(slot.index, self.port),
            start_step=start_step,
            rejoin=rejoin,
            wait_for=wait_for,
        )
        proc = self.children.start(f"learner-{slot.index}", self.links.wrap(slot.index, cmd))
        slot.runs.append(Incarnation(proc, out, start_step))
        slot.down = False

    def check(self) -> None:
        if self.sync_proc.poll() is not None:
            raise JobError(
                f"the Synchronizer exited with code {self.sync_proc.returncode}; see {self.children.log('synchronizer')}"
            )
        for s in self.slots:
            if not s.down and s.proc is not None and s.proc.poll() not in (None, 0):
                raise JobError(
                    f"learner {s.index} exited with code {s.proc.returncode}; see {self.children.log(f'learner-{s.index}')}"
                )

    def run(
        self,
        tick: Callable[[DilocoJob], None] | None = None,
        timeout_s: float = 1800,
        evaluator: GlobalModel | None = None,
        eval_every_s: float = 0.0,
    ) -> dict:
        """Runs to the end; returns the summary. `tick` is called about 20 times a second."""
        evals: list[dict] = []
        try:
            self.start()
            self.links.start_sampling()
            deadline = time.monotonic() + timeout_s
            next_eval = time.time() + eval_every_s
            while not all(s.finished() for s in self.slots):
                time.sleep(0.05)
                self.check()
                if tick is not None:
                    tick(self)
                if time.monotonic() > deadline:
                    raise JobError(f"{self.cfg.name} did not finish within {timeout_s:.0f} s")
                if (
                    evaluator is not None
                    and eval_every_s
                    and time.time() >= next_eval
                    and self.training_started()
                ):
                    evals.append(evaluator.timed(self.address))
                    next_eval = time.time() + eval_every_s
            self.links.stop_sampling()
            samples = scrape(self.metrics_url)
            final = (evaluator or GlobalModel(self.workload, self.cfg.fragments)).timed(
                self.address
            )
        finally:
            self.links.stop_sampling()
            self.children.stop_all()
        return self.summarize(samples, final, evals)

    def training_started(self) -> bool:
        return all(s.runs and "started_at" in s.runs[0].result() for s in self.slots)

    def summarize(self, samples: dict, final: dict, evals: list[dict]) -> dict:
        results, t_start, t_end, wire = run_span(self.slots, self.links, self.workload.steps)
        learner_counted = statistics.mean(
            sum(r.get("bytes_sent", 0) + r.get("bytes_received", 0) for r in rs) for rs in results
        )
        return {
            "name": self.cfg.name,
            "config": self.cfg.describe(),
            "eval_loss": final["eval_loss"],
            "wall_s": t_end - t_start,
            "steps": self.workload.steps,
            "steps_per_s": statistics.mean(rs[-1].get("steps_per_s", 0.0) for rs in results),
            **wire,
            "learner_counted_bytes_per_step": learner_counted / self.workload.steps,
            "outer_steps": metric(samples, "diloco_outer_steps_total"),
            "synchronizer_goodput": metric(samples, "diloco_goodput_ratio"),
            "merged_compute_s": metric(samples, "diloco_compute_seconds_total", bucket="merged"),
            "capacity_s": metric(samples, "diloco_learner_capacity_seconds_total"),
            "pushes": {
                dict(k).get("outcome", ""): v
                for k, v in samples.get("diloco_pushes_total", {}).items()
            },
            "eval_series": [
                {"t": e["t"] - t_start, "eval_loss": e["eval_loss"], "tokens": e["tokens"]}
                for e in evals
            ]
            + [{"t": t_end - t_start, "eval_loss": final["eval_loss"], "tokens": final["tokens"]}],
            # the Synchronizer's own: tokens its learners reported, and with --reference-curve
            # the effective goodput of the final model
            "synchronizer_consumed_tokens": final["tokens"],
            "synchronizer_effective_goodput": final["effective_goodput"],
            "t_start": t_start,
            "results": results,
        }


def run_span(
    slots: list[Slot], links: Links, steps: int
) -> tuple[list[list[dict]], float, float, dict]:
    """A finished job's results per slot (one per incarnation), the time its first training step
    began and its last progress line, and its wire bytes (`wire_bytes`; per learner only where
    no slot restarted)."""
    results = [[r.result() for r in s.runs] for s in slots]
    t_start = min(rs[0]["started_at"] for rs in results)
    t_end = max(rs[-1]["series"][-1]["t"] for rs in results)
    wire = wire_bytes(
        links, [rs[0] for rs in results] if all(len(rs) == 1 for rs in results) else None, steps
    )
    return results, t_start, t_end, wire


def wire_bytes(links: Links, results: list[dict] | None, steps: int) -> dict:
    """Bytes per inner step each learner sent plus received, mean over learners: over the whole
    run (join, first full pull and final pull included) and in the steady state (between the
    first and the last progress line of each learner, from the sampled link counters)."""
    s = links.samples
    if not s:
        return {"wire": "none", "bytes_per_step": None, "steady_bytes_per_step": None}
    first, last = s[0][1], s[-1][1]
    total = [(last[i][0] - first[i][0]) + (last[i][1] - first[i][1]) for i in range(len(first))]
    out: dict[str, Any] = {
        "wire": links.kind,
        "bytes_per_step": statistics.mean(total) / steps,
        "sent_per_step": statistics.mean(last[i][0] - first[i][0] for i in range(len(first)))
        / steps,
        "received_per_step": statistics.mean(last[i][1] - first[i][1] for i in range(len(first)))
        / steps,
        "steady_bytes_per_step": None,
    }
    if results:
        steady = []
        for i, r in enumerate(results):
            series = r.get("series") or []
            if len(series) < 2:
                continue
            a, b = links.at(i, series[0]["t"]), links.at(i, series[-1]["t"])
            if a is not None and b is not None:
                steady.append(
                    (b[0] - a[0] + b[1] - a[1]) / (series[-1]["step"] - series[0]["step"])
                )
        if steady:
            out["steady_bytes_per_step"] = statistics.mean(steady)
    return out


class GlobalModel:
    """The served global model, pulled into this process and evaluated on the held-out windows,
    by an evaluator that reports the loss (`timed` gives the Synchronizer's reply too)."""

    _built: dict[str, tuple] = {}  # one model and evaluation set per workload, for every run

    def __init__(self, workload: Workload, fragments: int) -> None:
        torch.set_num_threads(1)
        key = repr(workload)
        if key not in self._built:
            self._built[key] = build(workload.options(), torch.device("cpu"))
        self.model, _, self.eval_fn = self._built[key]
        self.plan = FragmentPlan(self.model, fragments)

    def evaluate(self, address: str) -> float:
        return float(self.timed(address)["eval_loss"])

    def timed(self, address: str) -> dict:
        """The eval loss of the served model, when it was pulled, and what the Synchronizer
        answered its report: the training tokens consumed by then, and the effective goodput
        (None without a reference curve)."""
        t = time.time()
        client = SyncClient(address, rpc_timeout_s=60)
        try:
            client.join("bench-eval", self.plan.spec, evaluator=True)
            versions = {}
            for p in range(len(self.plan)):
                versions[p], _, flat = client.pull(p, numel=self.plan.numel(p))
                self.plan.scatter(p, flat)
            loss = self.eval_fn(self.model)
            reply = client.report_eval(loss, versions)
            client.leave(pb.LearnerCounters())
        finally:
            client.close()
        return {
            "t": t,
            "eval_loss": loss,
            "eval_s": time.time() - t,
            "tokens": reply.consumed_tokens,
            "effective_goodput": reply.effective_goodput if reply.has_reference else None,
        }


def alone(workload: Workload, out: Path) -> dict:
    """One learner, learner 0's shard, the same steps, no syncing: the M = 1 baseline."""
    path = out / "alone.json"
    procs = Procs(out)
    try:
        proc = procs.start("alone", learner_cmd(None, workload, 0, path))
        if proc.wait() != 0:
            raise JobError(
                f"the lone learner exited with code {proc.returncode}; see {procs.log('alone')}"
            )
    finally:
        procs.stop_all()
    r = read_json(path)
    return {
        "name": "alone",
        "config": "M=1, no sync",
        "eval_loss": r["eval_loss_end"],
        "wall_s": r["train_s"],
        "steps": workload.steps,
        "steps_per_s": r["steps_per_s"],
        "bytes_per_step": 0.0,
        "steady_bytes_per_step": 0.0,
        "wire": "none",
        "results": [[r]],
        "eval_series": [{"t": r["train_s"], "eval_loss": r["eval_loss_end"]}],
    }
