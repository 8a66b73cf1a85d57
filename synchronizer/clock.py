"""Time, as the Synchronizer's policies see it: one clock, handed in at the edge.

Leases, idle streams, round openings and their grace timers, goodput's capacity, the stall of an
InitModel upload and the checkpoint interval all read the `Clock` the server gives the core
(`SystemClock`), never `time` itself. Tests give a `ManualClock` instead: time moves only when
the test says so and a grace timer fires inside `advance`, so a policy is checked in
microseconds, without gRPC and without sleeping (as etcd's raft takes time only as `Tick()`).

What is not policy stays on the system's clock: bounded waits on a condition (a pull waiting for
a version, a push for room in a budget or for the log's fsync) and the durations the metrics
measure. A manual clock cannot wake a thread that is blocked.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger(__name__)


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (deadlines, ages, rates)."""
        ...

    def wall(self) -> float:
        """Seconds since the epoch (what outlives a restart: when a learner first joined)."""
        ...

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Timer:
        """Runs `fn` once, `delay_s` from now, on a thread of the clock's; cancellable."""
        ...


class SystemClock:
    """The machine's clocks. Timers run in time order on one daemon thread of the clock's, which
    starts with the first timer and ends once none has been pending for `IDLE_S`: a timer per
    round opening never starts a thread of its own (threads started and ended at that rate
    fragment the allocator's arenas, and the soak saw resident memory creep)."""

    IDLE_S = 5.0

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.timers: list[tuple[float, int, _ManualTimer, Callable[[], None]]] = []
        self.order = itertools.count()
        self.running = False
        self.thread: threading.Thread | None = None

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Timer:
        timer = _ManualTimer()
        with self.cv:
            entry = (time.monotonic() + delay_s, next(self.order), timer, fn)
            heapq.heappush(self.timers, entry)
            if not self.running:
                self.running = True
                self.thread = threading.Thread(target=self._run, name="clock-timers", daemon=True)
                self.thread.start()
            self.cv.notify()
        return timer

    def _run(self) -> None:
        while True:
            with self.cv:
                while True:
                    if not self.timers:
                        if not self.cv.wait(self.IDLE_S) and not self.timers:
                            self.running = False
                            return
                        continue
                    left = self.timers[0][0] - time.monotonic()
                    if left <= 0:
                        _, _, timer, fn = heapq.heappop(self.timers)
                        break
                    self.cv.wait(left)
            if not timer.cancelled:
                try:
                    fn()
                except Exception:  # one timer's failure must not stop the others
                    logger.exception("a timer's callback failed")


class _ManualTimer:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A clock that moves only when advanced; due timers run inside `advance`, in time order,
    on the caller's thread."""

    def __init__(self, start: float = 1000.0, wall_start: float = 1.8e9) -> None:
        self.now = start
        self.wall_offset = wall_start - start
        self.lock = threading.Lock()
        self.timers: list[tuple[float, int, _ManualTimer, Callable[[], None]]] = []
        self.order = itertools.count()

    def monotonic(self) -> float:
        with self.lock:
            return self.now

    def wall(self) -> float:
        with self.lock:
            return self.now + self.wall_offset

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Timer:
        timer = _ManualTimer()
        with self.lock:
            heapq.heappush(self.timers, (self.now + max(0.0, delay_s), next(self.order), timer, fn))
        return timer

    def pending(self) -> int:
        """Timers armed and not cancelled."""
        with self.lock:
            return sum(1 for _, _, t, _ in self.timers if not t.cancelled)

    def advance(self, seconds: float) -> None:
        """Moves time forward by `seconds`, running each timer that falls due at its time."""
        if seconds < 0:
            raise ValueError("a monotonic clock does not go back")
        with self.lock:
            target = self.now + seconds
        while True:
            with self.lock:
                if not self.timers or self.timers[0][0] > target:
                    self.now = target
                    return
                due, _, timer, fn = heapq.heappop(self.timers)
                self.now = max(self.now, due)
            if not timer.cancelled:
                fn()
