"""Load: hundreds of live learners against one Synchronizer: health, heartbeats, joins and pushes.

A real `python -m synchronizer serve` (a fresh one per cell, small model: the model's size is
`bench.scale`'s question, not this one's) and lightweight synthetic learners: a few client
processes, each running its share of the learners as asyncio tasks, each learner on a gRPC
channel of its own, as learners on other machines are. No model is trained: a learner joins
(all of a cell's learners at once: a join storm), heartbeats at the interval its Join reply asks
for, and pushes one fragment (pre-encoded INT4) on the default schedule (H = 100 inner steps of
0.5 s and 4 fragments: one push every 12.5 s per learner, at a random phase), then pulls that
fragment's updates since its last pull. Meanwhile one probe calls the gRPC health check every
0.1 s.

Per cell (learners asked for, under `defaults` or under `raised`, the same settings with
`--max-learners 4096`), over a measured window that starts once every learner is joined or
refused:

- `joined`, `join_refused` (and the codes of the refusals), Join latency p50/p99, `join_all_s`
  (the storm: the first Join sent to the last answered);
- heartbeat and health-check latency p50/p99 (ms); every call has a deadline, and one that ran
  out is counted under `timeouts` (a silent failure: capacity must be refused with a code);
- pushes `due` in the window by the schedule, `done` (answered in the window), `accepted`,
  `retried` (refused for now: RESOURCE_EXHAUSTED / UNAVAILABLE, sent again with the same seq),
  `lost` (failed otherwise or never answered), push latency p99 (s);
- the Synchronizer's CPU (cores: CPU seconds over the window's seconds) and per learner
  (`cpu_ms_per_learner_s`: CPU milliseconds per learner per second), its resident memory per
  joined learner (`rss_kB_per_learner`: after the storm minus before it, over the joined), its
  threads, and the client processes' CPU (cores: on this machine they share its cores).

The verdict per arm: the largest cell whose heartbeat and health p99 stay under a second, with
no timeouts and pushes kept up (`done` >= 95% of `due`), and what failed first above it.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import os
import random
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common import machine, parser, program, run_mode, say_mode, table, write_json
from bench.ingest import GRPC_OPTIONS, init_synchronizer, model_spec
from bench.scale_load import push_payloads
from demo.procs import Procs, start_synchronizer
from protos import diloco_pb2 as pb
from protos import diloco_pb2_grpc as pb_grpc

FRAGMENTS = 4
INNER_STEPS = 100  # H
STEP_S = 0.5  # seconds per inner step
PUSH_EVERY_S = INNER_STEPS * STEP_S / FRAGMENTS  # one learner: one fragment push every 12.5 s
PUSH_METHOD = "/diloco.v1.Synchronizer/PushFragment"
RETRY = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
RETRY_S = 0.5
DEADLINE_S = 10.0  # every call's deadline: past it, a call counts as a timeout
PROBE_EVERY_S = 0.1
SLO_P99_S = 1.0  # heartbeats and health checks must answer within this at p99
KEPT_UP = 0.95  # pushes done in the window over pushes due, for a cell that keeps up
PARAMS = 65_536  # 4 fragments of 16,384 elements: 8 KiB INT4 pushes
RAISED = 4096
MODES = {  # sizes, window (s), max_learners of the defaults arm (0: the default)
    # smoke: one size past its cap, so one cell per arm shows both a refusal and the rest answered
    "smoke": ((8,), 3.0, 6),
    "quick": ((64, 256, 1024), 20.0, 0),
    "full": ((64, 256, 1024), 60.0, 0),
}
COLUMNS = [
    "arm",
    "learners",
    "joined",
    "join_refused",
    "join_p99_s",
    "join_all_s",
    "hb_p50_ms",
    "hb_p99_ms",
    "health_p99_ms",
    "timeouts",
    "due",
    "done",
    "retried",
    "lost",
    "push_p99_s",
    "sync_cpu_cores",
    "cpu_ms_per_learner_s",
    "rss_kB_per_learner",
    "sync_threads",
    "client_cpu_cores",
]


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank); NaN when there are none."""
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class Tally:
    """What one client process saw: latencies by kind, counts by kind."""

    def __init__(self) -> None:
        self.lat: dict[str, list[float]] = {"join": [], "hb": [], "push": [], "pull": []}
        self.n: Counter[str] = Counter()

    def to_dict(self) -> dict[str, Any]:
        return {"lat": self.lat, "n": dict(self.n)}


