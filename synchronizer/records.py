"""A learner's record as the Synchronizer keeps it, and the checks every call makes against it.

`LearnerRecord` holds who a learner is (id, name, the SHA-256 of the session secret Join gave
it, the credential it joined under), its lease, its self-reported counters with their sanity
bounds, and the replies to its recent pushes by sequence number. What a checkpoint and a
write-ahead log JOIN record keep of it, and how a record comes back from them, are here too;
`synchronizer.leases` keeps the records and decides who is alive.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from dataclasses import dataclass, field
from typing import Any

from protos import diloco_pb2 as pb
from synchronizer.errors import Code, Rejected

MAX_NAME_CHARS = 128  # a learner's name: logged, stored in checkpoints, listed by Status
MAX_ID_CHARS = 64  # ids handed out are 12 hex digits
# Sanity bounds of self-reported counts: no learner has done more than this since it first
# joined (time counters at most the wall time itself), give or take COUNTS_SLACK_S.
MAX_TOKENS_PER_S = 1e9
MAX_STEPS_PER_S = 1e5
COUNTS_SLACK_S = 60.0


@dataclass
class LearnerRecord:
    learner_id: str
    name: str
    state: str  # "alive", "dead" or "left"
    lease_deadline: float
    joined_at: float
    died_at: float | None = None
    steps: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    blocked_s: float = 0.0
    step_time_s: float = 0.0
    dlu_ratio: float = 0.0  # the speed ratio Dynamic Local Updates last told it (0: none yet)
    max_seq: int = 0
    session_hash: str = ""  # SHA-256 of the session secret Join gave; "" = unbound (old checkpoint)
    spec_hash: str = ""  # of the model spec it joined with
    credential: str = ""  # the credential it joined under ("" in shared mode)
    first_joined: float = 0.0  # wall clock, kept across restarts
    evaluator: bool = False  # joined as an evaluator: reports eval loss, never trains
    # Said in its heartbeats: finishing, its last pushes answered; no round waits for it. Not
    # kept across restarts (its next heartbeat says it again); a Join clears it.
    pushes_done: bool = False
    # Tokens consumed under this id across its processes: a process restarted under the id
    # (re-joined, counters from zero) reports less than its predecessor's last count, which is
    # then banked in earlier_tokens (`tokens` keeps the most any process reported)
    reported_tokens: int = 0  # the current process's last report
    earlier_tokens: int = 0  # its earlier processes' last reports, summed

    @property
    def consumed_tokens(self) -> int:
        return max(self.tokens, self.earlier_tokens + self.reported_tokens)

    forgotten_up_to: int = 0  # replies up to this seq are no longer remembered
    replies: dict[int, pb.PushReply] = field(default_factory=dict)
    tickets: dict[int, int] = field(default_factory=dict)  # seq -> write-ahead log ticket
    push_lock: threading.Lock = field(default_factory=threading.Lock)  # judge one seq at a time

    def check_counts(
        self, what: str, tokens: float, steps: float, seconds: float, wall_now: float
    ) -> None:
        """Refuses counts no learner could have reached since it first joined (wall clock
        `wall_now`): more tokens or steps than MAX_*_PER_S, or more compute or blocked seconds
        than wall-clock seconds."""
        age = max(0.0, wall_now - self.first_joined) + COUNTS_SLACK_S
        if tokens > age * MAX_TOKENS_PER_S or steps > age * MAX_STEPS_PER_S or seconds > age:
            raise Rejected(
                Code.INVALID_ARGUMENT,
                "bad_counters",
                f"{what} of learner {self.learner_id!r} (tokens={tokens:g}, steps={steps:g}, seconds={seconds:g}) are more than it can have done in the {age:.0f} s since it joined",
            )

    def counters(self) -> pb.LearnerCounters:
        return pb.LearnerCounters(
            steps=self.steps, tokens=self.tokens, compute_s=self.compute_s, blocked_s=self.blocked_s
        )


def session_hash(session: str) -> str:
    return hashlib.sha256(session.encode()).hexdigest()


def check_session(rec: LearnerRecord, session: str) -> None:
    """Refuses a call whose session is not the one Join gave this learner."""
    if rec.session_hash and not hmac.compare_digest(
        session_hash(session) if session else "", rec.session_hash
    ):
        raise Rejected(
            Code.PERMISSION_DENIED,
            "wrong_session",
            f"this call's session is not learner {rec.learner_id!r}'s: only the learner that joined under an id may act as it (join without learner_id to get an id of your own)",
        )


def check_credential(rec: LearnerRecord, credential: str) -> None:
    """Refuses a call under another credential than the one this learner id joined under."""
    if not hmac.compare_digest(rec.credential.encode(), credential.encode()):
        raise Rejected(
            Code.PERMISSION_DENIED,
            "wrong_credential",
            f"learner {rec.learner_id!r} joined under another credential; each credential acts only as its own learners (join without learner_id to get an id of your own)",
        )


def check_id(learner_id: str) -> None:
    """Refuses an id longer than any the Synchronizer hands out (it is logged and stored)."""
    if len(learner_id) > MAX_ID_CHARS:
        raise Rejected(
            Code.INVALID_ARGUMENT,
            "bad_learner_id",
            f"learner_id is {len(learner_id)} characters; the ids Join hands out have at most {MAX_ID_CHARS}",
        )


def join_fields(rec: LearnerRecord) -> dict[str, Any]:
    """What a write-ahead log JOIN record keeps of a learner."""
    return {
        "learner_id": rec.learner_id,
        "name": rec.name,
        "session_hash": rec.session_hash,
        "first_joined": rec.first_joined,
        "spec_hash": rec.spec_hash,
        "credential": rec.credential,
        "evaluator": rec.evaluator,
    }


def checkpoint_fields(rec: LearnerRecord) -> dict[str, Any]:
    """What a checkpoint keeps of a learner."""
    return {
        "learner_id": rec.learner_id,
        "name": rec.name,
        "left": rec.state == "left",
        "alive": rec.state == "alive",
        "max_seq": rec.max_seq,
        "session_hash": rec.session_hash,
        "spec_hash": rec.spec_hash,
        "credential": rec.credential,
        "evaluator": rec.evaluator,
        "first_joined": rec.first_joined,
        "steps": rec.steps,
        "tokens": rec.tokens,
        "compute_s": rec.compute_s,
        "blocked_s": rec.blocked_s,
        "reported_tokens": rec.reported_tokens,
        "earlier_tokens": rec.earlier_tokens,
    }


def from_checkpoint(d: dict[str, Any], now: float, lease_s: float, wall: float) -> LearnerRecord:
    """A learner a checkpoint kept (not one that left): alive with a fresh lease from `now` if
    it was alive, dead otherwise; every reply up to its highest seq counts as forgotten."""
    if d.get("alive"):
        rec = LearnerRecord(d["learner_id"], d["name"], "alive", now + lease_s, now)
    else:
        rec = LearnerRecord(d["learner_id"], d["name"], "dead", now, now, died_at=now)
    rec.max_seq = rec.forgotten_up_to = int(d["max_seq"])
    rec.session_hash = str(d.get("session_hash", ""))
    rec.spec_hash = str(d.get("spec_hash", ""))
    rec.credential = str(d.get("credential", ""))
    rec.evaluator = bool(d.get("evaluator", False))
    rec.first_joined = float(d.get("first_joined", wall))
    rec.steps, rec.tokens = int(d["steps"]), int(d["tokens"])
    rec.compute_s, rec.blocked_s = float(d["compute_s"]), float(d["blocked_s"])
    rec.reported_tokens = int(d.get("reported_tokens", rec.tokens))
    rec.earlier_tokens = int(d.get("earlier_tokens", 0))
    return rec
