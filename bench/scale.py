"""Scale: one Synchronizer process serving a large model: its memory, start-up and capacity.

A real `python -m synchronizer serve` with default settings, its resident memory sampled from
/proc (VmRSS every 50 ms, VmHWM for the peak) the whole time, and synthetic clients that send
pre-encoded payloads (as `bench.ingest` does):

- `init_s`: one client joins and uploads the whole model (InitModel, which writes the first
  checkpoint before it answers);
- `join_s`: a second client joins and pulls every fragment in full: parameters in hand;
- `learners_sustained`: 4 client processes act for N learners with H = 100 inner steps of 0.5 s
  and 4 fragments, so each learner pushes one fragment (INT4) every 12.5 s and then pulls that
  fragment's updates since its own previous pull (a delta, or in full once the kept chain no
  longer covers it). N is raised (doubling, then bisecting) until pushes are no longer served
  on schedule: more ops due by the end of a window than the 4 clients can have in hand;
- `outer_step_s`: the mean outer step of one fragment over the run (`diloco_round_apply_seconds`)
  and `apply_ratio`: that over one `add_` pass over a fragment in this process (how many plain
  passes an outer step costs);
- `rss_ratio`: the peak resident memory (VmRSS sampled every 50 ms) over the model's FP32 bytes
  while it initialises, serves a join, and serves 4 learners on schedule (`serving`: 50 s, each
  pushing every fragment once), beside `synchronizer.memory`'s projection for the same settings
  (`projected_ratio`); `rss_ratio_search` is the same during the capacity search, which
  overloads the Synchronizer on purpose (held pushes pile up past the payload budget, and rounds
  that add pushes on arrival take FP32 buffers beyond the shared ones).

    python -m bench.scale [--quick | --smoke] [--params N] [--json PATH]
Full mode: 1e9 parameters (quick: 250M, smoke: 1M); full and quick need several times the
model's FP32 bytes of free memory.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import grpc
import torch

from bench.common import machine, parser, table, write_json
from bench.ingest import GRPC_OPTIONS, init_synchronizer, model_spec, service_threads
from demo.procs import Procs, metric, scrape, start_synchronizer
from protos import codec, framing, layout
from protos import diloco_pb2 as pb
from protos import diloco_pb2_grpc as pb_grpc
from protos.initmodel import init_model_requests
from protos.spec import ModelSpec, shard_owners
from synchronizer import memory
from synchronizer.config import SynchronizerConfig

FRAGMENTS = 4
CLIENTS = 4
INNER_STEPS = 100  # H
STEP_S = 0.5  # seconds per inner step
PUSH_EVERY_S = INNER_STEPS * STEP_S / FRAGMENTS  # one learner: one fragment push every 12.5 s
PUSH_METHOD = "/diloco.v1.Synchronizer/PushFragment"
RETRY_S = 0.5  # a push refused for now (BEHIND) is retried after this, with the same seq
# The payload budget is full, or the write-ahead log took longer than wal_wait_s to reach the disk
BEHIND = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
WINDOW_COLUMNS = [
    "learners",
    "pushes_per_s",
    "due",
    "done",
    "backlog",
    "sustained",
    "late_p50_s",
    "late_max_s",
    "in_MBps",
    "out_MBps",
]
MODES = {  # params, first N, shortest window (s), bisection steps, largest N
    "smoke": (1_000_000, 64, 2.0, 1, 4096),
    "quick": (250_000_000, 4, 20.0, 2, 1024),
    "full": (1_000_000_000, 4, 30.0, 2, 1024),
}


class RssSampler:
    """VmRSS of a process every `every_s`, by phase, and its VmHWM (peak) on demand."""

    def __init__(self, pid: int, every_s: float = 0.05) -> None:
        self.path = Path(f"/proc/{pid}/status")
        self.phase = "start"
        self.peaks: dict[str, int] = defaultdict(int)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self.thread.start()

    def read(self) -> dict[str, int]:
        """{"VmRSS": bytes, "VmHWM": bytes}; empty once the process is gone."""
        try:
            lines = self.path.read_text().splitlines()
        except OSError:
            return {}
        out = {}
        for line in lines:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
        return out

    def _run(self, every_s: float) -> None:
        while not self.stopped.wait(every_s):
            rss = self.read().get("VmRSS", 0)
            self.peaks[self.phase] = max(self.peaks[self.phase], rss)

    def stop(self) -> int:
        """Stops sampling; returns the process's peak resident bytes (VmHWM)."""
        peak = self.read().get("VmHWM", 0)
        self.stopped.set()
        self.thread.join()
        return max(peak, *self.peaks.values(), 0)


