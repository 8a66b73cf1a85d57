"""The learner's local arithmetic, no server: fragment plan, schedule, error feedback, merges,
gather/scatter, and its config."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from learner.client import MIN_TRANSFER_BPS, SyncClient
from learner.config import LearnerConfig
from learner.fragments import (
    ErrorFeedback,
    FragmentPlan,
    Schedule,
    gather,
    merge_fragment,
    scatter,
    schedule_offsets,
)
from protos import codec, layout
from protos import diloco_pb2 as pb
from protos.configload import ConfigError, load


class TinyGPT(nn.Module):
    """GPT-shaped parameter set: embeddings, n blocks of (ln, qkv, proj, ln, mlp), final ln, head."""

    def __init__(self, vocab: int = 256, d: int = 64, ctx: int = 128, layers: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(d),
                    "qkv": nn.Linear(d, 3 * d),
                    "proj": nn.Linear(d, d),
                    "ln2": nn.LayerNorm(d),
                    "fc": nn.Linear(d, 4 * d),
                    "out": nn.Linear(4 * d, d),
                }
            )
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)


def test_fragment_plan_is_identical_for_two_instances_of_the_model():
    torch.manual_seed(0)
    a = FragmentPlan(TinyGPT(), 4)
    torch.manual_seed(1)
    b = FragmentPlan(TinyGPT(), 4)
    assert a.spec.spec_hash == b.spec.spec_hash
    assert [[t.name for t in f.tensors] for f in a.fragments] == [
        [t.name for t in f.tensors] for f in b.fragments
    ]


def test_balanced_plan_keeps_fragment_sizes_even_on_a_gpt_like_model():
    model = TinyGPT()
    plan = FragmentPlan(model, 4, "balanced")
    sizes = [f.numel for f in plan.fragments]
    assert len(sizes) == 4
    assert sum(sizes) == sum(p.numel() for p in model.parameters())
    assert max(sizes) / min(sizes) < 1.1
    strided = [f.numel for f in FragmentPlan(model, 4, "strided").fragments]
    assert sum(strided) == sum(sizes)


def _dues(sched: Schedule, steps: range) -> list[tuple[int, int]]:
    return [(step, f) for step in steps for f in sched.due(step)]


def test_schedule_puts_each_fragment_due_once_per_h_steps_at_its_offset():
    for h, p in [(10, 4), (100, 4), (7, 3), (3, 5), (1, 2)]:
        offsets = schedule_offsets(h, p)
        assert offsets == [(i * h) // p for i in range(p)]
        due_at: dict[int, list[int]] = {i: [] for i in range(p)}
        for step, f in _dues(Schedule(h, p), range(1, 5 * h + 1)):
            due_at[f].append(step)
        for f, steps in due_at.items():
            assert all(b - a == h for a, b in zip(steps, steps[1:], strict=False)), (h, p, f, steps)
            assert steps[0] == (offsets[f] or h)
            for window in range(5):  # exactly once in every run of H consecutive steps
                assert sum(window * h < s <= (window + 1) * h for s in steps) == 1


def test_staggered_schedule_keeps_at_most_one_fragment_due_per_step_when_p_divides_h():
    dues = _dues(Schedule(100, 4), range(1, 401))
    assert len({step for step, _ in dues}) == len(dues) == 16


def test_a_schedule_started_later_is_the_run_s_schedule_from_there_on():
    for start in (0, 1, 24, 25, 99, 100, 137):
        whole = [(s, f) for s, f in _dues(Schedule(100, 4), range(1, 501)) if s > start]
        assert _dues(Schedule(100, 4, start), range(start + 1, 501)) == whole


def test_a_change_of_h_changes_the_spacing_from_the_last_push_never_the_order():
    # Dynamic Local Updates changes a learner's H mid-cycle: its fragments must still come in
    # turn (by (step - offset_p) % H they came in whatever order the new H put them), or a
    # synchronous round waits for a fragment this learner pushes a cycle later.
    for new_h, at in [(41, 57), (22, 60), (24, 61), (49, 30), (250, 80), (3, 30)]:
        sched = Schedule(100, 4)
        dues = _dues(sched, range(1, at + 1))
        sched.set_sync_every(new_h)
        dues += _dues(sched, range(at + 1, at + 4 * new_h + 1))
        order = [f for _, f in dues]
        assert order == [(1 + i) % 4 for i in range(len(order))], (new_h, at, order)
        off = schedule_offsets(new_h, 4)
        gap = [new_h - off[3], off[1] - off[0], off[2] - off[1], off[3] - off[2]]  # before f
        last = max(s for s, _ in dues if s <= at)
        after = [(s, f) for s, f in dues if s > at]
        assert after[0][0] == max(at + 1, last + gap[after[0][1]])  # due its new spacing
        for (a, _), (b, f) in zip(after, after[1:], strict=False):
            assert b - a == gap[f], (new_h, at, after)


def test_a_schedule_survives_its_state():
    sched = Schedule(100, 4)
    _dues(sched, range(1, 31))
    sched.set_sync_every(40)
    again = Schedule.restored(sched.state(), 4)
    assert _dues(again, range(31, 200)) == _dues(sched, range(31, 200))


@pytest.mark.parametrize(
    ("versions", "first"),
    [
        ([5, 5, 4, 4], 2),  # the others are on fragment 2
        ([3, 3, 3, 3], 1),  # a cycle just ended: its own turn (1 at step 0) stands
        ([5, 7, 6, 6], 1),  # two behind (rounds not in turn, asynchronous): its own turn
        ([9], 0),  # one fragment: nothing to choose
    ],
)
def test_a_schedule_joining_a_run_follows_the_fragment_behind_in_turn(versions, first):
    sched = Schedule(100, len(versions))
    sched.follow(versions)
    order = [f for _, f in _dues(sched, range(1, 2 * 100 + 1))]
    assert order[0] == first
    assert order == [(first + i) % len(versions) for i in range(len(order))]


def _quantized_sum(
    deltas: list[torch.Tensor], ef_enabled: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of what int4 pushes carried, the last pushed input) over rounds, with or without EF."""
    n = deltas[0].numel()
    ef = ErrorFeedback([n], "cpu", enabled=ef_enabled)
    sent = torch.zeros(n)
    x = deltas[0]
    for d in deltas:
        x = d.clone()
        encoded, header, residual = ef.encode(
            0, x, pb.CODEC_INT4, layout.DEFAULT_BLOCK_SIZE, pb.SCALE_FP32
        )
        sent += codec.decode(encoded, header, torch.empty(n))
        ef.commit(0, residual)
    return sent, x


