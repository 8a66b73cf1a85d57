"""A round's share of a whole outer step (`synchronizer.shares`, `round_share`): rounds that
split and a last learner pushing alone move the model by the work they hold."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from protos import diloco_pb2 as pb
from synchronizer import journal
from synchronizer.clock import ManualClock
from synchronizer.config import SynchronizerConfig
from synchronizer.model import FragmentModel
from synchronizer.outer import Nesterov
from synchronizer.shares import HORIZON_ROUNDS, RoundShares
from tests.core_helpers import CoreClient, make_core
from tests.helpers import small_spec
from tests.test_core import initialised, killed, make, params, version


@dataclass
class _C:
    learner_id: str
    weight: float
    base_version: int = 0


def test_a_round_steps_by_its_share_of_one_push_from_every_recent_contributor() -> None:
    shares = RoundShares()
    # The first round of four equal learners holds all of them: a whole step.
    assert shares.share(0, [_C(x, 100.0) for x in "abcd"]) == 1.0
    assert shares.share(1, [_C("a", 100.0)]) == 0.25
    assert shares.share(2, [_C("b", 100.0), _C("c", 100.0)]) == 0.5
    # A learner 3x slower whose H was scaled to a third: a third of one learner's work.
    assert shares.share(3, [_C("d", 100.0 / 3)]) == pytest.approx((100 / 3) / (300 + 100 / 3))
    # A push carrying more than its last weight cannot step more than whole.
    assert shares.share(4, [_C(x, 500.0) for x in "abcd"]) == 1.0
    # Nothing weighs anything: a whole step (the round merges to no change anyway).
    assert RoundShares().share(0, [_C("a", 0.0)]) == 1.0


def test_a_contributor_that_stopped_expires_and_the_one_left_steps_whole_again() -> None:
    shares = RoundShares()
    shares.share(0, [_C(x, 1.0) for x in "abcd"])
    # b, c and d left after version 0: a's lone rounds stand for a quarter while they are
    # recent (HORIZON_ROUNDS rounds per recent contributor), then for the whole fleet it is.
    horizon = HORIZON_ROUNDS * 4
    got = [shares.share(v, [_C("a", 1.0)]) for v in range(1, horizon + 2)]
    assert got[:horizon] == [0.25] * horizon
    assert got[horizon] == 1.0 and set(shares.recent) == {"a"}


def test_the_shares_survive_a_checkpoint(tmp_path: Path) -> None:
    cfg = SynchronizerConfig(state_dir=tmp_path, outer="sgd", outer_lr=1.0)
    model = FragmentModel(0, 8, cfg)
    model.initialize(torch.zeros(8))
    for v, who in enumerate("abc"):
        model.step(v, lambda s: torch.full((8,), s), [_C(who, 1.0, v)])
    with model.frozen_state() as (tensors, meta):
        tensors = {k: t.clone() for k, t in tensors.items()}
    restored = FragmentModel(0, 8, cfg)
    restored.restore(tensors, meta)
    assert restored.shares.recent == model.shares.recent
    # the next lone round of each is a third of a step, the merged delta scaled by it
    for m in (model, restored):
        assert m.step(3, lambda s: torch.full((8,), s), [_C("a", 1.0, 3)])[2] == pytest.approx(
            1 / 3
        )
    assert model.params is not None and restored.params is not None
    assert torch.equal(model.params, restored.params)


def test_partial_nesterov_steps_move_about_as_far_per_unit_of_work_as_whole_ones() -> None:
    # By hand: a partial step of share s decays the momentum by mu**s and looks ahead by s*mu.
    g = torch.linspace(-1.0, 1.0, 16)
    opt = Nesterov(16, lr=0.7, momentum=0.9)
    opt.momentum_buffer.copy_(g * 3)
    params = torch.zeros(16)
    opt.step(params, g * 0.25, share=0.25)
    buf = g * 3 * 0.9**0.25 + g * 0.25
    assert torch.allclose(opt.momentum_buffer, buf)
    assert torch.allclose(params, -0.7 * (g * 0.25 + 0.25 * 0.9 * buf))
    # Round after round of the same work, split into k rounds of share 1/k or whole: the
    # parameters move within 5% of each other per unit of work (exactly as far at k = 1).
    moved = {}
    for k in (1, 2, 4, 8):
        opt, params = Nesterov(16, lr=0.7, momentum=0.9), torch.zeros(16)
        for _ in range(200):
            for _ in range(k):
                before = params.clone()
                opt.step(params, g / k, share=1.0 / k)
        moved[k] = (params - before) * k  # the last step's move, per whole step of work
    for k in (2, 4, 8):
        assert torch.allclose(moved[k], moved[1], rtol=0.05)
    with pytest.raises(ValueError, match="share must be in"):
        Nesterov(16).begin(share=0.0)


@pytest.mark.parametrize("round_share", ["work", "full"])
def test_a_last_learner_pushing_alone_after_the_others_left_steps_by_its_share(
    tmp_path: Path, round_share: str
) -> None:
    # Four equal learners, quorum 1, no grace: every push is a round of its own. Three leave;
    # the last one's pushes then stand for a quarter of a whole step each (its recent fellows'
    # work still counts), where round_share full steps each of them in full.
    spec = small_spec()
    core = make_core(
        tmp_path,
        ManualClock(),
        quorum=1,
        grace="none",
        anchor="base",
        update_history=0,  # exact FP32 parameters: no INT8 update chain
        outer="sgd",
        outer_lr=1.0,
        round_share=round_share,
    )
    try:
        learners = [CoreClient(core, spec, name) for name in "abcd"]
        for learner in learners:
            learner.join()
        n = spec.fragments[0].numel
        gen = torch.Generator().manual_seed(5)
        learners[0].init([torch.randn(f.numel, generator=gen) for f in spec.fragments])
        frag = core.model.fragment(0)
        for learner in learners:
            learner.push(0, torch.randn(n, generator=gen) * 1e-2, base=frag.version)
        for learner in learners[:3]:
            learner.leave()
        assert frag.model.params is not None
        before = frag.model.params.clone()
        delta = torch.randn(n, generator=gen) * 1e-2
        learners[3].push(0, delta, base=frag.version)
        moved = before - frag.model.params
        share = 0.25 if round_share == "work" else 1.0
        assert torch.allclose(moved, delta * share, rtol=0, atol=1e-6)  # params ~1: FP32 ulps
    finally:
        core.close()
    assert journal.replay_settings(core.cfg)["round_share"] == round_share


def test_the_share_is_the_same_whatever_order_the_contributions_come_in() -> None:
    # A replay meets a round's contributions in its log's order: sums exactly rounded.
    weights = {"a": 0.1, "b": 0.2, "c": 0.3, "d": 1e-17}
    one, other = RoundShares(), RoundShares()
    one.share(0, [_C(k, w) for k, w in weights.items()])
    other.share(0, [_C(k, w) for k, w in reversed(weights.items())])
    round_ = [_C("a", 0.1), _C("c", 0.3), _C("d", 1e-17)]
    assert one.share(1, round_) == other.share(1, list(reversed(round_)))


def test_a_log_replay_steps_each_round_by_the_share_it_stepped_by(tmp_path: Path) -> None:
    settings = {"quorum": 1, "grace": "none", "wal": True, "lease_s": 600.0}
    core, spec = make(tmp_path, ManualClock(), **settings)
    learners = initialised(core, spec, ["a", "b", "c"])
    n = spec.fragments[0].numel
    gen = torch.Generator().manual_seed(8)
    # lone rounds of learners whose work differs: shares of a third, a half, ... of a step
    for i, who in enumerate([0, 1, 2, 0, 0, 1, 0]):
        delta = torch.randn(n, generator=gen) * 1e-2
        reply = learners[who].push(0, delta, base=version(core), tokens=100 + 37 * i)
        assert reply.outcome == pb.PUSH_ACCEPTED
    assert version(core) == 7 and len(core.model.fragment(0).model.shares.recent) == 3
    served, recent = params(core).clone(), dict(core.model.fragment(0).model.shares.recent)
    killed(core)  # the log holds every round; the only checkpoint is the initial model's

    again, _ = make(tmp_path, ManualClock(), **settings)
    try:
        assert version(again) == 7 and torch.equal(params(again), served)
        assert again.model.fragment(0).model.shares.recent == recent
    finally:
        again.close()


@pytest.mark.parametrize("history", [False, True], ids=["outer-step", "update-chain"])
def test_a_fragment_warms_its_outer_lr_up_over_its_first_rounds(
    tmp_path: Path, history: bool
) -> None:
    # SGD at lr 1 moves by lr x warm x the merged delta: a quarter, a half, ... then whole,
    # whether the step runs alone or through the update chain.
    chain = {} if history else {"update_history": 0, "anchor": "base"}
    cfg = SynchronizerConfig(state_dir=tmp_path, outer="sgd", outer_lr=1.0, outer_warmup=4, **chain)
    model = FragmentModel(0, 8, cfg)
    model.initialize(torch.zeros(8))
    moved = []
    for v in range(5):
        assert model.params is not None
        before = model.params.clone()
        model.step(v, lambda s: torch.full((8,), -1.0), [_C("a", 1.0, v)])
        moved.append(float((model.params - before).mean()))
    assert moved == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0], rel=0.02)
