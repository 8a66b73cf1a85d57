"""The checked-in stubs match the .proto, and the model spec is deterministic and self-checking."""

from __future__ import annotations

import pytest

from protos import generate
from protos.spec import ModelSpec, TensorInfo, plan_fragments


def test_generated_stubs_are_up_to_date_with_the_proto():
    assert generate.main(["--check"]) == 0, "run: python -m protos.generate"


def _tensors() -> list[TensorInfo]:
    return [TensorInfo(f"h.{i}.w", (64, 16 * (i % 5 + 1))) for i in range(12)] + [
        TensorInfo("wte", (256, 64))
    ]


def test_balanced_plan_is_deterministic_and_even():
    a, b = plan_fragments(_tensors(), 4), plan_fragments(list(_tensors()), 4)
    assert a == b and a.spec_hash == b.spec_hash
    sizes = [f.numel for f in a.fragments]
    largest = max(t.numel for t in _tensors())
    assert sum(sizes) == a.numel
    assert max(sizes) <= max(largest, 1.2 * a.numel / 4)  # no worse than the largest tensor forces


def test_strided_plan_keeps_model_order_in_contiguous_bands():
    spec = plan_fragments(_tensors(), 3, "strided")
    order = [t.name for f in spec.fragments for t in f.tensors]
    assert order == [t.name for t in _tensors()]


def test_spec_survives_the_wire_and_rejects_tampering():
    spec = plan_fragments(_tensors(), 4)
    assert ModelSpec.from_proto(spec.to_proto()) == spec
    msg = spec.to_proto()
    msg.tensors[0].shape[0] = 65
    with pytest.raises(ValueError, match="numel"):
        ModelSpec.from_proto(msg)


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="fragments must be >= 1"):
        plan_fragments(_tensors(), 0)
    with pytest.raises(ValueError, match="strategy"):
        plan_fragments(_tensors(), 2, "random")