class Window:
    """The measured window's bounds (wall clock, shared by every process); inside() before it is
    set is False."""

    def __init__(self) -> None:
        self.start = math.inf
        self.end = math.inf

    def inside(self, t: float) -> bool:
        return self.start <= t < self.end


async def _learner(
    address: str,
    spec: Any,
    payloads: list[tuple[pb.PayloadHeader, list[bytes]]],
    window: Window,
    done: asyncio.Event,
    tally: Tally,
    joined_count: list[int],
    storm: list[float],
) -> None:
    """One synthetic learner: Join, then heartbeats and scheduled pushes (each followed by a
    delta pull) until `done`, then Leave."""
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stub = pb_grpc.SynchronizerStub(channel)
        t0 = time.time()
        try:
            joined = await stub.Join(
                pb.JoinRequest(learner_name="load", spec=spec.to_proto()), timeout=DEADLINE_S
            )
        except grpc.aio.AioRpcError as e:
            tally.n[f"join_{e.code().name}"] += 1
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                tally.n["timeouts"] += 1
            storm.append(time.time())
            joined_count[1] += 1
            return
        tally.lat["join"].append(time.time() - t0)
        storm.append(time.time())
        joined_count[0] += 1
        ident = {"learner_id": joined.learner_id, "session": joined.session}
        push = channel.stream_unary(PUSH_METHOD, response_deserializer=pb.PushReply.FromString)
        known = {v.fragment_id: v.version for v in joined.versions}
        seq = joined.next_seq

        async def heartbeats() -> None:
            interval = joined.heartbeat_interval_s
            await asyncio.sleep(random.uniform(0, interval))
            while not done.is_set():
                t = time.time()
                try:
                    await stub.Heartbeat(pb.HeartbeatRequest(**ident), timeout=DEADLINE_S)
                    if window.inside(t):
                        tally.lat["hb"].append(time.time() - t)
                except grpc.aio.AioRpcError as e:
                    if window.inside(t):
                        tally.n[f"hb_{e.code().name}"] += 1
                        tally.n["timeouts"] += e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                await _wait(done, interval)

        async def pushes() -> None:
            nonlocal seq
            at = time.time() + random.uniform(0, PUSH_EVERY_S)
            fid = random.randrange(FRAGMENTS)
            while True:
                if await _wait(done, at - time.time()):
                    return
                due_in_window = window.inside(at)
                tally.n["due"] += due_in_window
                header, wire = payloads[fid]
                h = pb.PushHeader(
                    seq=seq,
                    spec_hash=spec.spec_hash,
                    fragment_id=fid,
                    base_version=known.get(fid, 0),
                    tokens=1000 * INNER_STEPS,
                    steps=INNER_STEPS,
                    compute_s=INNER_STEPS * STEP_S,
                    payload=header,
                    **ident,
                )
                first = pb.PushRequest(header=h).SerializeToString()
                t = time.time()
                while True:
                    try:
                        reply = await push(iter([first, *wire]), timeout=DEADLINE_S)
                    except grpc.aio.AioRpcError as e:
                        if e.code() in RETRY and not done.is_set():
                            tally.n["retried"] += due_in_window
                            await asyncio.sleep(RETRY_S)
                            continue
                        tally.n["lost"] += due_in_window
                        tally.n[f"push_{e.code().name}"] += due_in_window
                        tally.n["timeouts"] += due_in_window and (
                            e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                        )
                        reply = None
                    break
                seq += 1
                end = time.time()
                if reply is not None:
                    known[fid] = max(known.get(fid, 0), reply.current_version)
                    if due_in_window:
                        tally.lat["push"].append(end - t)
                        tally.n[pb.PushOutcome.Name(reply.outcome)] += 1
                        tally.n["done"] += end < window.end
                    await _pull(stub, ident, fid, known, window, tally)
                at += PUSH_EVERY_S
                fid = (fid + 1) % FRAGMENTS

        await asyncio.gather(heartbeats(), pushes())
        try:
            await stub.Leave(pb.LeaveRequest(**ident), timeout=DEADLINE_S)
        except grpc.aio.AioRpcError as e:
            tally.n[f"leave_{e.code().name}"] += 1


