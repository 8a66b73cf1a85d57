"""The main job on one machine: a Synchronizer and N learners as separate processes on this host.

`diloco-learner local` starts the Synchronizer (`python -m synchronizer serve`, port 0, address read
from its ready file) and N learner processes (`python -m demo train`) on the bundled example.
To show the system routing around trouble, one learner runs 3x slower than the rest (and, as it
would in a real deployment, takes proportionally fewer steps in the same wall-clock time), and
another is killed with SIGKILL mid-run and restarted a few seconds later, after its lease lapsed:
it re-joins, adopts the global model and carries on from the step it had reached.

While it runs it shows one line per learner. At the end it pulls the final global model (a
learner process with zero steps joins, adopts it, evaluates it, leaves) and writes
`OUT/summary.json`: eval loss of the global model at start and end, goodput from the
Synchronizer's metrics endpoint, bytes each learner sent against what data-parallel ring
all-reduce of the same model and steps would have sent; and `OUT/summary.png`. Every child runs in
its own process group and is terminated (then killed) when the job ends, however it ends.

With `shards` > 1 the Synchronizer is that many processes (`serve --shards S --shard-index i`, each
with its own port and state directory), every learner is given all their addresses, and the
figures add up the shards' metrics.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from demo.options import LocalOptions
from demo.procs import Procs, Samples, metric, read_json, rejoin_args, scrape, start_synchronizer
from protos.configload import program_env

# Each child gets the environment with its own settings only (DILOCO_SYNC_* for the Synchronizer,
# DILOCO_LEARNER_* for the learners), never the other program's
SYNCHRONIZER_ENV, LEARNER_ENV = "DILOCO_SYNC_", "DILOCO_LEARNER_"


def synchronizer_flags(o: LocalOptions) -> list[str]:
    return [
        "--quorum",
        str(o.quorum),
        "--grace",
        o.grace,
        "--lease-s",
        str(o.lease_s),
        # rounds of two or more learners: plain Nesterov beat Delayed Nesterov here (1.75 vs 1.83)
        "--outer",
        "nesterov" if o.quorum != 1 else "delayed_nesterov",
        "--forget-after-s",
        str(max(10.0, 3 * o.lease_s)),
        "--goodput-window-s",
        "3600",
        "--shutdown-grace-s",
        "2",
        *o.synchronizer_args,
    ]


@dataclass
class Slot:
    """One learner position: its current process and the result file of each incarnation."""

    index: int
    steps: int
    slow: float = 1.0
    proc: subprocess.Popen | None = None
    runs: list[Path] = field(default_factory=list)
    killed_at_step: int | None = None
    killed_at: float | None = None
    restarted: bool = False

    @property
    def name(self) -> str:
        return f"l{self.index}"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def awaiting_restart(self) -> bool:
        return self.killed_at is not None and not self.restarted


def island_launcher(ranks: int) -> list[str]:
    """What starts `python -m demo ...` as an island of `ranks` processes: torchrun on a free
    local rendezvous port, in the same process group, so a signal to the group reaches every
    rank (an island is killed, and stops, as a whole)."""
    if ranks == 1:
        return [sys.executable]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
    ]


def learner_cmd(
    o: LocalOptions,
    address: str,
    slot: Slot,
    out: Path,
    start_step: int = 0,
    name: str = "",
    ranks: int = 1,
) -> list[str]:
    cmd = [
        *island_launcher(ranks),
        "-m",
        "demo",
        "train",
        "--synchronizer",
        address,
        "--name",
        name or slot.name,
        "--learner-index",
        str(slot.index),
        "--learners",
        str(o.learners),
        "--steps",
        str(slot.steps),
        "--start-step",
        str(start_step),
        "--out",
        str(out),
        "--sync-every",
        str(o.sync_every),
        "--fragments",
        str(o.fragments),
        "--codec",
        o.codec,
        "--slow",
        str(slot.slow),
        "--log-every",
        str(o.log_every),
        "--seed",
        str(o.seed),
        "--threads",
        "1",
    ]
    if o.data:
        cmd += ["--data", o.data]
    if o.fsdp and ranks > 1:
        cmd.append("--fsdp")
    return cmd + o.train_args


def island_rank(launcher: int, rank: int) -> int:
    """The pid of rank `rank` among the workers torchrun (pid `launcher`) started."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone, or not ours to read
        if ppid == launcher and f"RANK={rank}".encode() in env:
            return int(entry.name)
    raise RuntimeError(f"no rank {rank} among the workers of torchrun (pid {launcher})")


