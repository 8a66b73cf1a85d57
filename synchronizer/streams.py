"""What push and pull streams may hold: slots, per-learner limits, waiting pulls, and a
progress deadline, so no mix of idle, slow or waiting clients takes the service down.

Every gRPC worker a stream holds is one of three kinds, and `max_workers` covers all three plus
`RESERVED_WORKERS` for Join, Heartbeat, Leave, Status and health checks:

- a transfer slot (`max_concurrent_streams`): a push being received or a pull being sent. It
  must make progress (a message received, a chunk taken by the client) at least every
  `stream_idle_s`, and a push must say whose it is within `IDENTIFY_S`, or the watchdog
  cancels the call: a client that opens a stream and sends nothing, or stops reading a pull,
  holds its slot for at most that long. Each move also renews the learner's lease, so a
  transfer that outlasts a lease keeps its learner alive while it makes progress, and a stalled
  one does not;
- a waiting slot (`max_waiting_pulls`): a pull waiting for a version that is not there yet,
  for at most `max_pull_wait_s`, and woken as soon as its client cancels, then for a transfer
  slot for at most `SLOT_PATIENCE_S`. With every waiting slot taken, a pull is answered at
  once with what exists instead of waiting;
- both kinds count toward the learner's own limit (`max_streams_per_learner`), so one learner
  cannot take the slots every other learner needs.

gRPC-free: a stream's `cancel` is whatever ends its call (the servicer passes the call's).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from synchronizer.clock import Clock, SystemClock
from synchronizer.config import SynchronizerConfig
from synchronizer.errors import Code, Rejected
from synchronizer.metrics import Metrics

logger = logging.getLogger(__name__)

T = TypeVar("T")

IDENTIFY_S = 5.0  # a push stream's header (who it is from) must arrive within this
SLOT_PATIENCE_S = 5.0  # a pull in a waiting slot waits this long for a transfer slot


def _never() -> None:
    pass


def _ignore(_callback: Callable[[], None]) -> None:
    pass


@dataclass
class Call:
    """What the service lets the core do with an RPC: end it, and hear when it ends."""

    cancel: Callable[[], None] = _never
    on_end: Callable[[Callable[[], None]], object] = _ignore


@dataclass(eq=False)
class Stream:
    """One open push or pull: who (once known), when it last moved, and how to end it."""

    kind: str  # "push" or "pull"
    cancel: Callable[[], None]
    now: Callable[[], float]  # the core's clock
    learner_id: str = ""
    keep_alive: Callable[[], None] = _never  # renews the learner's lease; called on every move
    progress_at: float = 0.0
    cut: bool = False

    def __post_init__(self) -> None:
        self.progress_at = self.now()

    def owned_by(self, learner_id: str, keep_alive: Callable[[], None]) -> None:
        """Names the stream's learner, whose lease every later move renews through
        `keep_alive`: a transfer longer than a lease keeps it while it makes progress."""
        self.learner_id, self.keep_alive = learner_id, keep_alive

    def touch(self) -> None:
        self.progress_at = self.now()
        self.keep_alive()

    def moving(self, items: Iterable[T]) -> Iterator[T]:
        """`items`, touching the stream for every one that passes."""
        for item in items:
            self.touch()
            yield item
            self.touch()


class Streams:
    def __init__(
        self, cfg: SynchronizerConfig, metrics: Metrics, clock: Clock | None = None
    ) -> None:
        self.clock = clock or SystemClock()
        self.cfg = cfg
        self.metrics = metrics
        self.lock = threading.Lock()
        self.freed = threading.Condition(self.lock)  # a transfer slot was given back
        self.open: set[Stream] = set()
        self.transfers = 0
        self.waiters = 0
        self.per_learner: dict[str, int] = {}
        self.per_learner_limit = cfg.max_streams_per_learner

    def limit_per_learner(self, fragments: int) -> None:
        """Sets the automatic per-learner limit once the model's fragment count is known: a
        pull per fragment, a push and a retry."""
        if self.cfg.max_streams_per_learner == 0:
            self.per_learner_limit = fragments + 2

    @contextlib.contextmanager
    def transfer(self, kind: str, call: Call, patience_s: float = 0.0) -> Iterator[Stream]:
        """A transfer slot for one stream, watched for progress and counted in
        `diloco_streams_open` while held. With none free: RESOURCE_EXHAUSTED, after waiting up
        to `patience_s` for one (only a caller that holds a waiting slot may be patient)."""
        deadline = time.monotonic() + patience_s
        with self.freed:
            while self.transfers >= self.cfg.max_concurrent_streams:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Rejected(
                        Code.RESOURCE_EXHAUSTED,
                        "too_many_streams",
                        f"the Synchronizer is serving {self.cfg.max_concurrent_streams} streams already; retry with backoff",
                    )
                self.freed.wait(left)
            self.transfers += 1
            stream = Stream(kind, call.cancel, self.clock.monotonic)
            self.open.add(stream)
        self.metrics.streams_open.inc()
        try:
            yield stream
        finally:
            self.metrics.streams_open.dec()
            with self.freed:
                self.transfers -= 1
                self.open.discard(stream)
                self.freed.notify()

    @contextlib.contextmanager
    def claimed(self, learner_id: str) -> Iterator[None]:
        """Counts one stream toward its learner's limit (RESOURCE_EXHAUSTED past it)."""
        with self.lock:
            held = self.per_learner.get(learner_id, 0)
            if self.per_learner_limit and held >= self.per_learner_limit:
                raise Rejected(
                    Code.RESOURCE_EXHAUSTED,
                    "too_many_learner_streams",
                    f"learner {learner_id!r} has {held} streams open already (max_streams_per_learner {self.per_learner_limit}); retry when one ends",
                )
            self.per_learner[learner_id] = held + 1
        try:
            yield
        finally:
            with self.lock:
                left = self.per_learner.get(learner_id, 1) - 1
                if left > 0:
                    self.per_learner[learner_id] = left
                else:
                    self.per_learner.pop(learner_id, None)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[bool]:
        """A waiting slot for a pull: yields False (answer at once, do not wait) when all are
        taken."""
        with self.lock:
            free = self.waiters < self.cfg.max_waiting_pulls
            if free:
                self.waiters += 1
        if free:
            self.metrics.pulls_waiting.inc()
        try:
            yield free
        finally:
            if free:
                self.metrics.pulls_waiting.dec()
                with self.lock:
                    self.waiters -= 1

    def _deadline(self, s: Stream) -> float:
        return self.cfg.stream_idle_s if s.learner_id else min(self.cfg.stream_idle_s, IDENTIFY_S)

    def cut_idle(self) -> int:
        """Cancels every stream that made no progress for `stream_idle_s`; returns how many."""
        now = self.clock.monotonic()
        with self.lock:
            idle = [s for s in self.open if not s.cut and now - s.progress_at > self._deadline(s)]
            for s in idle:
                s.cut = True
        for s in idle:
            self.metrics.streams_cut.labels(s.kind).inc()
            logger.warning(
                "%s stream of %s made no progress for %.0f s (stream_idle_s): cancelled",
                s.kind,
                f"learner {s.learner_id}"
                if s.learner_id
                else "a client that never identified itself",
                now - s.progress_at,
            )
            s.cancel()
        return len(idle)