async def _pull(
    stub: pb_grpc.SynchronizerStub,
    ident: dict[str, str],
    fid: int,
    known: dict[int, int],
    window: Window,
    tally: Tally,
) -> None:
    """A delta pull of fragment `fid` since the version this learner knows (bytes only counted)."""
    t = time.time()
    try:
        call = stub.PullFragment(
            pb.PullRequest(
                learner_id=ident["learner_id"],
                session=ident["session"],
                fragment_id=fid,
                delta_ok=True,
                have_version=known.get(fid, 0),
            ),
            timeout=DEADLINE_S,
        )
        async for r in call:
            if r.HasField("header"):
                known[fid] = max(known.get(fid, 0), r.header.version)
        if window.inside(t):
            tally.lat["pull"].append(time.time() - t)
    except grpc.aio.AioRpcError as e:
        if window.inside(t):
            tally.n[f"pull_{e.code().name}"] += 1
            tally.n["timeouts"] += e.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def _wait(event: asyncio.Event, seconds: float) -> bool:
    """Waits up to `seconds` for `event`; whether it is set."""
    if seconds > 0:
        try:
            await asyncio.wait_for(event.wait(), seconds)
        except TimeoutError:
            pass
    return event.is_set()


def _client(address: str, learners: int, index: int, commands: Any, results: Any) -> None:
    """One client process: `learners` synthetic learners. Commands: ("join", t) sends every
    Join at wall time t and reports the counts; ("window", start, end) sets the measured window;
    ("stop",) ends the run (every learner leaves) and reports its tally."""
    torch.set_num_threads(1)
    random.seed(index)
    spec = model_spec(PARAMS, FRAGMENTS)
    payloads = push_payloads(spec, index)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        tally, window, done = Tally(), Window(), asyncio.Event()
        joined_count, storm = [0, 0], list[float]()
        cmd = await loop.run_in_executor(None, commands.get)
        await asyncio.sleep(max(0.0, cmd[1] - time.time()))
        tasks = [
            asyncio.create_task(
                _learner(address, spec, payloads, window, done, tally, joined_count, storm)
            )
            for _ in range(learners)
        ]
        while sum(joined_count) < learners:
            await asyncio.sleep(0.05)  # the tasks' own progress: nothing else to wait on
        results.put(("joined", joined_count[0], max(storm, default=cmd[1])))
        _, window.start, window.end = await loop.run_in_executor(None, commands.get)
        cpu0 = time.process_time()
        await asyncio.sleep(max(0.0, window.end - time.time()))
        cpu = time.process_time() - cpu0
        await loop.run_in_executor(None, commands.get)
        done.set()
        await asyncio.gather(*tasks)
        results.put(("tally", tally.to_dict(), cpu))

    asyncio.run(main())


