"""A round's share: how much of one whole outer step the contributions of a round stand for.

With quorum 1 a round may close on one learner's push while the others are still training; at
the end of a run the last learner may push alone after the others left. Stepped in full, each
such round moves the fragment as far as a round of every learner would (and again through the
momentum), so how pushes happen to group into rounds decides how far the model moves per unit
of work: split rounds and lone final pushes overshoot, and runs of one configuration end apart.

`round_share = "work"` scales a round's outer step by its share: the weight of its contributions
over the weight one contribution from every recent contributor carries (each learner's weight
as of its last contribution to this fragment). A round of every learner steps in full; a lone
push of one learner in four equal ones steps a quarter, and the four such rounds make about one
whole step. The merged delta is scaled by the share (folded into the merge's divisor and the
re-anchoring links' weights, so the fused and the separate kernels keep one set of numbers)
and Nesterov's momentum decays by mu**share and looks ahead by share * mu (`outer.Nesterov`).

A contributor is recent while the fragment has advanced at most `HORIZON_ROUNDS` rounds per
recent contributor since its last contribution: long enough for a 3x slower learner among
several to count, short enough that a fleet that shrank for good steps in full again. The
state is a pure function of the rounds applied, in order (checkpointed; a log replay repeats it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

ROUND_SHARES = ("work", "full")
HORIZON_ROUNDS = 4  # rounds per recent contributor before one that stopped contributing expires


class Weighed(Protocol):
    learner_id: str
    weight: float


def checked(share: float) -> float:
    """`share` if it is one a round can have (in (0, 1]), else ValueError."""
    if not (math.isfinite(share) and 0.0 < share <= 1.0):
        raise ValueError(f"share must be in (0, 1], got {share}")
    return share


class RoundShares:
    """One fragment's recent contributors (their last weight and the round it came in)."""

    def __init__(self) -> None:
        self.recent: dict[str, tuple[float, int]] = {}

    def share(self, start_version: int, contributions: Sequence[Weighed]) -> float:
        """The share of the round turning `start_version` into the next version, in (0, 1]
        (1 where nothing weighs anything); records the round's contributors."""
        for c in contributions:
            self.recent[c.learner_id] = (c.weight, start_version)
        horizon = HORIZON_ROUNDS * len(self.recent)
        self.recent = {
            k: (w, v) for k, (w, v) in self.recent.items() if start_version - v <= horizon
        }
        # exactly rounded sums: the same share whatever order a replay meets them in
        full = math.fsum(w for w, _ in self.recent.values())
        held = math.fsum(c.weight for c in contributions)
        if not full > 0.0 or not held > 0.0:
            return 1.0
        return min(1.0, held / full)

    def state(self) -> dict[str, list[Any]]:
        """For the checkpoint's metadata (JSON)."""
        return {k: [w, v] for k, (w, v) in self.recent.items()}

    def restore(self, state: dict[str, list[Any]]) -> None:
        self.recent = {str(k): (float(w), int(v)) for k, (w, v) in state.items()}
