"""Round policy at the core (no gRPC, time on a `ManualClock`): quorum, grace window, dead
learners, weights, anchors, batching and the payload budget. One test keeps a real server: an
outer step running on its worker while pushes arrive."""

from __future__ import annotations

import threading

import pytest
import torch

from protos import codec, layout
from protos import diloco_pb2 as pb
from synchronizer import pushes as push_module
from synchronizer.clock import ManualClock
from synchronizer.errors import Code, Rejected
from tests.core_helpers import CoreClient, clock, make_core
from tests.helpers import Client, small_spec

__all__ = ["clock"]  # the fixture

SPEC = small_spec(fragments=1)
N = SPEC.fragments[0].numel


def _settings(cfg: dict) -> dict:
    # Round policy is checked against exact arithmetic: keep FP32 parameters (no update chain)
    # unless a test is about re-anchoring, which needs the kept updates.
    cfg.setdefault("anchor", "base")
    cfg.setdefault("update_history", 0 if cfg["anchor"] == "base" else 16)
    return cfg


def _setup(tmp_path, clock: ManualClock, learners: int, **cfg):
    core = make_core(tmp_path, clock, **_settings(cfg))
    clients = [CoreClient(core, SPEC, f"l{i}") for i in range(learners)]
    for c in clients:
        c.join()
    init = torch.linspace(-1, 1, N)
    clients[0].init([init])
    return core, clients, init


def _vec(seed: int, scale: float = 0.1) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed)) * scale


def test_quorum_all_without_grace_is_synchronous_diloco_bit_for_bit(tmp_path, clock):
    core, clients, init = _setup(
        tmp_path,
        clock,
        3,
        quorum=0,
        grace="none",
        token_weight="uniform",
        anchor="base",
        update_history=0,
        outer="nesterov",
    )
    p = torch.nn.Parameter(init.clone())
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    for r in range(4):
        deltas = [_vec(10 * r + i) for i in range(3)]
        for c, d in zip(clients[:2], deltas, strict=False):
            reply = c.push(0, d, base=r)
            assert reply.outcome == pb.PUSH_ACCEPTED and reply.round_version == r + 1
        assert core.model.fragments[0].version == r  # the round waits for the third learner
        clients[2].push(0, deltas[2], base=r)
        version, served = clients[0].pull(0, min_version=r + 1, wait_s=10)
        assert version == r + 1
        acc = torch.zeros(N)
        for d in deltas:
            acc.add_(d, alpha=1.0)
        p.grad = acc / 3.0
        opt.step()
        assert torch.equal(served, p.detach())


def test_quorum_one_applies_without_waiting_for_others(tmp_path, clock):
    core, clients, init = _setup(
        tmp_path, clock, 3, quorum=1, grace="none", outer="sgd", outer_lr=1.0, anchor="base"
    )
    d = _vec(1)
    assert clients[1].push(0, d).round_version == 1
    version, served = clients[1].pull(0, min_version=1, wait_s=10)
    assert version == 1
    torch.testing.assert_close(served, init - d)


def test_a_rounds_work_is_counted_before_its_version_can_be_seen(tmp_path, clock, monkeypatch):
    # A learner holding a version must find the work in it counted (merged tokens, Status): the
    # round was counted just after its version was served, so a learner could finish first.
    core, clients, _ = _setup(tmp_path, clock, 2, quorum=1, grace="none", outer="sgd")
    frag = core.model.fragments[0]
    seen: list[tuple[str, int]] = []
    for name in ("merged", "refused"):
        counted = getattr(core.goodput, name)

        def counting(shares, counted=counted, name=name):
            seen.append((name, frag.version))
            counted(shares)

        monkeypatch.setattr(core.goodput, name, counting)
    assert clients[0].push(0, _vec(1)).round_version == 1
    assert clients[1].push(0, torch.full((N,), 3e38), base=1).round_version == 2  # refused
    assert clients[0].pull(0, min_version=2, wait_s=10)[0] == 2
    assert seen == [("merged", 0), ("refused", 1)]  # each counted while the version before showed


