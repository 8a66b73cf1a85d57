"""The synthetic learners of `bench.scale` and `bench.scale_shards`, and what they measure with:
client processes that act for N learners (join, push pre-encoded INT4 payloads on the default
schedule, pull what changed), the model upload and first join they time, and the resident
memory sampler (VmRSS every 50 ms, VmHWM for the peak).
"""

from __future__ import annotations

import itertools
import math
import multiprocessing as mp
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import torch

from bench.common import dir_bytes
from bench.ingest import GRPC_OPTIONS, model_spec
from protos import codec, framing, layout
from protos import diloco_pb2 as pb
from protos import diloco_pb2_grpc as pb_grpc
from protos.initmodel import init_model_requests
from protos.spec import ModelSpec, shard_owners

FRAGMENTS = 4
CLIENTS = 4
INNER_STEPS = 100  # H
STEP_S = 0.5  # seconds per inner step
PUSH_EVERY_S = INNER_STEPS * STEP_S / FRAGMENTS  # one learner: one fragment push every 12.5 s
CYCLE_S = FRAGMENTS * PUSH_EVERY_S  # one learner pushes (and pulls) every fragment once in 50 s
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
MODES = {  # params, first N, shortest window (s), bisection steps, largest N, lead-in (s)
    "smoke": (1_000_000, 64, 1.0, 0, 64, 0.0),  # one window of the search: it runs, no more
    "quick": (250_000_000, 4, 20.0, 2, 1024, CYCLE_S),
    "full": (1_000_000_000, 4, 30.0, 2, 1024, CYCLE_S),
}


class RssSampler:
    """VmRSS of a process every `every_s`, by phase, and its VmHWM (peak) on demand; with
    `state_dir`, the bytes of the files under it every 10 samples too (`state_peak`)."""

    def __init__(self, pid: int, every_s: float = 0.05, state_dir: Path | None = None) -> None:
        self.path = Path(f"/proc/{pid}/status")
        self.state_dir = state_dir
        self.state_peak = 0
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
        samples = 0
        while not self.stopped.wait(every_s):
            rss = self.read().get("VmRSS", 0)
            self.peaks[self.phase] = max(self.peaks[self.phase], rss)
            samples += 1
            if self.state_dir is not None and samples % 10 == 0:
                self.state_peak = max(self.state_peak, dir_bytes(self.state_dir))

    def stop(self) -> int:
        """Stops sampling; returns the process's peak resident bytes (VmHWM)."""
        peak = self.read().get("VmHWM", 0)
        self.stopped.set()
        self.thread.join()
        return max(peak, *self.peaks.values(), 0)


def _pull(
    stub: pb_grpc.SynchronizerStub,
    joined: pb.JoinReply,
    fid: int,
    have: int | None,
    wanted: pb.Codec = pb.CODEC_FP32,
) -> tuple[pb.PullHeader, torch.Tensor | None, int]:
    """One pull, in full (FP32, or `wanted`) or (with `have`) of the updates since: (header, the
    decoded FP32 parameters of a full FP32 pull without `have`, payload bytes). Delta pulls,
    their full fallbacks and other codecs are only counted: learners decode on their own
    machines."""
    replies = stub.PullFragment(
        pb.PullRequest(
            learner_id=joined.learner_id,
            session=joined.session,
            fragment_id=fid,
            delta_ok=have is not None,
            have_version=have or 0,
            codec=wanted,
        ),
        timeout=600,
    )
    header = next(replies).header
    if have is not None or wanted != pb.CODEC_FP32 or not header.HasField("payload"):
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


def report_pace(shards: Shards) -> None:
    """A heartbeat to every shard with what the learners a client acts for would say: their
    step time and H, from which the Synchronizer's adaptive grace knows how long a round may
    wait for more pushes (without them it waits 0 s)."""
    for stub, joined in zip(shards.stubs, shards.joined, strict=True):
        request = pb.HeartbeatRequest(
            learner_id=joined.learner_id,
            session=joined.session,
            step_time_s=STEP_S,
            overlap_steps=INNER_STEPS,
        )
        stub.Heartbeat(request, 30)


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


