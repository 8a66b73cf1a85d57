"""Learners and their leases: who is joined, who is alive, and what each has reported.

A learner is alive while its lease is fresh (renewed by every heartbeat, push and pull, and by each
chunk a transfer of its moves, so an upload or a pull longer than a lease keeps it alive while its
bytes flow); a lease that lapses makes it dead: it no longer counts toward "every live learner" and
never holds a round. A dead learner may come back by joining again under its id. Join hands each new
learner a random session secret; every later call under that id (and a re-join under it) must carry
it, so one learner cannot act as another (PERMISSION_DENIED): only its SHA-256 is kept, and
checkpointed, so learners keep their sessions across a restart. With per-learner credentials
(`synchronizer.credentials`) an id is bound at Join to its credential too, and a credential has at
most `max_learners_per_credential` live learners. An evaluator (joined with `evaluator` set: it
pulls and reports eval loss, never pushes) is a learner here too, but never a training one: it
is not among the live learners rounds wait for, takes no `max_learners` slot (at most
MAX_EVALUATORS are alive), adds no goodput capacity, and its tokens are not consumed tokens.
The registry also keeps each
learner's push replies by sequence number, so a retried push is answered, not applied twice, and
computes the Dynamic Local Updates directive from measured step times.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from protos import diloco_pb2 as pb
from synchronizer.clock import Clock, SystemClock
from synchronizer.errors import Code, Rejected
from synchronizer.records import (
    MAX_NAME_CHARS,
    LearnerRecord,
    check_credential,
    check_id,
    check_session,
    checkpoint_fields,
    from_checkpoint,
    join_fields,
    session_hash,
)

logger = logging.getLogger(__name__)

REPLIES_KEPT = 256  # push replies remembered per learner for duplicate detection
RECORDS_PER_SLOT = 4  # learner records kept (alive, dead or left) per max_learners slot
RENEW_EVERY_S = 0.25  # a transfer renews its learner's lease at most this often
DLU_RATIO = 0.5  # Dynamic Local Updates with no H set: scale only learners below this speed ratio
MAX_EVALUATORS = 4  # live evaluators at once (they hold no max_learners slot)


class Registry:
    def __init__(
        self,
        lease_s: float,
        max_learners: int,
        forget_after_s: float,
        clock: Clock | None = None,
    ) -> None:
        self.clock = clock or SystemClock()
        self.lease_s = lease_s
        self.max_learners = max_learners
        self.forget_after_s = forget_after_s
        self.lock = threading.Lock()
        self.learners: dict[str, LearnerRecord] = {}
        self.renew_every_s = min(RENEW_EVERY_S, lease_s / 4)
        self.forgotten_tokens = 0  # tokens of training learners no longer kept (not checkpointed)

    def join(
        self,
        name: str,
        learner_id: str = "",
        session: str = "",
        credential: str = "",
        per_credential: int = 0,
        evaluator: bool = False,
    ) -> tuple[LearnerRecord, str, str]:
        """Registers (or revives) a learner under `credential`; returns it, its session secret
        and how it joined: "new", "back" (from a lapsed lease or a leave) or "again" (while
        alive: the same learner's Join repeated, or the Synchronizer restarted). Re-joining under
        an id takes that id's session and credential (PERMISSION_DENIED otherwise) and keeps
        them. With `per_credential`, a credential may have at most that many live learners
        (RESOURCE_EXHAUSTED past it).

        At most `max_learners` are alive at once: dead and left learners hold no slot. Records of
        dead and left learners are kept (for re-joins, duplicate pushes and goodput) up to
        RECORDS_PER_SLOT per slot; past that the longest gone are forgotten first. An
        `evaluator` takes no such slot; at most MAX_EVALUATORS are alive. A re-join keeps what
        the id first joined as."""
        if len(name) > MAX_NAME_CHARS:
            raise Rejected(
                Code.INVALID_ARGUMENT,
                "bad_learner_name",
                f"learner_name is {len(name)} characters; at most {MAX_NAME_CHARS}",
            )
        check_id(learner_id)
        now = self.clock.monotonic()
        with self.lock:
            rec = self.learners.get(learner_id) if learner_id else None
            if rec is not None:
                check_session(rec, session)
                check_credential(rec, credential)
                if not rec.session_hash:  # restored from a checkpoint that kept no sessions
                    session = session or secrets.token_hex(16)
                    rec.session_hash = session_hash(session)
                how = "again" if rec.state == "alive" else "back"
                if how == "back":
                    self._check_credential_room(credential, per_credential, now)
                rec.state, rec.died_at, rec.pushes_done = "alive", None, False
                rec.lease_deadline = now + self.lease_s
                rec.name = name or rec.name
                return rec, session, how
            self._check_credential_room(credential, per_credential, now)
            alive = sum(
                1
                for r in self.learners.values()
                if r.state == "alive" and now <= r.lease_deadline and r.evaluator == evaluator
            )
            if evaluator and alive >= MAX_EVALUATORS:
                raise Rejected(
                    Code.RESOURCE_EXHAUSTED,
                    "too_many_evaluators",
                    f"the Synchronizer already has {alive} live evaluators (at most {MAX_EVALUATORS}); retry when one leaves or its lease lapses",
                )
            if not evaluator and alive >= self.max_learners:
                raise Rejected(
                    Code.RESOURCE_EXHAUSTED,
                    "too_many_learners",
                    f"the Synchronizer already has {alive} live learners (max_learners={self.max_learners}); retry when one leaves or its lease lapses",
                )
            lid = learner_id or uuid.uuid4().hex[:12]
            session = secrets.token_hex(16)
            rec = LearnerRecord(lid, name or lid, "alive", now + self.lease_s, now)
            rec.first_joined = self.clock.wall()
            rec.session_hash = session_hash(session)
            rec.credential = credential
            rec.evaluator = evaluator
            self.learners[lid] = rec
            self._trim()
            return rec, session, "new"

    def _check_credential_room(self, credential: str, per_credential: int, now: float) -> None:
        """Refuses a learner beyond `per_credential` live ones of one credential (0: no limit).
        Caller holds the lock."""
        if not per_credential:
            return
        held = sum(
            1
            for r in self.learners.values()
            if r.credential == credential and r.state == "alive" and now <= r.lease_deadline
        )
        if held >= per_credential:
            raise Rejected(
                Code.RESOURCE_EXHAUSTED,
                "too_many_credential_learners",
                f"credential {credential!r} has {held} live learners already (max_learners_per_credential={per_credential}); leave, or let one's lease lapse, before another joins",
            )

    def _trim(self) -> None:
        """Forgets the longest-gone records beyond RECORDS_PER_SLOT * max_learners. Caller holds
        the lock."""
        excess = len(self.learners) - RECORDS_PER_SLOT * self.max_learners
        if excess <= 0:
            return
        gone = sorted(
            (r for r in self.learners.values() if r.state != "alive"),
            key=lambda r: r.died_at or r.joined_at,
        )
        for rec in gone[:excess]:
            self._forget(rec)

    def member(self, learner_id: str, session: str) -> LearnerRecord:
        """The record for an id, alive or dead (a lapsed lease still names its learner, which
        may re-join or leave): Rejected if unknown or gone, or when `session` is not the one
        Join gave it."""
        check_id(learner_id)
        with self.lock:
            return self._member(learner_id, session)

    def _member(self, learner_id: str, session: str) -> LearnerRecord:
        """`member`, lock held."""
        rec = self.learners.get(learner_id)
        if rec is None or rec.state == "left":
            raise Rejected(
                Code.NOT_FOUND,
                "unknown_learner",
                f"learner {learner_id!r} is not joined; call Join first",
            )
        check_session(rec, session)
        return rec

    def alive(self, learner_id: str, session: str) -> LearnerRecord:
        """The live record for an id, lease renewed: Rejected if unknown, dead or gone, or when
        `session` is not the one Join gave it."""
        check_id(learner_id)
        with self.lock:
            rec = self._member(learner_id, session)
            now = self.clock.monotonic()
            if rec.state == "dead" or now > rec.lease_deadline:
                raise Rejected(
                    Code.FAILED_PRECONDITION,
                    "lease_expired",
                    f"the lease of learner {learner_id!r} expired; call Join again with this learner_id",
                )
            rec.lease_deadline = now + self.lease_s
            return rec

    def renew(self, rec: LearnerRecord) -> None:
        """Renews a live learner's lease from its transfer's progress. Cheap enough to call on
        every chunk: the lock is taken only once the lease is `renew_every_s` older than a fresh
        one. A lease already lapsed stays lapsed (that learner joins again)."""
        now = self.clock.monotonic()
        if rec.lease_deadline - now > self.lease_s - self.renew_every_s:
            return
        with self.lock:
            if rec.state == "alive" and now <= rec.lease_deadline:
                rec.lease_deadline = now + self.lease_s

    @contextlib.contextmanager
    def held(self, rec: LearnerRecord) -> Iterator[None]:
        """Keeps a live learner's lease for as long as the block runs (the server's own work on
        its behalf, such as the first checkpoint of the model it uploaded), then renews it."""
        with self.lock:
            alive = rec.state == "alive" and self.clock.monotonic() <= rec.lease_deadline
            if alive:
                rec.lease_deadline = math.inf
        try:
            yield
        finally:
            if alive:
                with self.lock:
                    rec.lease_deadline = self.clock.monotonic() + self.lease_s

    def check_counts(
        self, rec: LearnerRecord, what: str, tokens: float, steps: float, seconds: float
    ) -> None:
        """`LearnerRecord.check_counts` against this registry's wall clock."""
        rec.check_counts(what, tokens, steps, seconds, self.clock.wall())

    def report(
        self, rec: LearnerRecord, counters: pb.LearnerCounters, step_time_s: float = 0.0
    ) -> float:
        """Stores cumulative counters (they never go down); returns the new blocked seconds.
        Counters no learner could have reached are refused and nothing is stored."""
        self.check_counts(
            rec,
            "counters",
            counters.tokens,
            counters.steps,
            max(counters.compute_s, counters.blocked_s, step_time_s),
        )
        with self.lock:
            blocked_delta = max(0.0, counters.blocked_s - rec.blocked_s)
            if counters.tokens < rec.reported_tokens:  # a new process under this id
                rec.earlier_tokens += rec.reported_tokens
            rec.reported_tokens = counters.tokens
            rec.steps = max(rec.steps, counters.steps)
            rec.tokens = max(rec.tokens, counters.tokens)
            rec.compute_s = max(rec.compute_s, counters.compute_s)
            rec.blocked_s = max(rec.blocked_s, counters.blocked_s)
            if step_time_s > 0:
                rec.step_time_s = step_time_s
            return blocked_delta

    def leave(self, learner_id: str) -> LearnerRecord:
        with self.lock:
            rec = self.learners.get(learner_id)
            if rec is None or rec.state == "left":
                raise Rejected(
                    Code.NOT_FOUND, "unknown_learner", f"learner {learner_id!r} is not joined"
                )
            rec.state, rec.died_at = "left", self.clock.monotonic()
            return rec

    def reap(self) -> list[LearnerRecord]:
        """Marks lapsed leases dead; a learner dead for `forget_after_s` stops counting toward
        capacity (left), and one left for `forget_after_s` is forgotten. Returns the newly dead."""
        now = self.clock.monotonic()
        died = []
        with self.lock:
            for rec in list(self.learners.values()):
                gone_for = now - rec.died_at if rec.died_at is not None else 0.0
                if rec.state == "alive" and now > rec.lease_deadline:
                    rec.state, rec.died_at = "dead", now
                    died.append(rec)
                elif rec.state == "dead" and gone_for > self.forget_after_s:
                    rec.state, rec.died_at = "left", now
                elif rec.state == "left" and gone_for > self.forget_after_s:
                    self._forget(rec)
        for rec in died:
            logger.warning("learner %s (%s) lease lapsed: now dead", rec.learner_id, rec.name)
        return died

    def _forget(self, rec: LearnerRecord) -> None:
        """Drops a record, keeping its tokens among the consumed. Caller holds the lock."""
        if not rec.evaluator:
            self.forgotten_tokens += rec.consumed_tokens
        del self.learners[rec.learner_id]

    def _live(self) -> list[LearnerRecord]:
        """Live training learners (evaluators are not)."""
        now = self.clock.monotonic()
        with self.lock:
            return [
                r
                for r in self.learners.values()
                if r.state == "alive" and now <= r.lease_deadline and not r.evaluator
            ]

    def live_by_credential(self) -> dict[str, int]:
        """Live learners per credential of every learner known (0 where none is live)."""
        now = self.clock.monotonic()
        counts: dict[str, int] = {}
        with self.lock:
            for r in self.learners.values():
                live = r.state == "alive" and now <= r.lease_deadline
                counts[r.credential] = counts.get(r.credential, 0) + live
        return counts

    def live_ids(self) -> set[str]:
        return {r.learner_id for r in self._live()}

    def pushing_ids(self) -> set[str]:
        """Live learners that may still push: the ones a round can wait for."""
        return {r.learner_id for r in self._live() if not r.pushes_done}

    def done_pushing(self, rec: LearnerRecord) -> bool:
        """The learner said it pushes nothing more; True if that is news."""
        with self.lock:
            news, rec.pushes_done = not rec.pushes_done, True
            return news

    def live_specs(self) -> set[str]:
        """Spec hashes the live learners joined with."""
        return {r.spec_hash for r in self._live()}

    def counts(self) -> dict[str, int]:
        with self.lock:
            out = {"alive": 0, "dead": 0}
            for r in self.learners.values():
                if r.state in out and not r.evaluator:
                    out[r.state] += 1
            return out

    def capacity_slots(self) -> int:
        """Learners that count toward capacity: alive, or dead and not yet forgotten (training
        learners only)."""
        with self.lock:
            return sum(
                1
                for r in self.learners.values()
                if r.state in ("alive", "dead") and not r.evaluator
            )

    def consumed_tokens(self) -> float:
        """Training tokens every training learner reported, kept or forgotten since the start
        (a process restarted under an id adds its tokens to its predecessors')."""
        with self.lock:
            kept = sum(r.consumed_tokens for r in self.learners.values() if not r.evaluator)
            return float(kept + self.forgotten_tokens)

    # Idempotency -------------------------------------------------------------------------

    def seen_reply(self, rec: LearnerRecord, seq: int) -> pb.PushReply | None:
        """The reply already given for (learner, seq), if that push was judged before.

        Pushes of different fragments may arrive out of order, so a seq below the newest is
        only a repeat if it is remembered, or no newer than a reply already forgotten (the
        last REPLIES_KEPT are remembered; after a restart, everything up to the restored
        high-water mark counts as forgotten).
        """
        with self.lock:
            if seq in rec.replies:
                return rec.replies[seq]
            if seq <= rec.forgotten_up_to:
                return pb.PushReply(
                    outcome=pb.PUSH_DUPLICATE,
                    message=f"push seq {seq} was judged before (too old to recall its outcome)",
                )
            return None

    def record_reply(
        self, rec: LearnerRecord, seq: int, reply: pb.PushReply, ticket: int = 0
    ) -> None:
        """Remembers the reply to (learner, seq), and the log ticket a repeat must wait for."""
        with self.lock:
            rec.replies[seq] = reply
            if ticket:
                rec.tickets[seq] = ticket
            rec.max_seq = max(rec.max_seq, seq)
            while len(rec.replies) > REPLIES_KEPT:
                oldest = min(rec.replies)
                del rec.replies[oldest]
                rec.tickets.pop(oldest, None)
                rec.forgotten_up_to = max(rec.forgotten_up_to, oldest)

    def ticket_of(self, rec: LearnerRecord, seq: int) -> int:
        with self.lock:
            return rec.tickets.get(seq, 0)

    def joined_record(self, d: dict[str, Any]) -> LearnerRecord:
        """A learner from a write-ahead log JOIN record: kept as it is if known (its session
        bound), otherwise added alive with a fresh lease (it joined after the checkpoint, so it
        was alive a moment ago; see `restore`)."""
        now = self.clock.monotonic()
        with self.lock:
            rec = self.learners.get(d["learner_id"])
            if rec is None:
                rec = LearnerRecord(d["learner_id"], d["name"], "alive", now + self.lease_s, now)
                rec.first_joined = self.clock.wall()
                self.learners[rec.learner_id] = rec
            rec.session_hash = rec.session_hash or str(d.get("session_hash", ""))
            rec.first_joined = min(rec.first_joined, float(d.get("first_joined", rec.first_joined)))
            rec.spec_hash = str(d.get("spec_hash", rec.spec_hash))
            rec.credential = str(d.get("credential", rec.credential))
            rec.evaluator = bool(d.get("evaluator", rec.evaluator))
            return rec

    def journal_of(self, rec: LearnerRecord) -> dict[str, Any]:
        """What a JOIN record keeps of a learner."""
        with self.lock:
            return join_fields(rec)

    # Dynamic Local Updates -------------------------------------------------------------------

    def speed_ratio(self, rec: LearnerRecord) -> float:
        """v_m / v_max: the fastest step time over this one's (1.0 until known), among the live
        learners and those that left (finished) and are not yet forgotten (`forget_after_s`):
        a slow learner whose faster peers finished first keeps the H it had, rather than
        taking the full H for the last steps of its run (whose last push then came at a step
        that depended on when they finished)."""
        with self.lock:
            times = [
                r.step_time_s
                for r in self.learners.values()
                if r.state in ("alive", "left") and r.step_time_s > 0
            ]
            if rec.step_time_s <= 0 or not times:
                return 1.0
            return min(1.0, min(times) / rec.step_time_s)

    def settled_ratio(self, rec: LearnerRecord, levels: int) -> float:
        """`speed_ratio` as Dynamic Local Updates tells it: with `levels`, rounded to a multiple
        of 1/levels (at least one level) and kept until the measured ratio moves more than 3/4
        of a level away from it, so that measured step times that jitter (within a run, and
        from one run to the next) give the same H; with 0 levels, as measured."""
        ratio = self.speed_ratio(rec)
        if levels <= 0:
            return ratio
        level = 1.0 / levels
        with self.lock:
            told = rec.dlu_ratio
            if not told or abs(ratio - told) > 0.75 * level:
                told = min(1.0, max(level, round(ratio / level) * level))
                rec.dlu_ratio = told
            return told

    def inner_steps_for(self, rec: LearnerRecord, inner_steps: int, levels: int) -> int:
        """H_m = floor(v_m / v_max * H) from measured step times (Async Local-SGD DyLU), the
        ratio settled on `levels` (`settled_ratio`)."""
        return max(1, int(self.settled_ratio(rec, levels) * inner_steps))

    # Durability ------------------------------------------------------------------------------

    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return [checkpoint_fields(r) for r in self.learners.values()]

    def restore(self, records: list[dict[str, Any]]) -> None:
        """Learners from a checkpoint: those alive when it was written come back alive with a
        fresh lease (they keep their sessions: a restart is not their fault, and a round that
        waits for every live learner still waits for them); if one does not call within that
        lease it is dead, as any other. The others come back dead: they re-join under their ids."""
        now = self.clock.monotonic()
        with self.lock:
            for d in records:
                if d.get("left"):
                    continue
                rec = from_checkpoint(d, now, self.lease_s, self.clock.wall())
                self.learners[rec.learner_id] = rec