def start_learner(
    o: LocalOptions, procs: Procs, address: str, slot: Slot, start_step: int = 0
) -> None:
    slot.runs.append(
        o.out
        / (
            f"learner-{slot.index}.json"
            if not slot.runs
            else f"learner-{slot.index}.run{len(slot.runs)}.json"
        )
    )
    cmd = learner_cmd(o, address, slot, slot.runs[-1], start_step, ranks=o.island_size)
    if start_step:
        cmd += rejoin_args(read_json(slot.runs[0]))  # come back as the same learner
    slot.proc = procs.start(f"learner-{slot.index}", cmd, program_env(LEARNER_ENV))


def kill_or_restart(o: LocalOptions, procs: Procs, address: str, slot: Slot) -> None:
    """The fault: SIGKILL the slot's learner at kill_at of its steps; restart_after_s later,
    start it again from the step its last progress line recorded."""
    now = time.time()
    if slot.killed_at is None:
        r = read_json(slot.runs[-1])
        if (
            "loss" in r
            and r["step"] >= o.kill_at * slot.steps
            and not r["finished"]
            and slot.proc is not None
        ):
            if o.kill_rank >= 0 and o.island_size > 1:  # one rank: torchrun ends the rest
                os.kill(island_rank(slot.proc.pid, o.kill_rank), signal.SIGKILL)
                try:
                    slot.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    Procs.kill(slot.proc)
            else:
                Procs.signal(slot.proc, signal.SIGKILL)
                slot.proc.wait()
            slot.killed_at_step, slot.killed_at = r["step"], now
            print(f"-- killed {slot.name} (SIGKILL) at step {r['step']}", flush=True)
    elif not slot.restarted and now - slot.killed_at >= o.restart_after_s:
        assert slot.killed_at_step is not None
        start_learner(o, procs, address, slot, start_step=slot.killed_at_step)
        slot.restarted = True
        print(f"-- restarted {slot.name} from step {slot.killed_at_step}", flush=True)


def check_exits(
    procs: Procs, shards: list[tuple[str, subprocess.Popen]], slots: list[Slot]
) -> None:
    """RuntimeError naming the log to read if a Synchronizer process or a learner failed."""
    for name, proc in shards:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the Synchronizer exited with code {proc.returncode}; see {procs.log(name)}"
            )
    for s in slots:
        if s.proc is not None and s.proc.poll() not in (None, 0) and not s.awaiting_restart():
            raise RuntimeError(
                f"learner {s.name} exited with code {s.proc.returncode}; see {procs.log(f'learner-{s.index}')}"
            )


def progress_line(slot: Slot) -> str:
    r = read_json(slot.runs[-1]) if slot.runs else {}
    tag = slot.name + (f" (x{slot.slow:g} slow)" if slot.slow > 1 else "")
    if slot.awaiting_restart():
        return f"{tag:16s} killed at step {slot.killed_at_step}, restarting..."
    if not r or "loss" not in r:
        return f"{tag:16s} starting..."
    done = "done " if r.get("finished") else ""
    return (
        f"{tag:16s} {done}step {r['step']:5d}/{slot.steps} | loss {r['loss']:.3f} | "
        f"{r['tokens_per_s']:7.0f} tok/s | {r.get('sync_state', '')}"
    )