def _pull(
    stub: pb_grpc.SynchronizerStub, joined: pb.JoinReply, fid: int, have: int | None
) -> tuple[pb.PullHeader, torch.Tensor | None, int]:
    """One pull, in full or (with `have`) of the updates since: (header, the decoded FP32
    parameters of a full pull without `have`, payload bytes). Delta pulls and their full
    fallbacks are only counted: learners decode on their own machines."""
    replies = stub.PullFragment(
        pb.PullRequest(
            learner_id=joined.learner_id,
            session=joined.session,
            fragment_id=fid,
            delta_ok=have is not None,
            have_version=have or 0,
        ),
        timeout=600,
    )
    header = next(replies).header
    if have is not None or not header.HasField("payload"):
        return header, None, sum(len(r.chunk.data) for r in replies)
    asm = framing.Assembler(header.payload)
    for r in replies:
        asm.add(r.chunk)
    out = torch.empty(header.payload.numel, dtype=torch.float32)
    return header, codec.decode(asm.finish(), header.payload, out), int(header.payload.total_bytes)


class Shards:
    """One learner's standing with every shard (one Synchronizer is one shard): a channel, stub
    and Join reply per shard, in shard order, and which shard serves each fragment."""

    def __init__(self, addresses: list[str], spec: ModelSpec, name: str) -> None:
        self.channels = [grpc.insecure_channel(a, options=GRPC_OPTIONS) for a in addresses]
        stubs = [pb_grpc.SynchronizerStub(c) for c in self.channels]
        owners = shard_owners(spec, len(addresses))
        request = pb.JoinRequest(
            learner_name=name, spec=spec.to_proto(), shards=len(addresses), fragment_shards=owners
        )
        replies = [stub.Join(request, timeout=60) for stub in stubs]
        order = sorted(range(len(stubs)), key=lambda i: replies[i].shard_index)
        self.addresses = [addresses[i] for i in order]
        self.channels = [self.channels[i] for i in order]
        self.stubs = [stubs[i] for i in order]
        self.joined = [replies[i] for i in order]
        self.owner = owners  # fragment id -> shard index

    def of(self, fid: int) -> tuple[pb_grpc.SynchronizerStub, pb.JoinReply]:
        s = self.owner[fid]
        return self.stubs[s], self.joined[s]

    def leave(self) -> None:
        for stub, joined in zip(self.stubs, self.joined, strict=True):
            stub.Leave(pb.LeaveRequest(learner_id=joined.learner_id, session=joined.session), 60)
        for c in self.channels:
            c.close()


def init_shards(addresses: list[str], params: int) -> list[str]:
    """Uploads the model (zeros) to every shard, each its own fragments (joined just before its
    upload: a join's lease is shorter than another shard's upload of a large model); returns
    the addresses in shard order."""
    spec = model_spec(params, FRAGMENTS)
    owners = shard_owners(spec, len(addresses))
    ordered = [""] * len(addresses)
    for address in addresses:
        channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        stub = pb_grpc.SynchronizerStub(channel)
        joined = stub.Join(
            pb.JoinRequest(
                learner_name="init",
                spec=spec.to_proto(),
                shards=len(addresses),
                fragment_shards=owners,
            ),
            timeout=60,
        )
        owned = list(joined.owned_fragments)
        zeros = (torch.zeros(spec.fragments[f].numel) for f in owned)
        stub.InitModel(
            init_model_requests(
                joined.learner_id, joined.session, spec.spec_hash, zeros, fragment_ids=owned
            ),
            timeout=600,
        )
        stub.Leave(pb.LeaveRequest(learner_id=joined.learner_id, session=joined.session), 60)
        channel.close()
        ordered[joined.shard_index] = address
    return ordered


def join_and_pull(addresses: list[str], params: int) -> float:
    """Seconds from Join (to every shard) to every fragment's parameters in hand (full FP32
    pulls)."""
    spec = model_spec(params, FRAGMENTS)
    t0 = time.perf_counter()
    shards = Shards(addresses, spec, "joiner")
    held = [_pull(*shards.of(f.fragment_id), f.fragment_id, None)[1] for f in spec.fragments]
    seconds = time.perf_counter() - t0
    assert all(t is not None for t in held)
    shards.leave()
    return seconds