def test_error_feedback_keeps_the_sum_of_int4_pushes_within_one_quantization_step():
    torch.manual_seed(0)
    n, rounds = 4096, 200
    drift = 0.02 * torch.randn(n)  # a consistent direction, mostly below the int4 step
    deltas = [torch.randn(n) + drift for _ in range(rounds)]
    truth = torch.stack(deltas).sum(0)

    with_ef, last_x = _quantized_sum(deltas, ef_enabled=True)
    # One step's int4 error bound, per block: absmax/14 (+ float slack), for the last input.
    absmax = last_x.abs().view(-1, 256).amax(1, keepdim=True)
    bound = (absmax / 14 * (1 + 1e-4) + 1e-5).expand(-1, 256).reshape(-1)
    assert bool(((with_ef - truth).abs() <= bound).all())

    without_ef, _ = _quantized_sum(deltas, ef_enabled=False)
    err_ef = (with_ef - truth).norm()
    err_plain = (without_ef - truth).norm()
    assert err_plain > 5 * err_ef  # without EF the error accumulates round after round


def test_merge_modes_on_hand_made_tensors():
    local = torch.tensor([1.0, 2.0, 3.0])
    fresh = torch.tensor([3.0, 2.0, 0.0])
    at_push = torch.tensor([0.5, 2.0, 4.0])
    assert torch.equal(merge_fragment("overwrite", local, fresh, at_push, 0.5), fresh)
    assert torch.allclose(
        merge_fragment("mix", local, fresh, at_push, 0.5), torch.tensor([2.0, 2.0, 1.5])
    )
    assert torch.allclose(
        merge_fragment("mix", local, fresh, at_push, 0.25), 0.25 * fresh + 0.75 * local
    )
    assert torch.equal(merge_fragment("mix", local, fresh, at_push, 1.0), fresh)
    # rebase: fresh global plus the local progress made since the push
    assert torch.allclose(
        merge_fragment("rebase", local, fresh, at_push, 0.5), torch.tensor([3.5, 2.0, -1.0])
    )
    # inputs are untouched
    assert torch.equal(local, torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError):
        merge_fragment("average", local, fresh, at_push, 0.5)
    with pytest.raises(ValueError):
        merge_fragment("rebase", local, fresh, None, 0.5)


