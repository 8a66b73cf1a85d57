"""`Learner`'s own policy against the in-memory fake Synchronizer (tests/fakes.py, held to the real
transports' contract): when it pushes, what a merge keeps, strict overlap's timing, re-syncs
after a dropped push, Dynamic Local Updates, and the end. No server, no sleeps: the parameters
move by known amounts (no optimizer), so every merge's result is known exactly."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from learner import Learner
from learner.config import LearnerConfig
from learner.fragments import FragmentPlan
from protos import diloco_pb2 as pb
from tests.fakes import DEADLINE_S, FAST, FakeClient

STEP = 0.01  # what every parameter moves by in one inner step


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


class Run:
    """A model, the fake Synchronizer it syncs with (which has no model yet: the learner's
    parameters become the global ones) and, once `start`ed, its Learner."""

    def __init__(self, fragments: int) -> None:
        self.model, self.fragments = mlp(), fragments
        plan = FragmentPlan(self.model, fragments, LearnerConfig().fragment_strategy)
        self.fake = FakeClient([plan.numel(p) for p in range(len(plan))])
        self.fake.needs_init = True
        self.learner: Learner | None = None

    def start(self, **settings: Any) -> Learner:
        merged: dict[str, Any] = {**FAST, **settings}
        self.learner = Learner(
            self.model, None, transport=self.fake, fragments=self.fragments, **merged
        )
        return self.learner

    def train(self, steps: int) -> None:
        """Inner steps that each move every parameter by STEP, then `Learner.step`."""
        assert self.learner is not None
        for _ in range(steps):
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(STEP)
            self.learner.step(tokens=16)

    def local(self, p: int) -> torch.Tensor:
        assert self.learner is not None
        return self.learner.plan.gather(p)

    def arrived(self, p: int) -> None:
        """Waits until fragment p's result is back, not yet merged."""
        assert self.learner is not None and self.learner.engine is not None
        engine = self.learner.engine
        with engine.cv:
            assert engine.cv.wait_for(lambda: engine.undelivered[p] == 1, DEADLINE_S)


@pytest.fixture
def run() -> Iterator[Any]:
    runs: list[Run] = []

    def make(fragments: int) -> Run:
        runs.append(Run(fragments))
        return runs[-1]

    yield make
    for r in runs:
        if r.learner is not None:
            r.learner.close()


# Strict overlap ------------------------------------------------------------------------------


def test_strict_overlap_with_tau_zero_merges_each_push_before_step_returns(run):
    r = run(2)
    lrn = r.start(
        sync_every=4, codec="int8", merge="overwrite", strict_overlap=True, overlap_steps=0
    )
    for step in range(1, 13):
        before = lrn.stats.fragment_versions
        r.train(1)
        due = {4: 0, 8: 0, 12: 0, 2: 1, 6: 1, 10: 1}.get(step)
        after = lrn.stats.fragment_versions
        if due is None:
            assert after == before
            continue
        assert after[due] == before[due] + 1
        assert torch.equal(r.local(due), r.fake.params[due])  # overwrite: exactly the served
    stats = lrn.stats
    assert stats.blocked_s > 0 and stats.pushes == {"accepted": 6}


def test_strict_overlap_merges_a_result_that_is_back_early_exactly_tau_steps_after_its_push(run):
    # The step a result lands at must not depend on how fast it came back: that is what makes
    # a synchronous run reproducible. And the end (flush) takes what is held at once.
    r = run(1)
    lrn = r.start(sync_every=4, strict_overlap=True, overlap_steps=2)
    r.train(4)  # step 4 pushes
    r.arrived(0)
    r.train(1)
    assert lrn.stats.fragment_versions == (0,)  # back after 1 step: held until tau
    r.train(1)
    assert lrn.stats.fragment_versions == (1,)  # merged at exactly tau = 2
    r.train(2)  # step 8 pushes, 0 steps before the end
    r.arrived(0)
    assert lrn.flush(timeout_s=DEADLINE_S)  # not held past the end
    assert lrn.stats.fragment_versions == (2,)


# What a merge keeps --------------------------------------------------------------------------


def test_a_rebase_merge_keeps_the_local_progress_made_since_the_push(run):
    r = run(1)
    lrn = r.start(sync_every=2, merge="rebase", strict_overlap=True, overlap_steps=1)
    r.train(2)  # pushes the fragment as it is now
    r.train(1)  # one more step of progress, then the round's result is merged
    assert lrn.stats.fragment_versions == (1,)
    assert torch.allclose(r.local(0), r.fake.params[0] + STEP, atol=1e-6)


