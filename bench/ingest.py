"""Ingest: how fast a real Synchronizer takes pushes, against the machine's own limits.

For each codec and client count, client processes stream one model's fragments (pre-encoded,
2 MiB chunks) over loopback for a fixed time: first to a bare sink server that only counts the
bytes (what Python gRPC itself moves here), then to a real Synchronizer that validates, decodes,
accumulates and applies outer steps, once with its write-ahead log off and once with it on
(each a fresh Synchronizer, its state in the run's state directory). Each cell is measured
against each of its limits separately, and the headlines are the worst cells:
- `ingest_ratio`: intake with the log off over raw gRPC's bytes/s;
- `wal_disk_ratio`: intake with the log on over the lower of the log-off intake and the state
  disk's sequential write bandwidth with fdatasync (`disk_write_MBps`: 16 MiB in smoke mode,
  1 GiB otherwise, appended in 4 MiB blocks as the log writes, each fdatasync'd and its pages
  then dropped from the page cache (`bench.limits.disk_write_bandwidth`), in the directory the
  Synchronizers keep their state in, before the cells).
Then, in this process, the outer-step apply over the whole model as the Synchronizer steps a
round of one INT8 push by default (`Fragment.apply`: the push decoded, merged, the Nesterov
step and the INT8 update chain that delta pulls are served from; one fused pass with the
native kernels), the same step `bench.scale`'s `outer_step_s` times, against one plain `add_`
pass over the same tensors (`apply_ratio` = plain pass seconds / apply seconds) and against one
core's memory bandwidth over the same elements (`mem_bw_copy_GBps`, `mem_bw_triad_GBps`: best of
5 `copy_` and triad passes, torch on one thread): `apply_bw_ratio` = the 20 bytes per parameter
a Nesterov step must move, per apply second, over the triad bandwidth, and
`bytes_per_param_moved` = the apply's seconds x the triad bandwidth / parameters. Beside it,
`unfused_apply_s` and its parts (`decode_s`, `merge_s`, `nesterov_s`): the same push decoded
into FP32 sums, merged and stepped by Nesterov one after the other, without the update chain
(rounds the fused step does not take run these passes, then the chain). `kernel_threads`: the
threads the served step split across (as in service: one per 16M elements, at most the
cores). A figure whose baseline could not be measured is written as null with the reason under
`missing`, and printed as "missing: <why>".
This process sets malloc's thresholds as `serve` does (`synchronizer.allocator`; `allocator` in
the JSON says what it did), so the Synchronizers it measures receive as they serve, and the bare
sink, in the same process, receives under the same settings.

    python -m bench.ingest [--quick | --smoke] [--state-dir DIR] [--json PATH]
Full mode: 100M parameters, 1/4/8 clients, FP32/BF16/INT8/INT4, three 8 s streaming runs per
cell (raw, log off, log on).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing as mp
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import torch

from bench.common import machine, parser, program, table, write_json
from bench.limits import combine, disk_write_bandwidth, memory_bandwidth, outer_step_figures, shown
from protos import codec, framing, layout
from protos import diloco_pb2 as pb
from protos import diloco_pb2_grpc as pb_grpc
from protos.initmodel import init_model_requests
from protos.spec import TensorInfo, plan_fragments
from synchronizer import allocator, native
from synchronizer.buffers import Fp32Buffers, Payloads, payload_budget
from synchronizer.clock import SystemClock
from synchronizer.config import SynchronizerConfig
from synchronizer.fragments import Fragment
from synchronizer.goodput import Goodput
from synchronizer.merge import Accumulator
from synchronizer.metrics import Metrics
from synchronizer.outer import make_outer
from synchronizer.server import serving

SINK_METHOD = "/bench.Sink/Push"
OUTER = "nesterov"  # the outer optimizer `measure_apply` times (the service's default)
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 8 << 20),
    ("grpc.max_receive_message_length", 8 << 20),
]


def model_spec(params: int, fragments: int):
    per = params // fragments
    return plan_fragments(
        [TensorInfo(f"block{i}.weight", (per,)) for i in range(fragments)], fragments
    )


def start_sink() -> tuple[grpc.Server, str]:
    def push(request_iterator: Any, context: grpc.ServicerContext) -> bytes:
        n = 0
        for chunk in request_iterator:
            n += len(chunk)
        return n.to_bytes(8, "little")

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16),
        options=[("grpc.so_reuseport", 0), *GRPC_OPTIONS],
    )
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(push)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def client(
    address: str,
    mode: str,
    codec_id: int,
    params: int,
    fragments: int,
    seconds: float,
    barrier: Any,
    results: Any,
) -> None:
    """One client process: pre-encodes a push per fragment, then streams them in a loop."""
    torch.set_num_threads(1)
    spec = model_spec(params, fragments)
    # Messages are serialized once, as the raw baseline's bytes are: only the small push header
    # is made per push, so both sides measure the receiving server, not the sending harness.
    # Only the bytes each side sends are kept (eight clients of a 100M-parameter FP32 model
    # hold 3.2 GB of them).
    payloads = []
    for f in spec.fragments:
        chunks = framing.iter_chunks(codec.encode(torch.randn(f.numel) * 1e-3, codec_id))
        wire = [
            c.data if mode == "raw" else pb.PushRequest(chunk=c).SerializeToString() for c in chunks
        ]
        payloads.append((f, layout.make_header(codec_id, f.numel), wire))
    channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
    if mode == "raw":
        push = channel.stream_unary(SINK_METHOD)
        learner_id, session, seq = "", "", 0
    else:
        stub = pb_grpc.SynchronizerStub(channel)
        push = channel.stream_unary(
            "/diloco.v1.Synchronizer/PushFragment", response_deserializer=pb.PushReply.FromString
        )
        joined = stub.Join(pb.JoinRequest(learner_name="bench", spec=spec.to_proto()), timeout=60)
        learner_id, session, seq = joined.learner_id, joined.session, joined.next_seq - 1
        versions = {v.fragment_id: v.version for v in joined.versions}
    barrier.wait()
    sent, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for f, header, wire in payloads:
            if mode == "raw":
                push(iter(wire), timeout=120)
            else:
                seq += 1
                h = pb.PushHeader(
                    learner_id=learner_id,
                    session=session,
                    seq=seq,
                    spec_hash=spec.spec_hash,
                    fragment_id=f.fragment_id,
                    base_version=versions[f.fragment_id],
                    tokens=1000,
                    steps=10,
                    compute_s=1.0,
                    payload=header,
                )
                reply = push(
                    iter([pb.PushRequest(header=h).SerializeToString(), *wire]), timeout=120
                )
                versions[f.fragment_id] = reply.current_version
            sent += header.total_bytes
    results.put((sent, time.perf_counter() - t0))
    channel.close()


def run_clients(
    address: str,
    mode: str,
    codec_id: int,
    params: int,
    fragments: int,
    clients: int,
    seconds: float,
) -> float:
    """Payload bytes per second that `clients` processes streamed together."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(clients), ctx.Queue()
    procs = [
        ctx.Process(
            target=client,
            args=(address, mode, codec_id, params, fragments, seconds, barrier, results),
        )
        for _ in range(clients)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    return sum(b for b, _ in got) / max(t for _, t in got)


def init_synchronizer(address: str, params: int, fragments: int) -> None:
    spec = model_spec(params, fragments)
    stub = pb_grpc.SynchronizerStub(grpc.insecure_channel(address, options=GRPC_OPTIONS))
    joined = stub.Join(pb.JoinRequest(learner_name="init", spec=spec.to_proto()), timeout=60)

    zeros = (torch.zeros(f.numel) for f in spec.fragments)
    stub.InitModel(
        init_model_requests(joined.learner_id, joined.session, spec.spec_hash, zeros), timeout=300
    )
    stub.Leave(pb.LeaveRequest(learner_id=joined.learner_id, session=joined.session), timeout=60)


def release_memory() -> None:
    """Hands freed heap memory back to the OS between cells: glibc keeps what a cell's threads
    freed (push buffers, update-chain links under its 32 MB mmap threshold), and twelve cells
    of a 100M-parameter Synchronizer would otherwise add up to more than this machine has."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@contextlib.contextmanager
def service_threads() -> Iterator[None]:
    """Torch's thread count as `diloco-synchronizer serve` sets it (`compute_threads`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(SynchronizerConfig().compute_threads)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def sync_rate(
    params: int,
    fragments: int,
    clients: int,
    codec_id: int,
    seconds: float,
    quorum: int,
    wal: bool,
    state_root: Path | None,
    kernels: str = "auto",
) -> tuple[float, int]:
    """Payload bytes/s a fresh Synchronizer (state in a new directory under `state_root`, the
    write-ahead log on or off) took from `clients` processes, and the outer steps it applied."""
    with tempfile.TemporaryDirectory(dir=state_root) as state:
        cfg = SynchronizerConfig(
            port=0,
            metrics_port=-1,
            state_dir=Path(state),
            quorum=quorum,
            grace="none",
            anchor="base",
            max_staleness=1_000_000,
            token_weight="uniform",
            checkpoint_interval_s=0,
            max_concurrent_streams=24,
            shutdown_grace_s=1,
            wal=wal,
            kernels=kernels,
        )
        with service_threads(), serving(cfg, Metrics()) as srv:
            init_synchronizer(srv.address, params, fragments)
            got = run_clients(srv.address, "sync", codec_id, params, fragments, clients, seconds)
            steps = sum(f.version for f in srv.synchronizer.model.fragments)
    release_memory()
    return got, steps