class Display:
    """One line per learner plus one for the Synchronizer: redrawn in place on a terminal,
    printed every 10 s otherwise (logs, CI)."""

    def __init__(self, live: bool) -> None:
        self.live = live
        self.shown = 0
        self.last = 0.0

    def show(self, slots: list[Slot], samples: dict, elapsed_s: float) -> None:
        if not self.live and time.monotonic() - self.last < 10:
            return
        by_fragment = samples.get("diloco_fragment_version", {})
        versions = [
            int(v)
            for _, v in sorted(by_fragment.items(), key=lambda kv: int(dict(kv[0])["fragment"]))
        ]
        lines = [progress_line(s) for s in slots]
        lines.append(
            f"{'synchronizer':16s} versions {versions} | goodput "
            f"{metric(samples, 'diloco_goodput_ratio'):.2f} | {elapsed_s:5.0f} s"
        )
        if self.live and self.shown:
            sys.stdout.write(f"\x1b[{self.shown}F\x1b[J")  # up to the first line, clear below
        print("\n".join(lines), flush=True)
        self.shown, self.last = len(lines), time.monotonic()


def start_shards(
    o: LocalOptions, procs: Procs, state_dir: Path
) -> tuple[list[tuple[str, subprocess.Popen]], list[str], list[str]]:
    """The Synchronizer: one process, or o.shards of them, each with its own port and state
    directory. Returns (name, process)s, addresses and metrics URLs, in shard order."""
    started, addresses, metrics_urls = [], [], []
    for i in range(o.shards):
        name = "synchronizer" if o.shards == 1 else f"synchronizer-{i}"
        flags = synchronizer_flags(o)
        if o.shards > 1:
            flags += ["--shards", str(o.shards), "--shard-index", str(i)]
        proc, info = start_synchronizer(
            procs,
            flags,
            state_dir=state_dir if o.shards == 1 else state_dir / f"shard-{i}",
            name=name,
            env=program_env(SYNCHRONIZER_ENV),
        )
        started.append((name, proc))
        addresses.append(info["address"])
        metrics_urls.append(f"http://127.0.0.1:{info['metrics_port']}/metrics")
    return started, addresses, metrics_urls


# The same on every shard (each sees every learner): not added up across shards.
PER_LEARNER = {"diloco_learners"}
# A shard's own ratio, for the share of the model it serves: weighted by that share.
PER_FRACTION = {"diloco_goodput_ratio"}


def scrape_all(metrics_urls: list[str]) -> Samples:
    """The samples of every shard added up, which is the whole Synchronizer's: each shard counts
    its own fragments' pushes, tokens and compute, and the learners' capacity in proportion to
    its share of the model (`diloco_model_fraction`), so counters add up and its goodput ratio
    weighs by that share; it labels its own fragments' versions. What every shard measures alike
    (the learners) is taken once."""
    merged: Samples = {}
    for url in metrics_urls:
        samples = scrape(url)
        fraction = metric(samples, "diloco_model_fraction") or 1.0
        for name, values in samples.items():
            into = merged.setdefault(name, {})
            for labels, v in values.items():
                v = v * fraction if name in PER_FRACTION else v
                old = into.get(labels)
                into[labels] = v if old is None else max(old, v) if name in PER_LEARNER else old + v
    return merged