def test_a_resync_after_a_refused_push_keeps_all_local_progress_since_the_last_merge(run):
    r = run(1)
    lrn = r.start(sync_every=2, merge="rebase", strict_overlap=True, overlap_steps=1)
    r.fake.close_round(0)  # another learner moves the fragment on
    r.fake.outcomes.append(pb.PUSH_REFUSED_NORM)  # nothing of this learner's push is applied
    r.train(3)
    stats = lrn.stats
    assert stats.pushes == {"refused_norm": 1} and stats.fragment_versions == (1,)
    # The fresh fragment plus every step since the global one it held (its own upload).
    assert torch.allclose(r.local(0), r.fake.params[0] + 3 * STEP, atol=1e-6)


def test_a_stale_push_is_dropped_and_the_fragment_repulled_while_strict_overlap_waits(run):
    r = run(1)
    r.fake.max_staleness = 0
    lrn = r.start(sync_every=2, merge="rebase", strict_overlap=True, overlap_steps=0)
    r.train(2)
    assert lrn.stats.fragment_versions == (1,)
    r.fake.close_round(0)  # another learner's round: the next push is one version behind
    r.train(2)
    stats = lrn.stats
    assert stats.pushes == {"accepted": 1, "dropped_stale": 1}
    assert stats.fragment_versions == (2,)  # re-pulled while strict overlap waited
    r.train(2)
    assert lrn.stats.pushes["accepted"] == 2 and lrn.stats.fragment_versions == (3,)


# When it pushes ------------------------------------------------------------------------------


def test_a_fragment_due_while_its_sync_is_in_flight_is_pushed_once_it_is_free_with_all_its_work(
    run,
):
    r = run(1)
    r.fake.close_rounds = False
    r.start(sync_every=2)
    r.train(2)  # step 2 pushes
    # the sender thread's call, not the training loop's: until it is made, a push due later
    # would supersede the queued one instead (one push with both steps' work)
    r.fake.wait_for_call("push", 1)
    r.train(2)  # step 4 is due while that round is still open
    assert r.fake.calls_of("push") == [(0, 1, 0, 32)]
    r.fake.close_round(0)
    r.arrived(0)
    r.train(1)  # merged, and the deferred push goes at once, with steps 3 to 5's tokens
    r.fake.wait_for_call("push", 2)
    assert r.fake.calls_of("push")[1] == (0, 2, 1, 48)


@pytest.mark.parametrize("start_step", [0, 5])
def test_a_learner_started_at_a_later_step_pushes_each_fragment_at_the_runs_steps(run, start_step):
    # H = 4, P = 2: fragment 0 is due at the run's steps 4, 8, 12, fragment 1 at 2, 6, 10. A
    # learner restarted without its state at step 5 must push them at those steps too (its own
    # steps 1, 5 for fragment 1 and 3, 7 for fragment 0), or its pushes never meet the others'.
    r = run(2)
    lrn = r.start(sync_every=4, start_step=start_step)
    pushed: list[tuple[int, int]] = []  # (its own step, fragment)
    for own in range(1, 9):
        before = len(r.fake.applied)
        r.train(1)
        assert lrn.flush()
        pushed += [(own, p) for p, _, _ in r.fake.applied[before:]]
    run_step = {
        p: [s for s in range(1, 9) if (start_step + s - 2 * (p == 1)) % 4 == 0] for p in (0, 1)
    }
    assert sorted(pushed) == sorted((s, p) for p in (0, 1) for s in run_step[p])
    assert lrn.stats.step == 8  # its counters are its own steps


def test_a_learner_told_a_new_h_mid_cycle_still_pushes_its_fragments_in_turn(run):
    # Dynamic Local Updates tells a slow learner a smaller H. Its fragments must still come
    # 0, 1, 2, 3, 0, ...: under the fixed formula (step - offset_p) % H, whichever the new H's
    # residues put first came next, so a synchronous round of one fragment waited for a learner
    # that pushed another.
    r = run(4)
    lrn = r.start(sync_every=12)
    order: list[int] = []
    for step in range(1, 41):
        if step == 7:  # what a heartbeat's reply with the directive sets
            lrn.engine.session.inner_steps = 7
        before = len(r.fake.applied)
        r.train(1)
        assert lrn.flush()
        order += [p for p, _, _ in r.fake.applied[before:]]
    assert lrn.sync_every == 7
    assert order == [(1 + i) % 4 for i in range(len(order))] and len(order) >= 20


@pytest.mark.parametrize(
    ("versions", "first"), [([2, 3, 3, 3], 0), ([4, 4, 3, 3], 2), ([3, 3, 3, 3], 1)]
)
def test_a_learner_joining_a_run_under_way_pushes_first_the_fragment_the_others_are_on(
    run, versions, first
):
    # The others push in turn 1, 2, 3, 0, 1, ...: the fragments whose rounds closed this cycle
    # are a version ahead. A learner back mid-run (here from step 0, so its own turn starts at
    # fragment 1) that pushed fragment 1 while the others were on fragment 0 would put its
    # pushes in rounds out of their order: under strict overlap in a synchronous run it blocks
    # on a round that needs the others' next push, while they block on one that needs its next.
    r = run(4)
    r.fake.needs_init = False
    r.fake.versions = list(versions)
    lrn = r.start(sync_every=8)
    order: list[int] = []
    for _ in range(16):
        before = len(r.fake.applied)
        r.train(1)
        assert lrn.flush()
        order += [p for p, _, _ in r.fake.applied[before:]]
    assert order == [(first + i) % 4 for i in range(len(order))] and len(order) == 8


