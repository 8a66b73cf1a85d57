"""The benchmarks in their smallest mode (`--smoke`), as a user runs them, so they do not rot:
each exits 0 and writes its headline figures to the JSON file. The figures themselves mean
nothing at this size; docs/performance.md has the real ones. Nothing here needs root: wan runs
through the rate-limiting, delaying proxies, the others use namespaces only where they can be
made. Then the benchmarks' own parts: the links' relay, delay and link check over real sockets
on loopback (the namespaces' transparent proxy only as root).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import convergence, scale, scale_load
from bench.common import parser, run_mode
from bench.goodput import pushed_fraction, schedule
from bench.ingest import against_limits, measure_apply
from bench.limits import (
    OUTER_BYTES_PER_PARAM,
    disk_write_bandwidth,
    memory_bandwidth,
    outer_step_figures,
    shown,
)
from bench.net import LinkError, Namespaces, Proxies, Relay, TokenBucket, socket_bytes
from bench.peers import MISSING, final_replica, headline, merged_syncs, torchft_missing
from bench.wan import parse_links, reach_time
from protos import diloco_pb2 as pb
from protos import layout
from synchronizer import native
from synchronizer.config import SynchronizerConfig
from synchronizer.downlink import Downlink
from synchronizer.outer import OUTER_KINDS
from tests.helpers import REPO, descendants, kill_tree, run_smoke
from tests.tools import DEBIAN, tool

SMOKES = [
    ("ingest", [], ["ingest_ratio", "wal_disk_ratio", "apply_ratio", "apply_bw_ratio"]),
    ("dp", [], ["dp_bytes_per_step", "dp_eval_loss"]),
    (
        "convergence",
        [],
        [
            "bandwidth_ratio",
            "loss_gap",
            "m1_gain",
            "default_vs_sync",
            "default_vs_dp",
            "default_vs_best",
        ],
    ),
    (
        "goodput",
        [],
        [
            "goodput",
            "goodput_sync",
            "goodput_lockstep",
            "effective_goodput",
            "effective_goodput_sync",
            "effective_goodput_lockstep",
        ],
    ),
    ("reference", [], ["eval_loss", "wall_s"]),
    ("overlap", [], ["overlap_ratio"]),
    # its kill -9 comparison is bench.chaos.compare, which test_e2e's chaos test runs
    ("durability", ["--no-chaos"], ["wal_ratio", "fsync_p50_ms", "restart_s"]),
    (
        "scale",
        [],
        [
            "rss_ratio",
            "init_s",
            "join_s",
            "outer_step_s",
            "apply_ratio",
            "apply_bw_ratio",
            "learners_sustained",
        ],
    ),
    ("scale", ["--learners", "8", "--window-s", "2"], ["learners_sustained"]),
    (
        "scale",
        ["--shards", "2"],
        ["shard_rss_ratio", "pushes_per_s_1", "pushes_per_s_2", "cpu_s_per_gb_1"],
    ),
    ("gpu", [], ["rss_ratio", "init_s", "join_s", "sync_vs_nosync"]),
]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("name", "extra", "keys"), SMOKES, ids=[" ".join([s[0], *s[1]]) for s in SMOKES]
)
def test_benchmark_smoke_mode_exits_0_and_writes_its_headline_figures(
    tmp_path: Path, name: str, extra: list[str], keys: list[str]
) -> None:
    result = run_smoke(name, tmp_path / f"{name}.json", *extra)
    for key in keys:
        assert isinstance(result.get(key), float) and math.isfinite(result[key]), (
            key,
            result.get(key),
        )
    if name == "scale" and not extra:  # its first checkpoint at least, within the projection
        assert 0 < result["state_peak_bytes"] <= result["state_projected_bytes"]
    if "--learners" in extra:  # that count's window alone, no search; its checkpoints counted
        (window,) = result["windows"]
        assert window["learners"] == 8 and window["checkpoints"] >= 0
        assert result["learners_sustained"] in (0.0, 8.0)
    assert "machine" in result
    if "smoke_run" in result:  # a smoke run says so, whatever its benchmark's quick mode does
        assert result["mode"] == "smoke" and result["smoke_run"] is True, result["mode"]


def test_kill_tree_reaches_a_child_in_a_session_of_its_own(tmp_path: Path) -> None:
    # A smoke that ran past its time was killed alone, and the Synchronizer it had started (in a
    # session of its own, as Procs starts them) went on loading the rest of the suite.
    spawn = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " start_new_session=True)\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", spawn], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert descendants(parent.pid) == [child]
    kill_tree(parent.pid)
    assert parent.wait(timeout=10) == -signal.SIGKILL
    gone = Path(f"/proc/{child}")
    deadline = time.monotonic() + 10
    while gone.exists() and "Z" not in _state(gone) and time.monotonic() < deadline:
        time.sleep(0.05)  # reaped by init once it dies: no event to wait on from here
    assert not gone.exists() or "Z" in _state(gone)


@pytest.mark.slow
def test_a_benchmark_stopped_with_sigterm_stops_every_process_it_started(tmp_path: Path) -> None:
    # `timeout` sends SIGTERM. Its default action ended a benchmark before the `finally`s that
    # stop its Synchronizer and learners (each in a session of its own) and remove its network
    # namespaces, and they went on loading whatever ran next.
    namespaces = _namespaces()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.defaults", "--smoke", "--arms", "default"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        started: list[int] = []
        while len(started) < 3 and time.monotonic() < deadline:  # a Synchronizer, 2 learners
            time.sleep(0.2)  # another process's children: no event to wait on from here
            started = [p for p in descendants(proc.pid) if _is_ours(p)]
        assert len(started) >= 3, f"the benchmark started {started}"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    left = [p for p in started if _state(Path(f"/proc/{p}")) not in ("gone", "Z")]
    for p in left:  # reparented: out of kill_tree's reach from the benchmark
        kill_tree(p)
    assert proc.returncode != 0, out[-2000:]
    assert not left, out[-2000:]
    assert _namespaces() == namespaces, out[-2000:]  # its learners' links removed


def _namespaces() -> set[str]:
    """The network namespaces here (none where `ip` cannot list them)."""
    if shutil.which("ip") is None:
        return set()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}


def _is_ours(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"synchronizer" in cmdline or b"demo" in cmdline


def _state(proc_dir: Path) -> str:
    try:
        return (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


NOT_BENCHMARKS = {"torchft_learner"}  # a learner process bench.peers starts, not run by hand


def benchmarks() -> list[str]:
    """Every module under bench/ that runs as `python -m bench.NAME`, but NOT_BENCHMARKS."""
    return sorted(
        p.stem
        for p in (REPO / "bench").glob("*.py")
        if 'if __name__ == "__main__":' in p.read_text() and p.stem not in NOT_BENCHMARKS
    )


def test_benchmarks_are_found_by_their_main_block() -> None:
    assert {"chaos", "memory", "wan", "peers", "scale", "ingest"} <= set(benchmarks())


@pytest.mark.parametrize("name", benchmarks())
def test_every_benchmark_help_lists_quick(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    main = importlib.import_module(f"bench.{name}").main
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    assert "--quick" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "argv"),
    [
        ("chaos", ["--kills", "-1"]),
        ("memory", ["--params", "0"]),
        ("memory", ["--learners", "0"]),
        ("convergence", ["--d-model", "0"]),
        ("convergence", ["--n-layer", "0"]),
        ("convergence", ["--lr", "0"]),
        ("convergence", ["--lr", "nan"]),
    ],
)
def test_a_benchmark_refuses_a_bad_size_in_one_line_before_running(
    name: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        importlib.import_module(f"bench.{name}").main(argv)
    assert done.value.code == 2
    assert re.search(r"takes? a number >", capsys.readouterr().err.splitlines()[-1])


def test_convergence_trains_every_arm_at_the_model_size_and_seed_given() -> None:
    p = convergence.arguments()
    w, base = convergence.workload(
        p.parse_args(
            ["--d-model", "128", "--n-layer", "3", "--seed", "2", "--sync-every", "50"]
            + ["--lr", "0.004"]
        )
    )
    assert (w.d_model, w.n_layer, w.seed, w.steps, base.sync_every) == (128, 3, 2, 3000, 50)
    assert w.lr == 0.004 and "0.004" in w.train_flags()
    assert w.options().lr == 0.004  # data parallel's ranks
    default_w, default_base = convergence.workload(p.parse_args(["--quick"]))
    assert (default_w.d_model, default_w.n_layer, default_w.steps) == (64, 2, 300)
    assert default_w.lr == 8e-3
    assert default_base.sync_every == 100
    with pytest.raises(ValueError, match="a multiple of the 2 heads, got 127"):
        convergence.workload(p.parse_args(["--d-model", "127"]))


def test_scale_clients_report_the_pace_that_sizes_the_synchronizers_grace(make_server) -> None:
    # bench.scale's clients stand for learners at H = 100 and 0.5 s a step. Their heartbeats say
    # so, and the adaptive grace then waits as it would for such learners (its 5 s cap); without
    # their pace it waited 0 s and every round closed on the pushes already in it.
    srv = make_server()
    grace = srv.synchronizer.grace
    assert grace.seconds() == 0.0
    spec = scale_load.model_spec(4000, scale_load.FRAGMENTS)
    shards = scale_load.Shards([srv.address], spec, "client0")
    try:
        scale_load.report_pace(shards)
    finally:
        shards.leave()
    assert grace.seconds() == SynchronizerConfig().grace_max_s == 5.0


def test_scale_windows_lead_in_one_cycle_so_each_measured_pull_spans_a_learners_cycle() -> None:
    # Without the lead-in, a learner's first pull of a fragment in a window asked for what
    # changed since its client process last heard of it (seconds ago, next to nothing); in steady
    # state it asks for the updates since its own pull one cycle (50 s) before, which at 1B is a
    # full snapshot once more versions than the kept chain holds went by.
    n, rate, window = 8, 8 / scale_load.PUSH_EVERY_S, 30.0
    ops = [
        (at, learner, fid, measured)
        for index in range(scale_load.CLIENTS)
        for at, learner, fid, measured in scale_load.schedule(
            n, rate, 0.0, window, scale_load.CYCLE_S, index
        )
    ]
    plain = [
        op
        for index in range(scale_load.CLIENTS)
        for op in scale_load.schedule(n, rate, 0.0, window, 0.0, index)
    ]
    assert sorted(op for op in ops if op[3]) == sorted(plain)  # the window itself is unchanged
    for learner in range(n):
        lead = [(at, fid) for at, who, fid, measured in ops if who == learner and not measured]
        assert sorted(fid for _, fid in lead) == list(range(scale_load.FRAGMENTS))
        assert all(-scale_load.CYCLE_S <= at < 0 for at, _ in lead)
        for at, fid in lead:  # the same learner's next op of that fragment: one cycle later
            after = [a for a, who, f, m in ops if who == learner and f == fid and m]
            assert not after or min(after) == pytest.approx(at + scale_load.CYCLE_S)
    for index in range(scale_load.CLIENTS):  # each client's ops in order, its learners only
        mine = list(scale_load.schedule(n, rate, 0.0, window, scale_load.CYCLE_S, index))
        assert [at for at, *_ in mine] == sorted(at for at, *_ in mine)
        assert {who % scale_load.CLIENTS for _, who, _, _ in mine} == {index}


def test_scale_clients_pull_in_full_in_bf16_or_int8_with_pulls_bf16_or_int8(make_server) -> None:
    # `--pulls bf16` / `int8` stand for learners with delta pulls off and that pull_codec: each
    # pull is the fragment in full at 2 (BF16) or about 1 (INT8) bytes a parameter, where the
    # default's fallback is FP32 at 4.
    srv = make_server()
    params = 4000
    scale_load.init_shards([srv.address], params)
    spec = scale_load.model_spec(params, scale_load.FRAGMENTS)
    numel = spec.fragments[0].numel
    shards = scale_load.Shards([srv.address], spec, "client0")
    try:
        stub, joined = shards.of(0)
        header, decoded, nbytes = scale_load._pull(stub, joined, 0, None, scale_load.PULLS["bf16"])
        assert (header.payload.codec, decoded, nbytes) == (pb.CODEC_BF16, None, 2 * numel)
        header, decoded, nbytes = scale_load._pull(stub, joined, 0, None, scale_load.PULLS["int8"])
        int8 = layout.encoded_nbytes(pb.CODEC_INT8, numel, layout.DEFAULT_BLOCK_SIZE)
        assert (header.payload.codec, decoded, nbytes) == (pb.CODEC_INT8, None, int8)
        assert numel < int8 < 1.1 * numel
        header, decoded, nbytes = scale_load._pull(stub, joined, 0, None)
        assert (header.payload.codec, nbytes) == (pb.CODEC_FP32, 4 * numel)
        assert decoded is not None and not decoded.any()  # the uploaded zeros
    finally:
        shards.leave()


def test_scale_stops_before_it_starts_where_the_state_would_not_fit(tmp_path: Path) -> None:
    # a full disk refuses pushes, and the capacity search would wait out every window
    with pytest.raises(SystemExit, match=r"need about [0-9.]+ GB free .* --state-dir"):
        scale.room_for_state(tmp_path, 10**15)
    assert scale.room_for_state(tmp_path, 10**6)["total"] > 0


def test_a_quick_mode_too_short_for_its_figures_calls_itself_a_smoke_run() -> None:
    p = parser("test")
    quick, full = p.parse_args(["--quick"]), p.parse_args([])
    why = "too few steps"
    assert run_mode(quick, why) == {"mode": "quick", "smoke_run": True, "smoke_reason": why}
    assert run_mode(quick) == {"mode": "quick", "smoke_run": False}
    assert run_mode(full, why) == {"mode": "full", "smoke_run": False}
    assert run_mode(p.parse_args(["--smoke"]), why)["smoke_run"] is True


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_wan_over_proxies_reports_its_speedup_missing_with_the_reason_never_a_number(
    tmp_path: Path,
) -> None:
    """Data parallel's gloo traffic cannot go through the per-slot proxies: unshaped, it is no
    baseline, so it is not run and the headline is missing, with why."""
    result = run_smoke("wan", tmp_path / "wan.json", "--net", "proxy")
    assert result["wan_speedup"] is None and result["wan_speedup_50mbit"] is None
    assert "gloo" in result["missing"]["wan_speedup"], result["missing"]
    assert "--net netns" in result["missing"]["wan_speedup"]
    (cell,) = result["cells"]
    assert cell["links"] == "proxy" and cell["dp"] is None and not cell["dp_shaped"]
    assert math.isfinite(cell["decoupled"]["eval_loss"])  # the Decoupled arm still ran
    assert result["wan_lower_bound"] is None


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces, tc and iptables need root")
def test_wan_over_namespaces_shapes_data_parallel_too_and_reports_its_speedup(
    tmp_path: Path,
) -> None:
    for name, package in (("ip", "iproute2"), ("tc", "iproute2"), ("iptables", "iptables")):
        tool(name, DEBIAN.format(package))
    result = run_smoke("wan", tmp_path / "wan.json", "--net", "netns")
    assert isinstance(result["wan_speedup"], float) and math.isfinite(result["wan_speedup"])
    assert result["wan_dp_shaped"] is True and result["missing"] == {}
    assert result["cells"][0]["links"] == "netns"


def test_proxies_say_why_data_parallel_would_be_unshaped_only_when_the_links_shape() -> None:
    with Proxies(2) as plain:  # neither limited nor delayed: loopback is as asked
        assert plain.dp_unshaped() is None
    with Proxies(2, rate_bps=50e6) as limited:
        why = limited.dp_unshaped()
        assert why is not None and "gloo" in why and "install-tools.sh" in why
    with Proxies(2, rtt_s=0.05, instead_of_netns="no root") as delayed:
        assert (delayed.dp_unshaped() or "").endswith("namespaces here: no root")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_peers_smoke_runs_torchft_and_the_defaults_on_both_links_and_under_faults(
    tmp_path: Path,
) -> None:
    missing = torchft_missing()
    if missing:
        pytest.skip(f"bench.peers skips without torchft: {missing}")
    result = run_smoke("peers", tmp_path / "peers.json")
    for key in ("vs_torchft_bytes", "vs_torchft_wall", "vs_torchft_loss", "goodput_torchft"):
        assert isinstance(result.get(key), float) and math.isfinite(result[key]), (key, result)
    assert isinstance(result.get("goodput"), float)
    torchft = result["runs"]["loopback"]["torchft"]
    assert torchft["replicas_agree"] and torchft["manager_step"] == 10  # 100 steps, H = 10
    assert "machine" in result


@pytest.mark.slow
def test_peers_without_torchft_says_so_in_one_line_exits_0_and_writes_skipped(
    tmp_path: Path,
) -> None:
    hidden = tmp_path / "hide" / "torchft"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torchft'\", name='torchft')\n"
    )
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.peers", "--smoke", "--json", str(out)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(hidden.parent), str(REPO)])},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines() == [
        f"bench.peers: skipped: {MISSING}: No module named 'torchft'"
    ]
    result = json.loads(out.read_text())
    assert result["skipped"].startswith("torchft not installed") and "machine" in result


def test_every_outer_kind_states_the_bytes_its_arithmetic_moves() -> None:
    assert set(OUTER_BYTES_PER_PARAM) == set(OUTER_KINDS)
    assert OUTER_BYTES_PER_PARAM["nesterov"] == 20 and OUTER_BYTES_PER_PARAM["sgd"] == 12


def test_memory_bandwidth_runs_on_one_thread_and_restores_torchs_thread_count() -> None:
    threads = torch.get_num_threads()
    bw = memory_bandwidth(1 << 16, repeats=2)
    assert torch.get_num_threads() == threads
    assert bw["mem_bw_copy_GBps"] > 0 and bw["mem_bw_triad_GBps"] > 0
    assert memory_bandwidth(0)["mem_bw_triad_GBps"] is None


def test_outer_step_figures_count_the_arithmetics_bytes_at_the_triad_bandwidth() -> None:
    # 1M parameters, 20 bytes each, in 4 ms: 5 GB/s, half of a 10 GB/s triad; 40 bytes' worth
    got = outer_step_figures("nesterov", 1_000_000, 0.004, 10.0)
    assert got["apply_bw_ratio"] == pytest.approx(0.5)
    assert got["bytes_per_param_moved"] == pytest.approx(40.0)
    none_ran = outer_step_figures("nesterov", 1_000_000, 0.0, 10.0)
    assert none_ran["apply_bw_ratio"] is None
    assert shown(none_ran, "apply_bw_ratio").startswith("missing: no outer step was timed")
    assert outer_step_figures("sgd", 10, 1.0, None)["missing"]["bytes_per_param_moved"]


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_ingest_times_the_outer_step_the_synchronizer_runs(monkeypatch, kernels: str) -> None:
    # a delay put into the step a served round takes through its update chain (native or
    # torch) must show in apply_s, which the figures are made of; the unfused path's parts never
    # take that step
    delay = 0.1
    taken: list[str] = []

    def slowed(name: str) -> Any:
        original = getattr(Downlink, name)

        def step(self: Downlink, *args: Any, **kwargs: Any) -> Any:
            taken.append(name)
            time.sleep(delay)
            return original(self, *args, **kwargs)

        return step

    monkeypatch.setattr(Downlink, "step", slowed("step"))
    monkeypatch.setattr(Downlink, "step_pushes", slowed("step_pushes"))
    got = measure_apply(1 << 16, repeats=3, kernels=kernels)
    assert got["apply_s"] >= delay > got["unfused_apply_s"]
    # the figures are the served step's: at least the delay's worth of bytes per parameter
    triad = got["mem_bw_triad_GBps"]
    assert got["bytes_per_param_moved"] >= delay * triad * 1e9 / (1 << 16)
    assert got["apply_bw_ratio"] == pytest.approx(20 * (1 << 16) / got["apply_s"] / (triad * 1e9))
    if kernels == "auto" and native.resolve("auto"):
        assert got["kernels"] == "native" and taken[-1] == "step_pushes"
    else:
        assert got["kernels"] == "torch" and taken[-1] == "step"
    assert got["kernel_threads"] == 1  # 64K elements: never split


def test_disk_bandwidth_leaves_no_file_and_is_missing_with_the_error_where_it_cannot_write(
    tmp_path: Path,
) -> None:
    got = disk_write_bandwidth(tmp_path, total_bytes=3 << 20, block_bytes=1 << 20)
    assert got["disk_write_MBps"] > 0 and list(tmp_path.iterdir()) == []
    gone = disk_write_bandwidth(tmp_path / "nowhere", total_bytes=1 << 20)
    assert gone["disk_write_MBps"] is None
    assert "nowhere" in shown(gone, "disk_write_MBps")


def test_wal_intake_is_held_to_the_slower_of_the_disk_and_the_log_off_intake() -> None:
    cell = {"raw_MBps": 400.0, "log_off_MBps": 200.0, "log_on_MBps": 90.0}
    assert against_limits(cell, 100.0) == {
        "ingest_ratio": 0.5,
        "wal_limit_MBps": 100.0,
        "wal_disk_ratio": 0.9,
    }
    assert against_limits(cell, 1000.0)["wal_disk_ratio"] == pytest.approx(0.45)
    assert against_limits(cell, None)["wal_disk_ratio"] is None


def sync(before: int, after: int, participants: int = 2) -> dict:
    return {"before": before, "after": after, "participants": participants}


def test_peers_torchft_merged_syncs_count_own_commits_not_failed_healed_or_forked_ones() -> None:
    # a survivor: two commits with its peer, one lost (the peer died mid all-reduce), one alone
    assert merged_syncs([sync(0, 1), sync(1, 2), sync(2, 2), sync(2, 3, 1)], False) == 3
    # a restarted replica: its first sync heals it from the peer (its last H steps replaced)
    assert merged_syncs([sync(0, 5), sync(5, 6), sync(6, 7)], True) == 2
    # a restarted replica with nobody left to heal from trains a model nobody evaluates
    assert merged_syncs([sync(0, 1, 1), sync(1, 2, 1)], True) == 0
    # one restarted before the first commit rejoins at step 0 with its peer: no heal, all merged
    assert merged_syncs([sync(0, 1), sync(1, 2)], True) == 2


def test_peers_torchft_final_model_is_the_finished_replica_at_the_highest_manager_step() -> None:
    results = [
        {"finished": False, "manager_step": 3, "param_hash": "x"},
        {"finished": True, "manager_step": 11, "param_hash": "fork", "eval_loss_end": 3.0},
        {"finished": True, "manager_step": 14, "param_hash": "a", "eval_loss_end": 2.0},
        {"finished": True, "manager_step": 14, "param_hash": "a", "eval_loss_end": 2.0},
    ]
    final = final_replica(results)
    assert final["eval_loss_end"] == 2.0 and final["agree"]
    assert not final_replica([*results, {**results[2], "param_hash": "b"}])["agree"]


def test_peers_headline_is_theirs_over_ours_and_ours_minus_theirs() -> None:
    runs = {
        "loopback": {
            "torchft": {"sent_per_learner": 5e6, "eval_loss": 1.867, "wall_s": 40.0},
            "default": {"sent_per_learner": 1e6, "eval_loss": 1.80, "wall_s": 38.0},
            "sync": {"sent_per_learner": 5.5e6, "eval_loss": 1.868, "wall_s": 45.0},
        },
        "50mbit": {
            "torchft": {"sent_per_learner": 5e6, "eval_loss": 1.87, "wall_s": 60.0},
            "default": {"sent_per_learner": 1e6, "eval_loss": 1.81, "wall_s": 40.0},
        },
    }
    h = headline(runs, {"torchft": {"goodput": 0.7}, "default": {"goodput": 0.9}})
    assert h["vs_torchft_bytes"] == pytest.approx(5.0)
    assert h["vs_torchft_wall"] == pytest.approx(1.5)
    assert h["vs_torchft_loss"] == pytest.approx(1.80 - 1.867)
    assert h["sync_minus_torchft_loss"] == pytest.approx(0.001)
    assert (h["goodput_torchft"], h["goodput"]) == (0.7, 0.9)
    assert h["missing"] == {}
    assert headline({"loopback": runs["loopback"]}, {})["vs_torchft_wall"] is None


def test_peers_wall_ratio_is_missing_with_the_reason_where_torchft_ran_unshaped() -> None:
    with Proxies(2, rate_bps=50e6, rtt_s=0.05) as links:
        why = links.dp_unshaped()
    runs: dict[str, dict[str, dict]] = {
        "50mbit": {
            "torchft": {"wall_s": 40.0, "unshaped_why": why},
            "default": {"wall_s": 60.0, "unshaped_why": None},
        }
    }
    h = headline(runs, {})
    assert h["vs_torchft_wall"] is None
    assert h["missing"]["vs_torchft_wall"].endswith(f"links: {why}")


def test_reach_time_interpolates_the_crossing_and_says_never_when_it_is_not_reached() -> None:
    series = [
        {"t": 0.0, "eval_loss": 3.0},
        {"t": 10.0, "eval_loss": 2.0},
        {"t": 20.0, "eval_loss": 1.0},
    ]
    assert reach_time(series, 1.5) == pytest.approx(15.0)
    assert reach_time(series, 3.5) == 0.0
    assert reach_time(series, 0.5) is None


def test_pushed_fraction_leaves_out_each_fragments_steps_after_its_last_push() -> None:
    assert pushed_fraction(100, 100, 1) == 1.0
    assert pushed_fraction(99, 100, 1) == 0.0
    # P = 4, H = 100, 400 steps: the fragments last pushed at 400, 325, 350 and 375
    assert pushed_fraction(400, 100, 4) == pytest.approx((400 + 325 + 350 + 375) / 1600)


def test_fault_schedule_is_seeded_and_puts_each_fault_on_its_own_slot() -> None:
    a, b = schedule(7, 4, 100.0, 6.0), schedule(7, 4, 100.0, 6.0)
    assert a == b
    assert [f.kind for f in a] == ["crash", "slow", "slow"]
    assert len({f.slot for f in a}) == 3
    assert a[0].restart_after_s == 6.0


def test_proxy_counts_both_directions_and_limits_the_rate() -> None:
    import socket
    import threading
    import time

    server = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data[:10])

    threading.Thread(target=echo, daemon=True).start()
    with Proxies(1, rate_bps=8 * 200_000) as links:  # 200 kB/s each way
        address = links.synchronizer_address(0, server.getsockname()[1])
        host, port = address.rsplit(":", 1)
        t0 = time.monotonic()
        with socket.create_connection((host, int(port))) as c:
            c.sendall(b"x" * 150_000)
            c.shutdown(socket.SHUT_WR)
            while c.recv(65536):
                pass
        elapsed = time.monotonic() - t0
        counts = links.counters()
        assert counts is not None  # the proxies count every byte
        sent, received = counts[0]
    server.close()
    assert sent == 150_000
    assert 0 < received <= 150_000
    assert elapsed >= 0.3  # 150 kB at 200 kB/s, less the 64 KiB burst


def test_token_bucket_and_socket_counters() -> None:
    import time

    bucket = TokenBucket(8 * 100_000, burst=10_000)  # 100 kB/s
    t0 = time.monotonic()
    for _ in range(5):
        bucket.take(10_000)
    assert time.monotonic() - t0 >= 0.3
    sent, received = socket_bytes()
    assert sent >= 0 and received >= 0


def _pair(delay_s: float, rate_bps: float | None = None) -> tuple[socket.socket, socket.socket]:
    """(client, far end): what the client sends reaches the far end through a Relay."""
    near_server = socket.create_server(("127.0.0.1", 0))
    far_server = socket.create_server(("127.0.0.1", 0))
    with near_server, far_server:
        client = socket.create_connection(near_server.getsockname())
        near, _ = near_server.accept()
        upstream = socket.create_connection(far_server.getsockname())
        far, _ = far_server.accept()
    buckets = (TokenBucket(rate_bps), TokenBucket(rate_bps)) if rate_bps else (None, None)
    Relay(near, upstream, delay_s, buckets)
    for s in (client, far):
        s.settimeout(10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client, far


def test_relay_holds_each_chunk_half_the_round_trip_in_each_direction() -> None:
    client, far = _pair(delay_s=0.05)
    with client, far:
        there, back = [], []
        for _ in range(5):
            t = time.perf_counter()
            client.sendall(b"x")
            assert far.recv(1) == b"x"
            there.append(time.perf_counter() - t)
            t = time.perf_counter()
            far.sendall(b"y")
            assert client.recv(1) == b"y"
            back.append(time.perf_counter() - t)
        client.shutdown(socket.SHUT_WR)
        assert far.recv(1) == b""  # the end of the stream passes through
    for one_way in (there, back):
        assert min(one_way) >= 0.05
        assert statistics.median(one_way) < 0.05 + 0.03


def test_relay_delay_does_not_slow_a_bulk_transfer_by_more_than_the_delay() -> None:
    # 2 MB at 4 MB/s is 0.5 s; a delay paid chunk after chunk (32 chunks x 0.1 s) would be 3.2 s
    size, rate, delay = 2_000_000, 4_000_000, 0.1
    client, far = _pair(delay_s=delay, rate_bps=8 * rate)
    with client, far:
        t = time.perf_counter()
        sender = threading.Thread(target=client.sendall, args=(bytes(size),))
        sender.start()
        got = 0
        while got < size:
            chunk = far.recv(1 << 16)
            assert chunk
            got += len(chunk)
        elapsed = time.perf_counter() - t
        sender.join()
    transfer = (size - (64 << 10)) / rate  # less the token bucket's burst
    assert transfer + delay <= elapsed < transfer + delay + 0.3


def test_link_check_reports_the_round_trip_and_rate_the_proxies_were_given() -> None:
    with Proxies(1, rate_bps=8 * 4_000_000, rtt_s=0.04) as links:
        measured = links.verify()
    assert [m["slot"] for m in measured] == [0]
    for m in measured:
        assert 40 <= m["rtt_ms"] < 40 + 15, m
        for key in ("up_mbit", "down_mbit"):
            assert 0.8 * 32 <= m[key] <= 1.3 * 32, m  # 4 MB/s = 32 Mbit/s
        assert not m["rate_short"]


def test_link_check_refuses_links_whose_round_trip_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    with Proxies(1, rtt_s=0.05) as links:
        measured = [{"slot": 0, "rtt_ms": 90.0, "up_mbit": 1.0, "down_mbit": 1.0}]
        monkeypatch.setattr(links, "measure", lambda: measured)
        with pytest.raises(LinkError, match="rtt_ms 90.0 ms, asked for 50 ms"):
            links.verify()
        measured[0]["rtt_ms"] = 53.0  # within 20% of it
        assert links.verify() == measured
        # a busy machine delays some round trips: the least one says what the link is
        measured[0] |= {"rtt_ms": 61.7, "rtt_min_ms": 51.0}
        assert links.verify() == measured
        measured[0]["rtt_min_ms"] = 62.0  # never within the tolerance: not the link asked for
        with pytest.raises(LinkError, match="rtt_min_ms 62.0 ms, asked for 50 ms"):
            links.verify()


def test_wan_links_parse_from_links_or_rates_with_round_trips() -> None:
    assert parse_links("50:50,1000:10", None, None) == [(50.0, 50.0), (1000.0, 10.0)]
    assert parse_links(None, "50,1000", None) == [(50.0, 0.0), (1000.0, 0.0)]
    assert parse_links(None, "50,1000", "20") == [(50.0, 20.0), (1000.0, 20.0)]
    assert parse_links(None, "50,1000", "50,10") == [(50.0, 50.0), (1000.0, 10.0)]
    assert parse_links(None, None, None) == []
    with pytest.raises(SystemExit):
        parse_links(None, "50,1000", "1,2,3")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces, tc and iptables need root")
def test_namespace_links_delay_every_connection_once_learner_to_learner_included() -> None:
    for name, package in (("ip", "iproute2"), ("tc", "iproute2"), ("iptables", "iptables")):
        tool(name, DEBIAN.format(package))
    with Namespaces(2, rate_bps=50e6, rtt_s=0.04) as links:
        measured = links.verify()
    for m in measured:
        assert 40 <= m["rtt_ms"] < 40 + 10, m
        assert 0.8 * 50 <= m["up_mbit"] <= 1.2 * 50 and 0.8 * 50 <= m["down_mbit"] <= 1.2 * 50, m
    # slot 1 to slot 0 crosses two shaped links but one delaying proxy: one round trip, not two
    assert 40 <= measured[1]["peer_rtt_ms"] < 40 + 10, measured
