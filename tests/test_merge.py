"""Contribution weights and the round accumulator: weighted mean and radial-directional merge."""

from __future__ import annotations

import math

import pytest
import torch

from protos import codec, layout
from protos import diloco_pb2 as pb
from synchronizer.merge import Accumulator, staleness_factor, token_weight


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_token_weights() -> None:
    assert token_weight("uniform", 1000, 10) == 1.0
    assert token_weight("uniform", 0, 0) == 1.0
    assert token_weight("tokens", 1000, 10) == 1000.0
    assert token_weight("tokens2_per_step", 1000, 10) == 100_000.0
    assert token_weight("tokens2_per_step", 30, 0) == 900.0  # steps < 1 reads as 1
    assert token_weight("tokens", 0, 10) == 0.0
    assert token_weight("tokens2_per_step", 0, 10) == 0.0
    with pytest.raises(ValueError, match="token weight must be one of"):
        token_weight("bytes", 1, 1)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("none", (1.0, 1.0, 1.0)),
        ("poly", (1.0, 2**-0.5, 6**-0.5)),
        ("hinge", (1.0, 1.0, 1 / (1 + 0.5 * (5 - 2)))),
        ("exp", (1.0, math.exp(-0.5), math.exp(-2.5))),
    ],
)
def test_staleness_factor_values_at_0_1_5(kind: str, expected: tuple[float, ...]) -> None:
    got = tuple(staleness_factor(kind, s, alpha=0.5, hinge=2) for s in (0, 1, 5))
    assert got == pytest.approx(expected)


def test_staleness_factor_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="staleness factor must be one of"):
        staleness_factor("linear", 1)
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness_factor("poly", -1)
    with pytest.raises(ValueError, match="alpha"):
        staleness_factor("exp", 1, alpha=-1.0)


def test_weighted_mean_equals_hand_computed_reference() -> None:
    acc = Accumulator(3)
    acc.add(_t(1, 2, 3), 1.0)
    acc.add(_t(3, 0, -3), 3.0)
    assert (acc.count, acc.total_weight) == (2, 4.0)
    # (1*[1, 2, 3] + 3*[3, 0, -3]) / 4
    torch.testing.assert_close(acc.merged(torch.empty(3)), _t(2.5, 0.5, -1.5))


def test_radial_orthogonal_norms_1_and_3_give_norm_2_on_the_bisector() -> None:
    acc = Accumulator(4, segments=[(0, 2), (2, 4)], radial=True, mean_segments={1})
    acc.add(_t(1, 0, 2, 4), 1.0)
    acc.add(_t(0, 3, 0, 0), 1.0)
    root2 = math.sqrt(2.0)
    # segment 0: mean norm 2 along (1, 1)/sqrt(2); segment 1 (mean_segments): plain mean
    torch.testing.assert_close(acc.merged(torch.empty(4)), _t(root2, root2, 1, 2))


def test_radial_weights_both_norm_and_direction() -> None:
    acc = Accumulator(2, radial=True)
    acc.add(_t(1, 0), 1.0)
    acc.add(_t(0, 3), 3.0)
    # norm (1*1 + 3*3) / 4 = 2.5 along (1*e1 + 3*e2) / sqrt(10)
    expected = 2.5 * _t(1, 3) / math.sqrt(10.0)
    torch.testing.assert_close(acc.merged(torch.empty(2)), expected)


def test_radial_zero_norm_delta_adds_weight_but_no_direction() -> None:
    acc = Accumulator(2, radial=True)
    acc.add(_t(3, 4), 1.0)
    acc.add(_t(0, 0), 1.0)
    assert acc.count == 2
    # norm (5 + 0) / 2 along (0.6, 0.8)
    torch.testing.assert_close(acc.merged(torch.empty(2)), _t(1.5, 2.0))

    only_zero = Accumulator(2, radial=True)
    only_zero.add(_t(0, 0), 1.0)
    assert torch.equal(only_zero.merged(torch.full((2,), 7.0)), _t(0, 0))


def test_radial_opposite_directions_cancel_to_zero() -> None:
    acc = Accumulator(2, radial=True)
    acc.add(_t(1, 1), 1.0)
    acc.add(_t(-2, -2), 1.0)
    assert torch.equal(acc.merged(torch.full((2,), 7.0)), _t(0, 0))


def test_add_rejects_negative_or_non_finite_weight() -> None:
    acc = Accumulator(2)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="weight must be a finite number >= 0"):
            acc.add(_t(1, 1), bad)
    assert (acc.count, acc.total_weight) == (0, 0.0)