def test_grace_window_takes_a_learner_in_time_and_not_one_that_is_late(tmp_path, clock):
    core, clients, init = _setup(
        tmp_path,
        clock,
        3,
        quorum=1,
        grace="fixed",
        grace_max_s=2.0,
        outer="sgd",
        outer_lr=1.0,
        anchor="base",
        token_weight="uniform",
    )
    a, b, late = _vec(1), _vec(2), _vec(3)
    assert clients[0].push(0, a).round_version == 1
    clock.advance(1.9)
    assert clients[1].push(0, b).round_version == 1  # inside the grace window: same round
    clock.advance(0.1)  # the window runs out: the round closes
    version, served = clients[0].pull(0)
    assert version == 1
    torch.testing.assert_close(served, init - (a + b) / 2)
    assert clients[2].push(0, late, base=0).round_version == 2  # too late for round 1


def test_dead_learner_never_holds_a_synchronous_round(tmp_path, clock):
    core, clients, _ = _setup(tmp_path, clock, 2, quorum=0, grace="none", lease_s=2.0)
    alive, silent = clients
    alive.push(0, _vec(1))
    for _ in range(3):  # the silent learner's lease lapses; heartbeats keep the other's
        clock.advance(0.9)
        alive.heartbeat()
        core.tick()
    version, _ = alive.pull(0)
    assert version == 1
    states = {lr.name: lr.state for lr in alive.status().learners}
    assert states == {"l0": "alive", "l1": "dead"}


def test_a_synchronous_round_waits_for_a_learner_back_mid_run_only_once_it_pushed_again(
    tmp_path, clock
):
    # A learner back from a lapsed lease (or new) mid-run may be a cycle behind and push another
    # fragment first, blocking on it: a round that waited for it would hold everyone else.
    core, clients, init = _setup(
        tmp_path, clock, 3, quorum=0, grace="none", lease_s=2.0, outer="sgd", outer_lr=1.0
    )
    a, b, back = clients
    for _ in range(3):  # its lease lapses; heartbeats keep the others'
        clock.advance(0.9)
        a.heartbeat()
        b.heartbeat()
        core.tick()
    assert a.push(0, _vec(1)).round_version == 1
    back.join(again=True)
    assert b.push(0, _vec(2)).round_version == 1
    version, served = a.pull(0)
    assert version == 1  # the round closed without it
    torch.testing.assert_close(served, init - (_vec(1) + _vec(2)) / 2)
    for c in (a, b):  # and so does one opened after it came back, before it pushed
        assert c.push(0, _vec(3), base=1).round_version == 2
    assert a.pull(0)[0] == 2
    new = CoreClient(core, SPEC, "new")  # a learner new mid-run alike
    new.join()
    assert back.push(0, _vec(4), base=0).round_version == 3
    assert a.push(0, _vec(5), base=2).round_version == 3
    assert a.pull(0)[0] == 2  # it pushed: waited for from now on, as b is
    assert b.push(0, _vec(6), base=2).round_version == 3
    assert a.pull(0, min_version=3, wait_s=10)[0] == 3
    for c in (a, b, new):
        assert c.push(0, _vec(7), base=3).round_version == 4
    assert a.pull(0)[0] == 3  # waits for the learner that came back and pushed
    assert back.push(0, _vec(8), base=3).round_version == 4
    assert a.pull(0, min_version=4, wait_s=10)[0] == 4


def test_a_process_restarted_within_its_lease_is_waited_for_and_its_push_joins_the_open_round(
    tmp_path, clock
):
    # A learner process restarted from its saved state within its lease joins under its id
    # again, and pushes first the fragment behind in turn: the one whose open round waits for
    # it. That round keeps waiting for it and takes its push, so its rounds stay the others'
    # (treated as a newcomer, the round closed without it and its pushes landed a round late:
    # synchronous runs then stalled 40 s at a time, docs/performance.md).
    core, clients, _ = _setup(tmp_path, clock, 3, quorum=0, grace="none", outer="sgd", outer_lr=1.0)
    a, b, restarted = clients
    for c in clients:
        assert c.push(0, _vec(1), base=0).round_version == 1
    for c in (a, b):
        assert c.push(0, _vec(2), base=1).round_version == 2
    restarted.join(again=True)
    restarted.heartbeat()
    core.tick()  # housekeeping re-checks every round
    assert a.pull(0)[0] == 1, "the open round still waits for the restarted process"
    assert restarted.push(0, _vec(3), base=1).round_version == 2
    assert a.pull(0, min_version=2, wait_s=10)[0] == 2


