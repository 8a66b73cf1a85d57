"""Admission: which pushes go into a fragment's next outer step.

Per fragment, `Admission` keeps at most one open round collecting weighted outer gradients: it
judges each push (staleness bound; norm bound and token-weight cap against the other learners'
recent pushes, `synchronizer.bounds`; staleness weight), holds its encoded payload for the outer
step or adds it at once when the held-bytes budget is full, and says whether the round may close
(`closability`). When it closes is `synchronizer.rounds`'s business; Admission only keeps the
round's state under its lock.

Held pushes are added in a canonical order (learner name, id, seq), not in arrival order: a
synchronous run (every learner in every round) sums the same numbers in the same order however
its pushes raced, so it is reproducible bit for bit, and a replay of the write-ahead log repeats
it (the log says which pushes were held and which were added at once).

A round's FP32 sums (an `Accumulator`) are lent by the Synchronizer-wide `Fp32Buffers`: taken
when the round starts adding (at its outer step, or on arrival when a push cannot be held) and
given back when its outer step ends, so a fragment between outer steps holds none.

Round policy (Decoupled DiLoCo): a round may close once it holds K contributions (K = quorum,
capped by the live learners; quorum 0 = every live learner, i.e. synchronous DiLoCo, except one
that joined or came back mid-run and has not pushed the fragment since). It closes
at once when every live learner has contributed, otherwise after the grace window
(`synchronizer.grace`). While a fragment's previous outer step is still being applied its open
round keeps collecting instead of closing, so a busy Synchronizer batches pushes rather than
queueing outer steps.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from protos import codec
from protos import diloco_pb2 as pb
from synchronizer.bounds import PushBounds
from synchronizer.buffers import Payloads
from synchronizer.clock import Clock, Timer
from synchronizer.config import SynchronizerConfig
from synchronizer.goodput import Goodput, Share
from synchronizer.grace import Paces
from synchronizer.merge import Accumulator, staleness_factor, token_weight
from synchronizer.metrics import Metrics
from synchronizer.receive import Measured

logger = logging.getLogger(__name__)


@dataclass
class Contribution:
    learner_id: str
    base_version: int
    weight: float
    share: Share


@dataclass
class Round:
    start_version: int  # the round's outer step turns this version into start_version + 1
    opened_at: float  # on the core's clock
    acc: Accumulator | None = None  # the round's sums, once it starts adding (`Fp32Buffers`)
    contributions: list[Contribution] = field(default_factory=list)
    owners: set[str] = field(default_factory=set)  # credentials that contributed (per-learner)
    quorum_at: float | None = None
    timer: Timer | None = None  # its grace window's, once it has its quorum
    expired: bool = False  # the grace window ran out
    closing: bool = False
    ticket: int = 0  # its write-ahead log record; the outer step waits until it is durable
    # Accepted pushes not yet added to `acc`, already validated. The outer-step worker decodes
    # and adds them, so acknowledging a push costs no decode.
    held: list[Held] = field(default_factory=list)

    def add_held(self, scratch: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Adds the held pushes to the accumulator in their canonical order (`Held.order`);
        returns their buffers."""
        assert self.acc is not None
        spent = [h.buf for h in self.held]
        try:
            self.acc.add_payloads(self.ordered_held(), scratch)
        finally:
            self.held.clear()
        return spent

    def ordered(self) -> list[Held]:
        """The held pushes, in the order they are added in."""
        return sorted(self.held, key=lambda h: h.order)

    def ordered_held(self) -> list[tuple[torch.Tensor, pb.PayloadHeader, float]]:
        """The held pushes as (buf, header, weight), in the order they are added in."""
        return [(h.buf, h.header, h.weight) for h in self.ordered()]


class Held(NamedTuple):
    """An accepted push held for its round's outer step."""

    buf: torch.Tensor  # the encoded payload as received
    header: pb.PayloadHeader
    weight: float
    order: tuple[str, str, int]  # (learner name, learner id, seq): the order it is added in
    largest: float | None = None  # FP32/BF16: its greatest |value|, where its check measured it


@dataclass
class Verdict:
    """What became of a push, as the fragment judged it."""

    outcome: pb.PushOutcome
    round_version: int
    current_version: int
    staleness: int
    weight: float
    message: str = ""  # why it was not accepted, and what to do
    ticket: int = 0  # its write-ahead log record (accepted pushes, with a log)