def test_start_step_is_refused_with_a_state_or_below_zero(run):
    r = run(1)
    with pytest.raises(ValueError, match="start_step must be an integer >= 0"):
        r.start(start_step=-1)
    with pytest.raises(ValueError, match="starts without its state"):
        r.start(start_step=3, state={"format": 1})
    assert not r.fake.calls_of("join")  # refused before anything was joined


def test_a_dynamic_local_updates_directive_replaces_sync_every(run):
    r = run(2)
    r.fake.inner_steps = 5
    lrn = r.start(sync_every=50)
    r.train(1)
    assert lrn.stats.sync_every == 5 and lrn.schedule.sync_every == 5


# The end -------------------------------------------------------------------------------------


def test_finish_ends_on_the_served_parameters_and_leaves(run):
    r = run(2)
    lrn = r.start(sync_every=2, merge="mix", alpha=0.5)
    r.train(7)
    lrn.finish()
    assert all(torch.equal(r.local(p), r.fake.params[p]) for p in range(2))
    stats = lrn.stats
    assert list(stats.fragment_versions) == r.fake.versions and stats.sync_state == "closed"
    assert r.fake.calls_of("leave") == [()] and r.fake.closed


@pytest.mark.parametrize("final_push", [True, False])
def test_finish_pushes_every_step_not_yet_pushed_and_merges_its_round(run, final_push):
    # H = 2, P = 2: fragment 0 pushes at steps 2, 4, 6 and fragment 1 at 1, 3, 5, 7, so step 7
    # of fragment 0 is in no push when the run ends.
    r = run(2)
    lrn = r.start(sync_every=2, merge="overwrite", final_push=final_push)
    for _ in range(7):
        r.train(1)
        assert lrn.flush()  # each round merged before the next step: no push is deferred
    lrn.finish()
    pushed = [[tokens for p, _, tokens in r.fake.applied if p == f] for f in range(2)]
    assert pushed[1] == [16, 32, 32, 32]
    if final_push:
        assert pushed[0] == [32, 32, 32, 16]  # every step's tokens reached the Synchronizer
        assert r.fake.versions == [4, 4]
    else:
        assert pushed[0] == [32, 32, 32]
        assert r.fake.versions == [3, 4]
    assert all(torch.equal(r.local(p), r.fake.params[p]) for p in range(2))
    assert r.fake.calls_of("leave") == [()]


def test_finish_pushes_nothing_more_when_the_last_step_was_pushed(run):
    r = run(1)
    lrn = r.start(sync_every=2)
    for _ in range(8):
        r.train(1)
        assert lrn.flush()
    lrn.finish()  # the push at step 8 holds every step
    assert [tokens for _, _, tokens in r.fake.applied] == [32, 32, 32, 32]


def test_a_learner_stopping_as_its_last_pushes_are_answered_still_says_it_pushes_nothing_more(
    run,
):
    # finish() stops the threads right after its last pushes are answered (at once against the
    # fake): the heartbeat saying so must not be lost to the stop, or the final pulls may wait
    # on rounds that wait for this learner.
    r = run(2)
    lrn = r.start(sync_every=2)
    engine = lrn.engine
    assert engine is not None
    with engine.session.lock:  # both before the heartbeat thread looks
        engine.session.done_pushing()
        engine.stopping.set()
    engine.stop()
    assert [c for c in r.fake.calls_of("heartbeat") if c[-1] is True]


def test_finish_says_it_pushes_nothing_more_once_its_last_pushes_are_answered(run):
    # A synchronous round waits for every live learner: one that finished and waits for its
    # last rounds must say it pushes nothing more, or rounds it will never push to (which the
    # learners still training may need closed first) wait for it until it leaves.
    r = run(2)
    lrn = r.start(sync_every=2, merge="overwrite")
    r.train(3)  # fragment 0 pushed at step 2: step 3 is in no push yet
    assert lrn.flush()
    pushed = len(r.fake.calls_of("push"))
    r.fake.hold_pushes()
    finisher = threading.Thread(target=lrn.finish)
    finisher.start()
    r.fake.wait_for_call("push", pushed + 1)  # the final push, unanswered
    assert not r.fake.calls_of("heartbeat"), "said while a push was unanswered"
    r.fake.release_pushes()
    finisher.join(DEADLINE_S)
    assert not finisher.is_alive()
    calls = [c[0] for c in r.fake.calls]
    said = next(i for i, c in enumerate(r.fake.calls) if c[0] == "heartbeat" and c[-1] is True)
    last_push = len(calls) - 1 - calls[::-1].index("push")
    assert last_push < said < calls.index("leave")