def test_rounds_stop_waiting_for_a_learner_that_says_it_pushes_nothing_more(tmp_path, clock):
    # A learner that finished and waits for its last rounds pushes nothing more: a synchronous
    # round it has not pushed to closes without it, one it pushed to keeps its push, and a Join
    # (a new process under its id) makes it a learner to wait for again.
    core, clients, _ = _setup(
        tmp_path, clock, 3, quorum=0, grace="none", outer="sgd", outer_lr=1.0, round_share="full"
    )
    done, a, b = clients
    for c in clients:
        assert c.push(0, _vec(1), base=0).round_version == 1
    for c in (done, a):
        assert c.push(0, _vec(2), base=1).round_version == 2
    done.heartbeat(pushes_done=True)
    assert a.pull(0)[0] == 1, "its push is in the open round: the round still waits for b"
    assert b.push(0, _vec(3), base=1).round_version == 2
    version, v2 = a.pull(0)
    assert version == 2
    assert a.push(0, _vec(4), base=2).round_version == 3
    assert a.pull(0)[0] == 2  # b may still push
    assert b.push(0, _vec(5), base=2).round_version == 3
    version, served = a.pull(0)
    assert version == 3, "the round closed without the learner that pushes no more"
    torch.testing.assert_close(served, v2 - (_vec(4) + _vec(5)) / 2)
    done.join(again=True)  # under its id again: waited for again until it says otherwise
    for c in (a, b):
        assert c.push(0, _vec(6), base=3).round_version == 4
    assert a.pull(0)[0] == 3
    done.heartbeat(pushes_done=True)
    assert a.pull(0, min_version=4, wait_s=10)[0] == 4


def test_push_beyond_max_staleness_is_dropped_and_counted(tmp_path, clock):
    core, clients, _ = _setup(tmp_path, clock, 2, quorum=1, grace="none", max_staleness=1)
    fast, slow = clients
    for r in range(2):
        fast.push(0, _vec(r), base=r)
        fast.pull(0, min_version=r + 1, wait_s=10)
    _, before = fast.pull(0)
    reply = slow.push(0, _vec(9), base=0)
    assert (
        reply.outcome == pb.PUSH_DROPPED_STALE
        and reply.staleness == 2
        and "re-pull" in reply.message
    )
    assert torch.equal(fast.pull(0)[1], before)
    discarded = core.metrics.registry.get_sample_value(
        "diloco_tokens_total", {"bucket": "discarded"}
    )
    assert discarded == pytest.approx(100.0)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("poly", (1 + 2) ** -0.5), ("exp", 2.718281828 ** (-0.5 * 2)), ("hinge", 1.0), ("none", 1.0)],
)
def test_stale_push_is_weighted_by_the_staleness_factor(tmp_path, clock, kind, expected):
    core, clients, _ = _setup(
        tmp_path, clock, 2, quorum=1, grace="none", staleness_weight=kind, token_weight="uniform"
    )
    fast, slow = clients
    for r in range(2):
        fast.push(0, _vec(r), base=r)
        fast.pull(0, min_version=r + 1, wait_s=10)
    reply = slow.push(0, _vec(9), base=0)
    assert reply.staleness == 2
    assert reply.weight == pytest.approx(expected, rel=1e-6)


def test_token_weights_give_the_weighted_mean(tmp_path, clock):
    core, clients, init = _setup(
        tmp_path,
        clock,
        2,
        quorum=0,
        grace="none",
        token_weight="tokens2_per_step",
        outer="sgd",
        outer_lr=1.0,
        anchor="base",
    )
    a, b = _vec(1), _vec(2)
    ra = clients[0].push(0, a, tokens=300, steps=10)  # weight 9000
    rb = clients[1].push(0, b, tokens=100, steps=10)  # weight 1000
    assert (ra.weight, rb.weight) == (9000.0, 1000.0)
    _, served = clients[0].pull(0, min_version=1, wait_s=10)
    torch.testing.assert_close(served, init - (0.9 * a + 0.1 * b))


