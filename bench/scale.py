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
  longer covers it). Each window starts with one cycle (50 s: every learner's push and pull of
  every fragment) that is not counted, so the pulls it measures cover a whole cycle of updates
  as in steady state (smoke mode: none); with `--pulls bf16` or `int8` every pull is in full,
  in that codec (learners with delta pulls off and that `pull_codec`). N is raised (doubling, then
  bisecting) until pushes are no longer served on schedule: more ops due by the end of a window
  than the 4 clients can have in hand (`--learners N`: one window at N alone; `--window-s`: the
  shortest window, 30 s in full mode; each window's row counts the checkpoints completed in it
  and its lead-in, which share the state disk with the log). Their heartbeats say what such learners' would (0.5 s
  per step, H = 100), so the Synchronizer's adaptive grace gathers pushes into rounds as it
  would for them (`pushes_per_round`: accepted pushes per outer step; `pushes_refused_budget`:
  refused for the payload budget);
- `outer_step_s`: the mean outer step of one fragment over the run (`diloco_round_apply_seconds`)
  and `apply_ratio`: that over one `add_` pass over a fragment in this process (how many plain
  passes an outer step costs); against the machine (`bench.limits`, in this process after the
  Synchronizer stopped): one core's memory bandwidth over a fragment's elements
  (`mem_bw_copy_GBps`, `mem_bw_triad_GBps`: best of 5 passes, torch on one thread),
  `apply_bw_ratio` = the bytes the default outer step's arithmetic must move (Nesterov: 20 per
  parameter) per `outer_step_s` over the triad bandwidth, and `bytes_per_param_moved` =
  `outer_step_s` x the triad bandwidth / the fragment's elements (null with the reason under
  `missing` when no outer step ran);
- `rss_ratio`: the peak resident memory (VmRSS sampled every 50 ms) over the model's FP32 bytes
  while it initialises, serves a join, and serves 4 learners on schedule (`serving`: 50 s, each
  pushing every fragment once), beside `synchronizer.memory`'s projection for the same settings
  (`projected_ratio`); `rss_ratio_search` is the same during the capacity search, which
  overloads the Synchronizer on purpose (held pushes pile up past the payload budget, and rounds
  that add pushes on arrival take FP32 buffers beyond the shared ones).

- `state_peak_bytes`: the state directory's largest size (sampled every 0.5 s) beside
  `synchronizer.memory.state_disk`'s projection (`state_projected_bytes`); a directory without
  room for that projection stops the run before it starts.

    python -m bench.scale [--quick | --smoke] [--params N] [--pulls delta|bf16|int8]
                          [--learners N] [--window-s S] [--state-dir DIR] [--json PATH]
Full mode: 1e9 parameters (quick: 250M, smoke: 1M); full and quick need several times the
model's FP32 bytes of free memory.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import scale_shards
from bench.common import machine, parser, program, table, write_json
from bench.ingest import init_synchronizer, service_threads
from bench.limits import combine, memory_bandwidth, outer_step_figures, shown
from bench.scale_load import (
    CLIENTS,
    FRAGMENTS,
    INNER_STEPS,
    MODES,
    PULLS,
    PUSH_EVERY_S,
    STEP_S,
    WINDOW_COLUMNS,
    Clients,
    RssSampler,
    join_and_pull,
)
from demo.procs import Procs, metric, scrape, start_synchronizer
from synchronizer import memory, native
from synchronizer.config import SynchronizerConfig


