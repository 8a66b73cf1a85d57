"""In-memory fakes of the Synchronizer behind the learner's `Transport`, and the small things tests
drive an engine with. `FakeClient` is held to the same checks as the real transports
(tests/test_transport_contract.py), so what passes against it holds against a real server."""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Any

import grpc
import torch
from torch import nn

from learner.fragments import FragmentPlan
from learner.session import Push
from learner.shards import Refusal
from learner.sync import Arrival, PushJob, SyncEngine
from protos import codec, layout
from protos import diloco_pb2 as pb
from protos.spec import ModelSpec, owned_fragments

DEADLINE_S = 10.0  # how long a test waits for something that should happen at once
SPEC = FragmentPlan(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), 3).spec
SIZES = [f.numel for f in SPEC.fragments]
FAST = dict(retry_initial_s=0.001, retry_max_s=0.01, heartbeat_interval_s=3600.0, pull_wait_s=60.0)


class RpcFailure(Refusal):
    """A `grpc.RpcError` with a status code, as the real client raises after its retries."""

    def __init__(self, code: grpc.StatusCode, details: str = "injected by the test") -> None:
        super().__init__(code, details)


class FakeClient:
    """An in-memory Synchronizer behind the `Transport` interface, as seen by one learner.

    Like the real one it refuses calls of a learner it does not know (never joined, or left)
    NOT_FOUND, a second InitModel ALREADY_EXISTS, pulls before the model exists
    FAILED_PRECONDITION (after waiting up to wait_s for it), a push seq below 1
    INVALID_ARGUMENT and a base version ahead of its own FAILED_PRECONDITION; it answers a
    repeated seq with the first reply (an accepted push as a duplicate), drops pushes staler
    than `max_staleness`, waits up to wait_s for min_version in pulls, serves BF16 and INT8
    pulls as their codec rounds them, and ends pulls with CANCELLED on `close`. An accepted
    push closes its round at once (the fragment's version goes up by one and its parameters by
    1.0) unless `close_rounds` is False (then `close_round` closes it).

    Test controls: every call is recorded in `calls` as (method, args...); `fail_next` makes the
    next calls of a method raise (an `RpcFailure` for a status code, or any exception);
    `outcomes` overrides the outcome of the next pushes; `hold_pushes`/`release_pushes` keep
    pushes in flight; `restart` changes the server epoch; `inner_steps` is the Dynamic Local
    Updates directive joins and heartbeats give.
    """

    def __init__(self, sizes: Sequence[int] = SIZES, epoch: str = "epoch-1") -> None:
        self.address = "fake:0"
        self.learner_id = ""
        self.session = ""
        self.bytes_sent = self.bytes_received = self.versions_checked = self.version_conflicts = 0
        self.cv = threading.Condition()
        self.epoch = epoch
        self.versions = [0] * len(sizes)
        self.params = [torch.full((n,), float(i)) for i, n in enumerate(sizes)]
        self.needs_init = False
        self.close_rounds = True
        self.max_staleness = 16
        self.inner_steps = 0
        self.outcomes: deque[int] = deque()
        self.failures: defaultdict[str, deque[BaseException]] = defaultdict(deque)
        self.calls: list[tuple[Any, ...]] = []
        self.applied: list[tuple[int, int, int]] = []  # accepted pushes: (fragment, seq, tokens)
        self.inits: list[list[int]] = []  # the fragment ids of every InitModel
        self.replies: dict[int, pb.PushReply] = {}  # by seq: every push judged
        self.known: set[str] = set()  # learners joined and not left
        self.pushes_held = False
        self.closed = False
        self.ids = 0

    # Test controls ---------------------------------------------------------------------------

    def fail_next(
        self, method: str, error: grpc.StatusCode | BaseException, times: int = 1
    ) -> None:
        with self.cv:
            for _ in range(times):
                self.failures[method].append(
                    RpcFailure(error) if isinstance(error, grpc.StatusCode) else error
                )

    def hold_pushes(self) -> None:
        with self.cv:
            self.pushes_held = True

    def release_pushes(self) -> None:
        with self.cv:
            self.pushes_held = False
            self.cv.notify_all()

    def restart(self, epoch: str) -> None:
        with self.cv:
            self.epoch = epoch
            self.cv.notify_all()

    def close_round(self, p: int) -> None:
        """The round of fragment p closes (another learner's push, or one left open by
        close_rounds=False): its version goes up by one, its parameters by 1.0."""
        with self.cv:
            self.versions[p] += 1
            self.params[p] = self.params[p] + 1.0
            self.cv.notify_all()

    def calls_of(self, method: str) -> list[tuple[Any, ...]]:
        with self.cv:
            return [c[1:] for c in self.calls if c[0] == method]

    def wait_for_call(self, method: str, count: int = 1) -> None:
        with self.cv:
            assert self.cv.wait_for(
                lambda: sum(c[0] == method for c in self.calls) >= count, DEADLINE_S
            )

    def _enter(self, method: str, *args: Any) -> None:
        with self.cv:
            self.calls.append((method, *args))
            self.cv.notify_all()
            if self.failures[method]:
                raise self.failures[method].popleft()

    def _known(self) -> None:
        """NOT_FOUND unless this learner is joined (the caller holds cv)."""
        if self.learner_id not in self.known:
            raise RpcFailure(
                grpc.StatusCode.NOT_FOUND, f"learner {self.learner_id!r} is not joined"
            )

    def mine(self) -> list[int]:
        """The fragments this Synchronizer serves: all of them."""
        return list(range(len(self.versions)))

    def _versions(self) -> list[pb.FragmentVersion]:
        return [pb.FragmentVersion(fragment_id=p, version=self.versions[p]) for p in self.mine()]

    # Transport -------------------------------------------------------------------------------

    def join(self, name: str, spec: ModelSpec, learner_id: str = "") -> pb.JoinReply:
        self._enter("join", learner_id)
        with self.cv:
            if not learner_id:
                self.ids += 1
                learner_id = f"learner-{self.ids}"
            self.learner_id, self.session = learner_id, f"secret-{learner_id}"
            self.known.add(learner_id)
            return pb.JoinReply(
                learner_id=learner_id,
                lease_s=30.0,
                server_epoch=self.epoch,
                versions=self._versions(),
                needs_init=self.needs_init,
                next_seq=max(self.replies, default=0) + 1,
                session=self.session,
                inner_steps=self.inner_steps,
            )

    def init_model(
        self, fragments: Sequence[torch.Tensor], fragment_ids: Sequence[int] | None = None
    ) -> pb.InitModelReply:
        self._enter("init_model")
        ids = list(range(len(fragments))) if fragment_ids is None else list(fragment_ids)
        with self.cv:
            self.inits.append(ids)
            self._known()
            if not self.needs_init:
                raise RpcFailure(grpc.StatusCode.ALREADY_EXISTS, "already initialised")
            for p, f in zip(ids, fragments, strict=True):
                self.params[p] = f.detach().float().clone()
            self.needs_init = False
            self.cv.notify_all()
            return pb.InitModelReply(
                versions=[pb.FragmentVersion(fragment_id=p, version=self.versions[p]) for p in ids]
            )

    def heartbeat(
        self,
        counters: pb.LearnerCounters,
        step_time_s: float = 0.0,
        overlap_steps: int = 0,
        pushes_done: bool = False,
    ) -> pb.HeartbeatReply:
        self._enter("heartbeat", overlap_steps, pushes_done)
        with self.cv:
            self._known()
            return pb.HeartbeatReply(
                server_epoch=self.epoch,
                lease_s=30.0,
                inner_steps=self.inner_steps,
                versions=self._versions(),
            )

    def push(self, push: Push) -> pb.PushReply:
        p, seq, base = push.fragment_id, push.seq, push.base_version
        self._enter("push", p, seq, base, push.tokens)
        with self.cv:
            self.cv.wait_for(lambda: not self.pushes_held or self.closed)
            if self.closed:
                raise RpcFailure(grpc.StatusCode.CANCELLED, "channel closed")
            self._known()
            if seq < 1:
                raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "push seq must be >= 1")
            if base > self.versions[p]:
                raise RpcFailure(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"base version {base} is ahead of the server's {self.versions[p]}; re-pull",
                )
            if seq in self.replies:
                reply = pb.PushReply()
                reply.CopyFrom(self.replies[seq])
                if reply.outcome == pb.PUSH_ACCEPTED:
                    reply.outcome = pb.PUSH_DUPLICATE
                return reply
            staleness = self.versions[p] - base
            outcome = self.outcomes.popleft() if self.outcomes else pb.PUSH_ACCEPTED
            if staleness > self.max_staleness:
                outcome = pb.PUSH_DROPPED_STALE
            reply = pb.PushReply(
                outcome=outcome,  # type: ignore[arg-type]
                round_version=self.versions[p] + 1,
                current_version=self.versions[p],
                staleness=staleness,
            )
            self.replies[seq] = reply
            if outcome == pb.PUSH_ACCEPTED:
                self.applied.append((p, seq, push.tokens))
                if self.close_rounds:
                    self.close_round(p)
            return reply

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
        self._enter("pull", fragment_id, min_version, None if have is None else have[0])
        with self.cv:
            self._known()
            self.cv.wait_for(
                lambda: (
                    (not self.needs_init and self.versions[fragment_id] >= min_version)
                    or self.closed
                ),
                wait_s,
            )
            if self.closed:
                self.calls.append(("pull_cancelled", fragment_id))
                raise RpcFailure(grpc.StatusCode.CANCELLED, "channel closed")
            if self.needs_init:
                raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, "the model has no parameters")
            params = self.params[fragment_id]
            if codec_id != pb.CODEC_FP32:  # what the codec keeps of them, as served
                header = layout.make_header(codec_id, params.numel())
                params = codec.decode(
                    codec.encode(params, codec_id), header, torch.empty_like(params)
                )
            target = out if out is not None else torch.empty_like(params)
            target.copy_(params)
            return self.versions[fragment_id], self.epoch, target

    def leave(self, counters: pb.LearnerCounters) -> None:
        self._enter("leave")
        with self.cv:
            self._known()
            self.known.discard(self.learner_id)

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def shard_of(self, fragment_id: int) -> int:
        return 0


