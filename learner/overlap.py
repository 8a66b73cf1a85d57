"""Strict overlap: the step at which each push's result is merged, whatever the network's timing.

With `strict_overlap` a push's result is merged exactly `overlap_steps` (tau) steps after the
push: a result back early is held until then, and one still out at tau is waited for (bounded,
by `Learner`). So the step at which each result lands does not depend on timing, and with the
Synchronizer's canonical order of a round's pushes a synchronous run is reproducible bit for
bit. `StrictOverlap` keeps the bookkeeping (which push waits since which step, which results are
held); it does no waiting and no I/O, so it is testable alone.
"""

from __future__ import annotations

from learner.sync import Arrival


class StrictOverlap:
    """The pushes whose results are due tau steps after them, and the results held until then."""

    def __init__(self, tau: int) -> None:
        self.tau = tau
        self.pushed_at: dict[int, int] = {}  # fragment -> step of its push, until merged
        self.early: dict[int, Arrival] = {}  # results back before their tau

    def pushed(self, p: int, step: int) -> None:
        self.pushed_at[p] = step

    def hold(self, a: Arrival, step: int) -> bool:
        """True if `a` is a round's result back before tau steps after its push: it is held
        (`release` gives it back). A re-sync is never held."""
        p = a.fragment
        if a.job is None or p not in self.pushed_at or step - self.pushed_at[p] >= self.tau:
            return False
        self.early[p] = a
        return True

    def due(self, step: int) -> list[int]:
        """Fragments pushed at least tau steps before `step` whose results are not merged."""
        return sorted(p for p, s in self.pushed_at.items() if step - s >= self.tau)

    def waiting(self, fragments: list[int]) -> list[int]:
        """Those of `fragments` whose results are not merged yet."""
        return [p for p in fragments if p in self.pushed_at]

    def release(self, fragments: list[int] | None = None) -> list[Arrival]:
        """The held results of `fragments` (all when None), in fragment order, no longer held."""
        ps = sorted(self.early if fragments is None else set(fragments) & set(self.early))
        return [self.early.pop(p) for p in ps]

    def merged(self, p: int) -> None:
        """Fragment p's result (or a re-sync) is merged: its push waits no more."""
        self.pushed_at.pop(p, None)

    def forget(self, fragments: list[int]) -> None:
        """Stops waiting for these pushes (each is waited for at most once)."""
        for p in fragments:
            self.pushed_at.pop(p, None)
