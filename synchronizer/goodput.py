"""Goodput accounting: where every token and compute second a learner spent ends up.

Each push covers the tokens and compute seconds of the inner steps since that fragment's last
push; it counts them in proportion to the fragment's share of the model (so P fragments together
count each step once). A judged push moves its share into `discarded` (dropped or rejected) or
into pending; a closed round moves its contributions' pending shares into `merged`. When a lease
lapses, what the learner reported processing but never pushed becomes `lost`. Everything else is
in flight. Capacity is wall-clock seconds of every joined learner, alive or dead (until it leaves
or is forgotten); goodput = merged compute / capacity over a sliding window.

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

    def accepted(self, learner_id: str, share: Share) -> None:
        with self.lock:
            self._account(learner_id, share)
            self.pending_tokens += share.tokens
            self.pending_compute += share.compute_s

    def discarded(self, learner_id: str, share: Share) -> None:
        with self.lock:
            self._account(learner_id, share)
        self.metrics.tokens.labels("discarded").inc(share.tokens)
        self.metrics.compute.labels("discarded").inc(share.compute_s)

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

    def died(self, learner_id: str) -> None:
        """The learner's reported-but-unpushed work is lost; its baseline moves up to match."""
        with self.lock:
            rep = self.reported.get(learner_id, [0.0, 0.0])
            acc = self.accounted.setdefault(learner_id, [0.0, 0.0])
            lost = [max(0.0, rep[0] - acc[0]), max(0.0, rep[1] - acc[1])]
            acc[0], acc[1] = max(acc[0], rep[0]), max(acc[1], rep[1])
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