def client(addresses: list[str], params: int, index: int, commands: Any, results: Any) -> None:
    """One client process: one Synchronizer learner that acts for its share of the N simulated
    learners. Per window command (N, rate, t0, window): op g (at t0 + g / rate) is learner
    g % N's push of fragment (g // N) % 4 (to the shard that serves it), then its pull of that
    fragment; the ops of learners l with l % CLIENTS == index are this process's, done in
    order, never early."""
    torch.set_num_threads(1)
    spec = model_spec(params, FRAGMENTS)
    g = torch.Generator().manual_seed(index)
    payloads = []
    for f in spec.fragments:
        buf = codec.encode(torch.randn(f.numel, generator=g) * 1e-3, pb.CODEC_INT4)
        wire = [pb.PushRequest(chunk=c).SerializeToString() for c in framing.iter_chunks(buf)]
        payloads.append((layout.make_header(pb.CODEC_INT4, f.numel), wire))
    shards = Shards(addresses, spec, f"client{index}")
    pushes = [
        c.stream_unary(PUSH_METHOD, response_deserializer=pb.PushReply.FromString)
        for c in shards.channels
    ]
    seq = max(j.next_seq for j in shards.joined) - 1
    known = {v.fragment_id: v.version for j in shards.joined for v in j.versions}
    stop = threading.Event()

    def heartbeat() -> None:  # slow windows leave a learner idle for longer than its lease
        while not stop.wait(shards.joined[0].heartbeat_interval_s):
            for stub, joined in zip(shards.stubs, shards.joined, strict=True):
                stub.Heartbeat(
                    pb.HeartbeatRequest(learner_id=joined.learner_id, session=joined.session), 30
                )

    threading.Thread(target=heartbeat, daemon=True).start()
    results.put(("ready", index))
    while (command := commands.get()) is not None:
        n, rate, t0, window = command
        have: dict[tuple[int, int], int] = {}  # (learner, fragment) -> version it pulled
        late: list[float] = []
        done_at: list[float] = []
        due_by_end = pushed = pulled = accepted = refused = 0
        op = -1
        while True:
            op += 1
            at = t0 + op / rate
            if at >= t0 + window:
                break
            learner = op % n
            if learner % CLIENTS != index:
                continue
            due_by_end += 1
            now = time.time()
            if now >= t0 + window:
                continue  # due, not started: backlog
            if now < at:
                time.sleep(at - now)
            fid = (op // n) % FRAGMENTS
            stub, joined = shards.of(fid)
            push = pushes[shards.owner[fid]]
            header, wire = payloads[fid]
            seq += 1
            h = pb.PushHeader(
                learner_id=joined.learner_id,
                session=joined.session,
                seq=seq,
                spec_hash=spec.spec_hash,
                fragment_id=fid,
                base_version=known[fid],
                tokens=1000 * INNER_STEPS,
                steps=INNER_STEPS,
                compute_s=INNER_STEPS * STEP_S,
                payload=header,
            )
            started = time.time()
            while True:
                try:
                    reply = push(
                        iter([pb.PushRequest(header=h).SerializeToString(), *wire]), timeout=600
                    )
                    break
                except grpc.RpcError as e:  # the Synchronizer is behind: back off, same seq
                    if e.code() not in BEHIND:
                        raise
                    refused += 1
                    time.sleep(RETRY_S)
            accepted += reply.outcome == pb.PUSH_ACCEPTED
            pushed += header.total_bytes
            known[fid] = max(known[fid], reply.current_version)
            pull_header, _, nbytes = _pull(stub, joined, fid, have.get((learner, fid), known[fid]))
            have[(learner, fid)] = pull_header.version
            known[fid] = max(known[fid], pull_header.version)
            pulled += nbytes
            late.append(started - at)
            done_at.append(time.time())
        results.put(
            (
                "window",
                {
                    "due": due_by_end,
                    "done": sum(t <= t0 + window for t in done_at),
                    "finished": len(done_at),
                    "accepted": accepted,
                    "refused": refused,
                    "late": late,
                    "pushed_bytes": pushed,
                    "pulled_bytes": pulled,
                },
            )
        )
    stop.set()
    shards.leave()


class Clients:
    """The CLIENTS client processes, kept across windows (they pre-encode their payloads once)."""

    def __init__(self, addresses: list[str], params: int) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(CLIENTS)]
        self.procs = [
            ctx.Process(target=client, args=(addresses, params, i, self.commands[i], self.results))
            for i in range(CLIENTS)
        ]
        for p in self.procs:
            p.start()
        for _ in self.procs:
            self._get("ready")

    def _get(self, kind: str) -> Any:
        got, value = self.results.get(timeout=1800)
        assert got == kind, (got, value)
        return value

    def window(self, learners: int, window_s: float, rate: float = 0.0) -> dict[str, Any]:
        """Runs `learners` simulated learners for `window_s` (ops due at `rate` per second, by
        default their schedule's); whether the pushes kept up."""
        rate = rate or learners / PUSH_EVERY_S
        t0 = time.time() + 0.5
        for q in self.commands:
            q.put((learners, rate, t0, window_s))
        parts = [self._get("window") for _ in self.procs]
        due, done = sum(p["due"] for p in parts), sum(p["done"] for p in parts)
        late = [x for p in parts for x in p["late"]]
        elapsed = max(time.time() - t0, window_s)
        return {
            "learners": learners,
            "pushes_per_s": rate,
            "due": due,
            "done": done,
            "backlog": due - done,
            "sustained": due - done <= CLIENTS,  # at most one op in hand per client
            "accepted": sum(p["accepted"] for p in parts),
            "refused": sum(p["refused"] for p in parts),
            "late_p50_s": statistics.median(late) if late else math.nan,
            "late_max_s": max(late, default=math.nan),
            "in_MBps": sum(p["pushed_bytes"] for p in parts) / elapsed / 1e6,
            "out_MBps": sum(p["pulled_bytes"] for p in parts) / elapsed / 1e6,
        }

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(120)
            if p.is_alive():
                p.kill()