def measure_ingest(
    params: int,
    fragments: int,
    clients: int,
    codec_name: str,
    seconds: float,
    quorum: int,
    state_root: Path | None = None,
    raw: bool = True,
    kernels: str = "auto",
) -> dict[str, Any]:
    """One cell: raw gRPC to the bare sink (unless `raw` is False: `raw_MBps` None), then a
    Synchronizer with its log off, then one with its log on, each streamed to for `seconds` by
    the same client processes' code and bytes."""
    codec_id = layout.parse_codec(codec_name)
    cell: dict[str, Any] = {"codec": codec_name, "clients": clients, "raw_MBps": None}
    if raw:
        sink, sink_address = start_sink()
        try:
            got = run_clients(sink_address, "raw", codec_id, params, fragments, clients, seconds)
        finally:
            sink.stop(0)
        cell["raw_MBps"] = got / 1e6
    bytes_per_param = layout.encoded_nbytes(codec_id, params) / params
    for log, wal in (("log_off", False), ("log_on", True)):
        got, steps = sync_rate(
            params, fragments, clients, codec_id, seconds, quorum, wal, state_root, kernels
        )
        cell |= {
            f"{log}_MBps": got / 1e6,
            f"{log}_params_per_s": got / bytes_per_param,
            f"{log}_outer_steps": steps,
        }
    return cell