def test_zero_weight_counts_toward_nothing_and_empty_round_cannot_merge() -> None:
    acc = Accumulator(2)
    acc.add(_t(5, 5), 0.0)
    assert (acc.count, acc.total_weight) == (0, 0.0)
    with pytest.raises(ValueError, match="total weight is 0"):
        acc.merged(torch.empty(2))
    acc.add(_t(1, -1), 2.0)
    torch.testing.assert_close(acc.merged(torch.empty(2)), _t(1, -1))


def test_add_rejects_wrong_dtype_or_length() -> None:
    acc = Accumulator(2)
    with pytest.raises(TypeError, match="delta must be float32"):
        acc.add(torch.zeros(2, dtype=torch.float64), 1.0)
    with pytest.raises(ValueError, match="delta must be flat with 2 elements"):
        acc.add(torch.zeros(3), 1.0)


def test_add_tensor_weighted_adds_to_the_weighted_sum_in_mean_mode_only() -> None:
    acc = Accumulator(2)
    acc.add(_t(1, 1), 1.0)
    acc.add_tensor_weighted(_t(6, 0), 2.0)  # e.g. 2 * [3, 0] computed by the caller
    acc.add_tensor_weighted(_t(0, 3), 0.0)  # a correction of weights already counted
    assert (acc.count, acc.total_weight) == (1, 3.0)
    torch.testing.assert_close(acc.merged(torch.empty(2)), _t(7 / 3, 4 / 3))
    with pytest.raises(NotImplementedError):
        Accumulator(2, radial=True).add_tensor_weighted(_t(1, 1), 1.0)


def test_reset_empties_the_round() -> None:
    acc = Accumulator(2, radial=True)
    acc.add(_t(1, 0), 1.0)
    acc.reset()
    assert (acc.count, acc.total_weight) == (0, 0.0)
    acc.add(_t(0, 2), 1.0)
    torch.testing.assert_close(acc.merged(torch.empty(2)), _t(0, 2))


@pytest.mark.parametrize(
    ("segments", "mean_segments"),
    [([(0, 2), (3, 4)], None), ([(0, 2)], None), ([(0, 2), (2, 2), (2, 4)], None), ([(0, 4)], {1})],
)
def test_segments_must_tile_the_fragment(segments, mean_segments) -> None:
    with pytest.raises(ValueError, match="segment"):
        Accumulator(4, segments=segments, radial=True, mean_segments=mean_segments)


@pytest.mark.parametrize("radial", [False, True])
@pytest.mark.parametrize("codec_id", [pb.CODEC_FP32, pb.CODEC_INT8, pb.CODEC_INT4])
def test_add_payload_equals_add_of_the_decoded_payload(radial: bool, codec_id: int) -> None:
    n, segments = 1000, [(0, 600), (600, 1000)]
    g = torch.Generator().manual_seed(3)
    deltas = [torch.randn(n, generator=g) for _ in range(3)]
    by_payload = Accumulator(n, segments, radial=radial)
    by_tensor = Accumulator(n, segments, radial=radial)
    for i, d in enumerate(deltas):
        buf, header = codec.encode(d, codec_id), layout.make_header(codec_id, n)
        by_payload.add_payload(buf, header, 0.5 + i, torch.empty(n))
        by_tensor.add(codec.decode(buf, header, torch.empty(n)), 0.5 + i)
    assert (
        by_payload.total_weight == by_tensor.total_weight
        and by_payload.count == by_tensor.count == 3
    )
    torch.testing.assert_close(
        by_payload.merged(torch.empty(n)), by_tensor.merged(torch.empty(n)), rtol=1e-5, atol=1e-6
    )


def test_reset_accumulator_is_overwritten_by_its_next_round() -> None:
    acc = Accumulator(3)
    acc.add(_t(1, 2, 3), 1.0)
    acc.reset()
    acc.add_payload(
        codec.encode(_t(4, 5, 6), pb.CODEC_FP32),
        layout.make_header(pb.CODEC_FP32, 3),
        2.0,
        torch.empty(3),
    )
    assert torch.equal(acc.merged(torch.empty(3)), _t(4, 5, 6))
    acc.reset()
    acc.add_tensor_weighted(_t(2, 2, 2), 2.0)
    assert torch.equal(acc.merged(torch.empty(3)), _t(1, 1, 1))
