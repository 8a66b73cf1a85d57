"""Compared with torchft: torchft's DiLoCo and this project on the same model, data, learners, H,
inner optimizer, steps and seed, on unshaped links and on 50 Mbit/s links with a 50 ms round trip
(bench.wan's headline links, built and verified by bench/net.py), and under the goodput
benchmark's fault schedule.

Arms (2 learners of the bundled example, each process on its own `bench.net` link slot):

  torchft   torchft 0.2.0's `DiLoCo` (bench/torchft_learner.py): one replica group per learner,
            a synchronous quorum from a lighthouse in this process, gloo all-reduce of the FP32
            pseudo-gradients every H steps, outer SGD Nesterov (lr 0.7, momentum 0.9), init_sync
            off (every replica starts from the same seed), a killed replica healed from a peer
  default   this project with no flags but H (`Decoupled.with_defaults`, bench/defaults.py's
            `default` arm): a Synchronizer and 2 learners
  sync      this project's synchronous FP32 configuration (bench/defaults.py's `sync` arm:
            quorum = every live learner, P = 1, FP32, overwrite merge, Nesterov 0.7/0.9, each
            learner blocking until its round is back), what torchft's DiLoCo computes; it should
            match torchft's eval loss

Both sides use the outer Nesterov (0.7, 0.9) that is also the Synchronizer's default.

Per run: bytes each learner sent (whole run, on its link: every frame its processes put on the
wire, heartbeats, quorum RPCs and rendezvous included; where the links cannot count, e.g. gloo
behind `--net proxy`, each torchft replica's own TCP sockets, marked `"wire": "socket"`), wall
time from the first training step to the last, and the final eval loss (this project: the
Synchronizer's global model; torchft: the replica that ends at the highest manager step, every
replica there holding the same parameters).

Goodput: bench/goodput.py's seeded schedule (one learner SIGKILLed and restarted 2 leases later,
one slowed 3x for a while), the lease (torchft: the lighthouse's heartbeat timeout) set to 3 s
on both sides. This project: `bench.goodput.run_diloco` and `diloco_goodput` with the defaults,
as `bench.goodput` computes it. torchft, as close as its records allow: capacity the same (per
slot, first training step of the job to that slot's last step); merged compute = per replica
process, H x its per-step compute (forward, backward, inner step; not the sync) for every sync
whose commit took its own work (the manager step went up by one). A sync that failed to commit
(a peer died mid all-reduce) loses H steps on every replica; a restarted replica's first H steps
are discarded when it heals from a peer (it adopts the peer's model, inner optimizer and step).

Headline: `vs_torchft_bytes` = torchft's bytes sent per learner over the defaults' (unshaped
links); `vs_torchft_wall` = torchft's wall time over the defaults' on the 50 Mbit/s, 50 ms links
(missing, with the reason, where those links are per-slot proxies: torchft's gloo all-reduce
goes around them, unshaped);
`vs_torchft_loss` = the defaults' eval loss minus torchft's (unshaped links); also
`goodput_torchft`, `goodput` (the defaults') and `sync_minus_torchft_loss`.

Without torchft (`pip install -e '.[peers]'`) it prints one line and writes
`{"skipped": "torchft not installed ..."}`, exiting 0.

    python -m bench.peers [--quick | --smoke] [--json PATH] [--steps S] [--arms torchft,default,sync]
        [--links loopback,50mbit] [--no-goodput] [--net auto|netns|proxy] [--out DIR]
Modes: --smoke a tiny model, 2 learners, 100 steps, H 10 (about 40 s here); --quick the bundled
example, 400 steps, H 100, the fault runs 600 (about 4 minutes); full the bundled example, 1,000
steps, H 100, the fault runs 1,000 (the run torchft's bundled-example figure came from; about 7
minutes by the quick runs' pace).
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import machine, parser, program, table, write_json
from bench.defaults import ARMS as DEFAULTS_ARMS
from bench.goodput import Injector, kill_learner, run_diloco, schedule
from bench.jobs import (
    SMOKE,
    Decoupled,
    DilocoJob,
    Incarnation,
    JobError,
    Slot,
    Workload,
    run_span,
)
from bench.jobs import python as python_cmd
from bench.net import Links, describe_links, open_links
from demo.procs import Procs

MISSING = "torchft not installed (pip install -e '.[peers]')"
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # torchft's example and the Synchronizer's default

# The link conditions: keyword arguments of open_links.
CONDITIONS: dict[str, dict[str, Any]] = {
    "loopback": {},
    "50mbit": {"rate_bps": 50e6, "rtt_s": 0.05},  # bench.wan's headline link
}
BYTES_ON, WALL_ON = "loopback", "50mbit"  # where the headline ratios are read


def torchft_missing() -> str | None:
    """Why torchft cannot run here, or None when it can."""
    try:
        import torchft  # noqa: F401
    except ImportError as e:
        return f"{MISSING}: {e}"
    return None


# The torchft job ----------------------------------------------------------------------------------


class TorchftJob:
    """torchft's lighthouse (`torchft_lighthouse`, on the links' bind host) and one replica
    process per link slot. The replicas start training together (a go file, once each has its
    manager heartbeating), so the first quorum has both: with both heartbeating, the lighthouse
    waits for the second (join timeout, and its rule of more than half of the live replicas)."""

    def __init__(
        self,
        workload: Workload,
        sync_every: int,
        links: Links,
        out: Path,
        heartbeat_timeout_s: float = 5.0,
    ) -> None:
        self.workload, self.sync_every, self.links, self.out = workload, sync_every, links, out
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.children = Procs(out)
        self.slots = [Slot(i) for i in range(workload.learners)]
        self.go = out / "go"
        self.lighthouse: Any = None  # its process
        self.lighthouse_addr = ""

    def start(self) -> None:
        host = self.links.bind_host()
        self.children.log("lighthouse").unlink(missing_ok=True)  # its port is read from it
        self.lighthouse = self.children.start(
            "lighthouse",
            [
                lighthouse_binary(),
                "--bind",
                f"{host}:0",
                "--min_replicas",
                "1",  # a lone survivor carries on; the first quorum waits for both (see below)
                "--join_timeout_ms",
                "60000",
                "--heartbeat_timeout_ms",
                str(int(self.heartbeat_timeout_s * 1000)),
            ],
        )
        port = listening_port(self.children.log("lighthouse"), self.lighthouse)
        self.lighthouse_addr = f"http://{host}:{port}"
        self.go.unlink(missing_ok=True)
        for s in self.slots:
            self.start_learner(s)

    def start_learner(self, slot: Slot, start_step: int = 0) -> None:
        n = len(slot.runs)
        out = self.out / f"torchft-{slot.index}.run{n}.json"
        out.unlink(missing_ok=True)
        spec = {
            "slot": slot.index,
            "host": self.links.slot_host(slot.index),
            "workload": dataclasses.asdict(self.workload),
            "start_step": start_step,
            "sync_every": self.sync_every,
            "outer_lr": OUTER_LR,
            "outer_momentum": OUTER_MOMENTUM,
            "lighthouse": self.lighthouse_addr,
            "go": str(self.go),
            "out": str(out),
        }
        spec_path = self.out / f"torchft-{slot.index}.run{n}.spec.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [
            "env",
            f"GLOO_SOCKET_IFNAME={self.links.gloo_ifname(slot.index)}",
            *python_cmd("-m", "bench.torchft_learner", str(spec_path)),
        ]
        proc = self.children.start(f"torchft-{slot.index}", self.links.wrap(slot.index, cmd))
        slot.runs.append(Incarnation(proc, out, start_step))
        slot.down = False

    def check(self) -> None:
        for s in self.slots:
            if not s.down and s.proc is not None and s.proc.poll() not in (None, 0):
                raise JobError(
                    f"torchft replica {s.index} exited with code {s.proc.returncode}; see {self.children.log(f'torchft-{s.index}')}"
                )

    def started_at(self) -> float | None:
        """When the job's first training step began (every first replica has started)."""
        starts = [s.runs[0].result().get("started_at") for s in self.slots if s.runs]
        return min(starts) if starts and all(starts) else None  # type: ignore[type-var]

    def run(
        self, tick: Callable[[TorchftJob], None] | None = None, timeout_s: float = 1800
    ) -> dict:
        try:
            self.links.start_sampling()
            self.start()
            deadline = time.monotonic() + timeout_s
            while not all(s.finished() for s in self.slots):
                time.sleep(0.05)
                self.check()
                if not self.go.exists() and all(
                    s.runs[0].result().get("ready") for s in self.slots
                ):
                    self.go.touch()  # every manager heartbeats the lighthouse: train
                if tick is not None:
                    tick(self)
                if time.monotonic() > deadline:
                    raise JobError(f"torchft did not finish within {timeout_s:.0f} s")
            self.links.stop_sampling()
        finally:
            self.links.stop_sampling()
            self.children.stop_all(grace_s=0)
        return self.summarize()

    def summarize(self) -> dict:
        w = self.workload
        results, t_start, t_end, wire = run_span(self.slots, self.links, w.steps)
        if self.links.kind != "netns":  # gloo bypasses the proxies: the replicas' own sockets
            sent = [sum(r.get("socket_sent", 0) for r in rs) for rs in results]
            received = [sum(r.get("socket_received", 0) for r in rs) for rs in results]
            wire = {
                "wire": "socket",
                "bytes_per_step": (statistics.mean(sent) + statistics.mean(received)) / w.steps,
                "sent_per_step": statistics.mean(sent) / w.steps,
                "received_per_step": statistics.mean(received) / w.steps,
                "steady_bytes_per_step": None,
            }
        final = final_replica([r for rs in results for r in rs])
        return {
            "name": "torchft",
            "config": f"torchft DiLoCo H={self.sync_every} FP32 gloo all-reduce, outer Nesterov({OUTER_LR:g},{OUTER_MOMENTUM:g})",
            "eval_loss": final["eval_loss_end"],
            "replicas_agree": final["agree"],
            "manager_step": final["manager_step"],
            "wall_s": t_end - t_start,
            "steps": w.steps,
            "steps_per_s": statistics.mean(rs[-1].get("steps_per_s", 0.0) for rs in results),
            **wire,
            "sent_per_learner": wire["sent_per_step"] * w.steps,
            "shaped": self.links.rate_bps is not None and self.links.kind == "netns",
            "unshaped_why": self.links.dp_unshaped(),  # its all-reduce goes around proxies
            "t_start": t_start,
            "results": results,
        }