def push_payloads(spec: ModelSpec, seed: int) -> list[tuple[pb.PayloadHeader, list[bytes]]]:
    """Per fragment, a push's payload header and its wire chunks (serialized PushRequests): a
    small random outer gradient, INT4-encoded once, which a synthetic learner sends every time."""
    g = torch.Generator().manual_seed(seed)
    payloads = []
    for f in spec.fragments:
        buf = codec.encode(torch.randn(f.numel, generator=g) * 1e-3, pb.CODEC_INT4)
        wire = [pb.PushRequest(chunk=c).SerializeToString() for c in framing.iter_chunks(buf)]
        payloads.append((layout.make_header(pb.CODEC_INT4, f.numel), wire))
    return payloads


def schedule(
    n: int, rate: float, t0: float, window: float, lead: float, index: int
) -> Iterator[tuple[float, int, int, bool]]:
    """Client `index`'s ops of a window, in order: (due at, learner, fragment, measured). Op g
    is due at t0 + g / rate and is learner g % n's of fragment (g // n) % FRAGMENTS; the ops
    due in the `lead` seconds before t0 come first, unmeasured: the previous cycle's, so that
    a learner's first measured pull of a fragment asks for the updates since its own pull of
    it one cycle earlier, as in steady state, not since the version its process knew last."""
    first = -math.ceil(lead * rate)
    for op in itertools.count(first):
        at = t0 + op / rate
        if at >= t0 + window:
            return
        if op % n % CLIENTS == index:
            yield at, op % n, (op // n) % FRAGMENTS, op >= 0


PULLS = {  # --pulls: how the simulated learners pull (their delta_pulls and pull_codec)
    "delta": pb.CODEC_FP32,  # the default: the updates since their previous pull, else FP32
    "bf16": pb.CODEC_BF16,  # delta_pulls off, pull_codec bf16: always in full, in BF16
    "int8": pb.CODEC_INT8,  # delta_pulls off, pull_codec int8: always in full, in INT8 blocks
}


def client(
    addresses: list[str], params: int, index: int, commands: Any, results: Any, pulls: str
) -> None:
    """One client process: one Synchronizer learner that acts for its share of the N simulated
    learners. Per window command (N, rate, t0, window, lead): the ops of `schedule`, each a
    learner's push of a fragment (to the shard that serves it), then its pull of that fragment
    (the updates since that learner's previous pull of it), done in order, never early; what
    the lead-in ops do is not counted. `pulls`: a key of PULLS."""
    torch.set_num_threads(1)
    spec = model_spec(params, FRAGMENTS)
    payloads = push_payloads(spec, index)
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
            report_pace(shards)

    report_pace(shards)
    threading.Thread(target=heartbeat, daemon=True).start()
    results.put(("ready", index))
    while (command := commands.get()) is not None:
        n, rate, t0, window, lead = command
        have: dict[tuple[int, int], int] = {}  # (learner, fragment) -> version it pulled
        late: list[float] = []
        done_at: list[float] = []
        due_by_end = pushed = pulled = accepted = refused = 0
        for at, learner, fid, measured in schedule(n, rate, t0, window, lead, index):
            due_by_end += measured
            now = time.time()
            if now >= t0 + window:
                continue  # due, not started: backlog
            if now < at:
                time.sleep(at - now)
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
                    refused += measured
                    time.sleep(RETRY_S)
            known[fid] = max(known[fid], reply.current_version)
            since = have.get((learner, fid), known[fid]) if pulls == "delta" else None
            pull_header, _, nbytes = _pull(stub, joined, fid, since, PULLS[pulls])
            have[(learner, fid)] = pull_header.version
            known[fid] = max(known[fid], pull_header.version)
            if measured:
                accepted += reply.outcome == pb.PUSH_ACCEPTED
                pushed += header.total_bytes
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

    def __init__(self, addresses: list[str], params: int, pulls: str = "delta") -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(CLIENTS)]
        self.procs = [
            ctx.Process(
                target=client,
                args=(addresses, params, i, self.commands[i], self.results, pulls),
            )
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

    def window(
        self, learners: int, window_s: float, rate: float = 0.0, lead_s: float = 0.0
    ) -> dict[str, Any]:
        """Runs `learners` simulated learners for `window_s` (ops due at `rate` per second, by
        default their schedule's), after `lead_s` of the same schedule that is not counted
        (`CYCLE_S`: each learner pulls what changed since its previous cycle, as in steady
        state); whether the pushes kept up."""
        rate = rate or learners / PUSH_EVERY_S
        t0 = time.time() + 0.5 + lead_s
        for q in self.commands:
            q.put((learners, rate, t0, window_s, lead_s))
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
