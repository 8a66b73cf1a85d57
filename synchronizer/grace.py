"""The adaptive grace window: how long a round that reached its quorum may wait for more.

Decoupled DiLoCo: waiting is free while the learners are still training on what they have, so
grace = gamma * (tau * step_time - quorum_time - apply_time), from exponential moving averages of
the learners' step time (heartbeats), the time rounds take to reach their quorum and the time an
outer step takes, capped by `grace_max_s`. `fixed` waits `grace_max_s`, `none` not at all.

`peers` waits as `adaptive` does, and longer for the learners that keep the pace of the round's
first pushers and are due soon (`Paces`): learners of one speed drift apart over a run, by more
than the cap, and a grace shorter than their drift splits each of their cycles into rounds of one
push. A learner of another pace (a slower one) is not waited for, and no wait outlasts the free
time (tau * step time - quorum time - apply time): no learner waits for its fragment.
"""

from __future__ import annotations

import statistics
import threading

from synchronizer.config import SynchronizerConfig


class GraceWindow:
    """Adaptive grace: gamma * (tau * step_time - quorum_time - apply_time), capped (EMAs).

    tau is `overlap_steps` when configured, else what the learners report in heartbeats (their
    H, or their strict-overlap bound), else 1.
    """

    def __init__(self, cfg: SynchronizerConfig, beta: float = 0.8) -> None:
        self.cfg = cfg
        self.beta = beta
        self.step_time = 0.0
        self.overlap_steps = 0.0  # tau as the learners report it, when the config leaves it to them
        self.quorum_time = 0.0
        self.apply_time = 0.0
        self.lock = threading.Lock()

    def _ema(self, old: float, new: float) -> float:
        return new if old == 0.0 else self.beta * old + (1 - self.beta) * new

    def observe(
        self,
        step_time: float = 0.0,
        quorum_time: float = -1.0,
        apply_time: float = -1.0,
        overlap_steps: int = 0,
    ) -> None:
        with self.lock:
            if step_time > 0:
                self.step_time = self._ema(self.step_time, step_time)
            if overlap_steps > 0:
                self.overlap_steps = self._ema(self.overlap_steps, float(overlap_steps))
            if quorum_time >= 0:
                self.quorum_time = self._ema(self.quorum_time, quorum_time)
            if apply_time >= 0:
                self.apply_time = self._ema(self.apply_time, apply_time)

    def free(self) -> float:
        """Seconds a round may wait before a learner that pushed into it needs it back."""
        with self.lock:
            tau = self.cfg.overlap_steps or self.overlap_steps or 1.0
            return max(0.0, tau * self.step_time - self.quorum_time - self.apply_time)

    def seconds(self, peers_due_s: float = 0.0) -> float:
        """The grace of a round that has its quorum; `peers_due_s`: when the last learner of
        the first pushers' pace is due (`Paces.due`), which only `peers` waits for."""
        cfg = self.cfg
        if cfg.grace == "none":
            return 0.0
        if cfg.grace == "fixed":
            return cfg.grace_max_s
        free = self.free()
        adaptive = min(cfg.grace_max_s, cfg.grace_gamma * free)
        if cfg.grace == "peers":
            return max(adaptive, min(peers_due_s, free))
        return adaptive


class Paces:
    """When each learner is next due to push one fragment, from the times of its own pushes of
    it (an exponential moving average of the gaps), and which learners a round should wait for.

    A learner is awaited when its pace is within `TOLERANCE` of the median pace of the round's
    contributors, both in seconds between its pushes and in inner steps per push, and its next
    push is due within `DRIFT` of its period, either way: one that pushed just before the round
    opened is a cycle away (it is in the previous round), one further overdue has stalled. Steps
    tell a slower learner apart where Dynamic Local Updates gave it a shorter H to push at the
    others' cadence (waiting for slower learners too is what a longer `grace_max_s` does). Each
    awaited learner is given `SLACK` of its period past its due time. Only the core's clock is
    read, by the caller."""

    TOLERANCE = 0.25
    DRIFT = 0.5
    SLACK = 0.1

    def __init__(self, beta: float = 0.5) -> None:
        self.beta = beta
        self.last: dict[str, float] = {}
        self.period: dict[str, float] = {}
        self.steps: dict[str, int] = {}  # inner steps in its latest push

    def pushed(self, learner_id: str, now: float, steps: int) -> None:
        self.steps[learner_id] = steps
        last = self.last.get(learner_id)
        if last is not None and now > last:
            old = self.period.get(learner_id)
            gap = now - last
            self.period[learner_id] = (
                gap if old is None else self.beta * old + (1 - self.beta) * gap
            )
        self.last[learner_id] = now

    def due(self, contributors: set[str], others: set[str], now: float) -> float:
        """Seconds from `now` until the last of `others` (live learners not in the round) that
        keeps the pace of `contributors` is due, plus its slack; 0 when none is awaited."""
        known = [c for c in contributors if c in self.period]
        if not known:
            return 0.0
        pace = statistics.median_high([self.period[c] for c in known])
        steps = statistics.median_high([self.steps[c] for c in known])
        wait = 0.0
        for learner_id in others:
            period = self.period.get(learner_id)
            if (
                period is None
                or abs(period - pace) > self.TOLERANCE * pace
                or abs(self.steps[learner_id] - steps) > self.TOLERANCE * steps
            ):
                continue
            due = self.last[learner_id] + period - now
            if abs(due) <= self.DRIFT * period:
                wait = max(wait, max(due, 0.0) + self.SLACK * period)
        return wait
