"""The learner's push/pull engine and session against an in-memory fake client: no server, no
sleeps. Every wait is on an event or a condition, bounded by a generous deadline."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch

from learner.config import LearnerConfig
from learner.session import Clock, Transport
from learner.sync import Arrival, SyncEngine
from protos import diloco_pb2 as pb
from tests.fakes import DEADLINE_S, FAST, SIZES, SPEC, FakeClient, arrival, job


def as_transport(fake: FakeClient) -> Transport:
    return fake  # the type checker holds the fake to the protocol the engine needs


def new_engine(fake: FakeClient, **settings: Any) -> SyncEngine:
    cfg = LearnerConfig(**{**FAST, **settings})
    return SyncEngine(
        as_transport(fake),
        cfg,
        SPEC,
        "test",
        Clock(),
        global_params=lambda: [torch.zeros(n) for n in SIZES],
        pin=False,
    )


@pytest.fixture
def fake() -> FakeClient:
    return FakeClient()


@pytest.fixture
def started() -> Iterator[Callable[..., SyncEngine]]:
    """Makes engines that have connected and started; stops them all and checks no thread is left."""
    engines: list[SyncEngine] = []

    def make(fake: FakeClient, **settings: Any) -> SyncEngine:
        engine = new_engine(fake, **settings)
        engines.append(engine)
        engine.connect(DEADLINE_S, lambda: [torch.zeros(n) for n in SIZES])
        engine.start()
        return engine

    yield make
    for engine in engines:
        engine.stop(timeout_s=DEADLINE_S, close_channel=True)
        assert not [t.name for t in engine.threads if t.is_alive()]


def arrivals(engine: SyncEngine, n: int) -> dict[int, Arrival]:
    got = [arrival(engine) for _ in range(n)]
    by_fragment = {a.fragment: a for a in got}
    assert len(by_fragment) == n, f"two arrivals of one fragment: {[a.fragment for a in got]}"
    return by_fragment


# Pushes and pulls ----------------------------------------------------------------------------


def test_a_push_is_sent_and_the_round_that_includes_it_is_merged(fake, started):
    engine = started(fake)
    j = job(0, tokens=10)
    assert engine.submit(j)
    a = arrival(engine)
    assert (a.fragment, a.version, a.job) == (0, 1, j)
    assert torch.equal(a.params, fake.params[0])
    assert fake.calls_of("push") == [(0, j.seq, 0, 10)]
    assert fake.calls_of("pull")[-1] == (
        0,
        1,
        0,
    )  # the round's version, as a delta from the one held
    assert engine.counts() == ({"accepted": 1}, len(SIZES) + 1, 0)
    assert engine.in_flight() == 0 and engine.sync_state() == "idle"


def test_a_fragment_stays_busy_until_its_arrival_is_merged(fake, started):
    engine = started(fake)
    assert engine.submit(job(1))
    a = engine.next_arrival(DEADLINE_S)
    assert a is not None and a.fragment == 1
    assert engine.busy(1) and not engine.submit(job(1))
    assert engine.in_flight() == 1
    engine.merged(1)
    assert not engine.busy(1) and engine.submit(job(1))


def test_a_push_still_unsent_when_the_next_comes_due_is_superseded_under_the_same_seq(
    fake, started
):
    engine = started(fake)
    fake.hold_pushes()
    assert engine.submit(job(0))
    fake.wait_for_call("push")  # the sender is stuck on fragment 0: fragment 1's pushes wait
    first, second = job(1, tokens=5), job(1, tokens=7)
    assert engine.submit(first) and engine.submit(second)
    assert second.seq == first.seq and second.tokens == 12
    fake.release_pushes()
    got = arrivals(engine, 2)
    assert got[1].job is second
    assert [c for c in fake.calls_of("push") if c[0] == 1] == [(1, first.seq, 0, 12)]
    assert [a for a in fake.applied if a[0] == 1] == [(1, first.seq, 12)]
    assert engine.counts()[0] == {"accepted": 2, "superseded": 1}


def test_a_push_on_the_wire_is_not_superseded_and_the_next_goes_once_it_is_merged(fake, started):
    # Superseding a push on the wire under its seq made the newer one a duplicate once the
    # first was applied: its steps were never merged.
    engine = started(fake)
    fake.hold_pushes()
    first = job(2, tokens=5)
    assert engine.submit(first)
    fake.wait_for_call("push")
    assert engine.busy(2) and not engine.submit(job(2, tokens=7))  # the caller defers it
    fake.release_pushes()
    a = arrival(engine)
    assert a.fragment == 2 and a.job is first
    engine.merged(2)
    second = job(2, tokens=7)
    assert engine.submit(second) and second.seq > first.seq
    assert arrival(engine).job is second
    assert [a for a in fake.applied if a[0] == 2] == [(2, first.seq, 5), (2, second.seq, 7)]
    assert "superseded" not in engine.counts()[0]


def test_a_push_whose_send_failed_is_superseded_by_the_next_under_its_seq(fake, started):
    engine = started(fake, retry_initial_s=2.0, retry_max_s=2.0)  # 1-2 s before the retry
    fake.fail_next("push", grpc.StatusCode.UNAVAILABLE, times=1)
    fake.hold_pushes()
    first = job(2, tokens=5)
    assert engine.submit(first)
    fake.wait_for_call("push")  # the failed attempt: the push is unsent, retried after backoff
    with engine.cv:
        assert engine.cv.wait_for(lambda: 2 not in engine.sending, DEADLINE_S)
    second = job(2, tokens=7)
    assert engine.submit(second) and second.seq == first.seq and second.tokens == 12
    fake.release_pushes()
    assert arrival(engine).job is second
    assert [a for a in fake.applied if a[0] == 2] == [(2, first.seq, 12)]


def test_unavailable_is_retried_with_backoff_and_never_raised_into_the_caller(fake, started):
    engine = started(fake)
    fake.fail_next("push", grpc.StatusCode.UNAVAILABLE, times=2)
    fake.fail_next("pull", grpc.StatusCode.UNAVAILABLE, times=2)
    j = job(0)
    assert engine.submit(j)
    a = arrival(engine)
    assert a.job is j and a.version == 1
    assert len(fake.calls_of("push")) == 3
    pushes, _, errors = engine.counts()
    assert pushes == {"accepted": 1} and errors == 4  # the injected failures, and no crash
    assert engine.session.healthy
    assert all(t.is_alive() for t in engine.threads)


@pytest.mark.parametrize(
    ("outcome", "label", "level"),
    [
        (pb.PUSH_DROPPED_STALE, "dropped_stale", logging.INFO),
        (pb.PUSH_REFUSED_NORM, "refused_norm", logging.WARNING),
    ],
    ids=["dropped-stale", "refused-norm"],
)
def test_a_push_dropped_or_refused_leads_to_a_repull_of_its_fragment(
    fake, started, caplog, outcome, label, level
):
    engine = started(fake)
    fake.outcomes.append(outcome)
    with caplog.at_level(logging.DEBUG, logger="learner.sync"):
        assert engine.submit(job(1))
        a = arrival(engine)
        engine.stop(timeout_s=DEADLINE_S)  # the sender logs the outcome after the pull starts
    assert (a.fragment, a.version, a.job) == (1, 0, None)  # a re-sync at the current version
    assert fake.calls_of("pull")[-1][:2] == (1, 0)
    assert fake.applied == []
    assert engine.counts()[0] == {label: 1}
    assert engine.in_flight() == 0
    assert [r.levelno for r in caplog.records if f"push {label}" in r.getMessage()] == [level]


def test_a_push_rejected_as_invalid_is_dropped_and_the_fragment_freed(fake, started):
    engine = started(fake)
    fake.fail_next("push", grpc.StatusCode.INVALID_ARGUMENT)
    assert engine.submit(job(0))
    with engine.cv:
        assert engine.cv.wait_for(lambda: engine.pushes["rejected"] == 1, DEADLINE_S)
    assert engine.in_flight() == 0 and engine.submit(job(0))
    assert arrival(engine).job is not None


def test_a_pull_that_arrives_with_a_bad_payload_is_retried(fake, started):
    from protos.layout import CodecError

    engine = started(fake)
    fake.fail_next("pull", CodecError("checksum mismatch"))
    assert engine.submit(job(2))
    assert arrival(engine).version == 1
    assert engine.counts()[2] == 1


def test_a_crash_in_a_background_loop_is_counted_and_the_loop_restarted(fake, started):
    engine = started(fake)
    fake.fail_next("push", RuntimeError("a bug"))
    j = job(0)
    assert engine.submit(j)
    assert arrival(engine).job is j
    assert engine.counts()[2] == 1
    assert engine.session.healthy  # a bug is not a network failure


# The session: epochs, leases, joins ----------------------------------------------------------


def test_a_new_server_epoch_seen_by_a_pull_leads_to_a_rejoin_and_a_repull_of_every_fragment(
    fake, started
):
    engine = started(fake)
    fake.restart("epoch-2")
    assert engine.submit(job(0))  # answered, then its pull sees the new epoch
    got = arrivals(engine, len(SIZES))
    assert all(a.job is None for a in got.values())  # re-syncs: the push's round is forgotten
    assert fake.calls_of("join") == [("",), ("learner-1",)]
    assert engine.session.epoch == "epoch-2" and engine.session.generation == 1
    assert engine.in_flight() == 0


def test_a_heartbeat_that_sees_a_new_server_epoch_leads_to_a_rejoin_and_a_repull_of_every_fragment(
    fake, started
):
    engine = started(fake, heartbeat_interval_s=0.01)
    fake.restart("epoch-2")
    got = arrivals(engine, len(SIZES))
    assert all(a.job is None and a.version == 0 for a in got.values())
    assert engine.session.epoch == "epoch-2" and engine.session.generation == 1
    assert len(fake.calls_of("join")) == 2


def test_a_push_refused_after_the_lease_lapsed_rejoins_under_the_same_id_and_is_retried(
    fake, started
):
    engine = started(fake)
    fake.fail_next("push", grpc.StatusCode.FAILED_PRECONDITION)
    j = job(1)
    assert engine.submit(j)
    a = arrival(engine)
    assert a.job is j and a.version == 1  # same epoch: nothing is re-pulled
    assert fake.calls_of("join") == [("",), ("learner-1",)]
    assert [c[1] for c in fake.calls_of("push")] == [j.seq, j.seq]
    assert engine.session.generation == 1 and engine.in_flight() == 0


def test_a_push_refused_again_after_a_rejoin_is_dropped_and_its_fragment_repulled(fake, started):
    engine = started(fake)
    fake.fail_next("push", grpc.StatusCode.FAILED_PRECONDITION, times=2)
    assert engine.submit(job(1))
    a = arrival(engine)
    assert (a.fragment, a.job) == (1, None)
    assert engine.counts()[0] == {"rejected": 1}
    assert fake.applied == []


def test_a_forgotten_learner_rejoins_under_its_own_id(fake, started):
    """NOT_FOUND (dead past the Synchronizer's forget_after_s): it joins again as itself, so
    its push replies stay its own; under a new id a push retried after a lost reply would be
    accepted a second time."""
    engine = started(fake)
    fake.fail_next("push", grpc.StatusCode.NOT_FOUND)
    j = job(0)
    assert engine.submit(j)
    assert arrival(engine).job is j
    assert fake.calls_of("join") == [("",), ("learner-1",)]
    assert engine.client.learner_id == "learner-1"
    assert [c[1] for c in fake.calls_of("push")] == [j.seq, j.seq]


def test_a_failed_rejoin_is_recorded_and_retried_not_raised(fake, started):
    engine = started(fake)
    fake.fail_next("push", grpc.StatusCode.FAILED_PRECONDITION)
    fake.fail_next("join", grpc.StatusCode.UNAVAILABLE)
    j = job(2)
    assert engine.submit(j)
    assert arrival(engine).job is j
    assert engine.counts()[2] == 2  # the refused push and the failed re-join


def test_connect_pulls_every_fragment_of_an_existing_model(fake):
    engine = new_engine(fake)
    versions, fetched = engine.connect(
        DEADLINE_S, lambda: pytest.fail("the model exists; nothing to upload")
    )
    assert versions == [0] * len(SIZES)
    assert fetched is not None and all(
        torch.equal(a, b) for a, b in zip(fetched, fake.params, strict=True)
    )
    assert engine.session.epoch == "epoch-1" and engine.client.learner_id == "learner-1"


def test_connect_uploads_the_local_model_when_the_synchronizer_has_none_and_pulls_deltas_from_it(
    fake,
):
    fake.needs_init = True
    engine = new_engine(fake)
    local = [torch.full((n,), 7.0) for n in SIZES]
    versions, fetched = engine.connect(DEADLINE_S, lambda: local)
    assert fetched is None and versions == [0] * len(SIZES)
    assert fake.calls_of("init_model") == [()] and fake.calls_of("pull") == []
    engine.pull(0)
    assert fake.calls_of("pull") == [(0, 0, 0)]  # a delta from the uploaded version


def test_connect_retries_an_unreachable_synchronizer_then_succeeds(fake):
    fake.fail_next("join", grpc.StatusCode.UNAVAILABLE, times=3)
    engine = new_engine(fake)
    versions, _ = engine.connect(DEADLINE_S, lambda: [])
    assert versions == [0] * len(SIZES) and len(fake.calls_of("join")) == 4


def test_connect_gives_up_with_timeout_error_when_the_synchronizer_stays_unreachable(fake):
    fake.fail_next("join", grpc.StatusCode.UNAVAILABLE, times=1000)
    with pytest.raises(TimeoutError, match="could not join"):
        new_engine(fake).connect(0.05, lambda: [])


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (grpc.StatusCode.UNAUTHENTICATED, PermissionError),
        (grpc.StatusCode.PERMISSION_DENIED, PermissionError),
        (grpc.StatusCode.FAILED_PRECONDITION, ValueError),
        (grpc.StatusCode.INVALID_ARGUMENT, ValueError),
    ],
)
def test_connect_raises_at_once_when_refused(fake, code, error):
    fake.fail_next("join", code)
    with pytest.raises(error):
        new_engine(fake).connect(DEADLINE_S, lambda: [])
    assert len(fake.calls_of("join")) == 1


def test_leave_reports_a_failure_instead_of_raising(fake):
    engine = new_engine(fake)
    engine.connect(DEADLINE_S, lambda: [])
    fake.fail_next("leave", grpc.StatusCode.UNAVAILABLE)
    engine.session.leave()
    assert engine.counts()[2] == 1 and not engine.session.healthy
    engine.session.leave()
    assert len(fake.calls_of("leave")) == 2


# Stopping ------------------------------------------------------------------------------------


def test_stop_cancels_a_waiting_pull_and_leaves_no_thread_running(fake):
    fake.close_rounds = False  # the round never closes: the pull waits pull_wait_s (60 s)
    engine = new_engine(fake)
    engine.connect(DEADLINE_S, lambda: [])
    engine.start()
    assert engine.submit(job(0))
    fake.wait_for_call("pull", len(SIZES) + 1)
    engine.stop(timeout_s=DEADLINE_S * 3, close_channel=True)
    assert not [t.name for t in engine.threads if t.is_alive()]
    assert fake.calls_of("pull_cancelled") == [(0,)]
    assert engine.counts()[2] == 0  # a cancellation on stop is not an error


def test_stop_of_an_idle_engine_ends_every_thread(fake):
    engine = new_engine(fake)
    engine.connect(DEADLINE_S, lambda: [])
    engine.start()
    assert len(engine.threads) == len(SIZES) + 2  # sender, pullers, heartbeat
    engine.stop(timeout_s=DEADLINE_S * 3)
    assert not [t.name for t in engine.threads if t.is_alive()]
    assert fake.calls_of("push") == [] and not fake.closed
