"""Bounds on what one learner's push can do to a fragment, judged against the other learners.

Per fragment, `PushBounds` remembers the recent accepted pushes of each learner: their L2 norms
and token weights, the last `PER_LEARNER` of each of the `LEARNERS` learners that pushed last. A
new push is judged against the pushes of the *other* learners only, so no learner moves its own
yardstick, by ramping its pushes up or by flooding the history with its own:

- its norm may be at most `max_norm_ratio` times the median of theirs (`norm_bound`), once they
  hold `WARMUP` norms; before that nothing is refused;
- its token weight is capped at `max_weight_ratio` times the median of theirs (`capped_weight`);
  while there are none nothing is capped.

A ratio of 0 turns its bound off. The learners of one honest run push deltas of similar norms
(a 10x jump within the last few pushes is no honest schedule) and similar counts, so neither
bound touches them. Not thread-safe: the caller holds the fragment's admission lock.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field

PER_LEARNER = 8  # accepted pushes remembered per learner
LEARNERS = 32  # learners remembered (those that pushed last)
WARMUP = 4  # norms of other learners needed before a norm is judged


@dataclass
class _Recent:
    """One learner's recent accepted pushes to the fragment."""

    norms: deque[float] = field(default_factory=lambda: deque(maxlen=PER_LEARNER))
    weights: deque[float] = field(default_factory=lambda: deque(maxlen=PER_LEARNER))


@dataclass
class NormBound:
    """The largest norm a learner's push may have now, and the median it derives from."""

    bound: float
    median: float
    known: int  # the other learners' norms the median is taken over


class PushBounds:
    def __init__(self, max_norm_ratio: float, max_weight_ratio: float) -> None:
        self.max_norm_ratio = max_norm_ratio
        self.max_weight_ratio = max_weight_ratio
        self.recent: OrderedDict[str, _Recent] = OrderedDict()  # least recent pusher first

    @property
    def judges_norms(self) -> bool:
        """False when the norm bound is off (then norms need not be computed at all)."""
        return self.max_norm_ratio > 0

    def norm_bound(self, learner_id: str) -> NormBound | None:
        """The bound on a push of `learner_id`, or None while it is off or warming up."""
        if not self.judges_norms:
            return None
        norms = [n for lid, r in self.recent.items() if lid != learner_id for n in r.norms]
        if len(norms) < WARMUP:
            return None
        median = statistics.median(norms)
        return NormBound(self.max_norm_ratio * median, median, len(norms))

    def capped_weight(self, learner_id: str, weight: float) -> float:
        """`weight` (a token weight), at most `max_weight_ratio` x the others' median."""
        if self.max_weight_ratio <= 0:
            return weight
        weights = [w for lid, r in self.recent.items() if lid != learner_id for w in r.weights]
        if not weights:
            return weight
        return min(weight, self.max_weight_ratio * statistics.median(weights))

    def accepted(self, learner_id: str, norm: float, weight: float) -> None:
        """Remembers an accepted push: its norm (when judged, and not 0: a zero delta says
        nothing about scale) and the token weight it was given."""
        recent = self.recent.pop(learner_id, None) or _Recent()
        self.recent[learner_id] = recent
        if norm > 0:
            recent.norms.append(norm)
        recent.weights.append(weight)
        while len(self.recent) > LEARNERS:
            self.recent.popitem(last=False)
