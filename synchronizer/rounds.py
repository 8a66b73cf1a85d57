"""Closing rounds: when a fragment's open round becomes an outer step, and what that step
counts.

`Rounds` asks each fragment's `Admission` (`synchronizer.admission`) whether its open round may
close, arms the round's grace timer on the core's clock once it has its quorum, and closes it:
the round is taken (its close logged), and its outer step runs on a worker thread, never on a
gRPC thread. A round that may close waits for a worker open, not closed: it is taken when a
worker starts it, so the pushes that arrive while the workers step other fragments join it (a
busy Synchronizer batches pushes into fewer outer steps instead of queueing small ones).
`apply` is the one way a taken round's outer step is applied and counted (goodput, metrics, a
refusal, a failure), on a worker and in a replay of the write-ahead log alike, so the two cannot
drift apart.

A round whose outer step raises fails its fragment (`on_failure`): the error reaches the health
service, the waiters and the metrics instead of vanishing in a worker thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from synchronizer.admission import Round
from synchronizer.clock import Clock
from synchronizer.fragments import Fragment
from synchronizer.goodput import Goodput
from synchronizer.grace import GraceWindow
from synchronizer.metrics import Metrics

logger = logging.getLogger(__name__)


class Rounds:
    """Decides when rounds close and closes them on worker threads (never on gRPC threads)."""

    def __init__(
        self,
        fragments: list[Fragment],
        grace: GraceWindow,
        metrics: Metrics,
        goodput: Goodput,
        live: Callable[[], set[str]],
        clock: Clock,
        threads: int,
        on_failure: Callable[[Fragment, str], None],
        durable: Callable[[int], None] = lambda _ticket: None,
    ) -> None:
        """`threads` outer-step workers; 0 applies each outer step on the thread that closes
        its round (tests: a close is done when `check` returns)."""
        self.fragments = fragments
        self.grace = grace
        self.metrics = metrics
        self.goodput = goodput
        self.live = live
        self.clock = clock
        self.on_failure = on_failure
        self.durable = durable  # waits until a write-ahead log ticket is on disk
        self.pool = (
            ThreadPoolExecutor(max_workers=threads, thread_name_prefix="outer-step")
            if threads > 0
            else None
        )
        self._lock = threading.Lock()
        self._queued: set[int] = set()  # fragments whose open round waits for a worker

    def check(self, frag: Fragment) -> None:
        """Re-evaluates a fragment's open round: close it now, or arm its grace timer."""
        self._judge(frag, self._close)

    def _judge(self, frag: Fragment, close: Callable[[Fragment, Round], None]) -> None:
        if frag.model.failure is not None:
            return
        live = self.live()
        rnd, close_now, quorum = frag.admission.closability(live, frag.model.version)
        if rnd is None:
            return
        if close_now:
            close(frag, rnd)
        elif quorum and rnd.timer is None:
            peers = frag.admission.peers_due(rnd, live)
            frag.admission.arm(
                rnd,
                lambda: self.clock.call_later(
                    self.grace.seconds(peers), lambda: self._expire(frag, rnd)
                ),
            )

    def _expire(self, frag: Fragment, rnd: Round) -> None:
        frag.admission.expire(rnd)
        self.check(frag)

    def check_all(self) -> None:
        for frag in self.fragments:
            self.check(frag)

    def _close(self, frag: Fragment, rnd: Round) -> None:
        """Closes a round that may close: at once without workers, else once a worker is free
        for it (`_start`), one queued start per fragment."""
        if self.pool is None:
            self._take(frag, rnd)
            return
        with self._lock:
            if frag.fid in self._queued:
                return
            self._queued.add(frag.fid)
        try:
            self.pool.submit(self._start, frag)
        except RuntimeError:  # shutting down: taken and applied here instead
            with self._lock:
                self._queued.discard(frag.fid)
            self._take(frag, rnd, inline=True)

    def _start(self, frag: Fragment) -> None:
        """On a worker: takes the fragment's open round as it is now (it has only gained pushes
        since it was queued) and applies it, judged again first: a close elsewhere (a
        shutdown's flush) may have taken it meanwhile, and its outer step's end then looks at
        the next round."""
        with self._lock:
            self._queued.discard(frag.fid)
        self._judge(frag, lambda f, r: self._take(f, r, inline=True))

    def _take(self, frag: Fragment, rnd: Round, inline: bool = False) -> None:
        """Takes the round (its close logged) and applies it: on this thread without workers
        or `inline`, else on a worker."""
        if not frag.admission.take(rnd):
            return
        now = self.clock.monotonic()
        if rnd.quorum_at is not None:
            self.grace.observe(quorum_time=rnd.quorum_at - rnd.opened_at)
        self.metrics.round_wait.observe(now - rnd.opened_at)
        if self.pool is None or inline:
            self._step(frag, rnd)
            return
        try:
            self.pool.submit(self._step, frag, rnd)
        except RuntimeError:  # shutting down: the final flush applies it in order instead
            self._step(frag, rnd)

    def _step(self, frag: Fragment, rnd: Round) -> None:
        if self.apply(frag, rnd):
            self.check(frag)  # the next round may have filled up while this one was applied

    def apply(self, frag: Fragment, rnd: Round) -> bool:
        """Applies a taken round's outer step once its close is durable, and counts it: merged
        (goodput, metrics, the grace window's apply time) or refused (counted and skipped: the
        fragment stays healthy). The round's work is counted before its version can be seen, so
        a learner holding the version never finds its work uncounted. False if the outer step
        raised: the fragment failed."""

        def settled(refused: str | None, share: float) -> None:  # under the model's lock
            shares = [c.share for c in rnd.contributions]
            if refused is not None:
                self.metrics.rounds_refused.inc()
                self.goodput.refused(shares)
                return
            self.metrics.contributors.observe(len(rnd.contributions))
            self.metrics.round_share.observe(share)
            self.metrics.outer_steps.inc()
            self.goodput.merged(shares)

        try:
            if rnd.ticket:  # nothing is served that a restart could not repeat
                self.durable(rnd.ticket)
            seconds, refused, _share = frag.apply(rnd, settled)
        except Exception as e:  # noqa: BLE001 - the failure becomes the fragment's state
            frag.discard(rnd)  # what the round holds goes back to the shared budgets
            if frag.model.failure is None:
                logger.exception(
                    "outer step of fragment %d round %d failed", frag.fid, rnd.start_version + 1
                )
                self.on_failure(
                    frag,
                    f"the outer step to version {rnd.start_version + 1} raised {type(e).__name__}: {e}",
                )
            return False
        self.metrics.fragment_version.labels(str(frag.fid)).set(frag.model.version)
        if refused is not None:
            logger.warning(
                "fragment %d: round to version %d refused, its %d contributions discarded: %s",
                frag.fid,
                rnd.start_version + 1,
                len(rnd.contributions),
                refused,
            )
            return True
        self.grace.observe(apply_time=seconds)
        self.metrics.round_apply.observe(seconds)
        logger.debug(
            "fragment %d -> version %d from %d contributions in %.4fs",
            frag.fid,
            frag.model.version,
            len(rnd.contributions),
            seconds,
        )
        return True

    def replay_close_before(self, frag: Fragment, version: int) -> bool:
        """Log replay: applies the fragment's open round, on this thread and without logging
        its close again, if it produces a version below `version` (its ROUND record may be
        missing: a close that was never served); False if its outer step raised."""
        rnd = frag.admission.round
        if rnd is None or rnd.start_version + 1 >= version:
            return True
        frag.admission.take(rnd, log=False)
        return self.apply(frag, rnd)

    def flush(self) -> None:
        """Closes every open round that holds anything and waits for the outer steps (shutdown:
        merge what was acknowledged). A failed fragment is skipped, never waited for."""
        for frag in self.fragments:
            rnd = frag.admission.round
            if rnd is not None and rnd.contributions and frag.model.failure is None:
                self._take(frag, rnd)  # now, whatever its quorum: its version is waited for
        for frag in self.fragments:
            frag.model.wait_applied(frag.admission.pending_version)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