def search(
    clients: Clients, first: int, window_s: float, bisect: int, largest: int
) -> tuple[int, list[dict[str, Any]]]:
    """The largest learner count whose pushes are served on schedule: doubling from `first`
    (halving when even that falls behind), then `bisect` bisection steps."""

    def run(n: int) -> dict[str, Any]:
        # Long enough for 8 ops at low rates, up to 4 shortest windows.
        seconds = max(window_s, min(4 * window_s, 8 * PUSH_EVERY_S / n))
        row = clients.window(n, seconds)
        print(
            f"{n} learners ({row['pushes_per_s']:.3g} pushes/s for {seconds:.0f} s): "
            f"{row['done']} of {row['due']} ops done on time, "
            + ("sustained" if row["sustained"] else "falling behind"),
            flush=True,
        )
        return row

    rows = [run(first)]
    good, bad = (first, None) if rows[-1]["sustained"] else (0, first)
    while bad is None and 2 * good <= largest:
        rows.append(run(2 * good))
        if rows[-1]["sustained"]:
            good *= 2
        else:
            bad = 2 * good
    while good == 0 and bad is not None and bad > 1:
        rows.append(run(bad // 2))
        good, bad = (bad // 2, bad) if rows[-1]["sustained"] else (0, bad // 2)
    for _ in range(bisect):
        if bad is None or bad - good <= 1:
            break
        mid = (good + bad) // 2
        rows.append(run(mid))
        good, bad = (mid, bad) if rows[-1]["sustained"] else (good, mid)
    return good, rows


def add_pass_s(numel: int, repeats: int = 3) -> float:
    """One plain `add_` over a fragment's FP32 parameters, with the service's torch threads."""
    a, b = torch.zeros(numel), torch.full((numel,), 1e-3)
    times = []
    with service_threads():
        for _ in range(repeats):
            t0 = time.perf_counter()
            a.add_(b)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(params: int, mode: str) -> dict[str, Any]:
    _, first, window_s, bisect, largest = MODES[mode]
    serve_s = window_s if mode == "smoke" else 4 * PUSH_EVERY_S  # each learner pushes 4 times
    projection = memory.project(SynchronizerConfig(), [params // FRAGMENTS] * FRAGMENTS)
    with tempfile.TemporaryDirectory() as d:
        procs = Procs(Path(d))
        try:
            proc, info = start_synchronizer(procs, (), name="synchronizer", timeout_s=300)
            rss = RssSampler(proc.pid)
            metrics_url = f"http://127.0.0.1:{info['metrics_port']}/metrics"
            baseline_rss = rss.read().get("VmRSS", 0)
            rss.phase = "init"
            t0 = time.perf_counter()
            init_synchronizer(info["address"], params, FRAGMENTS)
            init_s = time.perf_counter() - t0
            rss.phase = "join"
            join_s = join_and_pull([info["address"]], params)
            rss.phase = "clients"
            clients = Clients([info["address"]], params)
            try:
                rss.phase = "serve"  # what the memory target is about: 4 learners on schedule
                serving = clients.window(CLIENTS, serve_s)
                rss.phase = "search"  # past capacity on purpose: held pushes pile up
                sustained, rows = search(clients, first, window_s, bisect, largest)
            finally:
                clients.close()
            samples = scrape(metrics_url)
            rounds = metric(samples, "diloco_round_apply_seconds_count")
            outer_step_s = metric(samples, "diloco_round_apply_seconds_sum") / max(rounds, 1)
            exported = metric(samples, "diloco_memory_bytes", component="total")
            rss.stop()
            phases = dict(rss.peaks)
        finally:
            procs.stop_all(grace_s=30)
    add_s = add_pass_s(params // FRAGMENTS)
    fp32 = 4 * params
    peak = max(v for k, v in phases.items() if k != "search")
    return {
        "params": params,
        "rss_ratio": peak / fp32,
        "rss_peak_bytes": peak,
        "rss_ratio_search": phases.get("search", 0) / fp32,
        "serving": serving,
        "rss_idle_bytes": baseline_rss,
        "rss_peak_by_phase": phases,
        "projected_bytes": projection["total"],
        "projected_ratio": projection["total"] / fp32,
        "projected": projection,
        "projection_exported": exported == projection["total"],
        "init_s": init_s,
        "join_s": join_s,
        "outer_step_s": outer_step_s,
        "outer_steps": rounds,
        "add_pass_s": add_s,
        "apply_ratio": outer_step_s / add_s,
        "learners_sustained": float(sustained),
        "windows": rows,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--params", type=int, help="model parameters (FP32 elements)")
    p.add_argument(
        "--shards",
        type=int,
        default=1,
        help="S > 1: the same model served by one Synchronizer and by S shards, one after the "
        "other (peak RSS per shard, pushes/s, CPU seconds per pushed GB; bench/scale_shards.py)",
    )
    args = p.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    params = args.params or MODES[mode][0]
    if args.shards > 1:
        return shards_main(params, args.shards, mode, args.json)
    result = {"mode": mode, **run(params, mode), "machine": machine()}
    print()
    print(table(result["windows"], WINDOW_COLUMNS))
    print()
    print(
        table(
            [result],
            [
                "params",
                "rss_ratio",
                "projected_ratio",
                "init_s",
                "join_s",
                "outer_step_s",
                "apply_ratio",
                "learners_sustained",
            ],
        )
    )
    print(
        f"\npeak RSS serving 4 learners {result['rss_peak_bytes'] / (1 << 30):.2f} GiB = "
        f"{result['rss_ratio']:.2f}x the FP32 model (projected {result['projected_ratio']:.2f}x; "
        f"{result['rss_ratio_search']:.2f}x in the capacity search; by phase, GiB: "
        + ", ".join(f"{k} {v / (1 << 30):.2f}" for k, v in result["rss_peak_by_phase"].items())
        + f"); {result['learners_sustained']:.0f} learners sustained (H={INNER_STEPS}, {STEP_S} s/step)"
    )
    write_json(args.json, result)
    return result


def shards_main(params: int, shards: int, mode: str, json_path: Path | None) -> dict[str, Any]:
    from bench import scale_shards  # imports this module

    result = {"mode": mode, **scale_shards.run(params, shards, mode), "machine": machine()}
    rows = []
    for config in (result["single"], result["sharded"]):
        for i, peak in enumerate(config["rss_peak_bytes"]):
            rows.append(
                {
                    "shards": config["shards"],
                    "process": i,
                    "rss_peak_GiB": peak / (1 << 30),
                    "init_s": config["init_s"],
                    "join_s": config["join_s"],
                    "pushes_per_s": config["pushes_per_s"],
                    "cpu_s": config["cpu_s"][i],
                    "received_GB": config["received_GB"][i],
                    "cpu_s_per_gb": config["cpu_s_per_gb"][i],
                }
            )
    print()
    print(table(rows, list(rows[0])))
    print(
        f"\nshard_rss_ratio = {result['shard_rss_ratio']:.3f} (largest shard's peak over the single "
        f"Synchronizer's; goal <= 0.55)   pushes/s: 1 process {result['pushes_per_s_1']:.3g}, "
        f"{shards} shards {result[f'pushes_per_s_{shards}']:.3g} (same 2 cores)"
    )
    write_json(json_path, result)
    return result


if __name__ == "__main__":
    main()