def test_gather_scatter_round_trip_restores_every_parameter():
    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    model.ln_f.weight.data = model.ln_f.weight.data.to(torch.bfloat16)  # a non-fp32 parameter
    plan = FragmentPlan(model, 3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    flats = [plan.gather(p) for p in range(len(plan))]
    for f, flat in zip(plan.fragments, flats, strict=True):
        assert flat.dtype == torch.float32 and flat.numel() == f.numel
        for name, start, end in f.offsets():  # layout is the spec's: tensors in order, flattened
            assert torch.equal(flat[start:end], before[name].float().reshape(-1))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    for i, flat in enumerate(flats):
        plan.scatter(i, flat)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    with pytest.raises(ValueError):
        scatter(plan.params[0], torch.zeros(3))
    assert gather(plan.params[0]).data_ptr() != plan.params[0][0].data_ptr()


def test_config_loads_from_file_environment_and_flags(tmp_path):
    f = tmp_path / "learner.toml"
    f.write_text('synchronizer = "sync:1"\nsync_every = 25\nmerge = "rebase"\n')
    cfg = load(
        LearnerConfig,
        f,
        {"fragments": 8},
        {"DILOCO_LEARNER_SYNC_EVERY": "50", "DILOCO_LEARNER_CODEC": "int8"},
    )
    assert (cfg.synchronizer, cfg.sync_every, cfg.fragments, cfg.codec, cfg.merge) == (
        "sync:1",
        50,
        8,
        "int8",
        "rebase",
    )
    assert all(field.description for field in LearnerConfig.model_fields.values())


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"codec": "int3"}, "codec"),
        ({"sync_every": "0"}, "sync_every"),
        ({"alpha": "1.5"}, "alpha"),
        ({"merge": "average"}, "merge"),
    ],
)
def test_config_errors_name_the_field(settings, field):
    with pytest.raises(ConfigError, match=field):
        load(LearnerConfig, None, settings, {})


def test_config_file_with_an_unknown_setting_is_refused(tmp_path):
    f = tmp_path / "learner.yaml"
    f.write_text("sync_evry: 10\n")
    with pytest.raises(ConfigError, match="sync_evry"):
        load(LearnerConfig, f, {}, {})


def test_config_refuses_half_a_client_certificate(tmp_path):
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        LearnerConfig(tls_ca=tmp_path / "ca.pem", tls_cert=tmp_path / "c.pem")


def test_a_transfers_deadline_grows_with_its_bytes():
    # A whole 1B-parameter model (4 GB of FP32) cannot move in a fixed 30 s deadline; it is
    # given time at MIN_TRANSFER_BPS on top (stalls are the server's stream_idle_s to cut).
    client = SyncClient("127.0.0.1:1", rpc_timeout_s=30.0)
    try:
        assert client.transfer_s(0) == 30.0
        assert client.transfer_s(4_000_000_000) == 30.0 + 4_000_000_000 / MIN_TRANSFER_BPS
        assert client.transfer_s(4_000_000_000) >= 3600
    finally:
        client.close()