def test_current_anchor_adds_the_updates_a_stale_learner_missed(tmp_path, clock):
    core, clients, init = _setup(
        tmp_path,
        clock,
        2,
        quorum=1,
        grace="none",
        anchor="current",
        update_codec="fp32",
        outer="sgd",
        outer_lr=1.0,
        round_share="full",  # each lone round a whole step: the anchoring arithmetic alone
    )
    fast, slow = clients
    u = _vec(1)
    fast.push(0, u, base=0)
    _, theta1 = fast.pull(0, min_version=1, wait_s=10)  # theta1 = init - u
    d = _vec(2)  # computed by the slow learner against version 0: its params are init - d
    slow.push(0, d, base=0)
    _, theta2 = slow.pull(0, min_version=2, wait_s=10)
    # Decoupled DiLoCo: delta' = Theta_now - theta_m = (init - u) - (init - d) = d - u
    torch.testing.assert_close(theta2, theta1 - (d - u))
    torch.testing.assert_close(theta2, init - d)


def test_radial_directional_merge_averages_norms_and_directions(tmp_path, clock):
    core, clients, init = _setup(
        tmp_path,
        clock,
        2,
        quorum=0,
        grace="none",
        merge="radial",
        anchor="base",
        outer="sgd",
        outer_lr=1.0,
        token_weight="uniform",
    )
    a = torch.zeros(N)
    b = torch.zeros(N)
    a[:300] = 0.0
    a[0] = 1.0  # layer0: norm 1 along e0
    b[1] = 3.0  # layer0: norm 3 along e1
    clients[0].push(0, a)
    clients[1].push(0, b)
    _, served = clients[0].pull(0, min_version=1, wait_s=10)
    step = init - served
    # mean norm 2 along the bisector of e0 and e1
    assert step[0].item() == pytest.approx(2 / 2**0.5, rel=1e-5) and step[
        1
    ].item() == pytest.approx(2 / 2**0.5, rel=1e-5)
    assert step[2:].abs().max().item() < 1e-6


def test_dynamic_local_updates_give_slow_learners_fewer_steps(tmp_path, clock):
    core, clients, _ = _setup(tmp_path, clock, 2, dynamic_local_updates=True, inner_steps=100)
    fast, slow = clients
    assert fast.heartbeat(step_time_s=0.1).inner_steps == 100
    assert slow.heartbeat(step_time_s=0.3).inner_steps == 33
    assert fast.heartbeat(step_time_s=0.1).inner_steps == 100


def test_dynamic_local_updates_without_an_h_scale_only_a_clearly_slower_learners_own(
    tmp_path, clock
):
    core, clients, _ = _setup(tmp_path, clock, 2, dynamic_local_updates=True)
    fast, slow = clients
    assert fast.heartbeat(step_time_s=0.1).inner_steps_scale == 0.0  # 0: its own H
    reply = slow.heartbeat(step_time_s=0.3)
    assert reply.inner_steps == 0 and reply.inner_steps_scale == pytest.approx(1 / 3)
    # Step times of equal learners jitter (by 25% with 8 learners on 2 cores): above half the
    # fastest's speed, nothing changes.
    assert slow.heartbeat(step_time_s=0.19).inner_steps_scale == 0.0


def test_a_slow_learner_keeps_its_h_when_its_faster_peers_finish_first(tmp_path, clock):
    # At the end of a run the fast learners leave first: the slow one's H must not jump back to
    # the full H for its last steps (its last push would then depend on when they finished).
    core, clients, _ = _setup(tmp_path, clock, 3, dynamic_local_updates=True)
    fast, other, slow = clients
    fast.heartbeat(step_time_s=0.1)
    other.heartbeat(step_time_s=0.12)
    assert slow.heartbeat(step_time_s=0.3).inner_steps_scale == pytest.approx(1 / 3)
    fast.leave()
    other.leave()
    assert slow.heartbeat(step_time_s=0.3).inner_steps_scale == pytest.approx(1 / 3)
    # until they are forgotten: then it is the fastest there is
    waited = 0.0
    while waited <= core.cfg.forget_after_s:
        clock.advance(core.cfg.lease_s / 2)  # the slow one heartbeats and stays alive
        waited += core.cfg.lease_s / 2
        slow.heartbeat(step_time_s=0.3)
        core.registry.reap()
    assert slow.heartbeat(step_time_s=0.3).inner_steps_scale == 0.0