class Probe:
    """Calls the gRPC health check every PROBE_EVERY_S from a thread; latencies inside a window."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = health_pb2_grpc.HealthStub(self.channel)
        self.window = Window()
        self.lat: list[float] = []
        self.failed: Counter[str] = Counter()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(PROBE_EVERY_S):
            t = time.time()
            try:
                self.stub.Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S)
                if self.window.inside(t):
                    self.lat.append(time.time() - t)
            except grpc.RpcError as e:
                if self.window.inside(t):
                    self.failed[e.code().name] += 1

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.channel.close()


def _proc_figures(pid: int) -> dict[str, float]:
    """The process's CPU seconds (user + system), resident bytes and threads, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return {
        "cpu_s": cpu,
        "rss": int(status["VmRSS"].split()[0]) * 1024,
        "threads": int(status["Threads"]),
    }


def cell(arm: str, learners: int, window_s: float, flags: list[str]) -> dict[str, Any]:
    """One fresh Synchronizer under `flags` and `learners` synthetic learners; the row."""
    clients = max(1, min(4, learners // 64))
    share = [learners // clients + (i < learners % clients) for i in range(clients)]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        procs = Procs(Path(d))
        try:
            proc, info = start_synchronizer(procs, flags, timeout_s=120)
            address = info["address"]
            init_synchronizer(address, PARAMS, FRAGMENTS)
            results = ctx.Queue()
            commands = [ctx.Queue() for _ in share]
            workers = [
                ctx.Process(target=_client, args=(address, n, i, commands[i], results))
                for i, n in enumerate(share)
            ]
            for w in workers:
                w.start()
            probe = Probe(address)
            before = _proc_figures(proc.pid)
            storm_at = time.time() + 2.0  # the clients' start-up (spawn, imports, payloads)
            for q in commands:
                q.put(("join", storm_at))
            got = [results.get(timeout=600) for _ in workers]
            joined = sum(g[1] for g in got)
            join_all_s = max(g[2] for g in got) - storm_at
            after_join = _proc_figures(proc.pid)
            start = time.time() + 1.0
            end = start + window_s
            probe.window.start, probe.window.end = start, end
            for q in commands:
                q.put(("window", start, end))
            time.sleep(max(0.0, start - time.time()))
            cpu0 = _proc_figures(proc.pid)
            time.sleep(max(0.0, end - time.time()))
            cpu1 = _proc_figures(proc.pid)
            for q in commands:
                q.put(("stop",))
            tallies = [results.get(timeout=600) for _ in workers]
            probe.stop()
            for w in workers:
                w.join(60)
        finally:
            procs.stop_all(grace_s=30)
    lat: dict[str, list[float]] = {}
    n: Counter[str] = Counter()
    for _, t, _ in tallies:
        for k, v in t["lat"].items():
            lat.setdefault(k, []).extend(v)
        n.update(t["n"])
    refused = {k[len("join_") :]: v for k, v in n.items() if k.startswith("join_")}
    sync_cpu = (cpu1["cpu_s"] - cpu0["cpu_s"]) / window_s
    return {
        "arm": arm,
        "learners": learners,
        "joined": joined,
        "join_refused": sum(refused.values()),
        "join_refused_codes": refused,
        "join_p50_s": quantile(lat["join"], 0.5),
        "join_p99_s": quantile(lat["join"], 0.99),
        "join_all_s": join_all_s,
        "hb_p50_ms": 1e3 * quantile(lat["hb"], 0.5),
        "hb_p99_ms": 1e3 * quantile(lat["hb"], 0.99),
        "heartbeats": len(lat["hb"]),
        "health_p50_ms": 1e3 * quantile(probe.lat, 0.5),
        "health_p99_ms": 1e3 * quantile(probe.lat, 0.99),
        "health_failed": dict(probe.failed),
        "timeouts": n["timeouts"] + probe.failed.get("DEADLINE_EXCEEDED", 0),
        "due": n["due"],
        "done": n["done"],
        "accepted": n["PUSH_ACCEPTED"],
        "outcomes": {k: v for k, v in n.items() if k.startswith("PUSH_")},
        "errors": {
            k: v for k, v in n.items() if k.split("_", 1)[0] in ("hb", "push", "pull", "leave")
        },
        "retried": n["retried"],
        "lost": n["lost"],
        "push_p99_s": quantile(lat["push"], 0.99),
        "pull_p99_s": quantile(lat["pull"], 0.99),
        "sync_cpu_cores": sync_cpu,
        "cpu_ms_per_learner_s": 1e3 * sync_cpu / max(joined, 1),
        "rss_kB_per_learner": (after_join["rss"] - before["rss"]) / 1024 / max(joined, 1),
        "sync_rss_MB": cpu1["rss"] / 1e6,
        "sync_threads": cpu1["threads"],
        "client_cpu_cores": sum(c for _, _, c in tallies) / window_s,
        "window_s": window_s,
    }


def failures(row: dict[str, Any]) -> list[str]:
    """What a cell missed: heartbeat or health p99 over the bound, timeouts, pushes behind."""
    out = []
    if not row["hb_p99_ms"] < 1e3 * SLO_P99_S:
        out.append(f"heartbeat p99 {row['hb_p99_ms']:.0f} ms")
    if not row["health_p99_ms"] < 1e3 * SLO_P99_S:
        out.append(f"health p99 {row['health_p99_ms']:.0f} ms")
    if row["timeouts"]:
        out.append(f"{row['timeouts']} calls timed out")
    if row["done"] < KEPT_UP * row["due"]:
        out.append(f"pushes behind ({row['done']} of {row['due']} due done)")
    if row["lost"]:
        out.append(f"{row['lost']} pushes lost")
    return out


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest learner count served within the bounds, and what failed first above it."""
    held, first = 0, ""
    for row in sorted(rows, key=lambda r: r["learners"]):
        missed = failures(row)
        if missed:
            first = first or f"{row['learners']} learners: " + "; ".join(missed)
        elif not first:
            held = row["joined"]
    return {"served_within_bounds": held, "first_failure": first or "none"}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--learners", type=int, nargs="+", help="cell sizes (default: the mode's)")
    p.add_argument("--window", type=float, help="measured seconds per cell (default: the mode's)")
    args = p.parse_args(argv)
    mode = run_mode(args)
    say_mode(mode)
    sizes, window_s, smoke_limit = MODES[mode["mode"]]
    sizes = tuple(args.learners or sizes)
    window_s = args.window or window_s
    arms = {
        "defaults": ["--max-learners", str(smoke_limit)] if smoke_limit else [],
        "raised": ["--max-learners", str(RAISED)],
    }
    rows = []
    for arm, flags in arms.items():
        for n in sizes:
            if arm == "raised" and n <= (smoke_limit or 256):
                continue  # the same settings as the defaults arm's cell
            row = cell(arm, n, window_s, flags)
            rows.append(row)
            refused = ", ".join(f"{k} x{v}" for k, v in row["join_refused_codes"].items())
            print(
                f"{arm}, {n} learners: {row['joined']} joined"
                + (f" ({refused} refused)" if refused else "")
                + f", heartbeat p99 {row['hb_p99_ms']:.0f} ms, health p99 "
                f"{row['health_p99_ms']:.0f} ms, pushes {row['done']}/{row['due']} done, "
                f"Synchronizer CPU {row['sync_cpu_cores']:.2f} cores",
                flush=True,
            )
    verdicts = {arm: verdict([r for r in rows if r["arm"] == arm]) for arm in arms}
    result: dict[str, Any] = {
        **mode,
        "rows": rows,
        "verdicts": verdicts,
        "heartbeat_p99_ms_max": max(r["hb_p99_ms"] for r in rows),
        "health_p99_ms_max": max(r["health_p99_ms"] for r in rows),
        "timeouts": float(sum(r["timeouts"] for r in rows)),
        "machine": machine(),
    }
    print()
    print(table(rows, COLUMNS))
    for arm, v in verdicts.items():
        print(
            f"{arm}: served within bounds up to {v['served_within_bounds']} learners; "
            f"first failure: {v['first_failure']}"
        )
    say_mode(mode)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    program(main)
