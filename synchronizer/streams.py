"""What calls may hold before and after they say whose they are: a bounded pool for calls still
waiting for their first message, transfer and waiting slots, per-learner limits, and progress
deadlines, so no mix of silent, idle, slow or waiting clients takes the service down.

Every gRPC worker a call holds is one of four kinds, and `max_workers` covers all four plus
`RESERVED_WORKERS` for Join, Heartbeat, Leave, Status and health checks once their request has
arrived:

- a first-message place (`FirstMessages`, `max_unidentified_streams`, at most
  `max_unidentified_per_peer` of one peer, a client connection): every call, of every method,
  until its first request message arrives (a push's header, a pull's or a join's request). A
  call there has said nothing, so it holds nothing else: no transfer slot, no per-learner
  count. It is cut after `IDENTIFY_S`, and sooner when newer calls need its place: the peer's
  own oldest when the peer is at its limit, else the oldest of the peer holding the most. An
  honest client sends its first message with the call, so it holds a place for moments and
  never the most; a client that opens calls and sends nothing displaces its own;
- a transfer slot (`max_concurrent_streams`): a push being received or a pull being sent, taken
  only once its header or request names a learner with a valid session. It must make progress
  (a message received, a chunk taken by the client) at least every `stream_idle_s`, or the
  watchdog cancels the call. Each move also renews the learner's lease, so a transfer that
  outlasts a lease keeps its learner alive while it makes progress, and a stalled one does not;
- a waiting slot (`max_waiting_pulls`): a pull waiting for a version that is not there yet,
  for at most `max_pull_wait_s`, and woken as soon as its client cancels, then for a transfer
  slot for at most `SLOT_PATIENCE_S`. With every waiting slot taken, a pull is answered at
  once with what exists instead of waiting;
- transfers and waiting pulls count toward the learner's own limit
  (`max_streams_per_learner`), so one learner cannot take the slots every other learner needs,
  and with per-learner credentials toward its credential's (that limit times
  `max_learners_per_credential`), so joining many times buys no more.

gRPC-free: a call's `cancel` is whatever ends it (the server passes the call's), its peer a
string naming where it came from.
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

IDENTIFY_S = 5.0  # a call's first message (a push's header: who it is from) must arrive within this
CUT_LOG_S = 10.0  # calls cut before their first message are logged at most this often
SLOT_PATIENCE_S = 5.0  # a pull in a waiting slot waits this long for a transfer slot


def _never() -> None:
    pass


def _ignore(_callback: Callable[[], None]) -> None:
    pass


@dataclass
class Call:
    """What the service lets the core do with an RPC: end it, hear when it ends, and know the
    credential it was made under."""

    cancel: Callable[[], None] = _never
    on_end: Callable[[Callable[[], None]], object] = _ignore
    credential: str = ""  # whose it is (`synchronizer.credentials`; "" in shared mode)


@dataclass(eq=False)
class Stream:
    """One open push or pull of a learner: when it last moved, and how to end it."""

    kind: str  # "push" or "pull"
    learner_id: str
    cancel: Callable[[], None]
    now: Callable[[], float]  # the core's clock
    keep_alive: Callable[[], None] = _never  # renews the learner's lease; called on every move
    progress_at: float = 0.0
    cut: bool = False

    def __post_init__(self) -> None:
        self.progress_at = self.now()

    def touch(self) -> None:
        self.progress_at = self.now()
        self.keep_alive()

    def moving(self, items: Iterable[T]) -> Iterator[T]:
        """`items`, touching the stream for every one that passes."""
        for item in items:
            self.touch()
            yield item
            self.touch()


@dataclass(eq=False)
class Silent:
    """A call that has not sent its first message yet."""

    peer: str
    method: str
    cancel: Callable[[], None]
    since: float


class FirstMessages:
    """The calls waiting for their first request message: at most `per_peer` of one peer and
    `total` in all, each for at most `IDENTIFY_S`. A call that finds no place takes the oldest
    one of its own peer (at the peer's limit), else of the peer holding the most (at the total
    limit): that call is cancelled, and counted in `diloco_streams_cut_total{kind="unidentified"}`.
    """

    def __init__(self, per_peer: int, total: int, metrics: Metrics, clock: Clock) -> None:
        self.per_peer = per_peer
        self.total = total
        self.metrics = metrics
        self.clock = clock
        self.lock = threading.Lock()
        self.by_peer: dict[str, list[Silent]] = {}  # oldest first
        self.count = 0
        self.unlogged = 0  # cuts not logged yet (one line per CUT_LOG_S at most)
        self.logged_at = -CUT_LOG_S

    def held(self, peer: str | None = None) -> int:
        with self.lock:
            return self.count if peer is None else len(self.by_peer.get(peer, ()))

    @contextlib.contextmanager
    def waiting(self, peer: str, method: str, cancel: Callable[[], None]) -> Iterator[None]:
        """Holds a place for one call while it waits for its first message."""
        entry = Silent(peer, method, cancel, self.clock.monotonic())
        with self.lock:
            victim = self._make_room(peer)
            self.by_peer.setdefault(peer, []).append(entry)
            self.count += 1
        if victim is not None:
            self._cut([victim], "newer calls needed its place")
        try:
            yield
        finally:
            with self.lock:
                self._remove(entry)

    def _make_room(self, peer: str) -> Silent | None:
        mine = self.by_peer.get(peer, [])
        if len(mine) >= self.per_peer:
            victim = mine[0]
        elif self.count >= self.total:
            fullest = max(self.by_peer.values(), key=lambda q: (len(q), -q[0].since))
            victim = fullest[0]
        else:
            return None
        self._remove(victim)
        return victim

    def _remove(self, entry: Silent) -> None:
        queue = self.by_peer.get(entry.peer)
        if queue is None or entry not in queue:
            return
        queue.remove(entry)
        self.count -= 1
        if not queue:
            del self.by_peer[entry.peer]

    def cut_overdue(self) -> int:
        """Cancels every call that sent nothing for `IDENTIFY_S`; returns how many."""
        now = self.clock.monotonic()
        with self.lock:
            overdue = [e for q in self.by_peer.values() for e in q if now - e.since > IDENTIFY_S]
            for e in overdue:
                self._remove(e)
        self._cut(overdue, f"sent nothing for {IDENTIFY_S:.0f} s")
        return len(overdue)

    def _cut(self, cut: list[Silent], why: str) -> None:
        if not cut:
            return
        self.metrics.streams_cut.labels("unidentified").inc(len(cut))
        for e in cut:
            e.cancel()
        now = self.clock.monotonic()
        with self.lock:
            self.unlogged += len(cut)
            if now - self.logged_at < CUT_LOG_S:
                return
            n, self.unlogged, self.logged_at = self.unlogged, 0, now
        last = cut[-1]
        logger.warning(
            "cancelled %d call(s) that never sent a first message (no learner named), the last "
            "a %s from %s: %s (at most %d per peer, %d in all, for %.0f s)",
            n,
            last.method,
            last.peer,
            why,
            self.per_peer,
            self.total,
            IDENTIFY_S,
        )


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
        self.per_credential: dict[str, int] = {}  # with per-learner credentials
        self.per_learner_limit = cfg.max_streams_per_learner
        self.first_messages = FirstMessages(
            cfg.max_unidentified_per_peer, cfg.max_unidentified_streams, metrics, self.clock
        )

    def counted(self, credential: str) -> str | None:
        """The key `claimed` counts a learner's credential under: None in shared mode, where a
        credential says nothing of who is calling."""
        per_learner = self.cfg.learner_tokens_file is not None or self.cfg.client_cert_credentials
        return credential if per_learner else None

    def limit_per_learner(self, fragments: int) -> None:
        """Sets the automatic per-learner limit once the model's fragment count is known: a
        pull per fragment, a push and a retry."""
        if self.cfg.max_streams_per_learner == 0:
            self.per_learner_limit = fragments + 2

    @contextlib.contextmanager
    def transfer(
        self,
        kind: str,
        learner_id: str,
        call: Call,
        keep_alive: Callable[[], None] = _never,
        patience_s: float = 0.0,
    ) -> Iterator[Stream]:
        """A transfer slot for one stream of `learner_id` (identified: its session checked),
        watched for progress, every move renewing its lease through `keep_alive`, and counted
        in `diloco_streams_open` while held. With none free: RESOURCE_EXHAUSTED, after waiting
        up to `patience_s` for one (only a caller that holds a waiting slot may be patient)."""
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
            stream = Stream(kind, learner_id, call.cancel, self.clock.monotonic, keep_alive)
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
    def claimed(self, learner_id: str, credential: str | None = None) -> Iterator[None]:
        """Counts one stream toward its learner's limit, and with per-learner credentials
        (`credential` not None) toward its credential's: that limit times
        `max_learners_per_credential`, however many ids the credential joined
        (RESOURCE_EXHAUSTED past either)."""
        keys = [(self.per_learner, learner_id, self.per_learner_limit, "learner")]
        if credential is not None:
            limit = self.per_learner_limit * self.cfg.max_learners_per_credential
            keys.append((self.per_credential, credential, limit, "credential"))
        with self.lock:
            for counts, key, limit, what in keys:
                held = counts.get(key, 0)
                if limit and held >= limit:
                    per_credential = (
                        f" x max_learners_per_credential {self.cfg.max_learners_per_credential}"
                        if what == "credential"
                        else ""
                    )
                    raise Rejected(
                        Code.RESOURCE_EXHAUSTED,
                        f"too_many_{what}_streams",
                        f"{what} {key!r} has {held} streams open already (max_streams_per_learner {self.per_learner_limit}{per_credential}); retry when one ends",
                    )
            for counts, key, _, _ in keys:
                counts[key] = counts.get(key, 0) + 1
        try:
            yield
        finally:
            with self.lock:
                for counts, key, _, _ in keys:
                    left = counts.get(key, 1) - 1
                    if left > 0:
                        counts[key] = left
                    else:
                        counts.pop(key, None)

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

    def cut_idle(self) -> int:
        """Cancels every transfer that made no progress for `stream_idle_s`, and every call that
        sent no first message within `IDENTIFY_S`; returns how many."""
        now = self.clock.monotonic()
        with self.lock:
            idle = [
                s for s in self.open if not s.cut and now - s.progress_at > self.cfg.stream_idle_s
            ]
            for s in idle:
                s.cut = True
        for s in idle:
            self.metrics.streams_cut.labels(s.kind).inc()
            logger.warning(
                "%s stream of learner %s made no progress for %.0f s (stream_idle_s): cancelled",
                s.kind,
                s.learner_id,
                now - s.progress_at,
            )
            s.cancel()
        return len(idle) + self.first_messages.cut_overdue()
