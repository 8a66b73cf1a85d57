"""No silent regressions of the defaults: with no flags but H, two learners of the bundled example
(200 steps, H 25) end at least as low as synchronous FP32 DiLoCo on the same seed and data
(`bench.defaults --smoke --steps 200`: real Synchronizer and learner processes on loopback).

MARGIN comes from measured run-to-run spread of this exact run (2026-12-02, on a loaded 2-core
machine): sync 2.4353 (synchronous: the same every run), the defaults 2.3180, 2.3271 and 2.3175
(0.952-0.956 of sync), the old default (Delayed Nesterov) 2.6477, 2.6354 and 2.5963 (1.066-1.087
of sync). Asynchronous rounds close on whichever pushes have arrived, so runs of the same seed
differ by up to 0.4% here; the margin is above that and far below what the old default lost, so
this fails on it. At 150 steps it would not: there the old default ended 1.002 and 1.003 of sync
(sync 2.4942, the defaults 0.968-0.978 of it).
The smoke mode's 300 steps (2026-12-01): sync 2.2887, the defaults 0.955 of it, the old 1.05.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.defaults import by_seed, pace_drift, run_detail, spread
from tests.helpers import REPO, run_smoke

MARGIN = 0.01


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_no_flags_end_at_least_as_low_as_synchronous_fp32_diloco(tmp_path: Path) -> None:
    result = run_smoke("defaults", tmp_path / "defaults.json", "--steps", "200")
    (cell,) = result["cells"]
    assert set(cell["loss"]) == {"sync", "default"}
    assert result["default_worst_vs_sync"] <= 1 + MARGIN, cell["loss"]
    # each run says what its rounds did: every outer step applied at least one accepted push,
    # and its two learners of equal speed reported the same steps, some time apart
    for arm in ("sync", "default"):
        (detail,) = cell["run_details"][arm]
        assert 0 < detail["outer_steps"] <= detail["pushes_accepted"], detail
        assert 0 <= detail["drift_mean_s"] <= detail["drift_max_s"], detail


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_seeds_run_each_arm_once_per_seed_and_a_seed_changes_the_run(tmp_path: Path) -> None:
    """`--seeds` reaches the learners: synchronous DiLoCo ends alike in every run of one seed,
    so two seeds that end on different losses were two different initialisations and data
    orders, and every run is labelled with its seed."""
    result = run_smoke(
        "defaults", tmp_path / "seeds.json", "--steps", "50", "--arms", "sync", "--seeds", "0,1"
    )
    (cell,) = result["cells"]
    assert cell["seeds"] == {"sync": [0, 1]}
    first, second = cell["runs"]["sync"]
    assert first != second, cell["runs"]
    assert cell["spread"]["sync"] == pytest.approx(abs(first - second) / cell["loss"]["sync"])
    # one run per seed: each seed's mean is its run, and runs of one seed spread by nothing
    assert cell["by_seed"]["sync"] == {
        "0": {"mean": first, "spread": 0.0},
        "1": {"mean": second, "spread": 0.0},
    }


@pytest.mark.parametrize(
    ("bench", "flag", "said"),
    [
        ("defaults", "--seeds=0,-1", "--seeds: integers >= 0"),
        ("convergence", "--seed=-1", "--seed takes a number >= 0"),
    ],
)
def test_a_negative_seed_is_refused_before_anything_runs(bench: str, flag: str, said: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{bench}", "--smoke", flag],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert said in proc.stderr
    assert "Traceback" not in proc.stderr


def test_runs_are_grouped_by_their_seed_for_the_mean_and_spread_of_each_seed() -> None:
    losses = {"default": [1.0, 2.0, 1.2, 2.2], "sync": [3.0, 3.0]}
    seeds = {"default": [0, 1, 0, 1], "sync": [5, 5]}
    got = by_seed(losses, seeds)
    assert got["default"]["0"] == {"mean": pytest.approx(1.1), "spread": pytest.approx(0.2 / 1.1)}
    assert got["default"]["1"] == {"mean": pytest.approx(2.1), "spread": pytest.approx(0.2 / 2.1)}
    assert got["sync"] == {"5": {"mean": 3.0, "spread": 0.0}}
    # over all runs the spread also holds what the seed moved
    assert spread(losses["default"]) == pytest.approx(1.2 / 1.6)


def test_pace_drift_is_how_far_apart_the_learners_of_equal_speed_reached_each_step() -> None:
    def series(*ts: float) -> dict:
        return {"series": [{"step": 10 * (i + 1), "t": t} for i, t in enumerate(ts)]}

    fast_a, fast_b = [series(1.0, 2.0, 3.0)], [series(1.5, 2.0, 5.0)]
    slow = [series(9.0, 19.0)]  # far behind, and not counted
    got = pace_drift([fast_a, fast_b, slow], slow=2)
    assert got == {"max_s": 2.0, "mean_s": pytest.approx(2.5 / 3)}
    # a slot restarted mid-run: its later incarnation's times count, over steps all reported
    restarted = [series(1.2, 9.0), {"series": [{"step": 20, "t": 2.5}, {"step": 30, "t": 3.1}]}]
    got = pace_drift([fast_a, restarted], slow=-1)
    assert got["max_s"] == pytest.approx(0.5)
    assert got["mean_s"] == pytest.approx((0.2 + 0.5 + 0.1) / 3)
    # one learner of its speed, or no step in common: nothing to say
    assert pace_drift([fast_a, slow], slow=1) == {"max_s": None, "mean_s": None}
    assert pace_drift([[series()], fast_b], slow=-1) == {"max_s": None, "mean_s": None}


def test_a_runs_detail_reads_its_rounds_from_the_synchronizers_counters_and_its_learners() -> None:
    run = {
        "outer_steps": 7.0,
        "pushes": {"accepted": 12.0, "dropped_stale": 1.0},
        "results": [
            [{"series": [{"step": 10, "t": 1.0}]}],
            [{"series": [{"step": 10, "t": 1.4}]}],
        ],
    }
    assert run_detail(run, slow=-1) == {
        "outer_steps": 7.0,
        "pushes_accepted": 12.0,
        "drift_max_s": pytest.approx(0.4),
        "drift_mean_s": pytest.approx(0.4),
    }
    # nothing accepted (no such sample), and the slow learner's times are not drift
    run["pushes"] = {}
    assert run_detail(run, slow=1) == {
        "outer_steps": 7.0,
        "pushes_accepted": 0.0,
        "drift_max_s": None,
        "drift_mean_s": None,
    }
