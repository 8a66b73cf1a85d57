"""Outer optimizers: agreement with torch and with Algorithm 3 by hand, resume, validation; the
fused outer step through the update chain against the same arithmetic on whole tensors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from protos import codec, layout
from protos import diloco_pb2 as pb
from synchronizer import downlink
from synchronizer import outer as outer_module
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


def _direction(opt, grad: torch.Tensor) -> float:
    """One step's direction over the whole of `grad`, written into it; returns its factor."""
    step = opt.begin()
    step.direction(0, grad.numel(), grad, grad)
    return step.factor


@pytest.mark.parametrize("fused", [True, False], ids=["fused-kernel", "separate-ops"])
def test_nesterov_matches_torch_sgd_nesterov_bit_for_bit(fused: bool, monkeypatch) -> None:
    # With torch's fused SGD kernel (the default where torch has one), as SGD(fused=True) runs
    # it; without, the separate operations of SGD(fused=False).
    if fused and outer_module.FUSED_SGD is None:
        pytest.skip("this torch has no fused SGD kernel")
    if not fused:
        monkeypatch.setattr(outer_module, "FUSED_SGD", None)
    init = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    grads = _grads(6)
    ref = torch.nn.Parameter(init.clone())
    torch_opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True, fused=fused)
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
def test_delayed_nesterov_with_delay_1_is_nesterov_bit_for_bit(
    activation: float, monkeypatch
) -> None:
    monkeypatch.setattr(outer_module, "FUSED_SGD", None)  # the same operations, one by one
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
        factor = _direction(split, d)
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


@pytest.mark.parametrize("kind", OUTER_KINDS)
@pytest.mark.parametrize("update_codec", ["int8", "fp32"])
def test_fused_outer_step_through_the_chain_equals_the_whole_tensor_arithmetic_bit_for_bit(
    kind: str, update_codec: str, monkeypatch
) -> None:
    # The fused step goes run by run (here runs of 3 blocks, a partial last block); a reference
    # applies the same operations to whole tensors one after the other, as the step did before
    # it was fused: direction, carried update, encode, decode, add, residual.
    monkeypatch.setattr(downlink, "RUN_ELEMS", 3 * layout.DEFAULT_BLOCK_SIZE)
    monkeypatch.setattr(outer_module, "FUSED_SGD", None)  # the kernel: test above
    n = 10 * layout.DEFAULT_BLOCK_SIZE + 77
    gen = torch.Generator().manual_seed(3)
    params = torch.randn(n, generator=gen)
    fused, reference = make_outer(kind, n, delay=2), make_outer(kind, n, delay=2)
    down = downlink.Downlink(n, update_codec, 8, "bf16")
    ref_params, ref_residual = params.clone(), torch.zeros(n, dtype=torch.bfloat16)
    header = layout.make_header(layout.parse_codec(update_codec), n)
    for version in range(1, 6):
        merged = torch.randn(n, generator=gen) * 1e-2
        down.step(params, merged.clone(), fused.begin(), version)
        g = merged.clone()
        factor = _direction(reference, g)
        update = torch.add(ref_residual.float(), g, alpha=factor)
        link = codec.encode(update, header.codec)
        decoded = codec.decode(link, header, torch.empty(n))
        ref_params.add_(decoded)
        ref_residual = (update - decoded).to(torch.bfloat16)
        assert torch.equal(params, ref_params)
        assert down.residual is not None and torch.equal(down.residual, ref_residual)
        assert torch.equal(down.chain[-1][2], link)  # the link's bytes, as encoded at once
    for key, value in fused.state_dict().items():
        assert torch.equal(value, reference.state_dict()[key])


@pytest.mark.parametrize(
    "codec_name, scale_dtype",
    [("int8", 0), ("int4", 0), ("fp4", 0), ("int8", 1), ("fp32", 0), ("bf16", 0)],
)
def test_run_encoder_writes_the_bytes_of_encode_and_returns_the_values_of_decode(
    codec_name: str, scale_dtype: int
) -> None:
    codec_id = layout.parse_codec(codec_name)
    scale = pb.SCALE_FP32 if scale_dtype == 0 else pb.SCALE_FP16
    n, run = 7 * layout.DEFAULT_BLOCK_SIZE + 33, 2 * layout.DEFAULT_BLOCK_SIZE
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    x[:300] = 0.0  # an all-zero block
    encoder = codec.RunEncoder(codec_id, n, run, scale_dtype=scale)
    scratch = torch.empty(run)
    values = []
    for start in range(0, n, run):
        values.append(encoder.encode(x[start : start + run], scratch).clone())
    whole = codec.encode(x, codec_id, scale_dtype=scale)
    assert torch.equal(encoder.out, whole)
    header = encoder.header
    assert torch.equal(torch.cat(values), codec.decode(whole, header, torch.empty(n)))
    bad = codec.RunEncoder(codec_id, n, run, scale_dtype=scale)
    with pytest.raises(layout.CodecError):
        bad.encode(torch.full((run,), float("nan")), scratch)


def test_warm_up_rises_linearly_over_the_first_rounds_then_stays_whole() -> None:
    assert [outer_module.warm_up(v, 4) for v in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [outer_module.warm_up(v, 0) for v in range(3)] == [1.0, 1.0, 1.0]
    assert outer_module.warm_up(0, 1) == 1.0


@pytest.mark.parametrize("fused", [True, False], ids=["fused-kernel", "separate-ops"])
def test_a_warmed_up_nesterov_step_is_torch_sgd_at_the_scheduled_lr_bit_for_bit(
    fused: bool, monkeypatch
) -> None:
    # The warm-up scales the learning rate only: the momentum advances as at any rate, as
    # torch's SGD does when a schedule changes its lr between steps.
    if fused and outer_module.FUSED_SGD is None:
        pytest.skip("this torch has no fused SGD kernel")
    if not fused:
        monkeypatch.setattr(outer_module, "FUSED_SGD", None)
    init = torch.randn(NUMEL, generator=torch.Generator().manual_seed(2))
    ref = torch.nn.Parameter(init.clone())
    torch_opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True, fused=fused)
    params, outer = init.clone(), make_outer("nesterov", NUMEL, lr=0.7, momentum=0.9)
    for v, g in enumerate(_grads(6, seed=3)):
        warm = outer_module.warm_up(v, 4)
        torch_opt.param_groups[0]["lr"] = 0.7 * warm
        ref.grad = g.clone()
        torch_opt.step()
        outer.step(params, g.clone(), warm=warm)
        assert torch.equal(params, ref.detach())


@pytest.mark.parametrize("kind", OUTER_KINDS)
def test_warm_scales_the_step_factor_and_not_the_state(kind: str) -> None:
    whole, warmed = make_outer(kind, NUMEL, delay=1), make_outer(kind, NUMEL, delay=1)
    for g in _grads(3, seed=4):
        a, b = whole.begin(), warmed.begin(warm=0.25)
        assert b.factor == pytest.approx(a.factor * 0.25)
        da = a.direction(0, NUMEL, g.clone(), torch.empty(NUMEL))
        db = b.direction(0, NUMEL, g.clone(), torch.empty(NUMEL))
        assert torch.equal(da, db)
    for key, value in whole.state_dict().items():
        assert torch.equal(value, warmed.state_dict()[key])
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="warm must be in"):
            make_outer(kind, NUMEL).begin(warm=bad)