def test_dynamic_local_updates_on_levels_tell_a_jittering_learner_the_same_ratio(tmp_path, clock):
    core, clients, _ = _setup(tmp_path, clock, 2, dynamic_local_updates=True, dlu_levels=8)
    fast, slow = clients
    fast.heartbeat(step_time_s=0.1)
    # measured 0.24: told 0.25 (two eighths)
    assert slow.heartbeat(step_time_s=0.1 / 0.24).inner_steps_scale == pytest.approx(0.25)
    # step times that jitter around it move nothing: 0.20 and 0.33 are within 3/4 of an eighth
    for ratio in (0.20, 0.33, 0.28, 0.17):
        assert slow.heartbeat(step_time_s=0.1 / ratio).inner_steps_scale == pytest.approx(0.25)
    # a real change of speed does: 0.40 is 0.15 away, told 0.375 (three eighths)
    assert slow.heartbeat(step_time_s=0.1 / 0.40).inner_steps_scale == pytest.approx(0.375)
    # never below one level, however slow
    assert slow.heartbeat(step_time_s=0.1 / 0.01).inner_steps_scale == pytest.approx(0.125)


def test_dynamic_local_updates_with_an_h_on_levels(tmp_path, clock):
    core, clients, _ = _setup(
        tmp_path, clock, 2, dynamic_local_updates=True, inner_steps=100, dlu_levels=8
    )
    fast, slow = clients
    assert fast.heartbeat(step_time_s=0.1).inner_steps == 100
    assert slow.heartbeat(step_time_s=0.1 / 0.3).inner_steps == 25  # 0.3 -> 0.25
    assert slow.heartbeat(step_time_s=0.1 / 0.33).inner_steps == 25  # kept
    assert fast.heartbeat(step_time_s=0.1).inner_steps == 100


def _gated_server(make_server, spec, **cfg):
    """A real server (the core's tests apply outer steps inline; these need the outer-step
    worker) with one learner joined and the model initialised, whose fragment 0's outer steps
    wait for `release` once they have set `entered`."""
    settings = _settings({"quorum": 1, "grace": "none", "outer": "sgd", "token_weight": "uniform"})
    srv = make_server(outer_lr=1.0, **settings, **cfg)
    c = Client(srv.address, spec, "l0")
    c.join()
    inits = [torch.linspace(-1, 1, f.numel) for f in spec.fragments]
    c.init(inits)
    frag = srv.synchronizer.model.fragments[0]
    release, entered = threading.Event(), threading.Event()
    step = frag.model.outer.step

    def slow_step(params, grad, share=1.0, warm=1.0):
        entered.set()
        release.wait(10)
        step(params, grad, share, warm)

    frag.model.outer.step = slow_step
    return srv, c, inits, release, entered


def test_pushes_arriving_during_an_outer_step_are_batched_into_the_next_round(make_server):
    srv, c, (init,), release, entered = _gated_server(make_server, SPEC)
    frag = srv.synchronizer.model.fragments[0]
    assert c.push(0, _vec(1)).round_version == 1
    assert entered.wait(10)  # round 1's outer step is running
    assert c.push(0, _vec(2), base=0).round_version == 2
    assert c.push(0, _vec(3), base=0).round_version == 2  # joins the same open round
    assert (
        frag.version == 0
        and frag.admission.round is not None
        and len(frag.admission.round.contributions) == 2
    )
    release.set()
    version, served = c.pull(0, min_version=2, wait_s=10)
    assert version == 2
    torch.testing.assert_close(served, init - _vec(1) - (_vec(2) + _vec(3)) / 2)


