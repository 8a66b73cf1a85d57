"""A sharded Synchronizer seen as one: `ShardedClient` routes each fragment to the shard that owns it.

S Synchronizer processes ("shards") share the model, shard i owning the fragments
`protos.spec.owned_fragments(spec, S, i)`. `ShardedClient` implements the learner's `Transport`
over one `SyncClient` per shard: a join joins every shard under one learner id (the first shard
that answers hands it out; each shard keeps its own session secret), checks that the shards are
0..S-1 once each and own what the learner computed, and merges their replies into one. Pushes and
pulls go to the fragment's owner; heartbeats go to every shard at once, and one shard down does not
fail them while another answers. The server epoch it reports is the shards' epochs joined in shard
order, so a shard restarted with a new epoch makes the session re-join and re-pull that shard's
fragments, and one restarted from its write-ahead log (same epoch) changes nothing. Which
addresses the shards have, and whether a learner needs this class at all, is
`learner.addresses`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Protocol

import grpc
import torch

from learner.client import ShardMismatch
from learner.session import EPOCH_SEP, REJOIN_CODES, Push, Transport
from protos import diloco_pb2 as pb
from protos.spec import ModelSpec, owned_fragments, shard_owners

logger = logging.getLogger(__name__)

WARN_EVERY_S = 30.0  # a shard that keeps failing heartbeats is logged at most this often
# A re-join carries on without a shard that fails with these (it keeps what that shard last said)
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class Shard(Transport, Protocol):
    """One shard's client (a `SyncClient`; a fake in tests): told, when it joins, how many
    shards there are and which owns each fragment; uploads only the fragments it owns."""

    def join(
        self,
        name: str,
        spec: ModelSpec,
        learner_id: str = "",
        *,
        shards: int = 0,
        fragment_shards: Sequence[int] = (),
        evaluator: bool = False,
    ) -> pb.JoinReply: ...

    def init_model(
        self, fragments: Sequence[torch.Tensor], fragment_ids: Sequence[int] | None = None
    ) -> pb.InitModelReply: ...

    def status(self) -> pb.StatusReply: ...

    def report_eval(
        self, eval_loss: float, versions: dict[int, int], eval_set: str = ""
    ) -> pb.EvalReply: ...


class Refusal(grpc.RpcError):
    """A status this client answers itself (as a shard would), e.g. ALREADY_EXISTS from an
    InitModel that left the fragments of already initialised shards to be pulled."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class ShardedClient:
    """The `Transport` of a learner whose Synchronizer is `len(shards)` shards (two or more)."""

    def __init__(self, shards: Sequence[Shard]) -> None:
        if len(shards) < 2:
            raise ValueError(f"a sharded client needs two or more shards, got {len(shards)}")
        self.shards = list(shards)  # in shard-index order once joined
        self.address = ",".join(s.address for s in shards)
        self.owners: list[int] = []  # shard of each fragment, set by the first join
        self.replies: list[pb.JoinReply | None] = [None] * len(shards)  # last Join of each shard
        self.ordered = False  # self.shards are in shard-index order
        self.restore: list[str] = []  # sessions to re-join with, by shard index (`session`)
        self.pool = ThreadPoolExecutor(len(shards), thread_name_prefix="diloco-shard")
        self.lock = threading.Lock()
        self.warned_at: dict[int, float] = {}
        self.beats: list[Future[pb.HeartbeatReply] | None] = [None] * len(shards)  # in flight

    # Identity ------------------------------------------------------------------------------

    @property
    def learner_id(self) -> str:
        return self.shards[0].learner_id

    @learner_id.setter
    def learner_id(self, value: str) -> None:
        for s in self.shards:
            s.learner_id = value

    @property
    def session(self) -> str:
        """The shards' session secrets, joined by ',' in shard order: what a restarted learner
        gives back (`learner_session`) to re-join as itself."""
        return ",".join(s.session for s in self.shards)

    @session.setter
    def session(self, value: str) -> None:
        sessions = value.split(",") if value else []
        if sessions and len(sessions) != len(self.shards):
            raise ShardMismatch(
                f"learner_session holds {len(sessions)} session(s), this learner has "
                f"{len(self.shards)} shards: give the one the sharded learner reported"
            )
        self.restore = sessions

    def shard_of(self, fragment_id: int) -> int:
        return self.owners[fragment_id]

    # Join ----------------------------------------------------------------------------------

    def join(
        self, name: str, spec: ModelSpec, learner_id: str = "", evaluator: bool = False
    ) -> pb.JoinReply:
        """Joins every shard under one learner id: the given one, or the one the first shard
        hands out. A re-join under an id carries on without a shard out of reach that was
        joined before (its last reply stands; it is re-joined when it answers again).
        ShardMismatch when the shards are not 0..S-1 once each owning what this learner
        computed; the first shard's `grpc.RpcError` otherwise. `evaluator`: as an evaluator
        on every shard."""
        n = len(self.shards)
        try:
            owners = shard_owners(spec, n)
        except ValueError as e:
            raise ShardMismatch(str(e)) from None
        if self.restore:
            self._order_by_status()
            for s, session in zip(self.shards, self.restore, strict=True):
                s.session = session
            self.restore = []
        rejoin = bool(learner_id)
        replies: list[pb.JoinReply | None] = [None] * n
        for i, s in enumerate(self.shards):
            try:
                replies[i] = r = s.join(
                    name, spec, learner_id, shards=n, fragment_shards=owners, evaluator=evaluator
                )
            except grpc.RpcError as e:
                if not (rejoin and self.replies[i] is not None and e.code() in UNREACHABLE):
                    raise
                logger.warning(
                    "learner=%s re-joining without the shard at %s: %s",
                    learner_id,
                    s.address,
                    e.code().name,
                )
                continue
            learner_id = r.learner_id
        if not self.ordered:
            self._order(replies)
            replies = sorted(replies, key=lambda r: r.shard_index if r else 0)
        for i, got in enumerate(replies):
            if got is not None:
                self._check(i, got, spec)
                self.replies[i] = got
        self.owners = owners
        return self._merged_join(spec)

    def _order(self, replies: Sequence[pb.JoinReply | None]) -> None:
        """Puts the shards in shard-index order; ShardMismatch unless they are 0..S-1 once each."""
        n = len(self.shards)
        indexes = [r.shard_index for r in replies if r is not None]
        if sorted(indexes) != list(range(n)):
            said = ", ".join(
                f"{s.address} is shard {r.shard_index}"
                for s, r in zip(self.shards, replies, strict=True)
                if r is not None
            )
            raise ShardMismatch(
                f"this learner needs shards 0..{n - 1} once each, but {said}: give each shard's "
                "address once"
            )
        by_index = sorted(zip(indexes, self.shards, strict=True), key=lambda t: t[0])
        self.shards = [s for _, s in by_index]
        self.ordered = True

    def _order_by_status(self) -> None:
        """Before the first join, when sessions are to be restored: the shards' order, from their
        Status (a Join must already carry the right shard's session)."""
        if self.ordered:
            return
        by_index = {s.status().shard_index: s for s in self.shards}
        if sorted(by_index) != list(range(len(self.shards))):
            raise ShardMismatch(
                f"this learner needs shards 0..{len(self.shards) - 1} once each, but the "
                f"Synchronizers at {self.address} are shards {sorted(by_index)}"
            )
        self.shards = [by_index[i] for i in range(len(self.shards))]
        self.ordered = True

    def _check(self, i: int, r: pb.JoinReply, spec: ModelSpec) -> None:
        n = len(self.shards)
        if r.shard_index != i:
            raise ShardMismatch(
                f"the Synchronizer at {self.shards[i].address} was shard {i} of {n} and now "
                f"answers as shard {r.shard_index}: restart this learner with the shards' addresses"
            )
        mine = owned_fragments(spec, n, i)
        if list(r.owned_fragments) != mine:
            raise ShardMismatch(
                f"shard {i} of {n} at {self.shards[i].address} owns fragments "
                f"{list(r.owned_fragments)}, this learner computed {mine}: are the shards and "
                "the learner of the same version?"
            )

    def _merged_join(self, spec: ModelSpec) -> pb.JoinReply:
        replies = [r for r in self.replies if r is not None]
        assert len(replies) == len(self.shards), "every shard joined at least once"
        low = replies[0]  # the Dynamic Local Updates directive of the lowest-index shard
        return pb.JoinReply(
            learner_id=self.learner_id,
            lease_s=min(r.lease_s for r in replies),
            heartbeat_interval_s=min(
                (r.heartbeat_interval_s for r in replies if r.heartbeat_interval_s), default=0.0
            ),
            server_epoch=self._epoch(),
            versions=self._versions([r.versions for r in replies]),
            needs_init=any(r.needs_init for r in replies),
            inner_steps=low.inner_steps,
            inner_steps_scale=low.inner_steps_scale,
            next_seq=max(r.next_seq for r in replies),
            session=self.session,
            shards=len(self.shards),
            shard_index=0,
            owned_fragments=range(len(spec.fragments)),
        )

    def _versions(
        self, per_shard: Sequence[Sequence[pb.FragmentVersion]]
    ) -> list[pb.FragmentVersion]:
        """Each fragment's version as its owner says (index = shard)."""
        out = [
            fv
            for s, versions in enumerate(per_shard)
            for fv in versions
            if fv.fragment_id < len(self.owners) and self.owners[fv.fragment_id] == s
        ]
        return sorted(out, key=lambda fv: fv.fragment_id)

    def _epoch(self, shard: int = -1, epoch: str = "") -> str:
        """The composite server epoch: every shard's as it last joined, shard `shard`'s as
        `epoch` instead when given."""
        parts = [r.server_epoch if r is not None else "" for r in self.replies]
        if shard >= 0:
            parts[shard] = epoch
        return EPOCH_SEP.join(parts)

    # The model -----------------------------------------------------------------------------

    def init_model(self, fragments: Sequence[torch.Tensor]) -> pb.InitModelReply:
        """Uploads to each shard that had no model at its last join the fragments it owns, to all
        of them at once: each upload keeps its own shard's lease (one after another, a large
        model's first upload and checkpoint outlast the next shard's lease before its turn).
        When a shard already had one (or answers ALREADY_EXISTS) the others still get theirs,
        then ALREADY_EXISTS goes up: the caller pulls the fragments it did not upload."""
        exists: grpc.RpcError | None = None
        uploads: list[tuple[list[int], Future[pb.InitModelReply]]] = []
        for i, s in enumerate(self.shards):
            r = self.replies[i]
            if r is not None and not r.needs_init:
                exists = exists or Refusal(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"shard {i} at {s.address} already has its fragments; pull them",
                )
                continue
            ids = [p for p, owner in enumerate(self.owners) if owner == i]
            uploads.append((ids, self.pool.submit(s.init_model, [fragments[p] for p in ids], ids)))
        versions: list[pb.FragmentVersion] = []
        failed: grpc.RpcError | None = None
        for ids, upload in uploads:
            try:
                reply = upload.result()
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.ALREADY_EXISTS:
                    exists = exists or e
                else:
                    failed = failed or e
                continue
            versions += [fv for fv in reply.versions if fv.fragment_id in ids]
        if failed is not None:
            raise failed
        if exists is not None:
            raise exists
        versions.sort(key=lambda fv: fv.fragment_id)
        return pb.InitModelReply(versions=versions)

    def push(self, push: Push) -> pb.PushReply:
        return self.shards[self.owners[push.fragment_id]].push(push)

    def pull(
        self,
        fragment_id: int,
        min_version: int,
        wait_s: float,
        codec_id: int,
        *,
        out: torch.Tensor | None = None,
        have: tuple[int, torch.Tensor] | None = None,
    ) -> tuple[int, str, torch.Tensor]:
        """The owner's answer, with the composite epoch (changed where the owner's is new)."""
        s = self.owners[fragment_id]
        version, epoch, params = self.shards[s].pull(
            fragment_id, min_version, wait_s, codec_id, out=out, have=have
        )
        return version, self._epoch(s, epoch), params

    # Lease and leaving ---------------------------------------------------------------------

    def heartbeat(
        self,
        counters: pb.LearnerCounters,
        step_time_s: float = 0.0,
        overlap_steps: int = 0,
        pushes_done: bool = False,
    ) -> pb.HeartbeatReply:
        """Every shard at once, waiting at most a third of the shortest lease for their answers
        (a shard that hangs must not let the others' leases lapse; its heartbeat still in
        flight is not sent again). A shard that has forgotten this learner or refuses it fails
        the call (the session re-joins). One out of reach or slow is logged (at most every
        WARN_EVERY_S) while another answered, and keeps its last epoch in the merged reply."""
        beats = []
        for i, s in enumerate(self.shards):
            f = self.beats[i]
            if f is None or f.done():
                try:
                    f = self.beats[i] = self.pool.submit(
                        s.heartbeat, counters, step_time_s, overlap_steps, pushes_done
                    )
                except RuntimeError:  # closed
                    raise Refusal(grpc.StatusCode.CANCELLED, "the client is closed") from None
            beats.append(f)
        leases = [r.lease_s for r in self.replies if r is not None and r.lease_s > 0]
        wait(beats, timeout=min(leases, default=9.0) / 3)
        replies: list[pb.HeartbeatReply | None] = [None] * len(self.shards)
        errors: list[tuple[int, grpc.RpcError]] = []
        late: list[int] = []
        for i, f in enumerate(beats):
            if not f.done():
                late.append(i)
                continue
            try:
                replies[i] = f.result()
            except grpc.RpcError as e:
                errors.append((i, e))
        answered = [(i, r) for i, r in enumerate(replies) if r is not None]
        for _, err in errors:
            if err.code() in REJOIN_CODES or not answered:
                raise err
        if not answered:
            raise Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "no shard answered the heartbeat")
        for i, err in errors:
            self._warn(i, f"heartbeat failed: {err.code().name} {err.details()}")
        for i in late:
            self._warn(i, "heartbeat not answered in time")
        epochs = [
            r.server_epoch if r is not None else j.server_epoch if j is not None else ""
            for r, j in zip(replies, self.replies, strict=True)
        ]
        low = answered[0][1]
        return pb.HeartbeatReply(
            server_epoch=EPOCH_SEP.join(epochs),
            lease_s=min(r.lease_s for _, r in answered),
            inner_steps=low.inner_steps,
            inner_steps_scale=low.inner_steps_scale,
            versions=self._versions([r.versions if r else [] for r in replies]),
        )

    def _warn(self, shard: int, message: str) -> None:
        now = time.monotonic()
        with self.lock:
            if now - self.warned_at.get(shard, -WARN_EVERY_S) < WARN_EVERY_S:
                return
            self.warned_at[shard] = now
        logger.warning(
            "learner=%s shard %d at %s: %s (its fragments wait; the others go on)",
            self.learner_id,
            shard,
            self.shards[shard].address,
            message,
        )

    def report_eval(
        self, eval_loss: float, versions: dict[int, int], eval_set: str = ""
    ) -> pb.EvalReply:
        """An evaluator's eval loss to every shard, each with the versions of its own fragments
        (each scores it against its own reference curve over every learner's tokens, so their
        figures agree); the first shard's reply."""
        replies = [
            s.report_eval(
                eval_loss,
                {f: v for f, v in versions.items() if self.owners[f] == i},
                eval_set,
            )
            for i, s in enumerate(self.shards)
        ]
        return replies[0]

    def leave(self, counters: pb.LearnerCounters) -> None:
        """Leaves every shard; the first failure is raised once all were tried."""
        failed: grpc.RpcError | None = None
        for s in self.shards:
            try:
                s.leave(counters)
            except grpc.RpcError as e:
                failed = failed or e
        if failed is not None:
            raise failed

    def close(self) -> None:
        for s in self.shards:
            s.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def status(self) -> pb.StatusReply:
        """The lowest-index shard's status (its learners), with every shard's versions."""
        replies = [s.status() for s in self.shards]
        merged = pb.StatusReply()
        merged.CopyFrom(replies[0])
        del merged.versions[:]
        merged.versions.extend(
            sorted((fv for r in replies for fv in r.versions), key=lambda fv: fv.fragment_id)
        )
        return merged

    # Counters ------------------------------------------------------------------------------

    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in self.shards)

    @property
    def bytes_received(self) -> int:
        return sum(s.bytes_received for s in self.shards)

    @property
    def versions_checked(self) -> int:
        return sum(s.versions_checked for s in self.shards)

    @property
    def version_conflicts(self) -> int:
        return sum(s.version_conflicts for s in self.shards)