def search(
    clients: Clients,
    first: int,
    window_s: float,
    bisect: int,
    largest: int,
    lead_s: float,
    checkpoints: Callable[[], float],
    only: int = 0,
) -> tuple[int, list[dict[str, Any]]]:
    """The largest learner count whose pushes are served on schedule: doubling from `first`
    (halving when even that falls behind), then `bisect` bisection steps; with `only`, that
    count's window alone (`only` sustained, or 0). Each window's row counts the checkpoints
    completed in it (`checkpoints()`: the Synchronizer's total so far)."""

    def run(n: int) -> dict[str, Any]:
        # Long enough for 8 ops at low rates, up to 4 shortest windows.
        seconds = max(window_s, min(4 * window_s, 8 * PUSH_EVERY_S / n))
        before = checkpoints()
        row = clients.window(n, seconds, lead_s=lead_s)
        row["checkpoints"] = checkpoints() - before  # the lead-in's too: it shares the disk
        print(
            f"{n} learners ({row['pushes_per_s']:.3g} pushes/s for {seconds:.0f} s): "
            f"{row['done']} of {row['due']} ops done on time, {row['checkpoints']:.0f} "
            "checkpoints, " + ("sustained" if row["sustained"] else "falling behind"),
            flush=True,
        )
        return row

    if only:
        rows = [run(only)]
        return (only if rows[0]["sustained"] else 0), rows
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