def test_a_round_waiting_for_the_worker_stays_open_and_takes_the_pushes_that_arrive(make_server):
    # One outer-step worker, busy with fragment 0: fragment 1's round may close, but it is taken
    # only when the worker starts it, so a second push joins it and one outer step merges both
    # (taken at once, it would have queued a one-push step and opened another round).
    spec = small_spec(fragments=2)
    srv, c, inits, release, entered = _gated_server(make_server, spec, apply_threads=1)
    second = srv.synchronizer.model.fragments[1]
    n = spec.fragments[1].numel
    a, b = (torch.randn(n, generator=torch.Generator().manual_seed(s)) * 0.1 for s in (7, 8))
    assert c.push(0, torch.zeros(spec.fragments[0].numel)).round_version == 1
    assert entered.wait(10)  # the only worker is busy with fragment 0
    assert c.push(1, a).round_version == 1
    assert c.push(1, b, base=0).round_version == 1  # the round waits for the worker, open
    assert second.version == 0 and len(second.admission.round.contributions) == 2
    release.set()
    version, served = c.pull(1, min_version=1, wait_s=10)
    assert version == 1
    torch.testing.assert_close(served, inits[1] - (a + b) / 2)
    assert srv.synchronizer.metrics.outer_steps._value.get() == 2  # one per fragment


@pytest.mark.parametrize("codec_id", [pb.CODEC_FP32, pb.CODEC_INT8], ids=["fp32", "int8"])
def test_pushes_decoded_at_the_outer_step_or_past_the_budget_on_arrival_merge_alike(
    tmp_path, clock, codec_id
):
    # Accepted pushes are held encoded until the outer step, within the payload budget (here two
    # FP32 copies of the fragment); past it they are added on arrival (FP32: from the third push
    # on), into FP32 sums the round takes then, beyond the pool's one and counted. Either way the
    # round merges the same weighted mean, every held byte and buffer is given back, and a
    # duplicate or stale push holds nothing.
    learners = 6
    core, clients, init = _setup(
        tmp_path,
        clock,
        learners,
        payload_budget_bytes=2 * 4 * N,
        quorum=0,
        grace="none",
        outer="sgd",
        outer_lr=1.0,
        token_weight="tokens",
        max_staleness=0,
    )
    frag = core.model.fragments[0]
    deltas = [_vec(100 + i) for i in range(learners)]
    decoded = []
    for i, (c, d) in enumerate(zip(clients, deltas, strict=True)):
        reply = c.push(0, d, codec_id=codec_id, tokens=100 * (i + 1))
        assert reply.outcome == pb.PUSH_ACCEPTED
        decoded.append(
            codec.decode(codec.encode(d, codec_id), layout.make_header(codec_id, N), torch.empty(N))
        )
        if i == 2:  # FP32 past the budget: the round took FP32 sums for it
            assert frag.admission.round is not None
            assert (frag.admission.round.acc is not None) == (codec_id == pb.CODEC_FP32)
        if i == 0:
            assert frag.payloads.held_bytes > 0  # held, not decoded
            dup = c.push(0, d, codec_id=codec_id, seq=c.seq)
            assert dup.outcome == pb.PUSH_DUPLICATE
    version, served = clients[0].pull(0, min_version=1, wait_s=10)
    assert version == 1
    weights = [100.0 * (i + 1) for i in range(learners)]
    mean = sum(w * d for w, d in zip(weights, decoded, strict=True)) / sum(weights)
    torch.testing.assert_close(served, init - mean)
    stale = clients[1].push(0, deltas[1], codec_id=codec_id, base=0)
    assert stale.outcome == pb.PUSH_DROPPED_STALE
    assert frag.payloads.held_bytes == 0
    metric = core.metrics.registry.get_sample_value
    assert metric("diloco_payload_held_bytes") == 0
    assert metric("diloco_payload_pooled_bytes") == frag.payloads.pooled_bytes > 0
    assert metric("diloco_fp32_buffers") == 1  # the open round took the pool's free one
    assert metric("diloco_fp32_buffers_beyond_pool_total") == 0


