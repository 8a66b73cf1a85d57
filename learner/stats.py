"""`LearnerStats`: a snapshot of a learner's progress and sync traffic (`Learner.stats`), what
its metrics (`learner.metrics`) and progress lines are made from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from learner.learner import Learner


@dataclass(frozen=True)
class LearnerStats:
    """A snapshot of a learner's progress and sync traffic (`Learner.stats`)."""

    learner_id: str
    step: int
    tokens: int
    tokens_per_s: float
    loss: float | None
    compute_s: float
    blocked_s: float
    bytes_sent: int
    bytes_received: int
    pushes: dict[
        str, int
    ]  # by outcome: accepted, duplicate, dropped_stale, refused_norm, superseded, rejected
    pulls: int
    merges: int
    errors: int
    fragment_versions: tuple[int, ...]
    sync_every: int
    sync_state: str  # "idle", "syncing 2/4", "reconnecting"
    versions_checked: int = 0  # (epoch, fragment, version)s pulled, with their checksums
    version_conflicts: int = 0  # of those, served again with another checksum (a server bug)
    step_time_s: float | None = None  # moving average of an inner step's compute seconds
    # of bytes_sent, those sent by the time it had joined (an upload of the initial model too)
    bytes_sent_joining: int = 0


def of(learner: Learner) -> LearnerStats:
    """`learner`'s stats now: tokens per second over its recent steps, traffic from its client,
    pushes, pulls and errors from its sync engine (none on an island rank that does not talk)."""
    c, client, e = learner.clock, learner.client, learner.engine
    rate = 0.0
    if len(c.recent) >= 2:
        (t0, n0), (t1, n1) = c.recent[0], c.recent[-1]
        rate = (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
    pushes, pulls, errors = e.counts() if e else ({}, 0, 0)
    return LearnerStats(
        learner_id=learner.learner_id,
        step=c.step,
        tokens=c.tokens,
        tokens_per_s=rate,
        loss=c.loss,
        compute_s=c.compute_s,
        blocked_s=c.blocked_s,
        bytes_sent=client.bytes_sent if client else 0,
        bytes_received=client.bytes_received if client else 0,
        pushes=pushes,
        pulls=pulls,
        merges=learner.merges,
        errors=errors,
        fragment_versions=tuple(learner.versions),
        sync_every=learner.sync_every,
        sync_state=("closed" if learner.closed else e.sync_state()) if e else "island member",
        versions_checked=client.versions_checked if client else 0,
        version_conflicts=client.version_conflicts if client else 0,
        step_time_s=c.step_time_s if c.step else None,
        bytes_sent_joining=learner.joining_bytes,
    )
