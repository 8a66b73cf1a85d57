"""The learner's standing with the Synchronizer (`Session`): join, re-join, server epoch, lease.

A `Session` joins (uploading this learner's parameters when the Synchronizer has no model yet),
keeps what the Synchronizer told it (learner id, server epoch, next push sequence number, the
Dynamic Local Updates directive) and a generation that every successful re-join bumps, renews
its lease with heartbeats that report the training loop's `Clock`, and records failures: an
error count and whether the last RPC went through. When a lapsed lease, an unknown id or a new
server epoch is noticed, `recover` re-joins once however many threads noticed, and on a new epoch
tells the push/pull engine (`learner.sync`) to forget its unfinished syncs and re-pull every
fragment. It talks through a `Transport` (defined here, with the `Push` a transport sends):
`learner.client.SyncClient`, `learner.shards.ShardedClient` (one per shard of a sharded
Synchronizer), or an in-memory fake in tests. A sharded transport's
server epoch is its shards' epochs joined by EPOCH_SEP in shard order: a shard restarted with a new
epoch makes the engine forget and re-pull only that shard's fragments. Its heartbeat loop runs on
a thread the engine starts and stops. A join that cannot succeed raises `Unreachable` (no answer
within the timeout), `CredentialsRefused` or `ModelRefused` (both `JoinRefused`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import torch

from learner.client import ShardMismatch, backoff_s
from learner.config import LearnerConfig
from protos import diloco_pb2 as pb
from protos.spec import ModelSpec

logger = logging.getLogger(__name__)

# Refusals that mean the Synchronizer no longer knows this learner as it stands: re-join.
REJOIN_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
EPOCH_SEP = ","  # between the shards' epochs in a sharded transport's server epoch


def first_line(e: grpc.RpcError) -> str:
    """The first line of a failed RPC's details (a message, not a dump of the channel's state)."""
    return ((e.details() or "").splitlines() or [""])[0]  # type: ignore[attr-defined]


class JoinRefused(Exception):
    """The Synchronizer answered Join and refused this learner: its credentials or its model."""


class CredentialsRefused(JoinRefused, PermissionError):
    """The Synchronizer refused the learner's token or certificate."""


class ModelRefused(JoinRefused, ValueError):
    """The Synchronizer refused the learner's model (another spec, too large, ...)."""


class Unreachable(TimeoutError):
    """The Synchronizer did not answer Join (or the model did not appear) within the timeout."""


@dataclass(frozen=True)
class Push:
    """One outer gradient as a transport sends it: the fragment, its sequence number (a retry,
    or a push that supersedes an unsent one, keeps it), the version it was computed from, the
    work behind it (the Synchronizer weighs contributions by it) and its encoded bytes."""

    fragment_id: int
    seq: int
    base_version: int
    tokens: int
    steps: int
    compute_s: float
    encoded: torch.Tensor  # CPU uint8 (pinned when the model is on CUDA)
    header: pb.PayloadHeader


class Transport(Protocol):
    """What a learner needs of a client. `learner.client.SyncClient` is the real one,
    `learner.shards.ShardedClient` one over the shards of a sharded Synchronizer; tests pass an
    in-memory fake (`tests/test_transport_contract.py` holds all three to the same checks).
    Every call fails with a `grpc.RpcError` (a pull also with `CodecError`) after the
    transport's own retries."""

    address: str  # for messages
    learner_id: str  # set by join; sent with every later call
    session: str  # the secret join gave learner_id: what a restarted learner gives back

    def join(self, name: str, spec: ModelSpec, learner_id: str = "") -> pb.JoinReply: ...

    def init_model(self, fragments: Sequence[torch.Tensor]) -> pb.InitModelReply: ...

    def heartbeat(
        self,
        counters: pb.LearnerCounters,
        step_time_s: float = 0.0,
        overlap_steps: int = 0,
        pushes_done: bool = False,
    ) -> pb.HeartbeatReply: ...

    def push(self, push: Push) -> pb.PushReply: ...

    def pull(
        self,
        fragment_id: int,
        min_version: int,
        wait_s: float,
        codec_id: int,
        *,
        out: torch.Tensor | None = None,
        have: tuple[int, torch.Tensor] | None = None,
    ) -> tuple[int, str, torch.Tensor]: ...

    def leave(self, counters: pb.LearnerCounters) -> None: ...

    def close(self) -> None: ...

    def shard_of(self, fragment_id: int) -> int:
        """The shard that serves the fragment (0 when there is one): syncs of fragments on
        different shards never wait on one another."""
        ...

    @property
    def bytes_sent(self) -> int: ...

    @property
    def bytes_received(self) -> int: ...

    @property
    def versions_checked(self) -> int:
        """(epoch, fragment, version)s pulled with a checksum, remembered."""
        ...

    @property
    def version_conflicts(self) -> int:
        """Of those, served again with another checksum (a Synchronizer bug)."""
        ...