def test_adaptive_grace_is_sized_by_the_tau_the_learners_report(tmp_path, clock):
    # gamma * (tau * step time - quorum time - apply time), capped; tau from the config when
    # set, else from heartbeats (a learner's H), else 1 step.
    from synchronizer.config import SynchronizerConfig
    from synchronizer.grace import GraceWindow

    cfg = SynchronizerConfig(state_dir=tmp_path, grace="adaptive", grace_gamma=0.5, grace_max_s=3.0)
    grace = GraceWindow(cfg)
    grace.observe(step_time=0.1)
    assert grace.seconds() == pytest.approx(0.05)  # nobody said: tau = 1
    grace.observe(overlap_steps=40)
    assert grace.seconds() == pytest.approx(2.0)
    grace.observe(overlap_steps=100)  # an EMA of what learners report: 0.8 * 40 + 0.2 * 100
    assert grace.seconds() == pytest.approx(0.5 * 52 * 0.1)
    grace.observe(overlap_steps=1000)
    assert grace.seconds() == pytest.approx(3.0)  # capped at grace_max_s
    fixed = GraceWindow(cfg.model_copy(update={"overlap_steps": 10}))
    fixed.observe(step_time=0.1, overlap_steps=100)
    assert fixed.seconds() == pytest.approx(0.5)  # the operator's tau wins

    core, clients, _ = _setup(
        tmp_path, clock, 1, quorum=1, grace="adaptive", grace_gamma=0.5, grace_max_s=30.0
    )
    clients[0].heartbeat(step_time_s=0.05, overlap_steps=100)
    assert core.grace.seconds() == pytest.approx(2.5)


@pytest.mark.parametrize("grace", ["adaptive", "peers"])
def test_peers_grace_waits_for_a_learner_of_the_same_pace_that_drifted_past_the_cap(
    tmp_path, clock, grace
):
    """Two learners pushing every 6 s, 2.5 s apart: past the 1 s cap, so with the adaptive
    grace each of their cycles splits into two rounds of one push. `peers` waits for the one
    due (2.5 s, plus a tenth of its period) and the cycle is one round; the rounds before it
    close at the cap, while the learners' paces are not yet known."""
    core, clients, _ = _setup(
        tmp_path, clock, 2, quorum=1, grace=grace, grace_max_s=1.0, outer="sgd", outer_lr=1.0
    )
    a, b = clients
    a.heartbeat(step_time_s=0.1, overlap_steps=100)  # free time: 100 steps of 0.1 s
    frag = core.model.fragments[0]
    rounds: dict[float, int] = {}
    start = clock.monotonic()
    for i, (c, at) in enumerate([(a, 0.0), (b, 2.5), (a, 6.0), (b, 8.5), (a, 12.0), (b, 14.5)]):
        clock.advance(start + at - clock.monotonic())
        reply = c.push(0, _vec(i), base=frag.version)
        assert reply.outcome == pb.PUSH_ACCEPTED
        rounds[at] = reply.round_version
    assert len(set(rounds[t] for t in (0.0, 2.5, 6.0, 8.5))) == 4  # paces unknown: 1 s each
    assert (rounds[14.5] == rounds[12.0]) == (grace == "peers")
    if grace == "peers":  # both of its learners in: it closes without waiting out its timer
        assert frag.version == rounds[12.0]


