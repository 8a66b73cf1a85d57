"""The learner in a loop that keeps its own `opt.step()` and `zero_grad()`: the optimizer hook
makes each real optimizer step an inner step, with the same pushes as `learner.step()`, and
gradient clipping, a `GradScaler` (a skipped step is no inner step) and gradient accumulation
fit where users put them. Against the in-memory fake Synchronizer (tests/fakes.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from learner import Learner
from learner.config import LearnerConfig
from learner.fragments import FragmentPlan
from tests.fakes import FAST, FakeClient

H = 4  # sync_every
FRAGMENTS = 2
TOKENS = 16  # per micro-batch


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def fake_for(model: nn.Module) -> FakeClient:
    plan = FragmentPlan(model, FRAGMENTS, LearnerConfig().fragment_strategy)
    fake = FakeClient([plan.numel(p) for p in range(len(plan))])
    fake.needs_init = True  # the learner's parameters become the global model
    return fake


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def start(model: nn.Module, opt: torch.optim.Optimizer, fake: FakeClient, **kw: Any) -> Learner:
    settings: dict[str, Any] = {**FAST, "fragments": FRAGMENTS, "sync_every": H, **kw}
    return Learner(model, opt, transport=fake, **settings)


def pushes_of(fake: FakeClient) -> list[tuple[int, int]]:
    """(fragment, tokens) of every push, in order."""
    return [(p, tokens) for p, _seq, _base, tokens in fake.calls_of("push")]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def test_the_loops_own_optimizer_step_is_an_inner_step_pushing_as_learner_step_does() -> None:
    data = batches(3 * H)
    runs: dict[str, list[tuple[int, int]]] = {}
    for form in ("hook", "step"):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        fake = fake_for(model)
        # Strict overlap with tau 0: each push's result is merged before the step returns, so
        # both runs push at the same steps whatever the background threads' timing
        with start(
            model, opt, fake, tokens=TOKENS, strict_overlap=True, overlap_steps=0
        ) as learner:
            for x, y in data:
                loss = loss_of(model, x, y)
                loss.backward()
                if form == "hook":
                    learner.record(loss=loss.item())
                    opt.step()
                else:
                    learner.step(loss=loss.item())  # tokens: the constructor's
                opt.zero_grad()
            assert learner.stats.step == len(data)
            assert learner.stats.tokens == TOKENS * len(data)
            assert learner.stats.loss == pytest.approx(loss.item())
        runs[form] = pushes_of(fake)
    assert runs["hook"] == runs["step"]
    assert len(runs["hook"]) >= FRAGMENTS * (len(data) // H - 1)  # every fragment, each period
    assert {tokens for _, tokens in runs["hook"]} <= {TOKENS * H, TOKENS * H // FRAGMENTS}


def test_stepping_the_optimizer_and_calling_step_too_is_refused_naming_both() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with start(model, opt, fake_for(model)) as learner:
        ((x, y),) = batches(1)
        loss_of(model, x, y).backward()
        opt.step()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match=r"optimizer.step\(\) or learner.step\(\)"):
            learner.step()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        assert learner.stats.step == 1


def test_clipping_and_a_grad_scaler_fit_and_a_skipped_step_is_no_inner_step() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    fake = fake_for(model)
    with start(model, opt, fake, tokens=TOKENS) as learner:
        for i, (x, y) in enumerate(batches(2 * H + 1)):
            loss = loss_of(model, x, y) * (float("inf") if i == 0 else 1.0)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)  # skips opt.step() on inf/NaN gradients: no inner step then
            scaler.update()
            opt.zero_grad()
            if i == 0:
                assert learner.stats.step == 0
                assert all(
                    torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)
                )
        assert learner.stats.step == 2 * H
        assert learner.stats.tokens == TOKENS * 2 * H
    assert pushes_of(fake)  # the learner synced on the steps that happened


def test_gradient_accumulation_counts_one_inner_step_per_optimizer_step() -> None:
    micro = 3
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    fake = fake_for(model)
    seen = [0]  # tokens since the last optimizer step, counted by the loop

    def tokens_since_last_step() -> int:
        n, seen[0] = seen[0], 0
        return n

    steps = 2 * H
    tokens: Callable[[], int] = tokens_since_last_step
    with start(model, opt, fake, tokens=tokens) as learner:
        for i, (x, y) in enumerate(batches(steps * micro)):
            (loss_of(model, x, y) / micro).backward()
            seen[0] += TOKENS
            if (i + 1) % micro == 0:
                opt.step()
                opt.zero_grad()
        assert learner.stats.step == steps
        assert learner.stats.tokens == steps * micro * TOKENS
    pushed = pushes_of(fake)
    assert pushed and all(t % (micro * TOKENS) == 0 for _, t in pushed)


def test_the_hook_is_removed_when_the_learner_finishes() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    fake = fake_for(model)
    with start(model, opt, fake, tokens=TOKENS) as learner:
        ((x, y),) = batches(1)
        loss_of(model, x, y).backward()
        opt.step()
    assert learner.stats.step == 1
    loss_of(model, x, y).backward()
    opt.step()  # training on after the run: the learner is no longer part of it
    assert learner.stats.step == 1
