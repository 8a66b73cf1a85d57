"""Goodput accounting: where every token and compute second a learner spent ends up.

Each push covers the tokens and compute seconds of the inner steps since that fragment's last
push; it counts them in proportion to the fragment's share of the model (so P fragments together
count each step once). A judged push moves its share into `discarded` (dropped or rejected) or
into pending; a closed round moves its contributions' pending shares into `merged`. When a lease
lapses, what the learner reported processing but never pushed becomes `lost`. A learner that was
only cut off (a partition, not a crash) comes back as itself and pushes that work after all:
what was written off is not counted again (it stays lost, the rest of the push counts) until the
learner leaves. Everything else is in flight. Capacity is wall-clock seconds of every joined
learner, alive or dead (until it leaves or is forgotten); goodput = merged compute / capacity
over a sliding window.

A shard of a sharded Synchronizer serves `fraction` of the model: what learners report and their
capacity count that fraction, as its pushes do, so every shard's goodput is its own and the
shards' counters add up to the learners' totals (unsharded, the fraction is 1).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from synchronizer.clock import Clock, SystemClock
from synchronizer.metrics import Metrics


@dataclass
class Share:
    """Tokens and compute seconds of one judged push, already scaled by the fragment share."""

    tokens: float
    compute_s: float


class Goodput:
    def __init__(self, metrics: Metrics, window_s: float, clock: Clock | None = None) -> None:
        self.clock = clock or SystemClock()
        self.metrics = metrics
        self.window_s = window_s
        self.lock = threading.Lock()
        self.pending_tokens = 0.0
        self.pending_compute = 0.0
        self.merged_compute = 0.0
        self.capacity_s = 0.0
        self.accounted: dict[str, list[float]] = {}  # learner -> [tokens, compute] judged so far
        self.reported: dict[str, list[float]] = {}  # learner -> [tokens, compute] reported
        # learner -> [tokens, compute] counted lost when its lease lapsed, not yet pushed since
        # (not checkpointed: a restart replays accepted pushes before any lease can lapse)
        self.written_off: dict[str, list[float]] = {}
        self.samples: deque[tuple[float, float, float]] = deque()
        self.last_tick = self.clock.monotonic()
        self.fraction = 1.0  # of the model this Synchronizer serves (a shard's part)
        metrics.tokens_in_flight.set_function(lambda: self.in_flight()[0])
        metrics.compute_in_flight.set_function(lambda: self.in_flight()[1])
        metrics.goodput.set_function(self.ratio)
        metrics.model_fraction.set_function(lambda: self.fraction)

    def report(self, learner_id: str, tokens: float, compute_s: float) -> None:
        with self.lock:
            self.reported[learner_id] = [tokens * self.fraction, compute_s * self.fraction]

    def _account(self, learner_id: str, share: Share) -> None:
        acc = self.accounted.setdefault(learner_id, [0.0, 0.0])
        acc[0] += share.tokens
        acc[1] += share.compute_s

    def _not_lost(self, learner_id: str, share: Share) -> Share:
        """The part of a judged push not already counted lost at a lapse of the learner's lease
        (that part is used up). Caller holds the lock."""
        off = self.written_off.get(learner_id)
        if off is None:
            return share
        tokens, compute_s = min(off[0], share.tokens), min(off[1], share.compute_s)
        off[0] -= tokens
        off[1] -= compute_s
        if off[0] <= 0 and off[1] <= 0:
            del self.written_off[learner_id]
        return Share(share.tokens - tokens, share.compute_s - compute_s)

    def accepted(self, learner_id: str, share: Share) -> Share:
        """Counts an accepted push as pending; returns the share counted, which `merged` or
        `refused` must be given for it (less than `share` where it was counted lost)."""
        with self.lock:
            counted = self._not_lost(learner_id, share)
            self._account(learner_id, counted)
            self.pending_tokens += counted.tokens
            self.pending_compute += counted.compute_s
        return counted

    def discarded(self, learner_id: str, share: Share) -> None:
        with self.lock:
            counted = self._not_lost(learner_id, share)
            self._account(learner_id, counted)
        self.metrics.tokens.labels("discarded").inc(counted.tokens)
        self.metrics.compute.labels("discarded").inc(counted.compute_s)

    def merged(self, shares: list[Share]) -> None:
        tokens = sum(s.tokens for s in shares)
        compute = sum(s.compute_s for s in shares)
        with self.lock:
            self.pending_tokens -= tokens
            self.pending_compute -= compute
            self.merged_compute += compute
        self.metrics.tokens.labels("merged").inc(tokens)
        self.metrics.compute.labels("merged").inc(compute)

    def refused(self, shares: list[Share]) -> None:
        """Accepted contributions of a round whose update was refused: discarded."""
        tokens = sum(s.tokens for s in shares)
        compute = sum(s.compute_s for s in shares)
        with self.lock:
            self.pending_tokens -= tokens
            self.pending_compute -= compute
        self.metrics.tokens.labels("discarded").inc(tokens)
        self.metrics.compute.labels("discarded").inc(compute)

    def died(self, learner_id: str, left: bool = False) -> None:
        """The learner's reported-but-unpushed work is lost; its baseline moves up to match.
        Its lease lapsed: the work is written off, should it come back and push it. It `left`:
        nothing of it is pushed any more."""
        with self.lock:
            rep = self.reported.get(learner_id, [0.0, 0.0])
            acc = self.accounted.setdefault(learner_id, [0.0, 0.0])
            lost = [max(0.0, rep[0] - acc[0]), max(0.0, rep[1] - acc[1])]
            acc[0], acc[1] = max(acc[0], rep[0]), max(acc[1], rep[1])
            if left:
                self.written_off.pop(learner_id, None)
            elif lost[0] > 0 or lost[1] > 0:
                off = self.written_off.setdefault(learner_id, [0.0, 0.0])
                off[0] += lost[0]
                off[1] += lost[1]
        self.metrics.tokens.labels("lost").inc(lost[0])
        self.metrics.compute.labels("lost").inc(lost[1])

    def tick(self, slots: int) -> None:
        """Adds capacity for `slots` learners since the last tick and samples the window."""
        now = self.clock.monotonic()
        with self.lock:
            added = (now - self.last_tick) * slots * self.fraction
            self.capacity_s += added
            self.metrics.capacity.inc(added)
            self.last_tick = now
            self.samples.append((now, self.merged_compute, self.capacity_s))
            while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
                self.samples.popleft()

    def in_flight(self) -> tuple[float, float]:
        with self.lock:
            unpushed_t = sum(
                max(0.0, r[0] - self.accounted.get(k, [0.0, 0.0])[0])
                for k, r in self.reported.items()
            )
            unpushed_c = sum(
                max(0.0, r[1] - self.accounted.get(k, [0.0, 0.0])[1])
                for k, r in self.reported.items()
            )
            return self.pending_tokens + unpushed_t, self.pending_compute + unpushed_c

    def ratio(self) -> float:
        """Merged compute over capacity within the window (0 before any capacity accrued)."""
        with self.lock:
            if not self.samples:
                return 0.0
            t0, m0, c0 = self.samples[0]
            _, m1, c1 = self.samples[-1]
            if c1 - c0 <= 0:
                return 0.0
            return min(1.0, (m1 - m0) / (c1 - c0))