def room_for_state(root: Path, params: int) -> dict[str, int]:
    """The Synchronizer's projected peak state (`memory.state_disk`, default settings); exits
    with one line when `root` has less free space, rather than stall once the disk fills (a full
    disk refuses pushes, and the capacity search then waits out every window)."""
    need = memory.state_disk(SynchronizerConfig(), [params // FRAGMENTS] * FRAGMENTS)
    free = shutil.disk_usage(root).free
    if free < need["total"]:
        raise SystemExit(
            f"bench.scale: {params:,} parameters need about {need['total'] / 1e9:.1f} GB free "
            f"for the Synchronizer's state ({need['checkpoints'] / 1e9:.1f} GB of checkpoints, "
            f"the log up to {need['wal'] / 1e9:.1f} GB); {root} has {free / 1e9:.1f} GB: free "
            "some, or give --state-dir on a larger volume"
        )
    return need


def run(
    params: int,
    mode: str,
    kernels: str = "auto",
    state_dir: Path | None = None,
    pulls: str = "delta",
    learners: int = 0,
    window_s: float = 0.0,
) -> dict[str, Any]:
    _, first, shortest_s, bisect, largest, lead_s = MODES[mode]
    window_s = window_s or shortest_s
    serve_s = window_s if mode == "smoke" else 4 * PUSH_EVERY_S  # each learner pushes 4 times
    projection = memory.project(SynchronizerConfig(), [params // FRAGMENTS] * FRAGMENTS)
    with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=state_dir) as d:
        need = room_for_state(Path(d), params)
        procs = Procs(Path(d))
        try:
            proc, info = start_synchronizer(
                procs, ("--kernels", kernels), name="synchronizer", timeout_s=300
            )
            rss = RssSampler(proc.pid, state_dir=procs.root / "state")
            metrics_url = f"http://127.0.0.1:{info['metrics_port']}/metrics"
            baseline_rss = rss.read().get("VmRSS", 0)
            rss.phase = "init"
            t0 = time.perf_counter()
            init_synchronizer(info["address"], params, FRAGMENTS)
            init_s = time.perf_counter() - t0
            rss.phase = "join"
            join_s = join_and_pull([info["address"]], params)
            rss.phase = "clients"
            clients = Clients([info["address"]], params, pulls)
            try:
                rss.phase = "serve"  # what the memory target is about: 4 learners on schedule
                serving = clients.window(CLIENTS, serve_s)
                rss.phase = "search"  # past capacity on purpose: held pushes pile up
                sustained, rows = search(
                    clients,
                    first,
                    window_s,
                    bisect,
                    largest,
                    lead_s,
                    lambda: metric(scrape(metrics_url), "diloco_checkpoints_total"),
                    learners,
                )
            finally:
                clients.close()
            samples = scrape(metrics_url)
            rounds = metric(samples, "diloco_round_apply_seconds_count")
            outer_step_s = metric(samples, "diloco_round_apply_seconds_sum") / max(rounds, 1)
            accepted = metric(samples, "diloco_pushes_total", outcome="accepted")
            budget_refused = metric(samples, "diloco_pushes_refused_payload_budget_total")
            exported = sum(samples.get("diloco_memory_projected_bytes", {}).values())
            rss.stop()
            phases = dict(rss.peaks)
        finally:
            procs.stop_all(grace_s=30)
    numel = params // FRAGMENTS
    add_s = add_pass_s(numel)
    bandwidth = memory_bandwidth(numel)
    figures = outer_step_figures(
        SynchronizerConfig().outer, numel, outer_step_s, bandwidth["mem_bw_triad_GBps"]
    )
    fp32 = 4 * params
    peak = max(v for k, v in phases.items() if k != "search")
    measured = {
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
        "state_peak_bytes": rss.state_peak,
        "state_projected_bytes": need["total"],
        "init_s": init_s,
        "join_s": join_s,
        "outer_step_s": outer_step_s,
        "outer_steps": rounds,
        # accepted pushes per outer step: how many the grace gathers into a round (the
        # model's upload is no push)
        "pushes_per_round": accepted / rounds if rounds else None,
        # pushes that found the payload budget full and were refused after waiting for room
        "pushes_refused_budget": budget_refused,
        "add_pass_s": add_s,
        "apply_ratio": outer_step_s / add_s,
        "kernels": "native" if native.resolve(kernels) else "torch",
        "learners_sustained": float(sustained),
        "windows": rows,
    }
    return combine(measured, bandwidth, figures)


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
    p.add_argument(
        "--state-dir",
        type=Path,
        help="where the Synchronizer keeps its state (a fresh directory, deleted after; default: "
        "the system's temporary directory); it must have room for what synchronizer.memory's "
        "state_disk projects, or the benchmark says so and stops",
    )
    p.add_argument(
        "--pulls",
        choices=sorted(PULLS),
        default="delta",
        help="how the synthetic learners pull: delta (the default learners': the updates since "
        "their previous pull, or the fragment in FP32 once the kept chain no longer covers it) or "
        "bf16 or int8 (learners with delta_pulls off and that pull_codec: always in full, in it)",
    )
    p.add_argument(
        "--kernels",
        choices=native.KERNELS,
        default="auto",
        help="the Synchronizer's outer-step kernels (its --kernels; default auto, as it serves)",
    )
    p.add_argument(
        "--learners",
        type=int,
        default=0,
        help="one window at this many learners instead of the capacity search "
        "(learners_sustained: that count, or 0 when it fell behind)",
    )
    p.add_argument(
        "--window-s",
        type=float,
        default=0.0,
        help="the shortest window in seconds (default: the mode's, 30 s in full mode; a window "
        "at 1B shorter than the checkpoints' period may or may not hold one)",
    )
    args = p.parse_args(argv)
    if args.learners < 0 or args.window_s < 0:
        p.error("--learners and --window-s must not be negative")
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    params = args.params or MODES[mode][0]
    if args.shards > 1:
        return scale_shards.main(params, args.shards, mode, args.json)
    result = {
        "mode": mode,
        "pulls": args.pulls,
        **run(params, mode, args.kernels, args.state_dir, args.pulls, args.learners, args.window_s),
        "machine": machine(),
    }
    print()
    print(table(result["windows"], [*WINDOW_COLUMNS, "checkpoints"]))
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
                "kernels",
                "mem_bw_triad_GBps",
                "apply_bw_ratio",
                "bytes_per_param_moved",
                "pushes_per_round",
                "pushes_refused_budget",
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
    print(
        f"state directory at most {result['state_peak_bytes'] / 1e9:.2f} GB "
        f"(projected {result['state_projected_bytes'] / 1e9:.2f} GB)"
    )
    print(
        f"outer step {result['outer_step_s']:.3g} s per {result['mem_bw_numel']:,}-element "
        f"fragment: apply_bw_ratio (its arithmetic's {result['outer_bytes_per_param']} "
        f"bytes/parameter over one core's triad bandwidth, "
        f"{shown(result, 'mem_bw_triad_GBps', '.2f')} GB/s) = {shown(result, 'apply_bw_ratio')}, "
        f"bytes_per_param_moved = {shown(result, 'bytes_per_param_moved', '.1f')}"
    )
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    program(main)
