"""A learner's own state across a restart (`Learner.state_dict()` and `Learner(..., state=)`).

What a restarted learner needs to continue as itself: its learner id and session (so its pushes
are neither refused as a stranger's nor taken as another learner's), the fragment versions it
holds and their global parameters (what its next outer gradients are measured from), its
error-feedback residuals, the step, tokens and sync schedule, the work not yet pushed, and the
next push sequence number (so nothing it pushed is taken as a duplicate, and nothing
acknowledged is pushed again). Only island rank 0 holds the sync part.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from learner.fragments import Schedule

if TYPE_CHECKING:
    from learner.learner import Learner

logger = logging.getLogger(__name__)

STATE_FORMAT = 1  # of `Learner.state_dict()`


def check_state(state: dict[str, Any], numels: list[int], leader: bool) -> None:
    """ValueError naming what does not fit when `state` is not a learner state for this model's
    fragments."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ValueError(
            f"not a learner state of format {STATE_FORMAT} (from Learner.state_dict()): "
            f"format {state.get('format') if isinstance(state, dict) else type(state).__name__!r}"
        )
    if state.get("numels") != numels:
        raise ValueError(
            f"the learner state is for fragments of {state.get('numels')} elements, this model "
            f"has {numels}: same model, fragments and fragment_strategy needed to resume"
        )
    if leader and "learner_id" not in state:
        raise ValueError(
            "this learner state was saved by an island rank other than 0, which holds no sync "
            "state: resume rank 0 from rank 0's state"
        )


def snapshot(learner: Learner) -> dict[str, Any]:
    """The state of a flushed `learner` (nothing in flight), copied to the CPU."""
    c = learner.clock
    state: dict[str, Any] = {
        "format": STATE_FORMAT,
        "numels": [learner.plan.numel(p) for p in range(learner.num_fragments)],
        "step": c.step,
        "tokens": c.tokens,
        "compute_s": c.compute_s,
        "sync_every": learner.sync_every,
        "phase": learner.phase,
        "schedule": learner.schedule.state(),
        "since_push": [list(acc) for acc in learner.since_push],
        "deferred": sorted(learner.deferred),
    }
    if learner.leader and learner.engine is not None and learner.client is not None:
        state |= {
            "learner_id": learner.client.learner_id,
            "session": learner.client.session,
            "epoch": learner.engine.session.epoch,
            "next_seq": learner.engine.session.next_seq,
            "versions": list(learner.versions),
            "base": [b.detach().to("cpu", copy=True) for b in learner.base],
            "residuals": [
                None if r is None else r.detach().to("cpu", copy=True) for r in learner.ef.residuals
            ],
        }
    return state


def restore_clock(learner: Learner, state: dict[str, Any]) -> None:
    """The step, tokens and sync schedule, and the work not yet pushed (every rank)."""
    c = learner.clock
    c.step, c.tokens, c.compute_s = state["step"], state["tokens"], state["compute_s"]
    learner.phase = state.get("phase", 0)  # states saved before it had one started at 0
    saved = state.get("schedule")  # states saved before it had one: as a fixed H puts it
    learner.schedule = (
        Schedule(state["sync_every"], learner.num_fragments, learner.schedule_step())
        if saved is None
        else Schedule.restored(saved, learner.num_fragments)
    )
    learner.since_push = [list(acc) for acc in state["since_push"]]
    learner.deferred = set(state["deferred"])


def resumable(learner: Learner, state: dict[str, Any], versions: list[int], uploaded: bool) -> bool:
    """Whether the Synchronizer still holds the run the state was saved in: the same epoch (its
    write-ahead log keeps it across restarts), no fragment behind the saved version, and the
    model not just uploaded by this learner (a Synchronizer that lost its state). If not, the
    work not yet pushed is dropped and the learner starts from the global model."""
    assert learner.engine is not None
    behind = [p for p, (v, s) in enumerate(zip(versions, state["versions"], strict=True)) if v < s]
    if not uploaded and state["epoch"] == learner.engine.session.epoch and not behind:
        return True
    logger.warning(
        "learner=%s resumed at step %d, but the Synchronizer no longer holds the run its state "
        "was saved in (epoch %s, now %s; fragments behind the saved versions: %s): starting "
        "from its global model",
        learner.learner_id,
        learner.clock.step,
        state["epoch"],
        learner.engine.session.epoch,
        behind,
    )
    learner.since_push = [[0, 0, 0.0] for _ in range(learner.num_fragments)]
    learner.deferred.clear()
    return False


def restore_sync(learner: Learner, state: dict[str, Any]) -> None:
    """Keeps the local parameters (the caller loaded them) and measures the next outer gradients
    from the saved global parameters and versions."""
    assert learner.engine is not None
    learner.versions = list(state["versions"])
    learner.base = [b.to(learner.device) for b in state["base"]]
    if learner.ef.enabled:
        for p, r in enumerate(state["residuals"]):
            if r is not None:
                learner.ef.residuals[p] = r.to(learner.device)
    session = learner.engine.session
    with session.lock:
        session.next_seq = max(session.next_seq, state["next_seq"])
    logger.info(
        "learner=%s resumed at step %d with versions %s",
        learner.learner_id,
        learner.clock.step,
        learner.versions,
    )
