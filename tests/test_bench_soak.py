"""`bench.soak`: its verdict (a fitted slope over the second half, per incarnation for a
process's own series, warm-up left out) on made-up series, and its smallest mode run as a user
runs it: the Synchronizer restarted on its state, learners killed and back as themselves, every
series sampled."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from bench.soak import LIMITS, MIN_SAMPLES, Sample, fit, judge, main
from tests.helpers import run_smoke

HOUR = 3600.0


def series(
    restarts_at: list[float],
    level: list[float],
    per_h: float = 0.0,
    end_s: float = HOUR,
    every_s: float = 10.0,
    noise: float = 0.0,
    seed: int = 0,
) -> list[Sample]:
    """Samples every `every_s` of a process restarted at `restarts_at`: incarnation i sits at
    level[i] and grows `per_h` units an hour from its start, plus uniform noise."""
    rng = random.Random(seed)
    starts = [0.0, *restarts_at]
    out = []
    t = 0.0
    while t < end_s:
        i = sum(1 for s in starts if s <= t) - 1
        age = t - starts[i]
        out.append(Sample(t, level[i] + per_h * age / HOUR + rng.uniform(-noise, noise), i, age))
        t += every_s
    return out


RESTARTS = [600.0, 1200.0, 1800.0, 2400.0, 3000.0]


def test_memory_that_grows_in_every_incarnation_is_a_leak() -> None:
    leaking = series(RESTARTS, [250.0] * 6, per_h=60.0, noise=1.0)
    row = judge("sync_rss", leaking, HOUR / 2, 90.0)
    assert row["verdict"] == "grows"
    assert row["slope_per_h"] == pytest.approx(60.0, rel=0.1)


def test_a_flat_series_with_a_restarts_step_is_bounded_per_incarnation() -> None:
    # every restart comes back 40 MB higher (a fresh process's level), flat in between
    stepped = series(RESTARTS, [200.0, 240.0, 280.0, 320.0, 360.0, 400.0], noise=1.0)
    row = judge("sync_rss", stepped, HOUR / 2, 90.0)
    assert row["verdict"] == "bounded" and abs(row["slope_per_h"]) < 5
    # one line through the same samples would have called the steps growth
    assert fit(stepped, HOUR / 2, 90.0, per_incarnation=False).slope_per_h > 200


def test_samples_in_the_warm_up_after_a_restart_are_not_growth() -> None:
    # each incarnation climbs 30 MB in its first 60 s (start-up), then stays flat
    samples = [
        Sample(s.t, s.value - max(0.0, 30.0 * (1 - s.age_s / 60.0)), s.incarnation, s.age_s)
        for s in series(RESTARTS, [250.0] * 6)
    ]
    assert judge("sync_rss", samples, HOUR / 2, 90.0)["verdict"] == "bounded"
    assert judge("sync_rss", samples, HOUR / 2, 0.0)["verdict"] == "grows"


def test_what_every_restart_leaves_on_disk_is_growth_across_incarnations() -> None:
    # one more log segment kept for good by every restart: flat within each incarnation
    segments = series(RESTARTS, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert LIMITS["wal_segments"].per_incarnation is False
    row = judge("wal_segments", segments, HOUR / 2, 90.0)
    assert row["verdict"] == "grows" and row["rise"] > 1


def test_a_late_blip_of_one_descriptor_is_churn_not_growth() -> None:
    fds = series(RESTARTS, [12.0] * 6)
    fds[-2] = Sample(fds[-2].t, 14.0, fds[-2].incarnation, fds[-2].age_s)  # a reconnect
    assert judge("sync_fds", fds, HOUR / 2, 90.0)["verdict"] == "bounded"
    climbing = series(RESTARTS, [12.0] * 6, per_h=12.0)  # one more every 5 minutes
    assert judge("sync_fds", climbing, HOUR / 2, 90.0)["verdict"] == "grows"


def test_the_late_slope_tells_a_fill_that_levels_off_from_a_leak() -> None:
    leak = judge("sync_rss", series(RESTARTS, [250.0] * 6, per_h=60.0), HOUR / 2, 90.0)
    assert leak["late_slope_per_h"] == pytest.approx(leak["slope_per_h"], rel=0.05)
    # 20 MB filled towards a level within each incarnation, half of it in the first 2 minutes
    filling = [
        Sample(s.t, s.value + 20.0 * (1 - 0.5 ** (s.age_s / 120.0)), s.incarnation, s.age_s)
        for s in series(RESTARTS, [250.0] * 6)
    ]
    fill = judge("sync_rss", filling, HOUR / 2, 90.0)
    assert fill["late_slope_per_h"] < fill["slope_per_h"] / 2


def test_a_series_with_too_few_samples_is_not_measured() -> None:
    few = series([], [250.0], end_s=(MIN_SAMPLES - 1) * 10.0)
    row = judge("l0_rss", few, 0.0, 0.0)
    assert row["verdict"] == "not measured" and row["detectable_per_h"] is not None
    assert judge("l0_rss", [], 0.0, 0.0)["verdict"] == "not measured"


def test_the_detectable_growth_is_the_floor_over_the_fitted_span() -> None:
    row = judge("sync_rss", series([], [250.0], end_s=HOUR), HOUR / 2, 0.0)
    # 180 samples over 1790 s: a 4 MB floor is about 8 MB/h, under the 30 MB/h limit
    assert row["detectable_per_h"] == pytest.approx(30.0)
    short = judge("sync_rss", series([], [250.0], end_s=300.0, every_s=2.0), 150.0, 0.0)
    assert short["detectable_per_h"] == pytest.approx(4.0 / 148.0 * HOUR)


def test_too_few_minutes_to_fit_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--smoke", "--minutes", "0.05"])
    assert exit_.value.code == 2
    assert "--minutes 0.05 leaves too little to fit" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_soak_smoke_restarts_the_synchronizer_and_learners_come_back_as_themselves(
    tmp_path: Path,
) -> None:
    result = run_smoke("soak", tmp_path / "soak.json", timeout_s=200)
    assert result["mode"] == "smoke" and result["smoke_run"] and not result["judged"]
    assert result["run_failures"] == [] and result["passed"]
    assert len(result["restarts"]) >= 1 and all(r["stop_s"] < 30 for r in result["restarts"])
    # a learner killed and started again is the learner it had been (id and session through the
    # environment): its next incarnation reports the same id (on a loaded machine it may not be
    # training again before the end), and the Synchronizer never holds a fourth learner record,
    # which a fresh join would add for as long as the killed learner's record is kept (20 s)
    assert result["kills"]
    assert all(k["came_back_as"] in ("", k["learner_id"]) for k in result["kills"])
    assert max(v for _, v, _ in result["samples"]["learner_records"]) == 3
    rows = {r["series"]: r for r in result["rows"]}
    assert set(rows) == set(LIMITS)
    for name in ("sync_rss", "sync_fds", "sync_threads", "wal_segments", "checkpoints"):
        assert rows[name]["samples"] >= MIN_SAMPLES, rows[name]
        assert math.isfinite(rows[name]["slope_per_h"]), rows[name]
    assert rows["sync_rss"]["last"] > 50 and rows["sync_threads"]["last"] >= 2
    assert rows["checkpoints"]["last"] >= 1  # the restart's SIGTERM checkpointed at least
    samples = result["samples"]
    assert {s[2] for s in samples["sync_rss"]} == set(range(len(result["restarts"]) + 1))
    assert result["pushes_accepted"] > 0
