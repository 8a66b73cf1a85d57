"""Durability: what the write-ahead log costs, how fast it commits, and how fast a restart replays it.

Three measurements, each against a baseline taken in the same run:

- `wal_ratio`: push throughput of a real Synchronizer (INT4, 4 clients (1 in smoke mode), quorum
  1, loopback; the ingest benchmark's cell) with the log on, over the same with it off (goal
  >= 0.8);
- fsync latency p50/p99 of the log's group commits and push-acknowledgement latency p50/p99,
  with 4 threads appending pushes of one fragment's INT4 size;
- `restart_s`: a Synchronizer process killed with SIGKILL after its log grew to the given size
  (no checkpoint since the model was initialised), restarted on the same state directory, until
  it is SERVING again (its ready file), with the versions it served before checked to come back;
- chaos (`bench.chaos`): the Synchronizer of a tiny synchronous run SIGKILLed at random moments
  and restarted (20 kills; 3 in quick mode; in smoke mode bench.chaos's smoke, 1 kill), against
  the same run without kills: versions checked, pushes acknowledged / merged / lost, eval loss
  against the run without kills.

    python -m bench.durability [--quick | --smoke] [--no-chaos] [--json PATH]
Full mode: 25M parameters, 8 s per throughput cell, a 1 GB log, 20 kills (several minutes here).

Power cuts instead (`tests/powercut.py`): an in-process Synchronizer whose disk loses everything
not fsynced (or keeps it torn) at N random moments, during group commits, checkpoints, log
rotations and releases of old segments, restarted each time on what is left; every acknowledged
push must still be held, no version served lower or with other contents. Exits 1 on any
violation.

    python -m bench.durability --power-cuts N [--seed S] [--json PATH]
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from bench import chaos
from bench.common import machine, parser, program, table, write_json
from bench.ingest import GRPC_OPTIONS, measure_ingest, model_spec
from demo.procs import Procs, start_synchronizer
from protos import codec, framing, layout
from protos import diloco_pb2 as pb
from protos import diloco_pb2_grpc as pb_grpc
from protos.initmodel import init_model_requests
from synchronizer.wal import Wal
from synchronizer.walformat import PUSH, Record
from tests import powercut

REPO = Path(__file__).resolve().parents[1]


def throughput(params: int, seconds: float, clients: int, raw: bool = True) -> dict[str, Any]:
    # log off, then on (after raw gRPC, which the ratio does not use: the smoke leaves it out)
    cell = measure_ingest(params, 4, clients, "int4", seconds, 1, raw=raw)
    return {
        "wal_off_MBps": cell["log_off_MBps"],
        "wal_on_MBps": cell["log_on_MBps"],
        "wal_ratio": cell["log_on_MBps"] / cell["log_off_MBps"],
    }


def commit_latency(record_bytes: int, seconds: float, threads: int = 4) -> dict[str, Any]:
    fsyncs: list[float] = []
    acks: list[float] = []
    lock = threading.Lock()
    payload = bytes(record_bytes)
    with tempfile.TemporaryDirectory(dir=REPO) as d:
        wal = Wal(Path(d) / "wal", 64 << 20, on_fsync=fsyncs.append)
        wal.start()
        stop = time.monotonic() + seconds

        def pusher() -> None:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                wal.wait(wal.append(Record(PUSH, {"fid": 0, "version": 1}, payload)), 60)
                with lock:
                    acks.append(time.perf_counter() - t0)

        workers = [threading.Thread(target=pusher) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wal.close()

    def pct(xs: list[float], q: int) -> float:
        return statistics.quantiles(xs, n=100)[q - 1] * 1e3 if len(xs) > 1 else xs[0] * 1e3

    return {
        "record_bytes": record_bytes,
        "pushes": len(acks),
        "fsyncs": len(fsyncs),
        "pushes_per_fsync": len(acks) / max(1, len(fsyncs)),
        "fsync_p50_ms": pct(fsyncs, 50),
        "fsync_p99_ms": pct(fsyncs, 99),
        "ack_p50_ms": pct(acks, 50),
        "ack_p99_ms": pct(acks, 99),
    }


SERVE_FLAGS = ["--quorum", "1", "--grace", "none", "--checkpoint-interval-s", "0"]


def _serve(procs: Procs, state: Path, name: str) -> tuple[subprocess.Popen, dict[str, Any]]:
    return start_synchronizer(procs, SERVE_FLAGS, state_dir=state, name=name, timeout_s=600)


def restart_time(params: int, log_bytes: int) -> dict[str, Any]:
    spec = model_spec(params, 4)
    with tempfile.TemporaryDirectory(dir=REPO) as d:
        procs, state = Procs(Path(d)), Path(d) / "state"
        proc, info = _serve(procs, state, "synchronizer")
        try:
            channel = grpc.insecure_channel(info["address"], options=GRPC_OPTIONS)
            stub = pb_grpc.SynchronizerStub(channel)
            joined = stub.Join(
                pb.JoinRequest(learner_name="bench", spec=spec.to_proto()), timeout=60
            )
            zeros = (torch.zeros(f.numel) for f in spec.fragments)
            stub.InitModel(
                init_model_requests(joined.learner_id, joined.session, spec.spec_hash, zeros),
                timeout=300,
            )
            g = torch.Generator().manual_seed(0)
            payloads = []
            for f in spec.fragments:
                header = layout.make_header(pb.CODEC_INT4, f.numel)
                buf = codec.encode(torch.randn(f.numel, generator=g) * 1e-3, pb.CODEC_INT4)
                payloads.append(
                    (
                        f.fragment_id,
                        header,
                        [pb.PushRequest(chunk=c) for c in framing.iter_chunks(buf)],
                    )
                )
            logged, seq, versions = 0, 0, {f.fragment_id: 0 for f in spec.fragments}
            while logged < log_bytes:
                for fid, header, chunks in payloads:
                    seq += 1
                    h = pb.PushHeader(
                        learner_id=joined.learner_id,
                        session=joined.session,
                        seq=seq,
                        spec_hash=spec.spec_hash,
                        fragment_id=fid,
                        base_version=versions[fid],
                        tokens=1000,
                        steps=10,
                        compute_s=1.0,
                        payload=header,
                    )
                    reply = stub.PushFragment(
                        iter([pb.PushRequest(header=h), *chunks]), timeout=120
                    )
                    versions[fid] = reply.current_version
                    logged += header.total_bytes
            status = stub.Status(pb.StatusRequest(), timeout=60)
            before = {v.fragment_id: v.version for v in status.versions}
            channel.close()
            proc.send_signal(signal.SIGKILL)
            proc.wait(60)
            wal_bytes = sum(p.stat().st_size for p in (state / "wal").glob("wal-*.log"))
            t0 = time.perf_counter()
            proc, again = _serve(procs, state, "synchronizer-restarted")
            restart_s = time.perf_counter() - t0
            channel = grpc.insecure_channel(again["address"], options=GRPC_OPTIONS)
            status = pb_grpc.SynchronizerStub(channel).Status(pb.StatusRequest(), timeout=60)
            after = {v.fragment_id: v.version for v in status.versions}
            channel.close()
        finally:
            procs.stop_all(grace_s=0)
    return {
        "log_bytes": wal_bytes,
        "pushes": seq,
        "restart_s": restart_s,
        "log_MBps_replayed": wal_bytes / restart_s / 1e6,
        # Rounds may close between the Status call and the kill: versions never go back.
        "versions_back": all(after[f] >= v for f, v in before.items())
        and again["epoch"] == info["epoch"],
    }


def power_cuts(cuts: int, seed: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=REPO) as d:
        report = powercut.run_cuts(Path(d), cuts, seed)
    print(report.summary())
    return {
        "machine": machine(),
        "power_cuts": report.cuts,
        "seed": seed,
        "seconds": report.seconds,
        "violations": report.violations,
        "cuts_by_moment": dict(report.by_group),
        "cuts_by_mode": dict(report.by_mode),
        "pushes_acknowledged": report.acked,
        "retries_answered_duplicate": report.duplicates,
        "unanswered_held": report.unanswered_held,
        "unanswered_accepted_again": report.unanswered_redone,
        "versions_served": report.served,
        "versions_compared_after_restart": report.versions_checked,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--power-cuts",
        type=int,
        metavar="N",
        help="run N power cuts at the Disk seam instead of the measurements above",
    )
    p.add_argument("--seed", type=int, default=0, help="the power cuts' random seed")
    p.add_argument(
        "--no-chaos",
        action="store_true",
        help="leave out the kill -9 comparison (python -m bench.chaos runs it alone)",
    )
    args = p.parse_args(argv)
    if args.power_cuts is not None:
        if args.power_cuts < 1:
            p.error("--power-cuts must be at least 1")
        result = power_cuts(args.power_cuts, args.seed)
        write_json(args.json, result)
        if result["violations"]:
            raise SystemExit(1)
        return result
    if args.smoke:  # the smallest that runs: its figures mean nothing (bench.chaos's smoke)
        params, clients, seconds, log_bytes, latency_s = 1_000_000, 1, 0.3, 1 << 20, 0.2
        kills, steps, learners = chaos.SMOKE["kills"], chaos.SMOKE["steps"], chaos.SMOKE["learners"]
    elif args.quick:
        params, clients, seconds, log_bytes, latency_s = 25_000_000, 4, 4.0, 128 << 20, 3.0
        kills, learners = 3, chaos.LEARNERS
        steps = chaos.steps_for(kills)
    else:
        params, clients, seconds, log_bytes, latency_s = 25_000_000, 4, 8.0, 1 << 30, 8.0
        kills, learners = 20, chaos.LEARNERS
        steps = chaos.steps_for(kills)
    ingest = throughput(params, seconds, clients, raw=not args.smoke)
    print(table([ingest], ["wal_off_MBps", "wal_on_MBps", "wal_ratio"]))
    record = layout.encoded_nbytes(pb.CODEC_INT4, params // 4)
    latency = commit_latency(record, latency_s)
    print(
        table(
            [latency],
            [
                "record_bytes",
                "pushes",
                "pushes_per_fsync",
                "fsync_p50_ms",
                "fsync_p99_ms",
                "ack_p50_ms",
                "ack_p99_ms",
            ],
        )
    )
    restart = restart_time(params, log_bytes)
    print(
        table([restart], ["log_bytes", "pushes", "restart_s", "log_MBps_replayed", "versions_back"])
    )
    if args.no_chaos:
        kill9 = {"kills": 0, "lost": None, "loss_vs_no_kills": None, "skipped": "--no-chaos"}
    else:
        with tempfile.TemporaryDirectory(dir=REPO) as d:
            kill9 = chaos.compare(Path(d), kills, steps, learners=learners)
        print(chaos.summary(kill9))
    result = {
        "machine": machine(),
        "mode": "smoke" if args.smoke else "quick" if args.quick else "full",
        "wal_ratio": ingest["wal_ratio"],
        "fsync_p50_ms": latency["fsync_p50_ms"],
        "fsync_p99_ms": latency["fsync_p99_ms"],
        "restart_s": restart["restart_s"],
        "chaos_kills": kill9["kills"],
        "chaos_lost": kill9["lost"],
        "chaos_loss_vs_no_kills": kill9["loss_vs_no_kills"],
        "throughput": ingest,
        "commit": latency,
        "restart": restart,
        "chaos": {k: v for k, v in kill9.items() if k not in ("chaos", "reference")},
    }
    print(
        f"\nwal_ratio = {ingest['wal_ratio']:.3f}   fsync p50/p99 = {latency['fsync_p50_ms']:.2f}/"
        f"{latency['fsync_p99_ms']:.2f} ms   restart with a {restart['log_bytes'] / 1e6:.0f} MB log = "
        f"{restart['restart_s']:.2f} s (versions back: {restart['versions_back']})"
    )
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    program(main)