def lighthouse_binary() -> str:
    """torchft's `torchft_lighthouse`, installed next to this Python."""
    path = Path(sys.executable).with_name("torchft_lighthouse")
    return str(path) if path.exists() else "torchft_lighthouse"


def listening_port(log: Path, proc: Any, timeout_s: float = 30.0) -> int:
    """The port the lighthouse logged it listens on (bound to port 0; the host in its line is
    the machine's hostname, not the address it is bound to)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(r"listening on: \S+:(\d+)", log.read_text(errors="replace"))
        if m:
            return int(m.group(1))
        if proc.poll() is not None:
            raise JobError(f"the torchft lighthouse exited with code {proc.returncode}; see {log}")
        time.sleep(0.05)  # another process's log: no event to wait on
    raise JobError(f"the torchft lighthouse did not start within {timeout_s:g} s; see {log}")


def final_replica(results: list[dict]) -> dict:
    """The finished replica process at the highest manager step (the final global model), and
    whether every finished process at that step holds the same parameters."""
    done = [r for r in results if r.get("finished")]
    if not done:
        raise JobError("no torchft replica finished")
    top = max(r["manager_step"] for r in done)
    at_top = [r for r in done if r["manager_step"] == top]
    return {**at_top[0], "agree": len({r["param_hash"] for r in at_top}) == 1}


def merged_syncs(syncs: list[dict], restarted: bool) -> int:
    """The syncs of one replica process whose commit took its own H steps into the job's model:
    the manager step went up by one (one that stayed failed to commit; one that jumped further
    healed from a peer, whose state replaced the last H steps). A restarted process counts only
    once it is back in the job's lineage, from its first quorum with a peer: alone (the others
    gone), it trains a model of its own from the initial one, which nobody evaluates."""
    merged, joined = 0, not restarted
    for s in syncs:
        joined = joined or s["participants"] > 1 or s["after"] > s["before"] + 1
        if joined and s["after"] == s["before"] + 1:
            merged += 1
    return merged


def torchft_goodput(sync_every: int, slots: list[Slot], t_start: float) -> dict:
    """Goodput as bench.goodput counts it for this project: merged compute over capacity."""
    merged = capacity = 0.0
    per_slot = []
    for s in slots:
        results = [r.result() for r in s.runs]
        end = results[-1]["series"][-1]["t"]
        slot_merged = 0.0
        for k, r in enumerate(results):
            calls = r.get("calls", 0)
            if calls <= 0:
                continue
            per_step = r.get("compute_s", 0.0) / calls
            slot_merged += per_step * sync_every * merged_syncs(r.get("syncs") or [], k > 0)
        merged += slot_merged
        capacity += end - t_start
        per_slot.append(
            {
                "slot": s.index,
                "capacity_s": end - t_start,
                "merged_compute_s": slot_merged,
                "processes": len(s.runs),
                "syncs": [
                    {k: x[k] for k in ("done", "before", "after", "participants")}
                    for r in results
                    for x in r.get("syncs") or []
                ],
            }
        )
    return {
        "goodput": merged / capacity if capacity else 0.0,
        "merged_compute_s_harness": merged,
        "capacity_s_harness": capacity,
        "per_slot": per_slot,
    }


def run_torchft_goodput(
    w: Workload, sync_every: int, faults: list, net: str, out: Path, lease_s: float
) -> dict:
    crashed: dict[int, int] = {}  # slot -> the step it had reached
    job: TorchftJob  # made below, once the links are open; the callbacks run after that

    def crash(i: int) -> str:
        r = kill_learner(job.slots[i], w.steps)
        if r is None:
            return "already finished"
        crashed[i] = r["step"]
        return f"at step {r['step']}"

    def restart(i: int) -> str:
        if i not in crashed:
            return "not down"
        step = crashed.pop(i)
        job.start_learner(job.slots[i], start_step=step)
        return f"from step {step}"

    injector = Injector(faults, lambda i: job.slots[i].proc, crash, restart)

    def tick(j: TorchftJob) -> None:
        injector.tick(j.started_at() if injector.t0 is None else injector.t0)

    with open_links(net, w.learners) as links:
        job = TorchftJob(w, sync_every, links, out, heartbeat_timeout_s=lease_s)
        try:
            summary = job.run(tick=tick)
        finally:
            injector.close()
    return {
        **summary,
        **torchft_goodput(sync_every, job.slots, summary["t_start"]),
        "events": injector.log,
    }


# This project's arms ------------------------------------------------------------------------------


def project_arm(arm: str, sync_every: int) -> Decoupled:
    return DEFAULTS_ARMS[arm](sync_every).with_(name=arm)


def run_project(cfg: Decoupled, w: Workload, links: Links, out: Path) -> dict:
    r = DilocoJob(cfg, w, links, out).run()
    r["sent_per_learner"] = (r.get("sent_per_step") or 0.0) * w.steps
    r["shaped"] = links.rate_bps is not None
    return r


# The benchmark ------------------------------------------------------------------------------------


@dataclass
class Mode:
    workload: Workload
    sync_every: int
    goodput_steps: int
    lease_s: float  # goodput runs: the Synchronizer's lease, torchft's heartbeat timeout
    steps_per_s: float  # per learner with 2 learners here, to place the faults in time


SMOKE_MODE = Mode(dataclasses.replace(SMOKE), 10, 150, 1.0, 150.0)
QUICK_MODE = Mode(Workload(learners=2, steps=400), 100, 600, 3.0, 25.0)
FULL_MODE = Mode(Workload(learners=2, steps=1000), 100, 1000, 3.0, 25.0)


def headline(runs: dict[str, dict[str, dict]], goodput: dict[str, dict]) -> dict[str, Any]:
    """The top-level figures from runs[condition][arm] and goodput[arm]; None where an arm or
    condition was not run, or (with the reason under `missing`) where torchft's traffic could not
    be given the links its wall time is compared on."""

    def get(cond: str, arm: str, key: str) -> float | None:
        v = runs.get(cond, {}).get(arm, {}).get(key)
        return float(v) if isinstance(v, (int, float)) else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def diff(a: float | None, b: float | None) -> float | None:
        return a - b if a is not None and b is not None else None

    unshaped = runs.get(WALL_ON, {}).get("torchft", {}).get("unshaped_why")
    missing = {}
    if unshaped:
        missing["vs_torchft_wall"] = f"torchft ran unshaped on the {WALL_ON} links: {unshaped}"
    return {
        "vs_torchft_bytes": ratio(
            get(BYTES_ON, "torchft", "sent_per_learner"),
            get(BYTES_ON, "default", "sent_per_learner"),
        ),
        "vs_torchft_wall": None
        if unshaped
        else ratio(get(WALL_ON, "torchft", "wall_s"), get(WALL_ON, "default", "wall_s")),
        "vs_torchft_loss": diff(
            get(BYTES_ON, "default", "eval_loss"), get(BYTES_ON, "torchft", "eval_loss")
        ),
        "sync_minus_torchft_loss": diff(
            get(BYTES_ON, "sync", "eval_loss"), get(BYTES_ON, "torchft", "eval_loss")
        ),
        "goodput_torchft": goodput.get("torchft", {}).get("goodput"),
        "goodput": goodput.get("default", {}).get("goodput"),
        "missing": missing,
    }


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, help="inner steps per learner")
    p.add_argument("--arms", help="comma-separated subset of torchft,default,sync")
    p.add_argument("--links", help=f"comma-separated subset of {','.join(CONDITIONS)}")
    p.add_argument("--no-goodput", action="store_true", help="leave out the fault schedule runs")
    p.add_argument("--seed", type=int, default=0, help="fault schedule seed")
    p.add_argument(
        "--net",
        choices=("auto", "netns", "proxy"),
        default="auto",
        help="links: namespaces (root) or proxies",
    )
    p.add_argument("--out", type=Path, help="keep the runs' logs and result files here")
    args = p.parse_args(argv)
    missing = torchft_missing()
    if missing:
        print(f"bench.peers: skipped: {missing}", flush=True)
        result: dict[str, Any] = {"skipped": missing, "machine": machine()}
        write_json(args.json, result)
        return result
    mode = SMOKE_MODE if args.smoke else QUICK_MODE if args.quick else FULL_MODE
    w, h = dataclasses.replace(mode.workload), mode.sync_every
    if args.steps:
        w.steps = args.steps
    arms = args.arms.split(",") if args.arms else ["torchft", "default", "sync"]
    if args.smoke and not args.arms:
        arms = ["torchft", "default"]
    conditions = args.links.split(",") if args.links else list(CONDITIONS)
    unknown = sorted(set(arms) - {"torchft", "default", "sync"}) + sorted(
        set(conditions) - set(CONDITIONS)
    )
    if unknown:
        raise SystemExit(
            f"unknown arms or links {unknown}; arms: torchft, default, sync; links: {list(CONDITIONS)}"
        )

    runs: dict[str, dict[str, dict]] = {}
    goodput: dict[str, dict] = {}
    measured: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        root = args.out or Path(tmp)
        for cond in conditions:
            with open_links(args.net, w.learners, **CONDITIONS[cond]) as links:
                print(
                    f"{w.learners} learners x {w.steps} steps, H={h}, links: {cond} ({links.kind})",
                    flush=True,
                )
                measured[cond] = links.verify()
                print(describe_links(measured[cond]), flush=True)
                for arm in arms:
                    out = root / f"{cond}-{arm}"
                    if arm == "torchft":
                        r = TorchftJob(w, h, links, out).run()
                    else:
                        r = run_project(project_arm(arm, h), w, links, out)
                    r.update(name=arm, link=cond)
                    runs.setdefault(cond, {})[arm] = r
                    print(
                        f"  {arm:8s} eval loss {r['eval_loss']:.4f}  sent {r['sent_per_learner'] / 1e6:8.3f} MB/learner  wall {r['wall_s']:6.1f} s  ({r['config']})",
                        flush=True,
                    )
                    if links.rate_bps and not r["shaped"]:
                        print(
                            f"  note: {arm} ran unshaped ({links.kind} links cannot hold gloo's peer-to-peer traffic; root gives namespaces)",
                            flush=True,
                        )
        if not args.no_goodput:
            gw = dataclasses.replace(w, steps=args.steps or mode.goodput_steps)
            faults = schedule(args.seed, gw.learners, gw.steps / mode.steps_per_s, 2 * mode.lease_s)
            print(f"goodput: {gw.learners} learners x {gw.steps} steps; faults:", flush=True)
            for f in faults:
                print(f"  {f}", flush=True)
            for arm in [a for a in arms if a in ("torchft", "default")]:
                out = root / f"goodput-{arm}"
                if arm == "torchft":
                    g = run_torchft_goodput(gw, h, faults, args.net, out, mode.lease_s)
                else:
                    cfg = Decoupled.with_defaults(
                        "default", h, synchronizer_args=["--lease-s", str(mode.lease_s)]
                    ).with_(lease_s=mode.lease_s)
                    g = run_diloco(cfg, gw, faults, args.net, out, align_restart=False)
                g["faults"] = [dataclasses.asdict(f) for f in faults]
                goodput[arm] = g
                print(
                    f"  {arm:8s} goodput {g['goodput']:.3f}  eval loss {g['eval_loss']:.4f}  wall {g['wall_s']:.1f} s",
                    flush=True,
                )

    rows = [r for cond in runs.values() for r in cond.values()]
    print()
    print(
        table(
            rows,
            [
                "link",
                "name",
                "eval_loss",
                "sent_per_learner",
                "bytes_per_step",
                "wire",
                "wall_s",
                "steps_per_s",
                "config",
            ],
        )
    )
    if goodput:
        print()
        print(
            table(
                [{"system": a, **g} for a, g in goodput.items()],
                [
                    "system",
                    "goodput",
                    "eval_loss",
                    "wall_s",
                    "merged_compute_s_harness",
                    "capacity_s_harness",
                ],
            )
        )
    head = headline(runs, goodput)
    print()
    print("  ".join(f"{k} = {v:.4g}" for k, v in head.items() if isinstance(v, float)))
    for key, why in head["missing"].items():
        print(f"{key} = missing: {why}")
    for cond in runs.values():
        for r in cond.values():
            r.pop("results", None)
    for g in goodput.values():
        g.pop("results", None)
    result = {
        **head,
        "sync_every": h,
        "workload": dataclasses.asdict(w),
        "runs": runs,
        "goodput_runs": goodput,
        "links_measured": measured,
        "machine": machine(),
    }
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    program(main)
