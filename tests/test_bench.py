"""The benchmarks in their smallest mode (`--smoke`), as a user runs them, so they do not rot:
each exits 0 and writes its headline figures to the JSON file. The figures themselves mean
nothing at this size; docs/performance.md has the real ones. Nothing here needs root: wan runs
through the rate-limiting proxies, the others use namespaces only where they can be made.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.common import parser, run_mode
from bench.goodput import pushed_fraction, schedule
from bench.net import Proxies, TokenBucket, socket_bytes
from bench.wan import reach_time
from tests.helpers import run_smoke

SMOKES = [
    ("ingest", [], ["ingest_ratio", "apply_ratio"]),
    ("dp", [], ["dp_bytes_per_step", "dp_eval_loss"]),
    (
        "convergence",
        [],
        ["bandwidth_ratio", "loss_gap", "m1_gain", "default_vs_sync", "default_vs_best"],
    ),
    ("wan", ["--net", "proxy"], ["wan_speedup"]),
    ("goodput", [], ["goodput", "goodput_sync", "goodput_lockstep"]),
    ("overlap", [], ["overlap_ratio"]),
    ("durability", [], ["wal_ratio", "fsync_p50_ms", "restart_s", "chaos_loss_vs_no_kills"]),
    (
        "scale",
        [],
        ["rss_ratio", "init_s", "join_s", "outer_step_s", "apply_ratio", "learners_sustained"],
    ),
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
    assert "machine" in result
    if "smoke_run" in result:  # a smoke run says so, whatever its benchmark's quick mode does
        assert result["mode"] == "smoke" and result["smoke_run"] is True, result["mode"]


def test_a_quick_mode_too_short_for_its_figures_calls_itself_a_smoke_run() -> None:
    p = parser("test")
    quick, full = p.parse_args(["--quick"]), p.parse_args([])
    why = "too few steps"
    assert run_mode(quick, why) == {"mode": "quick", "smoke_run": True, "smoke_reason": why}
    assert run_mode(quick) == {"mode": "quick", "smoke_run": False}
    assert run_mode(full, why) == {"mode": "full", "smoke_run": False}
    assert run_mode(p.parse_args(["--smoke"]), why)["smoke_run"] is True


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
