"""Outer optimizers: agreement with torch and with Algorithm 3 by hand, resume, validation."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from synchronizer.outer import OUTER_KINDS, DelayedNesterov, Nesterov, make_outer

NUMEL = 33


def _grads(count: int, numel: int = NUMEL, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) for _ in range(count)]


def _run(opt, params: torch.Tensor, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    trajectory = []
    for g in grads:
        opt.step(params, g.clone())  # step may scribble on its grad argument
        trajectory.append(params.clone())
    return trajectory


def test_nesterov_matches_torch_sgd_nesterov_bit_for_bit() -> None:
    init = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    grads = _grads(6)
    ref = torch.nn.Parameter(init.clone())
    torch_opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    params = init.clone()
    outer = make_outer("nesterov", NUMEL, lr=0.7, momentum=0.9)
    for g in grads:
        ref.grad = g.clone()
        torch_opt.step()
        outer.step(params, g.clone())
        assert torch.equal(params, ref.detach())


def test_sgd_with_lr_1_on_the_mean_delta_is_plain_averaging() -> None:
    base = torch.randn(NUMEL)
    locals_ = [base + torch.randn(NUMEL) for _ in range(3)]
    mean_delta = torch.stack([base - local for local in locals_]).mean(0)
    params = base.clone()
    make_outer("sgd", NUMEL, lr=1.0).step(params, mean_delta)
    torch.testing.assert_close(params, torch.stack(locals_).mean(0))


def _algorithm_3_by_hand(
    theta: list[float], grads: list[list[float]], lr: float, beta: float, n: int, c: float
) -> list[list[float]]:
    """Algorithm 3 (Delayed Nesterov) of arXiv 2401.09135, one coordinate at a time in floats."""
    m = [0.0] * len(theta)  # momentum m_0 = 0
    acc = [0.0] * len(theta)  # buffer Delta = 0
    trajectory = []
    for t, g in enumerate(grads):
        acc = [a + gi for a, gi in zip(acc, g, strict=True)]  # Delta <- Delta + g
        if (t + 1) % n == 0:
            m = [beta * mi + a / n for mi, a in zip(m, acc, strict=True)]  # m <- beta m + Delta/N
            theta = [
                th - lr * ((1 - c * n + c) * beta * mi + gi / n)
                for th, mi, gi in zip(theta, m, g, strict=True)
            ]
            acc = [0.0] * len(theta)  # Delta <- 0
        else:  # m unchanged
            theta = [
                th - lr * (c * beta * mi + gi / n) for th, mi, gi in zip(theta, m, g, strict=True)
            ]
        trajectory.append(theta)
    return trajectory


@pytest.mark.parametrize("activation", [0.0, 0.2])
def test_delayed_nesterov_matches_algorithm_3_by_hand(activation: float) -> None:
    numel, lr, beta, delay = 5, 0.7, 0.9, 3
    init = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    grads = _grads(7, numel)
    opt = DelayedNesterov(numel, lr, beta, delay, momentum_activation=activation)
    got = _run(opt, init.clone(), grads)
    expected = _algorithm_3_by_hand(
        init.tolist(), [g.tolist() for g in grads], lr, beta, delay, activation
    )
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(g, torch.tensor(e), rtol=0, atol=1e-6, msg=f"step {step + 1}")


def test_delayed_nesterov_moves_one_period_like_one_nesterov_step_on_the_mean() -> None:
    # With c = 0, after N arrivals the parameters moved by lr * (mean g + beta * (beta*0 + mean g)).
    g1, g2, g3 = torch.tensor([3.0]), torch.tensor([0.0]), torch.tensor([-6.0])
    params = torch.tensor([10.0])
    opt = DelayedNesterov(1, lr=0.5, momentum=0.9, delay=3)
    opt.step(params, g1.clone())
    assert params.item() == pytest.approx(10.0 - 0.5 * 3.0 / 3)  # plain step of lr * g / N
    opt.step(params, g2.clone())
    assert params.item() == pytest.approx(9.5)
    opt.step(params, g3.clone())  # mean g = -1, m = -1
    assert params.item() == pytest.approx(10.0 - 0.5 * (-1.0 + 0.9 * -1.0))
    assert opt.momentum_buffer.item() == pytest.approx(-1.0)
    assert opt.grad_buffer.item() == 0.0


@pytest.mark.parametrize("activation", [0.0, 0.3])
def test_delayed_nesterov_with_delay_1_is_nesterov_bit_for_bit(activation: float) -> None:
    init = torch.randn(NUMEL)
    grads = _grads(6)
    delayed = DelayedNesterov(NUMEL, 0.7, 0.9, delay=1, momentum_activation=activation)
    got = _run(delayed, init.clone(), grads)
    expected = _run(Nesterov(NUMEL, 0.7, 0.9), init.clone(), grads)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


@pytest.mark.parametrize("kind", OUTER_KINDS)
def test_state_dict_round_trip_through_safetensors_resumes_exactly(kind: str) -> None:
    init = torch.randn(NUMEL)
    grads = _grads(5)
    straight = _run(make_outer(kind, NUMEL, delay=4), init.clone(), grads)[-1]

    first = make_outer(kind, NUMEL, delay=4)
    params = init.clone()
    _run(first, params, grads[:3])
    saved = st_save(first.state_dict())  # what a checkpoint writes
    resumed = make_outer(kind, NUMEL, delay=4)
    resumed.load_state_dict(st_load(saved))
    _run(resumed, params, grads[3:])
    assert torch.equal(params, straight)


def test_load_state_dict_refuses_another_kind_and_wrong_shapes() -> None:
    nesterov = make_outer("nesterov", NUMEL)
    delayed = make_outer("delayed_nesterov", NUMEL)
    with pytest.raises(ValueError, match="missing keys"):
        delayed.load_state_dict(nesterov.state_dict())
    with pytest.raises(ValueError, match="unexpected keys"):
        nesterov.load_state_dict(delayed.state_dict())
    with pytest.raises(ValueError, match="momentum_buffer"):
        nesterov.load_state_dict({"momentum_buffer": torch.zeros(NUMEL + 1)})
    with pytest.raises(ValueError, match="unexpected keys"):
        make_outer("sgd", NUMEL).load_state_dict(nesterov.state_dict())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": "adam"}, "kind"),
        ({"numel": 0}, "numel"),
        ({"lr": 0.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"delay": 0}, "delay"),
        ({"delay": 2.5}, "delay"),
        ({"kind": "sgd", "delay": 0}, "delay"),
        ({"delay": 4, "momentum_activation": 0.5}, "momentum_activation"),
    ],
)
def test_make_outer_rejects_bad_arguments_naming_the_field(kwargs: dict, field: str) -> None:
    args = {"kind": "delayed_nesterov", "numel": NUMEL} | kwargs
    with pytest.raises(ValueError, match=rf"^{field} must"):
        make_outer(**args)


def test_step_rejects_wrong_dtype_or_length() -> None:
    opt = make_outer("nesterov", NUMEL)
    with pytest.raises(TypeError, match="grad must be float32"):
        opt.step(torch.zeros(NUMEL), torch.zeros(NUMEL, dtype=torch.float64))
    with pytest.raises(ValueError, match="params must be flat"):
        opt.step(torch.zeros(NUMEL - 1), torch.zeros(NUMEL))


@pytest.mark.parametrize("kind", ["sgd", "nesterov", "delayed_nesterov"])
def test_direction_and_factor_are_the_step(kind: str) -> None:
    # step(params, g) == params + factor * direction(g), with the same state afterwards.
    stepped, split = make_outer(kind, NUMEL, delay=2), make_outer(kind, NUMEL, delay=2)
    p1 = torch.linspace(-1, 1, NUMEL)
    p2 = p1.clone()
    for i in range(5):
        g = torch.randn(NUMEL, generator=torch.Generator().manual_seed(i))
        stepped.step(p1, g.clone())
        d = g.clone()
        factor = split.direction(d)
        p2.add_(d, alpha=factor)
        assert torch.equal(p1, p2)
    for key, value in stepped.state_dict().items():
        assert torch.equal(value, split.state_dict()[key])


def test_step_with_bad_params_changes_no_state() -> None:
    opt = make_outer("nesterov", NUMEL)
    before = opt.state_dict()["momentum_buffer"].clone()
    with pytest.raises(ValueError, match="params must be flat"):
        opt.step(torch.zeros(NUMEL - 1), torch.ones(NUMEL))
    assert torch.equal(opt.state_dict()["momentum_buffer"], before)
