"""The Synchronizer's policies at the core, without gRPC and without sleeping: time is a
`ManualClock` the test moves, housekeeping is `tick()`, and RPCs are the core's own methods
called with the wire's messages. What needs a real server (status codes on the wire, streams,
TLS, processes) is tested elsewhere against one on port 0.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from protos import diloco_pb2 as pb
from protos.initmodel import init_model_requests
from protos.spec import ModelSpec
from synchronizer.clock import ManualClock
from synchronizer.core import Synchronizer
from synchronizer.errors import Code, Rejected
from synchronizer.leases import RECORDS_PER_SLOT
from synchronizer.streams import IDENTIFY_S, Call
from tests.core_helpers import CoreClient, clock, make_core
from tests.helpers import small_spec

__all__ = ["clock"]  # the fixture

WAIT_S = 10.0  # bounds the one wait on another thread (a stalled upload)


def make(tmp_path: Path, clock: ManualClock, **settings: Any) -> tuple[Synchronizer, ModelSpec]:
    settings = {"lease_s": 10.0, "token_weight": "uniform", **settings}
    return make_core(tmp_path, clock, **settings), small_spec()


def initialised(core: Synchronizer, spec: ModelSpec, names: Sequence[str]) -> list[CoreClient]:
    learners = [CoreClient(core, spec, name) for name in names]
    for learner in learners:
        learner.join()
    learners[0].init([torch.zeros(f.numel) for f in spec.fragments])
    return learners


def version(core: Synchronizer, fid: int = 0) -> int:
    return core.model.fragment(fid).version


def params(core: Synchronizer, fid: int = 0) -> torch.Tensor:
    served = core.model.fragment(fid).model.params
    assert served is not None
    return served


def killed(core: Synchronizer) -> None:
    """Ends a core as kill -9 would as far as its state directory knows: what the log holds
    stays, nothing is flushed, no checkpoint is written."""
    assert core.model.rounds is not None
    core.model.rounds.shutdown()
    core.journal.close()


def test_round_with_its_quorum_waits_out_the_grace_window_on_the_clock_then_closes(tmp_path, clock):
    core, spec = make(tmp_path, clock, quorum=2, grace="fixed", grace_max_s=3.0)
    try:
        a, b, _c = initialised(core, spec, ["a", "b", "c"])
        n = spec.fragments[0].numel
        assert a.push(0, torch.ones(n)).outcome == pb.PUSH_ACCEPTED
        assert clock.pending() == 0  # one contribution: no quorum, no timer
        assert b.push(0, torch.ones(n)).outcome == pb.PUSH_ACCEPTED
        assert clock.pending() == 1  # quorum: the grace timer is armed, c may still come
        clock.advance(2.999)
        frag = core.model.fragment(0)
        assert frag.version == 0 and frag.admission.round is not None
        clock.advance(0.002)  # the window ends: the round closes without c
        assert version(core) == 1
        assert core.metrics.registry.get_sample_value("diloco_outer_steps_total") == 1
    finally:
        core.close()


def test_round_closes_at_once_when_every_live_learner_contributed(tmp_path, clock):
    core, spec = make(tmp_path, clock, quorum=1, grace="fixed", grace_max_s=60.0)
    try:
        a, b = initialised(core, spec, ["a", "b"])
        n = spec.fragments[0].numel
        a.push(0, torch.ones(n))
        assert clock.pending() == 1  # quorum 1 reached: waiting for b within the window
        b.push(0, torch.ones(n))  # everyone is in: no need to wait
        assert version(core) == 1
        assert clock.now == ManualClock().now  # no time passed at all
    finally:
        core.close()


def test_synchronous_round_stops_waiting_for_a_learner_whose_lease_lapsed(tmp_path, clock):
    core, spec = make(tmp_path, clock, quorum=0, lease_s=10.0)
    try:
        a, b = initialised(core, spec, ["a", "b"])
        n = spec.fragments[0].numel
        a.push(0, torch.ones(n))
        clock.advance(9.0)
        core.tick()
        assert core.model.fragment(0).version == 0  # b is alive: synchronous waits for it
        a.heartbeat()
        clock.advance(1.5)  # b's lease lapses; a's was renewed
        core.tick()  # the reaper marks b dead and the round no longer waits for it
        assert version(core) == 1
        assert core.registry.counts() == {"alive": 1, "dead": 1}
        with pytest.raises(Rejected) as lapsed:
            b.push(1, torch.ones(spec.fragments[1].numel))
        assert lapsed.value.code == Code.FAILED_PRECONDITION
        assert lapsed.value.reason == "lease_expired"
        assert b.join(again=True).learner_id == b.learner_id  # it comes back as itself
        assert core.registry.counts() == {"alive": 2, "dead": 0}
    finally:
        core.close()


def test_a_learner_whose_lease_lapsed_may_still_leave(tmp_path, clock):
    core, spec = make(tmp_path, clock, lease_s=5.0)
    try:
        (a,) = initialised(core, spec, ["a"])
        clock.advance(60.0)
        core.tick()
        assert core.registry.counts() == {"alive": 0, "dead": 1}
        a.leave()  # nothing of it is left to refuse
        assert core.registry.learners[a.learner_id].state == "left"
        with pytest.raises(Rejected) as gone:
            a.leave()
        assert gone.value.code == Code.NOT_FOUND
    finally:
        core.close()


def test_dead_learners_unpushed_work_is_lost_and_capacity_follows_the_clock(tmp_path, clock):
    core, spec = make(tmp_path, clock, quorum=1, grace="none", lease_s=10.0)
    try:
        a, b = initialised(core, spec, ["a", "b"])
        core.tick()  # capacity counts from here
        n0, n1 = (f.numel for f in spec.fragments)
        share0 = n0 / spec.numel
        core.heartbeat(
            pb.HeartbeatRequest(
                learner_id=b.learner_id,
                session=b.session,
                counters=pb.LearnerCounters(steps=10, tokens=500, compute_s=4.0),
            )
        )
        a.push(0, torch.ones(n0), tokens=100, compute_s=2.0)
        assert version(core) == 1
        clock.advance(4.0)
        a.heartbeat()
        core.tick()  # 4 s x 2 learners of capacity
        reg = core.metrics.registry
        assert reg.get_sample_value("diloco_learner_capacity_seconds_total") == pytest.approx(8.0)
        merged = reg.get_sample_value("diloco_compute_seconds_total", {"bucket": "merged"})
        assert merged == pytest.approx(2.0 * share0)
        assert core.goodput.ratio() == pytest.approx(2.0 * share0 / 8.0)
        clock.advance(7.0)  # b's lease (renewed at the heartbeat) lapses
        core.tick()
        lost = reg.get_sample_value("diloco_compute_seconds_total", {"bucket": "lost"})
        assert lost == pytest.approx(4.0)  # b reported 4 s and pushed none of it
    finally:
        core.close()


def test_admission_drops_stale_pushes_and_answers_a_repeated_seq_without_applying_it(
    tmp_path, clock
):
    core, spec = make(tmp_path, clock, quorum=1, grace="none", max_staleness=1)
    try:
        a, b = initialised(core, spec, ["a", "b"])
        n = spec.fragments[0].numel
        for v in (1, 2):
            assert a.push(0, torch.ones(n), base=v - 1).outcome == pb.PUSH_ACCEPTED
            assert version(core) == v
        stale = b.push(0, torch.ones(n), base=0)  # 2 versions behind, max_staleness 1
        assert stale.outcome == pb.PUSH_DROPPED_STALE and stale.staleness == 2
        before = params(core).clone()
        again = a.push(0, torch.full((n,), 5.0), base=2, seq=a.seq)  # a retry of seq 2
        assert again.outcome == pb.PUSH_DUPLICATE
        assert core.model.fragment(0).admission.round is None
        assert torch.equal(params(core), before)
    finally:
        core.close()


def test_log_replay_restores_versions_open_rounds_and_duplicate_answers(tmp_path, clock):
    settings: dict[str, Any] = {"quorum": 2, "grace": "fixed", "grace_max_s": 60.0, "wal": True}
    settings["lease_s"] = 600.0
    core, spec = make(tmp_path, clock, **settings)
    a, b, c = initialised(core, spec, ["a", "b", "c"])
    n = spec.fragments[0].numel
    a.push(0, torch.full((n,), 1.0))
    b.push(0, torch.full((n,), 3.0))
    clock.advance(60.0)  # grace over: the round of a and b closes
    assert version(core) == 1
    served = params(core).clone()
    assert c.push(0, torch.full((n,), 2.0), base=1).outcome == pb.PUSH_ACCEPTED  # open round
    killed(core)  # no final flush, no checkpoint past the first

    again, _ = make(tmp_path, ManualClock(), **settings)
    try:
        frag = again.model.fragment(0)
        assert frag.version == 1 and torch.equal(params(again), served)
        assert frag.admission.round is not None
        assert [x.learner_id for x in frag.admission.round.contributions] == [c.learner_id]
        c.core = again
        retry = c.push(0, torch.full((n,), 2.0), base=1, seq=c.seq)
        assert retry.outcome == pb.PUSH_DUPLICATE
    finally:
        again.close()


def test_a_round_refused_at_its_outer_step_counts_as_refused_in_goodput_on_replay_too(
    tmp_path, clock
):
    # One close path for the worker and the replay: a round whose merged delta cannot be
    # applied is refused, its contributions discarded, the fragment stays healthy, and the
    # replay of the same log says the same.
    settings: dict[str, Any] = {"quorum": 1, "grace": "none", "wal": True}
    core, spec = make(tmp_path, clock, **settings)
    (a,) = initialised(core, spec, ["a"])
    n = spec.fragments[0].numel
    assert a.push(0, torch.full((n,), 3e38)).outcome == pb.PUSH_ACCEPTED
    frag = core.model.fragment(0)
    assert core.metrics.registry.get_sample_value("diloco_rounds_refused_total") == 1
    assert frag.version == 1 and core.unhealthy is None
    counts = discarded_and_merged(core)
    killed(core)

    again, _ = make(tmp_path, ManualClock(), **settings)
    try:
        assert again.model.fragment(0).version == 1 and again.unhealthy is None
        assert discarded_and_merged(again) == counts
    finally:
        again.close()


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_a_checkpoint_starts_once_the_log_grew_by_checkpoint_wal_bytes_and_frees_it(
    tmp_path, clock, ratio
):
    # No interval: the log's growth alone starts a checkpoint, one per growth, however little
    # time passed, and the segments it covers are deleted. With checkpoint_log_ratio, the
    # growth must also reach that many times the newest checkpoint's size (over 64 KiB here,
    # its header's room): a checkpoint writes no more than the log did.
    settings: dict[str, Any] = {"quorum": 1, "grace": "none", "wal": True}
    core, spec = make(
        tmp_path, clock, checkpoint_wal_bytes=8192, checkpoint_log_ratio=ratio, **settings
    )
    try:
        (a,) = initialised(core, spec, ["a"])
        n = spec.fragments[0].numel
        reg = core.metrics.registry
        written = reg.get_sample_value("diloco_checkpoints_total") or 0
        bound = max(8192, ratio * core.state.size)
        assert core.state.size > 8192
        while core.journal.written_bytes() < bound:
            core.tick()
            assert core.checkpointer is None  # not grown enough yet
            assert a.push(0, torch.full((n,), 1e-3), base=version(core)).outcome == pb.PUSH_ACCEPTED
        assert (reg.get_sample_value("diloco_wal_bytes") or 0) >= bound
        core.tick()
        started = core.checkpointer
        assert started is not None
        started.join(WAIT_S)
        assert reg.get_sample_value("diloco_checkpoints_total") == written + 1
        assert reg.get_sample_value("diloco_wal_bytes") == 0  # every segment it covers is gone
        core.tick()  # the log has not grown since: nothing more to do
        assert core.checkpointer is started
    finally:
        core.close()


def test_the_interval_checkpoint_waits_for_a_checkpoints_bytes_of_log_for_ten_intervals_at_most(
    tmp_path, clock
):
    # With the log, the interval's checkpoint waits until the log holds as many bytes as the
    # newest checkpoint (checkpoint_log_ratio 1, the default), or ten intervals have passed.
    settings: dict[str, Any] = {"quorum": 1, "grace": "none", "wal": True}
    core, spec = make(tmp_path, clock, checkpoint_interval_s=60.0, lease_s=3600.0, **settings)
    try:
        (a,) = initialised(core, spec, ["a"])
        n = spec.fragments[0].numel
        core.tick()
        mark = core.journal.written_bytes()
        assert a.push(0, torch.full((n,), 1e-3), base=version(core)).outcome == pb.PUSH_ACCEPTED
        assert 0 < core.journal.written_bytes() - mark < core.state.size
        for _ in range(9):
            clock.advance(60.0)
            core.tick()
            assert core.checkpointer is None  # the log holds less than a checkpoint
        clock.advance(60.0)
        core.tick()  # ten intervals: written all the same
        assert core.checkpointer is not None
        core.checkpointer.join(WAIT_S)
        first = core.checkpointer
        while core.journal.written_bytes() - core.checkpoint_mark < core.state.size:
            assert a.push(0, torch.full((n,), 1e-3), base=version(core)).outcome == pb.PUSH_ACCEPTED
        core.tick()
        assert core.checkpointer is first  # enough log, but not an interval yet
        clock.advance(60.0)
        core.tick()
        assert core.checkpointer is not first
    finally:
        core.close()


@pytest.mark.parametrize("wal", [True, False])
def test_an_idle_model_is_not_rewritten_each_interval_and_its_checkpoint_stays_current(
    tmp_path, clock, wal
):
    # Nothing served or logged since the newest checkpoint: the interval writes nothing, and the
    # gauge the checkpoint-age alert reads says the newest is current. A version served since
    # (without the log, the only change a checkpoint holds) is written at the interval.
    settings: dict[str, Any] = {"quorum": 1, "grace": "none", "wal": wal}
    core, spec = make(
        tmp_path,
        clock,
        checkpoint_interval_s=60.0,
        checkpoint_log_ratio=0,
        lease_s=3600.0,
        **settings,
    )
    try:
        (a,) = initialised(core, spec, ["a"])
        gauge = "diloco_checkpoint_last_success_timestamp_seconds"
        reg = core.metrics.registry
        written = reg.get_sample_value("diloco_checkpoints_total")
        clock.advance(60.0)
        core.tick()  # the Join and the first checkpoint's covered records: one more, then idle
        if core.checkpointer is not None:
            core.checkpointer.join(WAIT_S)
            written = reg.get_sample_value("diloco_checkpoints_total")
        for _ in range(3):
            clock.advance(60.0)
            core.tick()
            assert reg.get_sample_value("diloco_checkpoints_total") == written
            assert reg.get_sample_value(gauge) == clock.wall()
        assert a.push(
            0, torch.full((spec.fragments[0].numel,), 1e-3), base=version(core)
        ).outcome == (pb.PUSH_ACCEPTED)
        assert version(core) == 1
        stale = clock.wall()
        clock.advance(60.0)
        core.tick()
        assert core.checkpointer is not None
        core.checkpointer.join(WAIT_S)
        assert reg.get_sample_value("diloco_checkpoints_total") == (written or 0) + 1
        assert reg.get_sample_value(gauge) > stale
        assert not core.state.changed()  # it holds everything up to its seal
        clock.advance(60.0)
        core.tick()
        assert reg.get_sample_value("diloco_checkpoints_total") == (written or 0) + 1
    finally:
        core.close()


def discarded_and_merged(core: Synchronizer) -> tuple[float | None, float | None]:
    reg = core.metrics.registry
    return (
        reg.get_sample_value("diloco_tokens_total", {"bucket": "discarded"}),
        reg.get_sample_value("diloco_tokens_total", {"bucket": "merged"}),
    )


def test_stalled_init_upload_loses_its_claim_after_init_stall_s_on_the_clock(tmp_path, clock):
    core, spec = make(tmp_path, clock, init_stall_s=30.0, lease_s=60.0)
    try:
        a, b = CoreClient(core, spec, "a"), CoreClient(core, spec, "b")
        a.join()
        b.join()
        flats = [torch.zeros(f.numel) for f in spec.fragments]
        claimed, resume = threading.Event(), threading.Event()

        def stalling() -> Iterator[pb.InitModelRequest]:
            messages = init_model_requests(a.learner_id, a.session, spec.spec_hash, flats, 1000)
            yield next(messages)  # InitStart: the upload claims the model
            claimed.set()
            resume.wait(WAIT_S)  # then stops sending
            yield from messages

        outcome: list[BaseException | pb.InitModelReply] = []

        def upload() -> None:
            try:
                outcome.append(core.init_model(stalling()))
            except Rejected as e:
                outcome.append(e)

        uploader = threading.Thread(target=upload)
        uploader.start()
        assert claimed.wait(WAIT_S)
        with pytest.raises(Rejected) as busy:
            b.init(flats)
        assert busy.value.code == Code.ALREADY_EXISTS and a.learner_id in busy.value.message
        clock.advance(31.0)  # no progress for longer than init_stall_s
        b.heartbeat()
        ones = [torch.ones(f.numel) for f in spec.fragments]
        assert len(b.init(ones).versions) == len(spec.fragments)  # b takes over
        resume.set()
        uploader.join(WAIT_S)
        (refused,) = outcome
        assert isinstance(refused, Rejected) and refused.code == Code.ALREADY_EXISTS
        assert "took over" in refused.message
        assert torch.equal(params(core), ones[0])  # b's upload; a's late end changed nothing
    finally:
        core.close()


def test_idle_streams_are_cut_at_their_deadline_on_the_clock(tmp_path, clock):
    # A transfer must move every stream_idle_s; the housekeeping tick cancels it through its
    # call otherwise (tested here on the clock; the gRPC side of a cancel in
    # tests/test_leases_transfer.py).
    core, spec = make(tmp_path, clock, stream_idle_s=30.0)
    try:
        (a,) = initialised(core, spec, ["a"])
        cancelled: list[str] = []
        with (
            core.streams.transfer(
                "push", a.learner_id, Call(cancel=lambda: cancelled.append("push"))
            ),
            core.streams.transfer(
                "pull", a.learner_id, Call(cancel=lambda: cancelled.append("pull"))
            ) as pull,
        ):
            clock.advance(20.0)
            pull.touch()  # progress moves its deadline
            clock.advance(10.1)
            core.tick()
            assert cancelled == ["push"]
            clock.advance(19.8)
            core.tick()
            assert cancelled == ["push"]
            clock.advance(0.2)
            core.tick()
            assert cancelled == ["push", "pull"]
            cut = core.metrics.registry.get_sample_value
            assert cut("diloco_streams_cut_total", {"kind": "push"}) == 1
            assert cut("diloco_streams_cut_total", {"kind": "pull"}) == 1
    finally:
        core.close()


def test_calls_without_a_first_message_are_cut_at_the_deadline_or_by_newer_ones(tmp_path, clock):
    # Before its first message a call holds one place (per peer and in all) and nothing else;
    # it is cut after IDENTIFY_S, or sooner by a newer call: its own peer's oldest at the
    # peer's limit, else the oldest of the peer holding the most.
    core, _ = make(tmp_path, clock, max_unidentified_per_peer=2, max_unidentified_streams=3)
    gate = core.streams.first_messages
    cancelled: list[str] = []
    try:
        with contextlib.ExitStack() as held:

            def call(peer: str, name: str) -> None:
                held.enter_context(gate.waiting(peer, "m", lambda: cancelled.append(name)))
                clock.advance(0.1)

            call("A", "a1")
            call("A", "a2")
            call("A", "a3")  # A at its limit of 2: its own oldest goes
            assert cancelled == ["a1"] and gate.held("A") == 2
            call("B", "b1")  # 3 in all, the limit
            call("C", "c1")  # all full: the oldest of the fullest peer (A) goes, not B's
            assert cancelled == ["a1", "a2"]
            assert (gate.held("A"), gate.held("B"), gate.held("C"), gate.held()) == (1, 1, 1, 3)
            assert core.streams.transfers == 0  # none of them holds a transfer slot
            clock.advance(IDENTIFY_S - 0.25)  # a3 has waited IDENTIFY_S + 0.05, b1 and c1 less
            core.tick()
            assert cancelled == ["a1", "a2", "a3"]
            clock.advance(0.2)
            core.tick()
            assert sorted(cancelled[3:]) == ["b1", "c1"] and gate.held() == 0
        cut = core.metrics.registry.get_sample_value
        assert cut("diloco_streams_cut_total", {"kind": "unidentified"}) == 5
    finally:
        core.close()


def test_every_reported_token_ends_in_one_bucket_merged_discarded_or_lost(tmp_path, clock):
    core, _ = make(tmp_path, clock, quorum=1, grace="none", lease_s=2.0, max_staleness=0)
    spec = small_spec(sizes=(300, 100), fragments=2)
    try:
        a, b = CoreClient(core, spec, "a"), CoreClient(core, spec, "b")
        a.join()
        b.join()
        a.init([torch.zeros(f.numel) for f in spec.fragments])
        share = spec.fragments[0].numel / spec.numel
        a.heartbeat(steps=20, tokens=2000, compute_s=4.0)
        assert buckets(core)["in_flight"] == pytest.approx(2000)
        a.push(0, torch.ones(spec.fragments[0].numel), tokens=1000, steps=10)  # merged (K=1)
        b.heartbeat(steps=10, tokens=1000, compute_s=2.0)
        dropped = b.push(0, torch.ones(spec.fragments[0].numel), base=0, tokens=1000, steps=10)
        assert dropped.staleness == 1  # stale: discarded
        got = buckets(core)
        assert got["merged"] == pytest.approx(1000 * share)
        assert got["discarded"] == pytest.approx(1000 * share)
        assert got["in_flight"] == pytest.approx(3000 - 2000 * share)
        clock.advance(2.1)  # both leases lapse: what they reported but never pushed is lost
        core.tick()
        got = buckets(core)
        assert got["lost"] == pytest.approx(3000 - 2000 * share)
        assert got["in_flight"] == pytest.approx(0)
        assert sum(got.values()) == pytest.approx(3000)
    finally:
        core.close()


def test_work_counted_lost_when_a_lease_lapsed_is_not_counted_again_once_the_learner_pushes_it(
    tmp_path, clock
):
    """A learner cut off by a partition (not crashed) comes back as itself and pushes the work
    its lapsed lease had written off: that part stays lost, so no token is in two buckets."""
    core, _ = make(tmp_path, clock, quorum=1, grace="none", lease_s=2.0)
    spec = small_spec(sizes=(300, 100), fragments=2)
    try:
        a = CoreClient(core, spec, "a")
        a.join()
        a.init([torch.zeros(f.numel) for f in spec.fragments])
        a.heartbeat(steps=20, tokens=2000, compute_s=4.0)
        clock.advance(2.1)  # cut off: its lease lapses, the 2000 tokens it never pushed are lost
        core.tick()
        assert buckets(core)["lost"] == pytest.approx(2000)
        a.join(again=True)  # back, as itself
        a.heartbeat(steps=30, tokens=3000, compute_s=6.0)
        for p, f in enumerate(spec.fragments):  # what it trained before and after the partition
            pushed = a.push(p, torch.ones(f.numel), tokens=3000, steps=30, compute_s=6.0)
            assert pushed.outcome == pb.PUSH_ACCEPTED
        got = buckets(core)
        assert got["lost"] == pytest.approx(2000)
        assert got["merged"] == pytest.approx(1000)
        assert sum(got.values()) == pytest.approx(3000)
        reg = core.metrics.registry
        compute = {
            b: reg.get_sample_value("diloco_compute_seconds_total", {"bucket": b})
            for b in ("merged", "lost")
        }
        assert compute == {"merged": pytest.approx(2.0), "lost": pytest.approx(4.0)}
        a.leave()  # gone for good: nothing of it is written off any more
        assert core.goodput.written_off == {}
    finally:
        core.close()


def buckets(core: Synchronizer) -> dict[str, float]:
    reg = core.metrics.registry
    out = {
        bucket: reg.get_sample_value("diloco_tokens_total", {"bucket": bucket}) or 0.0
        for bucket in ("merged", "discarded", "lost")
    }
    out["in_flight"] = reg.get_sample_value("diloco_tokens_in_flight") or 0.0
    return out


def test_learners_that_are_gone_hold_no_slot_and_records_stay_bounded(tmp_path, clock):
    core, spec = make(tmp_path, clock, max_learners=2, lease_s=1.0)
    try:
        for name in ("a", "b"):
            CoreClient(core, spec, name).join()
        with pytest.raises(Rejected) as full:
            CoreClient(core, spec, "c").join()
        assert full.value.code == Code.RESOURCE_EXHAUSTED
        clock.advance(1.1)  # their leases lapse: the slots are free long before forget_after_s
        CoreClient(core, spec, "c").join()
        cycling = CoreClient(core, spec, "cycling")
        for _ in range(5 * RECORDS_PER_SLOT * 2):  # join/leave cycles do not grow the registry
            cycling.join()  # a new learner id each time
            cycling.leave()
        assert len(core.registry.learners) <= RECORDS_PER_SLOT * 2
        assert len(core.status().learners) <= RECORDS_PER_SLOT * 2
    finally:
        core.close()
