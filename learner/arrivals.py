"""How global fragments coming back reach a learner's model: each arrival (a round's result, or
a re-sync) is merged into the local parameters after an optimizer step (`merge`: the settings'
merge rule against the fragment's anchor), or, with `strict_overlap`, held until exactly tau
steps after its push and waited for (bounded) when late (`wait_overlap`). `Learner` calls these
on the ranks that talk to the Synchronizer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from learner.fragments import merge_fragment
from learner.sync import Arrival

if TYPE_CHECKING:
    from learner.learner import Learner

logger = logging.getLogger(__name__)


def take_all(learner: Learner) -> set[int]:
    """Takes every arrival waiting (`take`); the fragments merged."""
    assert learner.engine is not None
    merged: set[int] = set()
    while (arrival := learner.engine.next_arrival()) is not None:
        take(learner, arrival, merged)
    return merged


def take(learner: Learner, a: Arrival, merged: set[int]) -> None:
    """Merges an arrival, or (strict_overlap) holds a round's result that came back before
    its tau until `wait_overlap` merges it at exactly tau."""
    if not learner.flushing and learner.overlap.hold(a, learner.clock.step):
        return
    merge_held(learner, [a.fragment], merged)  # a re-sync overtook a held result: that first
    merge(learner, a)
    merged.add(a.fragment)


def merge_held(learner: Learner, fragments: list[int] | None, merged: set[int]) -> None:
    for a in learner.overlap.release(fragments):
        merge(learner, a)
        merged.add(a.fragment)


@torch.no_grad()
def merge(learner: Learner, a: Arrival) -> None:
    """The arrival's fresh global fragment into the model, by the merge rule; it becomes the
    fragment's base (what the next outer gradient is measured from)."""
    assert learner.engine is not None
    p, cfg = a.fragment, learner.cfg
    fresh = a.params.to(learner.device, non_blocking=True)
    theta = learner.plan.gather(p, learner.device)
    # A round's result keeps the progress since the push; a re-sync all local progress.
    anchor = a.job.theta_at_push if a.job is not None else learner.base[p]
    learner.plan.scatter(p, merge_fragment(cfg.merge, theta, fresh, anchor, cfg.alpha))
    learner.base[p] = fresh  # replaced, never modified in place (a re-join may read it)
    learner.versions[p] = a.version
    if a.job is not None:
        learner.ef.commit(p, a.job.residual)
    learner.merges += 1
    learner.overlap.merged(p)
    learner.engine.merged(p)
    logger.debug(
        "learner=%s fragment=%d version=%d merged (%s) at step %d",
        learner.learner_id,
        p,
        a.version,
        "round" if a.job else "re-sync",
        learner.clock.step,
    )


def merge_until(
    learner: Learner, done: Callable[[], bool], deadline: float, merged: set[int]
) -> bool:
    """Merges arrivals as they come until `done()` or the monotonic deadline; True if done."""
    assert learner.engine is not None
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        arrival = learner.engine.next_arrival(min(left, 0.1))
        if arrival is None:
            continue
        take(learner, arrival, merged)
    return True


def wait_overlap(learner: Learner) -> set[int]:
    """strict_overlap: waits for fragments pushed at least tau steps ago (bounded)."""
    overlap, cfg = learner.overlap, learner.cfg
    merged: set[int] = set()
    late = overlap.due(learner.clock.step)
    if not late:
        return merged
    merge_held(learner, late, merged)
    t0 = time.perf_counter()
    deadline = time.monotonic() + cfg.pull_wait_s + cfg.rpc_timeout_s
    # Through an outage too (bounded): a Synchronizer restarting keeps what it acknowledged,
    # and the result lands at the same step as if it had not been down.
    if not merge_until(learner, lambda: not overlap.waiting(late), deadline, merged):
        logger.warning(
            "learner=%s strict overlap: fragments %s not back in time, carrying on",
            learner.learner_id,
            overlap.waiting(late),
        )
    overlap.forget(late)  # wait for a push at most once
    learner.clock.blocked_s += time.perf_counter() - t0
    return merged


def drain(learner: Learner, deadline: float, merged: set[int]) -> bool:
    """The end (`Learner.flush`): every result merged as it comes, held ones first, until no
    sync is in flight (True) or the monotonic deadline (False)."""
    assert learner.engine is not None
    engine = learner.engine
    learner.flushing = True
    try:
        merge_held(learner, None, merged)
        merged |= take_all(learner)
        done = merge_until(learner, lambda: engine.in_flight() == 0, deadline, merged)
    finally:
        learner.flushing = False
    if not done:
        logger.warning(
            "learner=%s flush: %d syncs still in flight, giving up waiting",
            learner.learner_id,
            engine.in_flight(),
        )
    return done