class FakeShard(FakeClient):
    """One shard of a sharded Synchronizer: a `FakeClient` that answers Join as shard `index`
    of `shards` (owning `owned`, by default what `owned_fragments` gives it), and refuses every
    call UNAVAILABLE while `down`."""

    def __init__(self, index: int, shards: int = 2, owned: Sequence[int] | None = None) -> None:
        super().__init__(epoch=f"epoch-{index}")
        self.address = f"fake:{index}"
        self.index, self.shards, self.owned = index, shards, owned
        self.down = False
        self.joins: list[tuple[str, str, int, list[int]]] = []  # (id, session, shards, owners)

    def _enter(self, method: str, *args: Any) -> None:
        super()._enter(method, *args)
        if self.down:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, f"shard {self.index} is down")

    def mine(self, spec: ModelSpec = SPEC) -> list[int]:
        return (
            list(self.owned)
            if self.owned is not None
            else owned_fragments(spec, self.shards, self.index)
        )

    def join(
        self,
        name: str,
        spec: ModelSpec,
        learner_id: str = "",
        *,
        shards: int = 0,
        fragment_shards: Sequence[int] = (),
        evaluator: bool = False,
    ) -> pb.JoinReply:
        sent = self.session if learner_id else ""
        reply = super().join(name, spec, learner_id)
        with self.cv:
            self.joins.append((learner_id, sent, shards, list(fragment_shards)))
            self.session = f"s{self.index}-{reply.learner_id}"
            reply.session = self.session
            reply.shards, reply.shard_index = self.shards, self.index
            reply.owned_fragments.extend(self.mine(spec))
        return reply

    def report_eval(
        self, eval_loss: float, versions: dict[int, int], eval_set: str = ""
    ) -> pb.EvalReply:
        self._enter("report_eval", eval_loss, dict(versions), eval_set)
        return pb.EvalReply()

    def status(self) -> pb.StatusReply:
        self._enter("status")
        return pb.StatusReply(
            server_epoch=self.epoch,
            shards=self.shards,
            shard_index=self.index,
            versions=self._versions(),
        )


# Driving an engine ---------------------------------------------------------------------------


def job(fragment: int, tokens: int = 10, base_version: int = 0) -> PushJob:
    return PushJob(
        fragment,
        base_version,
        tokens,
        steps=1,
        compute_s=0.1,
        payload=torch.zeros(8, dtype=torch.uint8),
        header=pb.PayloadHeader(),
        residual=None,
        theta_at_push=None,
        step=1,
    )


def arrival(engine: SyncEngine) -> Arrival:
    """The next arrival, merged (as the training loop would) so the fragment is free again."""
    a = engine.next_arrival(DEADLINE_S)
    assert a is not None, "no arrival within the deadline"
    engine.merged(a.fragment)
    return a
