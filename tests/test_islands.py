"""Islands in the main job: `diloco-learner local --island-size N` runs each learner as a
torchrun island of N processes (gloo here), rank 0 alone talking to the Synchronizer. Real
processes on loopback, the tiny model."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from demo.procs import read_json
from demo.tiny import TINY


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_islands_train_as_one_learner_each_and_a_killed_island_comes_back_whole(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "demo",
        "local",
        "--learners",
        "2",
        "--island-size",
        "2",
        "--steps",
        "80",
        "--slow-learner",
        "-1",
        "--kill-learner",
        "1",
        "--kill-at",
        "0.3",
        "--restart-after-s",
        "2",
        "--lease-s",
        "2",
        "--sync-every",
        "10",
        "--fragments",
        "2",
        "--out",
        str(out),
        f"--train-args={shlex.join(TINY)}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["island_size"] == 2
    # Every island ended with both ranks finished and holding one model (the replicas never
    # drifted, the killed one's included: killed and restarted as a whole).
    islands = {name: learner["island"] for name, learner in summary["per_learner"].items()}
    assert islands == {
        name: {"ranks": 2, "finished": 2, "identical": True} for name in ("l0", "l1")
    }, islands
    assert summary["faults"]["killed"], summary["faults"]
    assert len(summary["per_learner"]["l1"]["series"]) == 2  # its two incarnations
    # Rank 0 alone talks to the Synchronizer; rank 1 reads its own data shard and syncs
    # through rank 0.
    for i in range(2):
        runs = sorted(out.glob(f"learner-{i}*.json"))
        last = runs[-1]
        rank0, rank1 = read_json(last), read_json(Path(f"{last}.rank1"))
        assert (rank0["rank"], rank1["rank"], rank0["world"]) == (0, 1, 2)
        assert rank0["learner"]["pushes"].get("accepted", 0) > 0
        assert rank1["learner"]["sync_state"] == "island member"
        assert rank1["learner"]["bytes_sent"] == 0
    restarted = read_json(out / "learner-1.run1.json")
    first = read_json(out / "learner-1.json")
    assert restarted["learner"]["learner_id"] == first["learner"]["learner_id"]  # as itself
    assert summary["pushes"].get("accepted", 0) > 0
    assert summary["eval_loss_end"] < summary["eval_loss_start"]