def run(o: LocalOptions) -> dict:
    """Runs the job; returns the summary (also written to OUT/summary.json)."""
    if o.learners < 1 or o.steps < 1:
        raise ValueError(f"need at least one learner and one step, got {o.learners} and {o.steps}")
    (o.out / "logs").mkdir(parents=True, exist_ok=True)
    for old in [
        *o.out.glob("learner-*.json"),
        *o.out.glob("learner-*.json.rank*"),  # an island's other ranks
        *o.out.glob("*.session"),  # the learners' session secrets (0600), for their restarts
        *(o.out / "logs").glob("*.log"),
        o.out / "final.json",
        o.out / "summary.json",
        o.out / "summary.png",
    ]:
        old.unlink(missing_ok=True)  # results of an earlier run
    procs = Procs(o.out)
    # Ctrl-C and SIGTERM both unwind into the finally below (even where SIGINT came in ignored)
    previous = {
        sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    state_dir = Path(
        tempfile.mkdtemp(prefix="diloco-local-state-")
    )  # a fresh run: nothing to resume
    t0 = time.time()
    try:
        shards, addresses, metrics_urls = start_shards(o, procs, state_dir)
        address = ",".join(addresses)
        print(
            f"Synchronizer at {address}, metrics at {', '.join(metrics_urls)}"
            + (f" ({o.shards} shards)" if o.shards > 1 else "")
            + f"; logs in {o.out / 'logs'}",
            flush=True,
        )

        slots = []
        for i in range(o.learners):
            slow = o.slow_factor if i == o.slow_learner and o.learners > 1 else 1.0
            slots.append(
                Slot(i, max(1, round(o.steps / slow)), slow)
            )  # same wall-clock, fewer steps
            start_learner(o, procs, address, slots[-1])
        victim = (
            slots[o.kill_learner] if 0 <= o.kill_learner < o.learners and o.learners > 1 else None
        )

        display = Display(sys.stdout.isatty() if o.live is None else o.live)
        goodput_series: list[dict] = []
        samples: dict = {}
        while any(s.running() or s.awaiting_restart() for s in slots):
            time.sleep(0.5)
            check_exits(procs, shards, slots)
            if victim is not None:
                kill_or_restart(o, procs, address, victim)
            try:
                samples = scrape_all(metrics_urls)
                goodput_series.append(
                    {"t": time.time(), "goodput": metric(samples, "diloco_goodput_ratio")}
                )
            except OSError:
                pass
            display.show(slots, samples, time.time() - t0)
        check_exits(procs, shards, slots)

        samples = scrape_all(metrics_urls)  # before the final pull joins as one more learner
        final_out = (
            o.out / "final.json"
        )  # zero steps: join, adopt the served model, evaluate, leave
        final = procs.start(
            "final-eval",
            learner_cmd(o, address, Slot(0, 0), final_out, name="final-eval"),
            program_env(LEARNER_ENV),
        )
        if final.wait(timeout=120) != 0:
            raise RuntimeError(
                f"the final evaluation exited with code {final.returncode}; see {procs.log('final-eval')}"
            )
        summary = summarize(o, slots, samples, read_json(final_out), goodput_series, t0)
    finally:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        procs.stop_all()
        shutil.rmtree(state_dir, ignore_errors=True)
        for secret in o.out.glob("*.session"):  # no learner is left to restart
            secret.unlink(missing_ok=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    (o.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if o.plot:
        try:
            from demo.plot import plot_summary
        except ImportError:
            print(
                "matplotlib is not installed (pip install '.[plot]'): skipped summary.png",
                flush=True,
            )
        else:
            plot_summary(summary, o.out / "summary.png")
    print_summary(summary, o.out)
    return summary


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def summarize(
    o: LocalOptions,
    slots: list[Slot],
    samples: dict,
    final: dict,
    goodput_series: list[dict],
    t0: float,
) -> dict:
    runs = {s.index: [read_json(p) for p in s.runs] for s in slots}
    first = runs[0][0]
    params = int(first.get("params") or final.get("params", 0))
    n = o.learners
    learners = {}
    for s in slots:
        rs = runs[s.index]
        steps = sum(r.get("step", 0) - r.get("start_step", 0) for r in rs)
        learners[s.name] = {
            "steps": steps,
            "slow_factor": s.slow,
            "killed_at_step": s.killed_at_step,
            "bytes_sent": sum(
                int(r.get("bytes_sent") or r.get("learner", {}).get("bytes_sent", 0)) for r in rs
            ),
            "bytes_received": sum(
                int(r.get("bytes_received") or r.get("learner", {}).get("bytes_received", 0))
                for r in rs
            ),
            "steps_per_s": rs[-1].get("steps_per_s"),
            "eval_loss_end": rs[-1].get("eval_loss_end"),
            "series": [r.get("series", []) for r in rs],  # one curve per process (run)
        }
        if o.island_size > 1:  # the island's ranks, as its last run ended
            last = s.runs[-1]
            ranks = [rs[-1], *(read_json(Path(f"{last}.rank{r}")) for r in range(1, o.island_size))]
            hashes = {r.get("param_hash") for r in ranks}
            learners[s.name]["island"] = {
                "ranks": len(ranks),
                "finished": sum(bool(r.get("finished")) for r in ranks),
                "identical": len(hashes) == 1 and None not in hashes,
            }
    # data-parallel ring all-reduce sends 2 (N-1)/N of the FP32 gradients per step, per learner
    dp_per_step = 2 * (n - 1) / n * params * 4
    full_steps = max(s.steps for s in slots)
    capacity = metric(samples, "diloco_learner_capacity_seconds_total")
    merged = metric(samples, "diloco_compute_seconds_total", bucket="merged")
    sent = {k: v["bytes_sent"] for k, v in learners.items()}
    mean_sent = sum(sent.values()) / max(1, len(sent))
    return {
        "learners": n,
        "island_size": o.island_size,
        "shards": o.shards,
        "steps": o.steps,
        "params": params,
        "wall_s": round(time.time() - t0, 1),
        "eval_loss_start": first.get("eval_loss_start"),
        "eval_loss_end": final.get("eval_loss_end"),
        "goodput": metric(samples, "diloco_goodput_ratio"),
        "goodput_from_totals": merged / capacity if capacity else None,
        "tokens": {
            b: metric(samples, "diloco_tokens_total", bucket=b)
            for b in ("merged", "discarded", "lost")
        },
        "pushes": {
            dict(k)["outcome"]: v for k, v in samples.get("diloco_pushes_total", {}).items()
        },
        "outer_steps": metric(samples, "diloco_outer_steps_total"),
        "bytes_sent_per_learner": sent,
        "bytes_received_per_learner": {k: v["bytes_received"] for k, v in learners.items()},
        "dp_bytes_per_learner": dp_per_step * full_steps,
        "dp_over_sent": dp_per_step * full_steps / mean_sent if mean_sent else None,
        "final_param_hash": final.get("param_hash"),
        "faults": {
            "slow": f"l{o.slow_learner} x{o.slow_factor:g}"
            if any(s.slow > 1 for s in slots)
            else None,
            "killed": next(
                (
                    f"l{s.index} at step {s.killed_at_step}, restarted after {o.restart_after_s:g} s"
                    for s in slots
                    if s.killed_at_step is not None
                ),
                None,
            ),
        },
        "per_learner": learners,
        "goodput_series": goodput_series,
        "t0": t0,
    }


def print_summary(s: dict, out: Path) -> None:
    def mb(b: float) -> str:
        return f"{b / 1e6:.2f} MB"

    islands = f" (islands of {s['island_size']} ranks)" if s.get("island_size", 1) > 1 else ""
    print(
        f"\nDone in {s['wall_s']:.0f} s: {s['learners']} learners{islands}, {s['steps']} steps, {s['params']:,} parameters"
    )
    print(f"  eval loss (global model): {s['eval_loss_start']:.4f} -> {s['eval_loss_end']:.4f}")
    print(
        f"  goodput: {s['goodput']:.1%}   outer steps: {s['outer_steps']:.0f}   pushes: {s['pushes']}"
    )
    for name, sent in s["bytes_sent_per_learner"].items():
        island = s["per_learner"][name].get("island")
        ranks = (
            f" ({island['ranks']} ranks, {'identical' if island['identical'] else 'DIFFERENT'})"
            if island
            else ""
        )
        print(
            f"  {name}: sent {mb(sent)}, received {mb(s['bytes_received_per_learner'][name])}{ranks}"
        )
    ratio = f" ({s['dp_over_sent']:.0f}x more)" if s["dp_over_sent"] else ""
    print(
        f"  data-parallel ring all-reduce would have sent {mb(s['dp_bytes_per_learner'])} per learner{ratio}"
    )
    print(
        f"  summary: {out / 'summary.json'}"
        + (f", plot: {out / 'summary.png'}" if (out / "summary.png").exists() else "")
    )