def test_paces_await_only_learners_of_the_first_pushers_pace_that_are_due_soon():
    from synchronizer.grace import Paces

    paces = Paces()
    for t in (0.0, 6.0, 12.0):
        paces.pushed("a", t, steps=100)  # every 6 s
    for t in (2.0, 8.0):
        paces.pushed("b", t, steps=100)  # every 6 s, due at 14
    for t in (0.0, 12.0):
        paces.pushed("slow", t + 1.0, steps=100)  # every 12 s, due at 25
    for t in (1.0, 6.5):
        paces.pushed("ahead", t, steps=90)  # every 5.5 s, 90 steps: within a quarter; due at 12
    for t in (1.5, 7.5):
        paces.pushed("short_h", t, steps=33)  # every 6 s, but a third of the steps: slower
    assert paces.due({"a"}, {"b"}, 12.0) == pytest.approx(2.0 + 0.6)
    assert paces.due({"a"}, {"short_h"}, 12.0) == 0.0  # due at 13.5, at a third of the speed
    assert paces.due({"a"}, {"b", "ahead"}, 12.0) == pytest.approx(2.0 + 0.6)
    assert paces.due({"a"}, {"ahead"}, 12.0) == pytest.approx(0.55)  # due now: its slack
    assert paces.due({"a"}, {"slow"}, 24.5) == 0.0  # another pace, however close it is
    assert paces.due({"a"}, {"b"}, 10.0) == 0.0  # due in 4 s of 6: a cycle away
    assert paces.due({"a"}, {"b"}, 17.5) == 0.0  # 3.5 s overdue of 6: stalled
    assert paces.due({"a"}, {"new"}, 12.0) == 0.0  # no pace known
    assert paces.due({"new"}, {"b"}, 12.0) == 0.0  # nothing to compare a pace with


def test_peers_grace_never_waits_past_the_free_time(tmp_path):
    from synchronizer.config import SynchronizerConfig
    from synchronizer.grace import GraceWindow

    cfg = SynchronizerConfig(state_dir=tmp_path, grace="peers", grace_gamma=0.5, grace_max_s=1.0)
    grace = GraceWindow(cfg)
    grace.observe(step_time=0.1, overlap_steps=40)  # free: 4 s; adaptive: min(1, 2)
    assert grace.seconds() == pytest.approx(1.0)
    assert grace.seconds(0.5) == pytest.approx(1.0)  # a peer due sooner: the adaptive grace
    assert grace.seconds(3.0) == pytest.approx(3.0)
    assert grace.seconds(9.0) == pytest.approx(4.0)  # never past the free time
    adaptive = GraceWindow(cfg.model_copy(update={"grace": "adaptive"}))
    adaptive.observe(step_time=0.1, overlap_steps=40)
    assert adaptive.seconds(3.0) == pytest.approx(1.0)  # only `peers` waits for peers


def test_past_the_payload_budget_a_round_with_its_quorum_makes_pushes_wait_then_refuses_them(
    tmp_path, clock, monkeypatch
):
    # The Synchronizer is behind: held pushes fill the budget. A round short of its quorum still
    # takes pushes (held past the budget), one that has its quorum makes the next wait for room
    # and then refuses it RESOURCE_EXHAUSTED before receiving it: no FP32 sums are taken, the
    # learner retries the same seq, and once the round closed and freed its bytes, it is in.
    monkeypatch.setattr(push_module, "PAYLOAD_WAIT_S", 0.5)
    link = layout.encoded_nbytes(pb.CODEC_INT8, N)
    core, clients, _ = _setup(
        tmp_path, clock, 3, payload_budget_bytes=link, quorum=2, grace="fixed", grace_max_s=60.0
    )
    frag = core.model.fragments[0]
    assert clients[0].push(0, _vec(1), codec_id=pb.CODEC_INT8).outcome == pb.PUSH_ACCEPTED
    assert clients[1].push(0, _vec(2), codec_id=pb.CODEC_INT8).outcome == pb.PUSH_ACCEPTED
    assert frag.payloads.held_bytes == 2 * link  # the second held past the budget: quorum needs it
    seq = clients[2].seq + 1
    with pytest.raises(Rejected) as refused:
        clients[2].push(0, _vec(3), codec_id=pb.CODEC_INT8, seq=seq)
    assert refused.value.code == Code.RESOURCE_EXHAUSTED
    assert "payload_budget_bytes" in refused.value.message
    assert core.metrics.payloads_refused._value.get() == 1
    assert frag.admission.round is not None and frag.admission.round.acc is None
    assert frag.version == 0 and len(frag.admission.round.contributions) == 2
    clock.advance(60.0)  # the grace window ends: the round closes
    assert frag.version == 1 and frag.payloads.held_bytes == 0
    again = clients[2].push(0, _vec(3), codec_id=pb.CODEC_INT8, seq=seq)
    assert again.outcome == pb.PUSH_ACCEPTED and again.round_version == 2
