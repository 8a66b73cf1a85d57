"""Scale across shards (`python -m bench.scale --shards S`): the same model served by one
Synchronizer and by S shard processes, one configuration after the other in the same run.

Per configuration, with bench.scale's synthetic clients (each learner joins every shard and
pushes and pulls each fragment at the shard that serves it):

- `init`, `join` and `serve` (4 learners on schedule, each pushing every fragment once) as in
  bench.scale; the peak resident memory (VmRSS sampled every 50 ms, and VmHWM) of every process
  over those phases. `shard_rss_ratio`: the largest shard's peak over the single Synchronizer's
  (goal: at most 0.55);
- `saturate`: the 4 client processes push and pull back to back for a window, each fragment in
  turn (ops due far faster than they can be done). `pushes_per_s`: pushes (each with its pull) done in the
  window; `cpu_s_per_gb`: each process's CPU seconds (utime + stime, /proc) in the window per GB
  of payload it received. On this 2-core machine the shards share the cores the single process
  had, so pushes/s cannot scale here; the CPU seconds per GB project what S shards on S
  machines would sustain (each shard's share of the bytes at its own cost per byte).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import machine, table, write_json
from bench.scale_load import (
    FRAGMENTS,
    PUSH_EVERY_S,
    Clients,
    RssSampler,
    init_shards,
    join_and_pull,
)
from demo.procs import Procs, metric, scrape, start_synchronizer

SATURATING_RATE = 10_000.0  # ops due per second, far beyond 4 clients: they go back to back
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def received_bytes(metrics_url: str) -> float:
    samples = scrape(metrics_url)
    return sum(samples.get("diloco_received_bytes_total", {}).values())


def run_config(params: int, shards: int, serve_s: float, saturate_s: float) -> dict[str, Any]:
    """One configuration: `shards` Synchronizer processes (1: a plain, unsharded one)."""
    with tempfile.TemporaryDirectory() as d:
        procs = Procs(Path(d))
        try:
            started = []
            for i in range(shards):
                flags = ("--shards", str(shards), "--shard-index", str(i)) if shards > 1 else ()
                started.append(
                    start_synchronizer(
                        procs,
                        flags,
                        state_dir=Path(d) / f"state{i}",
                        name=f"shard{i}",
                        timeout_s=300,
                    )
                )
            samplers = [RssSampler(proc.pid) for proc, _ in started]

            def phase(name: str) -> None:
                for s in samplers:
                    s.phase = name

            phase("init")
            t0 = time.perf_counter()
            addresses = init_shards([info["address"] for _, info in started], params)
            init_s = time.perf_counter() - t0
            by_address = {info["address"]: (proc, info) for proc, info in started}
            ordered = [by_address[a] for a in addresses]  # shard order
            urls = [f"http://127.0.0.1:{info['metrics_port']}/metrics" for _, info in ordered]
            phase("join")
            join_s = join_and_pull(addresses, params)
            phase("clients")
            clients = Clients(addresses, params)
            try:
                phase("serve")
                serving = clients.window(4, serve_s)
                phase("saturate")
                cpu0 = [cpu_s(proc.pid) for proc, _ in ordered]
                bytes0 = [received_bytes(u) for u in urls]
                # One learner per client, every fragment in turn, as fast as they can.
                saturated = clients.window(4, saturate_s, rate=SATURATING_RATE)
                cpu = [cpu_s(proc.pid) - c for (proc, _), c in zip(ordered, cpu0, strict=True)]
                got = [received_bytes(u) - b for u, b in zip(urls, bytes0, strict=True)]
            finally:
                clients.close()
            steps = [metric(scrape(u), "diloco_round_apply_seconds_count") for u in urls]
            peaks = []
            for s in samplers:
                s.stop()
                peaks.append(max(v for k, v in s.peaks.items() if k != "saturate"))
        finally:
            procs.stop_all(grace_s=30)
    return {
        "shards": shards,
        "rss_peak_bytes": peaks,
        "init_s": init_s,
        "join_s": join_s,
        "served_on_schedule": serving["sustained"],
        "pushes_per_s": saturated["done"] / saturate_s,
        "in_MBps": saturated["in_MBps"],
        "cpu_s": cpu,
        "received_GB": [b / 1e9 for b in got],
        "cpu_s_per_gb": [
            c / (b / 1e9) if b else float("nan") for c, b in zip(cpu, got, strict=True)
        ],
        "outer_steps": steps,
    }


def run(params: int, shards: int, mode: str) -> dict[str, Any]:
    # smoke: windows long enough for an op or two each (the suite only checks that it runs)
    serve_s = 1.0 if mode == "smoke" else 4 * PUSH_EVERY_S  # each learner pushes 4 times
    saturate_s = 1.0 if mode == "smoke" else 30.0
    one = run_config(params, 1, serve_s, saturate_s)
    many = run_config(params, shards, serve_s, saturate_s)
    single = one["rss_peak_bytes"][0]
    return {
        "params": params,
        "fragments": FRAGMENTS,
        "shards": shards,
        "single": one,
        "sharded": many,
        "rss_single_bytes": single,
        "rss_shard_bytes": many["rss_peak_bytes"],
        "shard_rss_ratio": max(many["rss_peak_bytes"]) / single,
        "pushes_per_s_1": one["pushes_per_s"],
        f"pushes_per_s_{shards}": many["pushes_per_s"],
        "cpu_s_per_gb_1": one["cpu_s_per_gb"][0],
        "cpu_s_per_gb_shards": many["cpu_s_per_gb"],
    }


def main(params: int, shards: int, mode: str, json_path: Path | None) -> dict[str, Any]:
    result = {"mode": mode, **run(params, shards, mode), "machine": machine()}
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