@dataclass
class Clock:
    """Counters the training loop owns and the heartbeat reads."""

    step: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    blocked_s: float = 0.0
    step_time_s: float = 0.0  # moving average of compute seconds per step
    loss: float | None = None
    recent: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=64))

    def counters(self) -> pb.LearnerCounters:
        return pb.LearnerCounters(
            steps=self.step, tokens=self.tokens, compute_s=self.compute_s, blocked_s=self.blocked_s
        )


class Session:
    """One learner's membership of a run: identity, epoch, lease and failure record."""

    def __init__(
        self,
        client: Transport,
        cfg: LearnerConfig,
        spec: ModelSpec,
        name: str,
        clock: Clock,
        global_params: Callable[[], list[torch.Tensor]] | None,
        *,
        lock: threading.Condition,
        stopping: threading.Event,
        on_new_epoch: Callable[[list[int]], int],
        follower: bool = False,
    ) -> None:
        """`global_params`: the whole global model, to upload to a Synchronizer that lost it
        (None: this learner cannot, a sharded island's ranks hold slices). `follower`: a rank of
        a sharded island other than 0, which uses rank 0's membership (id, session, lease) and
        never joins, heartbeats or leaves: a new server epoch it sees is only adopted (rank 0
        re-joins), and its fragments re-pulled."""
        self.client, self.cfg, self.spec, self.name, self.clock = client, cfg, spec, name, clock
        self.global_params = global_params  # what to upload if a restarted server has no model
        self.follower = follower
        # The engine's state lock: a re-join's generation bump and the engine's reaction to a new
        # epoch (`on_new_epoch(fragments whose shard restarted)`, called with it held; returns the
        # unfinished syncs it dropped) are one step for the engine's threads. It also guards
        # `errors`.
        self.lock = lock
        self.stopping = stopping
        self.on_new_epoch = on_new_epoch
        self.num = len(spec.fragments)
        self.epoch = ""
        self.joined_versions = [-1] * self.num  # each fragment's version at the last Join
        self.generation = 0  # bumped by every successful re-join
        self.next_seq = 1
        self.inner_steps = 0  # Dynamic Local Updates directive; 0 = the learner's own H...
        self.inner_steps_scale = 0.0  # ...scaled by this when in (0, 1)
        self.heartbeat_s = cfg.heartbeat_interval_s or 3.0
        self.pushes_done = False  # said in heartbeats once set (`done_pushing`)
        self.beat_due = False  # a heartbeat now, not at the next interval
        self.healthy = True  # False from a failed RPC until the next successful one
        self.errors = 0
        self.join_lock = threading.Lock()

    def _join(self, learner_id: str) -> pb.JoinReply:
        reply = self.client.join(self.name, self.spec, learner_id)
        self.epoch = reply.server_epoch
        self.joined_versions = versions_of(reply.versions, self.num)
        self.next_seq = max(self.next_seq, reply.next_seq)
        self.inner_steps, self.inner_steps_scale = reply.inner_steps, reply.inner_steps_scale
        self.heartbeat_s = (
            self.cfg.heartbeat_interval_s or reply.heartbeat_interval_s or reply.lease_s / 3 or 3.0
        )
        return reply

    def connect(
        self,
        timeout_s: float,
        local_params: Callable[[], list[torch.Tensor]],
        fetch: Callable[[float], tuple[list[int], list[torch.Tensor]]],
    ) -> tuple[list[int], list[torch.Tensor], bool]:
        """Joins and obtains the global model: (versions, fragments, initialised), where
        `initialised` says the fragments are this learner's own (`local_params()`), uploaded as
        the global model, and otherwise they were `fetch(wait_s)`ed, the pulls waiting up to
        wait_s for a model that does not exist yet. A learner that finds another one uploading
        the model says so once and waits for it, in waits shorter than its lease, joining again
        between them; it starts as soon as the model exists. Raises ValueError when the
        Synchronizer refuses the model, PermissionError on auth failures, TimeoutError when it
        cannot be reached (or the model does not appear) within timeout_s."""
        deadline = time.monotonic() + timeout_s
        failures = 0
        waiting = False  # for the model that another learner is uploading
        while True:
            try:
                try:
                    reply = self._join(self.client.learner_id)  # a retry keeps the id it got
                except grpc.RpcError as e:
                    if e.code() in (
                        grpc.StatusCode.FAILED_PRECONDITION,
                        grpc.StatusCode.INVALID_ARGUMENT,
                    ):
                        raise ModelRefused(
                            f"the Synchronizer at {self.client.address} refused this model: {first_line(e)}"
                        ) from None
                    raise
                wait_s = 0.0
                if reply.needs_init:
                    try:
                        params = local_params()
                        init = self.client.init_model(params)
                        logger.info(
                            "learner=%s initialised the global model", self.client.learner_id
                        )
                        return versions_of(init.versions, self.num), params, True
                    except grpc.RpcError as e:
                        if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                            raise
                    if not waiting:
                        waiting = True
                        logger.info(
                            "learner=%s waiting for the model to be initialised by another learner",
                            self.client.learner_id,
                        )
                    # Within half a lease: no heartbeat keeps it before the model is here.
                    wait_s = max(0.0, min(reply.lease_s / 2, deadline - time.monotonic()))
                versions, fetched = fetch(wait_s)
                return versions, fetched, False
            except grpc.RpcError as e:
                code = e.code()
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise CredentialsRefused(
                        f"the Synchronizer at {self.client.address} refused the credentials: {first_line(e)}"
                    ) from None
                # Still no model after a wait: join again soon (renewing the lease) and wait on.
                uploading = waiting and code == grpc.StatusCode.FAILED_PRECONDITION
                wait = backoff_s(
                    0 if uploading else failures, self.cfg.retry_initial_s, self.cfg.retry_max_s
                )
                if time.monotonic() + wait > deadline:
                    raise Unreachable(
                        f"could not join the Synchronizer at {self.client.address} within {timeout_s:g} s: "
                        f"{code.name} {first_line(e)}"
                    ) from None
                if not uploading:
                    failures += 1
                    logger.info(
                        "joining %s: %s, retrying in %.1fs", self.client.address, code.name, wait
                    )
                time.sleep(wait)

    def recover(self, seen_generation: int, seen_epoch: str = "") -> None:
        """Re-joins under this learner's id and session; a no-op if someone re-joined since
        `seen_generation`. Always as itself, even when the Synchronizer no longer lists it
        (NOT_FOUND: dead past its forget_after_s), which takes it back while it keeps the
        record: its push replies stay its own, so a push retried after a lost reply is answered
        as a duplicate, never applied again under a new id. On a new server epoch the engine
        re-pulls every fragment and drops unanswered pushes (their progress stays in the local
        parameters). Never raises."""
        with self.join_lock:
            if self.generation != seen_generation or self.stopping.is_set():
                return
            if self.follower:
                self._adopt(seen_epoch)
                return
            old_epoch, old_id = self.epoch, self.client.learner_id
            try:
                reply = self._join(old_id)
                upload = self.global_params
                if reply.needs_init and upload is None:
                    self.failed(
                        "the Synchronizer has no model and a sharded island cannot upload it: "
                        "initialise it (diloco-synchronizer init, or a learner holding the whole "
                        "model)"
                    )
                elif reply.needs_init and upload is not None:
                    try:
                        self.client.init_model(upload())
                        logger.warning(
                            "learner=%s re-initialised the Synchronizer's empty model from its global fragments",
                            reply.learner_id,
                        )
                    except grpc.RpcError as e:
                        if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                            raise
            except grpc.RpcError as e:
                self.failed(f"re-join failed: {e.code().name} {e.details()}")
                return
            except ShardMismatch as e:  # the shards were redeployed differently: say so, retry
                self.failed(f"re-join failed: {e}")
                return
            restarted = self.restarted(old_epoch, reply.server_epoch)
            with self.lock:
                self.generation += 1
                dropped = self.on_new_epoch(restarted) if restarted else 0
                self.lock.notify_all()
            self.healthy = True
            logger.warning(
                "learner=%s re-joined as %s (epoch %s%s)",
                old_id,
                reply.learner_id,
                reply.server_epoch,
                f", new: re-pulling fragments {restarted}, {dropped} unfinished syncs dropped"
                if restarted
                else "",
            )

    def _adopt(self, epoch: str) -> None:
        """A follower saw a new server epoch: it re-pulls its fragments (rank 0 re-joins)."""
        if not epoch or epoch == self.epoch:
            return
        restarted = self.restarted(self.epoch, epoch)
        with self.lock:
            self.epoch = epoch
            self.generation += 1
            self.on_new_epoch(restarted)
            self.lock.notify_all()
        logger.warning(
            "learner=%s new server epoch %s: re-pulling fragments %s",
            self.client.learner_id,
            epoch,
            restarted,
        )

    def restarted(self, old_epoch: str, new_epoch: str) -> list[int]:
        """The fragments whose shard's epoch differs between two server epochs: all of them
        when unsharded, only the restarted shard's when sharded."""
        old, new = old_epoch.split(EPOCH_SEP), new_epoch.split(EPOCH_SEP)
        if len(old) != len(new):
            return list(range(self.num))
        changed = {s for s, (a, b) in enumerate(zip(old, new, strict=True)) if a != b}
        return [p for p in range(self.num) if self.client.shard_of(p) in changed]

    def new_seq(self) -> int:
        """The next push sequence number; the caller holds `lock`."""
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def failed(
        self,
        message: str,
        fragment: int | None = None,
        network: bool = True,
        exc_info: bool = False,
    ) -> None:
        """Records a failure: counted, logged, and when it was the network's, the session is
        unhealthy until the next RPC that goes through. Never raises."""
        with self.lock:
            self.errors += 1
        if network:
            self.healthy = False
        log = logger.error if exc_info else logger.warning
        log(
            "learner=%s fragment=%s %s",
            self.client.learner_id,
            "-" if fragment is None else fragment,
            message,
            exc_info=exc_info,
        )

    def succeeded(self) -> None:
        """An RPC went through: the session is healthy again."""
        self.healthy = True

    def overlap_steps(self) -> int:
        """Steps until this learner needs a pushed fragment back: the strict-overlap bound, or
        its H (the next push of the same fragment), for the Synchronizer's adaptive grace."""
        if self.cfg.strict_overlap:
            return max(1, self.cfg.overlap_steps)
        return self.sync_every()

    def sync_every(self) -> int:
        """H now: the configured one, or what Dynamic Local Updates direct."""
        if self.inner_steps:
            return self.inner_steps
        if 0 < self.inner_steps_scale < 1:
            return max(1, int(self.inner_steps_scale * self.cfg.sync_every))
        return self.cfg.sync_every

    def done_pushing(self) -> None:
        """This learner pushes nothing more (it is finishing and its last pushes are answered):
        heartbeats say so from now on, the first at once, so that rounds stop waiting for it.
        The caller holds `lock`."""
        self.pushes_done = self.beat_due = True
        self.lock.notify_all()

    def heartbeat_loop(self) -> None:
        """Renews the lease every heartbeat_s until `stopping`; re-joins when the Synchronizer
        has forgotten this learner or restarted. Run on a thread by the engine. A heartbeat
        saying this learner pushes nothing more is sent even when stopping comes with it: a
        finishing learner stops its threads before its final pulls, which may wait for rounds
        that wait for it."""
        while True:
            with self.lock:
                self.lock.wait_for(
                    lambda: self.stopping.is_set() or self.beat_due, self.heartbeat_s
                )
                last = self.stopping.is_set()
                if last and not (self.beat_due and self.pushes_done):
                    return
                self.beat_due = False
            generation = self.generation
            clock = self.clock
            try:
                reply = self.client.heartbeat(
                    clock.counters(), clock.step_time_s, self.overlap_steps(), self.pushes_done
                )
            except grpc.RpcError as e:
                if self.stopping.is_set():
                    return
                code = e.code()
                self.failed(f"heartbeat failed: {code.name} {e.details()}")
                if code in REJOIN_CODES:
                    self.recover(generation)
                continue
            self.succeeded()
            if last:
                return
            self.inner_steps, self.inner_steps_scale = reply.inner_steps, reply.inner_steps_scale
            if reply.server_epoch != self.epoch:
                self.recover(generation)

    def leave(self) -> None:
        """Tells the Synchronizer this learner is done, with its final counters; a failure is
        recorded, not raised."""
        try:
            self.client.leave(self.clock.counters())
        except grpc.RpcError as e:
            self.failed(f"leave failed: {e.code().name}")


def versions_of(msg: Any, num: int) -> list[int]:
    out = [0] * num
    for fv in msg:
        if fv.fragment_id < num:
            out[fv.fragment_id] = fv.version
    return out