def measure_apply(numel: int, repeats: int = 7, kernels: str = "auto") -> dict[str, Any]:
    """The outer step as the Synchronizer runs it, against one plain add_ pass over the tensors.

    apply = the whole `Fragment.apply` of a one-push INT8 round with the default INT8 update
    chain that delta pulls are served from, once the chain holds all the links it keeps (the
    step `diloco_round_apply_seconds` times in service). `unfused_apply_s` = the same push
    decoded into a round's accumulator (weight folded into the scales), merged and stepped by
    Nesterov one after the other, without the update chain, with each part's seconds. Against
    the machine: one core's memory bandwidth over the same elements, and what the apply is
    worth in bytes moved at its triad bandwidth (`bench.limits`).
    """
    bandwidth = memory_bandwidth(numel)  # first: its three tensors are freed before these exist
    g = torch.Generator().manual_seed(0)
    params = torch.randn(numel, generator=g)
    delta = torch.randn(numel, generator=g) * 1e-3
    header = layout.make_header(pb.CODEC_INT8, numel)
    payload = codec.encode(delta, pb.CODEC_INT8)
    scratch, merged = torch.empty(numel), torch.empty(numel)
    fused = native.resolve(kernels)
    acc = Accumulator(numel, native_kernels=fused)
    outer = make_outer(OUTER, numel)
    with tempfile.TemporaryDirectory() as state:
        cfg = SynchronizerConfig(
            state_dir=Path(state), anchor="base", token_weight="uniform", kernels=kernels
        )
        metrics = Metrics()
        spec = plan_fragments([TensorInfo("w", (numel,))], 1).fragments[0]
        goodput = Goodput(metrics, cfg.goodput_window_s)
        payloads = Payloads(payload_budget(cfg.payload_budget_bytes, numel))
        frag = Fragment(
            spec, cfg, metrics, goodput, numel, payloads, Fp32Buffers(numel, 1), SystemClock()
        )
        frag.initialize(params)

    def chain_round() -> float:
        assert frag.payloads.reserve(payload.numel())
        frag.submit("bench", frag.version, 1000, 10, 1.0, (payload.clone(), header), hold=True)
        rnd = frag.admission.round
        assert rnd is not None and frag.admission.take(rnd)
        return frag.apply(rnd)[0]

    with service_threads():
        # the chain filled first, as in a Synchronizer that has served a while: a new link then
        # takes an evicted one's pages instead of fresh ones (a page fault per 4 KiB here)
        for _ in range(frag.model.downlink.history + 1):
            chain_round()
    plain: list[float] = []
    unfused: list[float] = []
    apply: list[float] = []
    parts: dict[str, list[float]] = {"decode": [], "merge": [], "nesterov": []}
    with service_threads():
        for _ in range(repeats):
            t0 = time.perf_counter()
            params.add_(delta)
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            acc.reset()
            acc.add_payload(payload, header, 2.0, scratch)
            t1 = time.perf_counter()
            acc.merged(merged)
            t2 = time.perf_counter()
            outer.step(params, merged)
            t3 = time.perf_counter()
            unfused.append(t3 - t0)
            parts["decode"].append(t1 - t0)
            parts["merge"].append(t2 - t1)
            parts["nesterov"].append(t3 - t2)
            apply.append(chain_round())
    plain_s, apply_s = statistics.median(plain), statistics.median(apply)
    measured = {
        "numel": numel,
        "plain_add_s": plain_s,
        "apply_s": apply_s,
        "apply_GBps_fp32": numel * 4 / apply_s / 1e9,
        "plain_GBps_fp32": numel * 4 / plain_s / 1e9,
        "apply_ratio": plain_s / apply_s,
        "unfused_apply_s": statistics.median(unfused),
        "kernel_threads": (
            len(native.ranges(numel, layout.DEFAULT_BLOCK_SIZE, frag.model.downlink.kernel_threads))
            if fused
            else 1
        ),
        "kernels": "native" if fused else "torch",
        **{f"{k}_s": statistics.median(v) for k, v in parts.items()},
    }
    figures = outer_step_figures(OUTER, numel, apply_s, bandwidth["mem_bw_triad_GBps"])
    return combine(measured, bandwidth, figures)


