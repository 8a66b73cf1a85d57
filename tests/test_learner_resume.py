"""A learner restarted from `Learner.state_dict()` continues as itself against a real Synchronizer
(in-process, real gRPC on port 0): the same learner id, its own parameters kept, pushes taken
as new (never duplicates, never from a stranger), nothing it pushed before sent again; against a
Synchronizer that no longer holds its run it starts from the global model; a state for another
model is refused before anything is joined."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from learner import Learner
from synchronizer.server import RunningServer
from tests.fakes import FAST

H = 4
FRAGMENTS = 2


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def train(learner: Learner, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(learner.stats.step)
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()  # the learner's hook makes it an inner step
        opt.zero_grad()


def start(srv: RunningServer, model: nn.Module, opt: torch.optim.Optimizer, **kw: Any) -> Learner:
    settings: dict[str, Any] = {
        **FAST,
        "synchronizer": srv.address,
        "fragments": FRAGMENTS,
        "sync_every": H,
        "metrics_port": -1,
        **kw,
    }
    return Learner(model, opt, tokens=16, **settings)


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_a_learner_restarted_from_its_state_continues_as_itself(make_server: Any) -> None:
    srv = make_server(quorum=1, grace="none")
    model = mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = start(srv, model, opt, start_step=3)  # itself a restart without its state
    train(first, model, opt, 2 * H + 1)
    state = first.state_dict()  # flushes: nothing in flight is saved
    saved_params, saved_opt = params(model), opt.state_dict()
    accepted_before = first.stats.pushes.get("accepted", 0)
    assert accepted_before > 0 and state["next_seq"] > 1
    first.close()  # no Leave: as a process that was killed

    model2 = mlp(1)  # a fresh process: other initial weights until the checkpoint is loaded
    with torch.no_grad():
        for p, v in zip(model2.parameters(), saved_params, strict=True):
            p.copy_(v)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    opt2.load_state_dict(saved_opt)
    second = start(srv, model2, opt2, state=state)
    assert second.learner_id == state["learner_id"]
    assert second.schedule_step() == 3 + 2 * H + 1  # the run's step: its fragments stay in phase
    assert second.stats.step == 2 * H + 1 and second.stats.fragment_versions == tuple(
        state["versions"]
    )
    assert all(torch.equal(a, b) for a, b in zip(params(model2), saved_params, strict=True))
    train(second, model2, opt2, 2 * H)
    assert second.flush()
    pushes = second.stats.pushes
    assert pushes.get("accepted", 0) > 0, pushes
    assert not pushes.get("duplicate") and not pushes.get("rejected"), pushes
    second.finish()
    status = srv.synchronizer.status()
    assert [r.learner_id for r in status.learners] == [state["learner_id"]]
    assert all(r.state == "left" for r in status.learners)


def test_against_a_synchronizer_that_lost_the_run_it_starts_from_the_global_model(
    make_server: Any, tmp_path: Path
) -> None:
    srv = make_server(quorum=1, grace="none")
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    learner = start(srv, model, opt)
    train(learner, model, opt, H + 1)
    state = learner.state_dict()
    learner.close()

    other = make_server(quorum=1, grace="none", state_dir=tmp_path / "other")
    owner = mlp(2)  # the other run's model, uploaded by its own first learner
    global_model = params(owner)
    start(other, owner, torch.optim.SGD(owner.parameters(), lr=0.05)).close()
    model2 = mlp(3)
    resumed = start(other, model2, torch.optim.SGD(model2.parameters(), lr=0.05), state=state)
    assert resumed.learner_id == state["learner_id"]  # still itself, in the other run
    assert all(torch.equal(a, b) for a, b in zip(params(model2), global_model, strict=True))
    assert resumed.stats.fragment_versions == (0,) * FRAGMENTS
    resumed.finish()


def test_a_state_for_another_model_is_refused_before_joining(make_server: Any) -> None:
    srv = make_server(quorum=1, grace="none")
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    learner = start(srv, model, opt)
    state = learner.state_dict()
    learner.finish()
    wider = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    known = len(srv.synchronizer.status().learners)
    with pytest.raises(ValueError, match="same model, fragments"):
        start(srv, wider, torch.optim.SGD(wider.parameters(), lr=0.05), state=state)
    with pytest.raises(ValueError, match="not a learner state"):
        start(srv, model, opt, state={"format": 99})
    assert len(srv.synchronizer.status().learners) == known