class Admission:
    """One fragment's open round: judges pushes into it and says when it may close."""

    def __init__(
        self,
        cfg: SynchronizerConfig,
        metrics: Metrics,
        goodput: Goodput,
        new_accumulator: Callable[[], Accumulator],
        payloads: Payloads,
        fid: int,
        clock: Clock,
    ) -> None:
        self.fid = fid
        self.clock = clock
        self.cfg = cfg
        self.metrics = metrics
        self.goodput = goodput
        self.new_accumulator = new_accumulator  # lent sums, for a round that adds on arrival
        self.payloads = payloads
        self.lock = threading.Lock()  # held only to judge and accumulate one push
        self.round: Round | None = None
        self.pending_version = 0  # version after every round already handed to the closers
        self.bounds = PushBounds(cfg.max_norm_ratio, cfg.max_weight_ratio)
        self.journal: Callable[[int], int] | None = None  # logs a round closing into a version
        # Learners that joined or came back while this fragment's run was under way and have
        # not pushed it since: a synchronous round does not wait for them. One may be a cycle
        # behind and push another fragment first, which the others, blocked on this round,
        # would never reach.
        self.newcomers: set[str] = set()
        # When each learner is next due to push this fragment: kept for `--grace peers` only.
        self.paces = Paces() if cfg.grace == "peers" else None

    def arrived(self, learner_id: str, version: int) -> None:
        """A learner joined, or came back from a lapsed lease or a leave: a newcomer here if
        the fragment's run is under way (a version past 0 or an open round)."""
        with self.lock:
            if version > 0 or self.round is not None:
                self.newcomers.add(learner_id)

    def reset(self, version: int) -> None:
        with self.lock:
            self.pending_version = version

    def applying(self, version: int) -> bool:
        """A taken round's outer step has not finished yet."""
        return self.pending_version != version

    def submit(
        self,
        learner_id: str,
        base_version: int,
        tokens: int,
        steps: int,
        share: Share,
        current_version: int,
        payload: tuple[torch.Tensor, pb.PayloadHeader],
        hold: bool,
        journal: Callable[[Verdict], int] | None = None,
        order: tuple[str, str, int] = ("", "", 0),
        owner: str = "",
        measured: Measured | None = None,
    ) -> tuple[Verdict, Round | None]:
        """Judges one push (its encoded bytes and header; `measured`, what its check measured
        of its values, where it did) and adds it to the open round; returns
        the verdict and its round. `owner`: the credential of the learner, where each learner
        has its own ("" otherwise): the bounds judge it against other credentials' pushes, and
        a round takes one contribution per credential (a second is PUSH_DROPPED_STALE), so
        joining many times buys no more of a round's weight nor of the bounds' history. An accepted push is given to `journal` (the write-ahead log)
        in the order it enters its round, and the verdict carries the ticket it returns.

        With `hold` (room reserved in the held budget by the caller) an accepted payload belongs
        to the round, whose outer step decodes and adds it in `order` (learner name, id, seq)
        among the others held; otherwise it is added now, after the pushes held before it. The caller has validated the base version (not ahead of the
        fragment's) and the values (`codec.check`: finite, right size).

        A push whose norm is above the bound of `self.bounds` is refused (PUSH_REFUSED_NORM),
        and its token weight is capped there, before anything enters the round.
        """
        key = owner or learner_id  # whose history the bounds keep and judge against
        if not self.bounds.judges_norms:
            norm = 0.0
        else:
            norm = measured.norm if measured is not None else self._norm(key, payload)
        spent: list[torch.Tensor] = []
        rnd: Round | None = None
        with self.lock:
            verdict, claimed, capped = self._judge(
                key, base_version, tokens, steps, current_version, norm
            )
            if (
                verdict.outcome == pb.PUSH_ACCEPTED
                and owner
                and self.round is not None
                and owner in self.round.owners
            ):
                verdict = Verdict(
                    pb.PUSH_DROPPED_STALE,
                    verdict.round_version,
                    current_version,
                    verdict.staleness,
                    0.0,
                    f"credential {owner!r} already contributed to round {verdict.round_version} "
                    f"of fragment {self.fid} (one contribution per credential per round): "
                    f"re-pull fragment {self.fid} once that round is merged",
                )
            if verdict.outcome != pb.PUSH_ACCEPTED:
                self.goodput.discarded(learner_id, share)
            else:
                if self.round is None:
                    self.round = Round(verdict.round_version - 1, self.clock.monotonic())
                rnd = self.round
                if hold:
                    largest = measured.largest if measured is not None else None
                    rnd.held.append(Held(payload[0], payload[1], verdict.weight, order, largest))
                else:
                    spent = self._add_now(rnd, payload, verdict.weight)
                counted = self.goodput.accepted(learner_id, share)
                if self.paces is not None:
                    self.paces.pushed(learner_id, self.clock.monotonic(), steps)
                self.newcomers.discard(learner_id)
                rnd.contributions.append(
                    Contribution(learner_id, base_version, verdict.weight, counted)
                )
                if owner:
                    rnd.owners.add(owner)
                if journal is not None:
                    verdict.ticket = journal(verdict)
                self.bounds.accepted(key, norm, capped)
        for buf in spent:
            self.payloads.give(buf)
        if verdict.outcome == pb.PUSH_REFUSED_NORM:
            logger.warning(
                "learner=%s fragment=%d push refused: %s", learner_id, self.fid, verdict.message
            )
        elif capped < claimed:
            self.metrics.weights_capped.inc()
            logger.warning(
                "learner=%s fragment=%d token weight %.4g capped at %.4g (tokens=%d steps=%d): "
                "max_weight_ratio %g x the median of other learners' recent pushes",
                learner_id,
                self.fid,
                claimed,
                capped,
                tokens,
                steps,
                self.cfg.max_weight_ratio,
            )
        return verdict, rnd

    def _norm(self, learner_id: str, payload: tuple[torch.Tensor, pb.PayloadHeader]) -> float:
        """The push's norm as far as judging needs it, outside the lock (pushes to the fragment
        go on): a sampled estimate when the upper bound from its scales is already within the
        norm bound (the usual case: a small fraction of a decode), the exact norm (one read
        pass) otherwise."""
        estimate, upper = codec.norm_estimate(*payload)
        with self.lock:
            limit = self.bounds.norm_bound(learner_id)
        if limit is None or upper <= limit.bound:
            return estimate
        return codec.l2_norm(*payload)

    def _judge(
        self,
        learner_id: str,
        base_version: int,
        tokens: int,
        steps: int,
        current_version: int,
        norm: float,
    ) -> tuple[Verdict, float, float]:
        """The verdict on a push into the open round (lock held), the token weight its counts
        claim and the token weight it gets (both 0 unless accepted)."""
        start = self.round.start_version if self.round is not None else self.pending_version
        staleness = start - base_version
        self.metrics.staleness.observe(staleness)

        def refused(outcome: pb.PushOutcome, message: str) -> tuple[Verdict, float, float]:
            return Verdict(outcome, start + 1, current_version, staleness, 0.0, message), 0.0, 0.0

        if staleness > self.cfg.max_staleness:
            return refused(
                pb.PUSH_DROPPED_STALE,
                f"staleness {staleness} > max_staleness {self.cfg.max_staleness}: re-pull "
                f"fragment {self.fid}",
            )
        limit = self.bounds.norm_bound(learner_id)
        if limit is not None and norm > limit.bound:
            return refused(
                pb.PUSH_REFUSED_NORM,
                f"norm {norm:.4g} > bound {limit.bound:.4g} (max_norm_ratio "
                f"{self.cfg.max_norm_ratio:g} x median {limit.median:.4g} of {limit.known} recent "
                f"accepted pushes by other learners): nothing applied; re-pull fragment {self.fid}",
            )
        claimed = token_weight(self.cfg.token_weight, tokens, steps)
        capped = self.bounds.capped_weight(learner_id, claimed)
        weight = capped * staleness_factor(
            self.cfg.staleness_weight, staleness, self.cfg.staleness_alpha, self.cfg.staleness_hinge
        )
        verdict = Verdict(pb.PUSH_ACCEPTED, start + 1, current_version, staleness, weight)
        return verdict, claimed, capped

    def closability(self, live: set[str], version: int) -> tuple[Round | None, bool, bool]:
        """(open round, close it now, quorum reached), judged together under the round lock."""
        with self.lock:
            rnd = self.round
            if rnd is None or rnd.closing or not rnd.contributions:
                return None, False, False
            contributed = {c.learner_id for c in rnd.contributions}
            busy = self.applying(version)
            if self.cfg.quorum == 0:  # synchronous: every live learner, nobody else to wait for
                done = live - self.newcomers <= contributed
                return rnd, done and not busy, done
            k = max(1, min(self.cfg.quorum, len(live)))
            if len(rnd.contributions) < k:
                return rnd, False, False
            if rnd.quorum_at is None:
                rnd.quorum_at = self.clock.monotonic()
            ready = live <= contributed or self.cfg.grace == "none" or rnd.expired
            # While the previous round's outer step is still being applied the open round keeps
            # collecting (a busy Synchronizer batches pushes instead of queueing outer steps).
            return rnd, ready and not busy, True

    def replayed(
        self,
        learner_id: str,
        base_version: int,
        weight: float,
        share: Share,
        payload: tuple[torch.Tensor, pb.PayloadHeader],
        round_version: int,
        order: tuple[str, str, int],
        hold: bool,
    ) -> Round:
        """Adds a push from the write-ahead log to the round it went into, with the weight it
        was judged to have, held or added at once as it was: the same additions in the same
        order as before the restart."""
        spent: list[torch.Tensor] = []
        with self.lock:
            if self.round is None:
                self.round = Round(round_version - 1, self.clock.monotonic())
            rnd = self.round
            if rnd.start_version != round_version - 1:
                raise ValueError(
                    f"fragment {self.fid}: a logged push for version {round_version} meets the open round to {rnd.start_version + 1}"
                )
            if hold:
                self.payloads.claim(payload[0].numel())
                rnd.held.append(Held(payload[0], payload[1], weight, order))
            else:
                spent = self._add_now(rnd, payload, weight)
            rnd.contributions.append(Contribution(learner_id, base_version, weight, share))
            self.newcomers.discard(learner_id)
        for buf in spent:
            self.payloads.give(buf)
        return rnd

    def _add_now(
        self, rnd: Round, payload: tuple[torch.Tensor, pb.PayloadHeader], weight: float
    ) -> list[torch.Tensor]:
        """Adds a push that is not held (lock held): the round takes its sums now if it has
        none, adds the pushes held so far (in their order) first, then this one; returns the
        held buffers spent (their bytes no longer count as held)."""
        if rnd.acc is None:
            rnd.acc = self.new_accumulator()
        spent = rnd.add_held()
        self.payloads.release(sum(buf.numel() for buf in spent))
        rnd.acc.add_payload(payload[0], payload[1], weight)
        return spent

    def take(self, rnd: Round, log: bool = True) -> bool:
        """Marks the round as closing and opens the way for the next; False if already taken.
        With a `journal` and `log`, the close is logged (in order with the round's pushes); a
        close replayed from the log is not logged again."""
        with self.lock:
            if self.round is not rnd or rnd.closing:
                return False
            if log and self.journal is not None:
                rnd.ticket = self.journal(rnd.start_version + 1)
            rnd.closing = True
            self.round = None
            self.pending_version = rnd.start_version + 1
            if rnd.timer is not None:
                rnd.timer.cancel()
            return True

    def peers_due(self, rnd: Round, live: set[str]) -> float:
        """Seconds until the last live learner of the pace of `rnd`'s contributors is due to
        push this fragment (`Paces.due`); 0 where the grace is not `peers`."""
        if self.paces is None:
            return 0.0
        with self.lock:
            contributed = {c.learner_id for c in rnd.contributions}
            return self.paces.due(contributed, live - contributed, self.clock.monotonic())

    def arm(self, rnd: Round, start: Callable[[], Timer]) -> None:
        """Starts the round's grace timer (`start`) unless it has one or is closing."""
        with self.lock:
            if rnd.timer is None and not rnd.closing:
                rnd.timer = start()

    def expire(self, rnd: Round) -> None:
        """The round's grace window ran out: it may close without the missing learners."""
        with self.lock:
            rnd.expired = True

    def holding(self, live: set[str], version: int) -> tuple[bool, bool, int]:
        """For a push that finds the held budget full: (the open round adds on arrival, it has
        its quorum, bytes it holds)."""
        rnd, _, quorum = self.closability(live, version)
        if rnd is None:
            return False, False, 0
        with self.lock:
            return rnd.acc is not None, quorum, sum(h.buf.numel() for h in rnd.held)