def against_limits(cell: dict[str, Any], disk_MBps: float | None) -> dict[str, Any]:
    """A cell's intake against each of its limits: `ingest_ratio` = log off over raw gRPC of the
    same bytes; `wal_disk_ratio` = log on over the lower of the state disk's write bandwidth
    with fdatasync and the log-off intake (None when the disk was not measured)."""
    out = {"ingest_ratio": cell["log_off_MBps"] / cell["raw_MBps"]}
    if disk_MBps is None:
        return out | {"wal_limit_MBps": None, "wal_disk_ratio": None}
    limit = min(disk_MBps, cell["log_off_MBps"])
    return out | {"wal_limit_MBps": limit, "wal_disk_ratio": cell["log_on_MBps"] / limit}


CELL_COLUMNS = [
    "codec",
    "clients",
    "raw_MBps",
    "log_off_MBps",
    "ingest_ratio",
    "log_on_MBps",
    "wal_limit_MBps",
    "wal_disk_ratio",
    "log_off_outer_steps",
    "log_on_outer_steps",
]
APPLY_COLUMNS = [
    "numel",
    "plain_add_s",
    "apply_s",
    "apply_GBps_fp32",
    "apply_ratio",
    "mem_bw_copy_GBps",
    "mem_bw_triad_GBps",
    "apply_bw_ratio",
    "bytes_per_param_moved",
    "unfused_apply_s",
    "decode_s",
    "merge_s",
    "nesterov_s",
    "kernels",
    "kernel_threads",
]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--params", type=int, help="model parameters (FP32 elements)")
    p.add_argument("--clients", help="comma-separated client counts")
    p.add_argument("--codecs", help="comma-separated codecs")
    p.add_argument("--seconds", type=float, help="streaming time per cell and side")
    p.add_argument(
        "--quorum", type=int, default=1, help="Synchronizer quorum K (default 1: asynchronous)"
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        help="where the Synchronizers keep their state (a fresh directory per run, deleted "
        "after), and whose sequential write bandwidth with fdatasync is measured as the log's "
        "limit (default: the system's temporary directory)",
    )
    p.add_argument(
        "--kernels",
        choices=native.KERNELS,
        default="auto",
        help="the Synchronizer's outer-step kernels (its --kernels; default auto, as it serves)",
    )
    args = p.parse_args(argv)
    mode: dict[str, Any]
    if args.smoke:
        mode = dict(params=1_000_000, clients=[1], codecs=["int8"], seconds=0.5, disk=16 << 20)
    elif args.quick:
        mode = dict(
            params=25_000_000,
            clients=[1, 4],
            codecs=["fp32", "int8", "int4"],
            seconds=4.0,
            disk=1 << 30,
        )
    else:
        mode = dict(
            params=100_000_000,
            clients=[1, 4, 8],
            codecs=["fp32", "bf16", "int8", "int4"],
            seconds=8.0,
            disk=1 << 30,
        )
    params = args.params or mode["params"]
    clients = [int(c) for c in args.clients.split(",")] if args.clients else mode["clients"]
    codecs = args.codecs.split(",") if args.codecs else mode["codecs"]
    seconds = args.seconds or mode["seconds"]
    malloc = allocator.keep_freed_buffers()
    print(malloc)
    with tempfile.TemporaryDirectory(prefix="bench-ingest-", dir=args.state_dir) as root:
        disk = disk_write_bandwidth(Path(root), mode["disk"])
        rows = [
            measure_ingest(
                params, 4, n, name, seconds, args.quorum, Path(root), kernels=args.kernels
            )
            for name in codecs
            for n in clients
        ]
    for row in rows:
        row |= against_limits(row, disk["disk_write_MBps"])
    print(table(rows, CELL_COLUMNS))
    print(
        f"\nstate disk ({disk['disk_dir']}): {shown(disk, 'disk_write_MBps', '.0f')} MB/s "
        f"sequential write with fdatasync ({disk['disk_write_bytes'] >> 20} MiB in 4 MiB blocks, "
        f"each fdatasync'd and dropped from the page cache, as the log writes)"
    )
    applied = measure_apply(params, kernels=args.kernels)
    print()
    print(table([applied], APPLY_COLUMNS))
    wal_ratios = [r["wal_disk_ratio"] for r in rows if r["wal_disk_ratio"] is not None]
    headline: dict[str, Any] = {
        "ingest_ratio": min(r["ingest_ratio"] for r in rows),
        "ingest_ratio_median": statistics.median(r["ingest_ratio"] for r in rows),
        "wal_disk_ratio": min(wal_ratios) if len(wal_ratios) == len(rows) else None,
        "disk_write_MBps": disk["disk_write_MBps"],
        "apply_ratio": applied["apply_ratio"],
        "apply_bw_ratio": applied["apply_bw_ratio"],
        "bytes_per_param_moved": applied["bytes_per_param_moved"],
        "apply_GBps_fp32": applied["apply_GBps_fp32"],
        "mem_bw_copy_GBps": applied["mem_bw_copy_GBps"],
        "mem_bw_triad_GBps": applied["mem_bw_triad_GBps"],
        "kernels": applied["kernels"],
        "allocator": malloc,
    }
    missing = disk.get("missing", {}) | applied.get("missing", {})
    if headline["wal_disk_ratio"] is None:
        why = missing["disk_write_MBps"]
        missing["wal_disk_ratio"] = f"the state disk was not measured: {why}"
    result = headline | {
        "missing": missing,
        "params": params,
        "cells": rows,
        "disk": disk,
        "apply": applied,
        "machine": machine(),
    }
    print(
        f"\ningest_ratio (log off, worst cell; over raw gRPC of the same bytes) = "
        f"{shown(result, 'ingest_ratio')}\n"
        f"wal_disk_ratio (log on, worst cell; over min(the disk's fdatasync write bandwidth, "
        f"log-off intake)) = {shown(result, 'wal_disk_ratio')}\n"
        f"apply (a one-push INT8 round's outer step, as served): "
        f"{applied['apply_GBps_fp32']:.2f} GB/s FP32-equivalent, plain add_ pass / apply = "
        f"{applied['apply_ratio']:.3f}; apply_bw_ratio (its arithmetic's "
        f"{applied['outer_bytes_per_param']} bytes/parameter over one core's triad bandwidth, "
        f"{shown(result, 'mem_bw_triad_GBps', '.2f')} GB/s) = {shown(result, 'apply_bw_ratio')}, "
        f"bytes_per_param_moved = {shown(result, 'bytes_per_param_moved', '.1f')}"
    )
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    program(main)
