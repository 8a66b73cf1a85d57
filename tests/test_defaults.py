"""No silent regressions of the defaults: with no flags but H, two learners of the bundled example
(300 steps, H 25) end at least as low as synchronous FP32 DiLoCo on the same seed and data
(`bench.defaults --smoke`: real Synchronizer and learner processes on loopback).

MARGIN comes from measured run-to-run spread of this exact run (2026-12-01, two runs each): sync
2.2887 and 2.2889, the defaults 2.1853 and 2.1842 (0.955 of sync), the old default (Delayed
Nesterov) 2.4115 and 2.3961 (1.05 of sync). Asynchronous rounds close on whichever pushes have
arrived, so runs of the same seed differ by up to 0.7% here; the margin is above that and far
below what the old default lost, so this fails on it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_smoke

MARGIN = 0.01


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_no_flags_end_at_least_as_low_as_synchronous_fp32_diloco(tmp_path: Path) -> None:
    result = run_smoke("defaults", tmp_path / "defaults.json")
    (cell,) = result["cells"]
    assert set(cell["loss"]) == {"sync", "default"}
    assert result["default_worst_vs_sync"] <= 1 + MARGIN, cell["loss"]
