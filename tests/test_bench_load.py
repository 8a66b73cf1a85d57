"""`bench.load` in its smallest mode, as a user runs it: learners past `--max-learners` are
refused with a code at Join (never left to time out), and the joined ones' heartbeats, health
checks and pushes are answered and counted."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.load import quantile, verdict
from tests.helpers import run_smoke


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_load_smoke_refuses_past_max_learners_with_a_code_and_answers_the_rest(
    tmp_path: Path,
) -> None:
    result = run_smoke("load", tmp_path / "load.json")
    cells = {(r["arm"], r["learners"]): r for r in result["rows"]}
    capped = cells[("defaults", 8)]  # the smoke defaults arm allows 6 learners
    assert capped["joined"] == 6 and capped["join_refused_codes"] == {"RESOURCE_EXHAUSTED": 2}
    raised = cells[("raised", 8)]
    assert raised["joined"] == 8 and raised["join_refused"] == 0
    for row in result["rows"]:
        assert row["timeouts"] == 0 and row["lost"] == 0, row
        assert row["heartbeats"] > 0 and math.isfinite(row["hb_p99_ms"]), row
        assert math.isfinite(row["health_p99_ms"]) and not row["health_failed"], row
        assert row["sync_cpu_cores"] > 0 and row["sync_threads"] > 0, row
    assert result["verdicts"]["raised"]["served_within_bounds"] == 8
    assert result["smoke_run"] is True


def row(learners: int, hb_ms: float, done: int = 10, timeouts: int = 0) -> dict:
    return {
        "learners": learners,
        "joined": learners,
        "hb_p99_ms": hb_ms,
        "health_p99_ms": 5.0,
        "timeouts": timeouts,
        "due": 10,
        "done": done,
        "lost": 0,
    }


def test_verdict_names_the_largest_cell_within_bounds_and_the_first_failure() -> None:
    v = verdict([row(256, 1500.0), row(64, 20.0), row(1024, 30.0, done=5)])
    assert v["served_within_bounds"] == 64
    assert v["first_failure"] == "256 learners: heartbeat p99 1500 ms"
    assert verdict([row(64, 20.0)]) == {"served_within_bounds": 64, "first_failure": "none"}
    assert "timed out" in verdict([row(64, 20.0, timeouts=3)])["first_failure"]
    assert "pushes behind" in verdict([row(64, 20.0, done=9)])["first_failure"]


def test_quantile_is_nearest_rank_and_nan_when_empty() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert quantile(xs, 0.5) == 50.0 and quantile(xs, 0.99) == 99.0 and quantile(xs, 1.0) == 100.0
    assert math.isnan(quantile([], 0.5))
