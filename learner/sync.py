"""The learner's background side: session, pushes, pulls and heartbeats (`SyncEngine`).

One sender thread streams pushes in sequence order, one puller thread per fragment fetches "the
round that includes my push" (as a delta from the version it holds when the Synchronizer still
keeps the updates), and a heartbeat thread renews the lease, reports counters and receives the
Dynamic Local Updates directive. Failures are logged, counted and retried with backoff; a lapsed
lease, an unknown id or a new server epoch leads to a re-join and, where the server's state may
have changed under us, a re-pull of every fragment. Per fragment there is at most one sync in
progress; a push still unsent when the next one comes due is superseded by it (same sequence
number, so at most one of them is ever applied). The training thread (`learner.learner`) only
submits `PushJob`s and collects `Arrival`s.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from learner.client import SyncClient, backoff_s
from learner.config import LearnerConfig
from protos import codec
from protos import diloco_pb2 as pb
from protos.spec import ModelSpec

logger = logging.getLogger(__name__)

OUTCOMES = {pb.PUSH_ACCEPTED: "accepted", pb.PUSH_DROPPED_STALE: "dropped_stale", pb.PUSH_DUPLICATE: "duplicate"}
PULL_CODECS = {"fp32": pb.CODEC_FP32, "bf16": pb.CODEC_BF16}


@dataclass
class PushJob:
    fragment: int
    base_version: int
    tokens: int
    steps: int
    compute_s: float
    payload: torch.Tensor  # encoded bytes, CPU (pinned when the model is on CUDA)
    header: pb.PayloadHeader
    residual: torch.Tensor | None  # error-feedback residual that stands once this push is applied
    theta_at_push: torch.Tensor | None  # the fragment as pushed: the anchor of a rebase merge
    step: int
    ready: Any = None  # CUDA event: the device-to-host copy of payload has finished
    seq: int = 0  # assigned by SyncEngine.submit


@dataclass
class Arrival:
    fragment: int
    version: int
    params: torch.Tensor  # the fresh global fragment, FP32 on the host
    job: PushJob | None  # the push this version includes; None for a re-sync


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


class SyncEngine:
    """The background side: session (join/re-join), pushes, pulls and heartbeats."""

    def __init__(
        self,
        client: SyncClient,
        cfg: LearnerConfig,
        spec: ModelSpec,
        name: str,
        clock: Clock,
        global_params: Callable[[], list[torch.Tensor]],
        pin: bool,
    ) -> None:
        self.client, self.cfg, self.spec, self.name, self.clock = client, cfg, spec, name, clock
        self.global_params = global_params  # what to upload if a restarted server has no model
        self.pin = pin
        self.num = len(spec.fragments)
        self.cv = threading.Condition()
        self.queued: dict[int, PushJob] = {}  # pushes not yet answered (supersedable)
        self.awaiting: dict[int, tuple[PushJob, int]] = {}  # answered pushes: (job, min_version)
        self.resync: set[int] = set()  # fragments to re-pull at their current version
        self.undelivered = [0] * self.num  # arrivals in the inbox not yet merged
        self.inbox: queue.SimpleQueue[Arrival] = queue.SimpleQueue()
        # Per fragment, the last version pulled exactly, as (epoch, version, FP32 on the CPU): the
        # starting point of delta pulls. Never modified in place.
        self.held: list[tuple[str, int, torch.Tensor] | None] = [None] * self.num
        self.epoch = ""
        self.generation = 0  # bumped by every successful (re-)join
        self.next_seq = 1
        self.inner_steps = 0  # Dynamic Local Updates directive; 0 = the learner's own H
        self.heartbeat_s = cfg.heartbeat_interval_s or 3.0
        self.healthy = True  # False from a failed RPC until the next successful one
        self.join_lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.pushes: Counter[str] = Counter()
        self.pulls = 0
        self.errors = 0

    # Session ---------------------------------------------------------------------------------

    def _join(self, learner_id: str) -> pb.JoinReply:
        reply = self.client.join(self.name, self.spec, learner_id)
        self.epoch = reply.server_epoch
        self.next_seq = max(self.next_seq, reply.next_seq)
        self.inner_steps = reply.inner_steps
        self.heartbeat_s = self.cfg.heartbeat_interval_s or reply.heartbeat_interval_s or reply.lease_s / 3 or 3.0
        return reply

    def connect(self, timeout_s: float, local_params: Callable[[], list[torch.Tensor]]) -> tuple[list[int], list[torch.Tensor] | None]:
        """Joins and obtains the global model: (versions, fragments to load), or (versions, None)
        when this learner's own parameters became the global model. Raises ValueError when the
        Synchronizer refuses the model, PermissionError on auth failures, TimeoutError when it
        cannot be reached within timeout_s."""
        deadline = time.monotonic() + timeout_s
        failures = 0
        while True:
            try:
                try:
                    reply = self._join(self.client.learner_id)  # a retry keeps the id it got
                except grpc.RpcError as e:
                    if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                        raise ValueError(f"the Synchronizer at {self.client.address} refused this model: {e.details()}") from None
                    raise
                if reply.needs_init:
                    try:
                        params = local_params()
                        init = self.client.init_model(params)
                        logger.info("learner=%s initialised the global model", self.client.learner_id)
                        versions = versions_of(init.versions, self.num)
                        self.held = [(self.epoch, v, t) for v, t in zip(versions, params, strict=True)]
                        return versions, None
                    except grpc.RpcError as e:
                        if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                            raise
                fetched = [self._pull(p, 0, 0.0, exact=True) for p in range(self.num)]
                return [v for v, _, _ in fetched], [t for _, _, t in fetched]
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise PermissionError(f"the Synchronizer at {self.client.address} refused the credentials: {e.details()}") from None
                wait = backoff_s(failures, self.cfg.retry_initial_s, self.cfg.retry_max_s)
                failures += 1
                if time.monotonic() + wait > deadline:
                    raise TimeoutError(
                        f"could not join the Synchronizer at {self.client.address} within {timeout_s}s: "
                        f"{e.code().name} {e.details()}"
                    ) from None
                logger.info("joining %s: %s, retrying in %.1fs", self.client.address, e.code().name, wait)
                time.sleep(wait)

    def recover(self, seen_generation: int, fresh: bool = False) -> None:
        """Re-joins (under the same id unless `fresh`); a no-op if someone re-joined since
        `seen_generation`. On a new server epoch every fragment is re-pulled and unanswered
        pushes are dropped (their progress stays in the local parameters). Never raises."""
        with self.join_lock:
            if self.generation != seen_generation or self.stopping.is_set():
                return
            old_epoch, old_id = self.epoch, self.client.learner_id
            try:
                reply = self._join("" if fresh else old_id)
                if reply.needs_init:
                    try:
                        self.client.init_model(self.global_params())
                        logger.warning("learner=%s re-initialised the Synchronizer's empty model from its global fragments", reply.learner_id)
                    except grpc.RpcError as e:
                        if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                            raise
            except grpc.RpcError as e:
                self._failed(f"re-join failed: {e.code().name} {e.details()}")
                return
            new_epoch = reply.server_epoch != old_epoch
            with self.cv:
                self.generation += 1
                if new_epoch:
                    dropped = len(self.queued) + len(self.awaiting)
                    self.queued.clear()
                    self.awaiting.clear()
                    self.resync.update(range(self.num))
                self.cv.notify_all()
            self.healthy = True
            logger.warning(
                "learner=%s re-joined as %s (epoch %s%s)", old_id, reply.learner_id, reply.server_epoch,
                f", new: re-pulling every fragment, {dropped} unfinished syncs dropped" if new_epoch else "",
            )

    def _failed(self, message: str, fragment: int | None = None, network: bool = True) -> None:
        with self.cv:
            self.errors += 1
        if network:
            self.healthy = False
        logger.warning("learner=%s fragment=%s %s", self.client.learner_id, "-" if fragment is None else fragment, message)

    # Training-loop side ----------------------------------------------------------------------

    def busy(self, p: int) -> bool:
        """True while fragment p's last push is answered but its fresh version not yet merged."""
        with self.cv:
            return p in self.awaiting or p in self.resync or self.undelivered[p] > 0

    def submit(self, job: PushJob) -> bool:
        """Queues a push; supersedes an unanswered one of the same fragment. False if busy."""
        p = job.fragment
        with self.cv:
            if p in self.awaiting or p in self.resync or self.undelivered[p] > 0:
                return False
            old = self.queued.get(p)
            if old is not None:  # never answered: the new delta already contains its progress
                job.seq = old.seq
                job.tokens += old.tokens
                job.steps += old.steps
                job.compute_s += old.compute_s
                self.pushes["superseded"] += 1
            else:
                job.seq = self.next_seq
                self.next_seq += 1
            self.queued[p] = job
            self.cv.notify_all()
            return True

    def merged(self, p: int) -> None:
        with self.cv:
            self.undelivered[p] -= 1
            self.cv.notify_all()

    def in_flight(self) -> int:
        with self.cv:
            return sum(
                1 for p in range(self.num)
                if p in self.queued or p in self.awaiting or p in self.resync or self.undelivered[p]
            )

    def counts(self) -> tuple[dict[str, int], int, int]:
        """(pushes by outcome, pulls, errors), consistent with each other."""
        with self.cv:
            return dict(self.pushes), self.pulls, self.errors

    def sync_state(self) -> str:
        if not self.healthy:
            return "reconnecting"
        n = self.in_flight()
        return f"syncing {n}/{self.num}" if n else "idle"

    # Threads ---------------------------------------------------------------------------------

    def start(self) -> None:
        loops: list[tuple[str, Callable[..., None], tuple[int, ...]]] = [("push", self._send_loop, ())]
        loops += [(f"pull-{p}", self._pull_loop, (p,)) for p in range(self.num)]
        loops.append(("heartbeat", self._heartbeat_loop, ()))
        self.threads = [
            threading.Thread(target=self._guarded, args=(fn, *args), name=f"diloco-{name}", daemon=True)
            for name, fn, args in loops
        ]
        for t in self.threads:
            t.start()

    def _guarded(self, loop: Callable[..., None], *args: int) -> None:
        """Runs a background loop; a bug in it is logged and the loop restarted, not lost."""
        failures = 0
        while not self.stopping.is_set():
            try:
                loop(*args)
                return
            except Exception:
                with self.cv:
                    self.errors += 1
                logger.exception("learner=%s background sync loop crashed; restarting it", self.client.learner_id)
                if self._backoff(failures):
                    return
                failures += 1

    def stop(self, timeout_s: float = 5.0, close_channel: bool = False) -> None:
        """Stops the threads; with close_channel, RPCs in flight are cancelled first."""
        self.stopping.set()
        with self.cv:
            self.cv.notify_all()
        if close_channel:
            self.client.close()
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _backoff(self, failures: int) -> bool:
        """Sleeps before a retry; True if the engine is stopping."""
        return self.stopping.wait(backoff_s(failures, self.cfg.retry_initial_s, self.cfg.retry_max_s))

    def _send_loop(self) -> None:
        failures, refused = 0, 0
        while True:
            with self.cv:
                while not self.stopping.is_set() and not self.queued:
                    self.cv.wait()
                if self.stopping.is_set():
                    return
                job = min(self.queued.values(), key=lambda j: j.seq)
                generation = self.generation
            p = job.fragment
            if job.ready is not None:
                job.ready.synchronize()
            try:
                reply = self.client.push(
                    p, job.seq, job.base_version, job.tokens, job.steps, job.compute_s, job.payload, job.header
                )
            except grpc.RpcError as e:
                if self.stopping.is_set():
                    return
                code = e.code()
                self._failed(f"push seq={job.seq} base_version={job.base_version} failed: {code.name} {e.details()}", p)
                if code == grpc.StatusCode.INVALID_ARGUMENT:  # retrying cannot help; progress stays local
                    self._drop(job, "rejected")
                elif code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    # A lapsed lease or a restarted server: re-join (which re-pulls everything on a
                    # new epoch) and retry. Refused again after that (e.g. a base version ahead of
                    # the server's): drop the push and re-pull the fragment.
                    if refused == job.seq:
                        self._drop(job, "rejected", resync=True)
                    else:
                        refused = job.seq
                        self.recover(generation, fresh=code == grpc.StatusCode.NOT_FOUND)
                if self._backoff(failures):
                    return
                failures += 1
                continue
            failures, refused = 0, 0
            self.healthy = True
            outcome = OUTCOMES.get(reply.outcome, "rejected")
            with self.cv:
                self.pushes[outcome] += 1
                if p in self.queued and self.queued[p].seq == job.seq:
                    del self.queued[p]  # the sent job, or one that superseded it under its seq
                if p in self.resync:
                    pass  # a re-join on a new epoch happened meanwhile: the re-pull decides
                elif outcome in ("accepted", "duplicate"):
                    self.awaiting[p] = (job, reply.round_version or job.base_version + 1)
                else:
                    self.resync.add(p)
                self.cv.notify_all()
            log = logger.info if outcome == "dropped_stale" else logger.debug
            log("learner=%s fragment=%d seq=%d base_version=%d push %s: round_version=%d staleness=%d %s",
                self.client.learner_id, p, job.seq, job.base_version, outcome, reply.round_version,
                reply.staleness, reply.message)

    def _drop(self, job: PushJob, outcome: str, resync: bool = False) -> None:
        with self.cv:
            if self.queued.get(job.fragment) is job:
                del self.queued[job.fragment]
                self.pushes[outcome] += 1
                if resync:
                    self.resync.add(job.fragment)
            self.cv.notify_all()

    def _pull(self, p: int, min_version: int, wait_s: float, exact: bool = False) -> tuple[int, str, torch.Tensor]:
        """Pulls fragment p, as a delta from the version held when possible; `exact` forces
        FP32 even when pull_codec is bf16."""
        out = torch.empty(self.spec.fragments[p].numel, dtype=torch.float32, pin_memory=self.pin)
        have, held = None, self.held[p]
        if self.cfg.delta_pulls and held is not None and held[0] == self.epoch:
            have = (held[1], held[2])
        codec_id = pb.CODEC_FP32 if exact or self.cfg.delta_pulls else PULL_CODECS[self.cfg.pull_codec]
        version, epoch, params = self.client.pull(p, min_version, wait_s, codec_id, out=out, have=have)
        self.held[p] = (epoch, version, params) if codec_id == pb.CODEC_FP32 else None
        with self.cv:
            self.pulls += 1
        return version, epoch, params

    def _pull_loop(self, p: int) -> None:
        failures = 0
        waited_since: float | None = None
        while True:
            with self.cv:
                while not self.stopping.is_set() and p not in self.resync and p not in self.awaiting:
                    self.cv.wait()
                if self.stopping.is_set():
                    return
                task = None if p in self.resync else self.awaiting[p]
                generation, epoch = self.generation, self.epoch
            job, min_version = task if task is not None else (None, 0)
            try:
                version, server_epoch, params = self._pull(p, min_version, self.cfg.pull_wait_s if task else 0.0)
            except (grpc.RpcError, codec.CodecError) as e:
                if self.stopping.is_set():
                    return
                if isinstance(e, grpc.RpcError):
                    code, detail = e.code(), f"{e.code().name} {e.details()}"
                else:
                    code, detail = None, str(e)
                self._failed(f"pull min_version={min_version} failed: {detail}", p)
                if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    self.recover(generation, fresh=code == grpc.StatusCode.NOT_FOUND)
                if self._backoff(failures):
                    return
                failures += 1
                continue
            failures = 0
            self.healthy = True
            if server_epoch != epoch:
                self.recover(generation)  # the server restarted: re-join, re-pull everything
                if self.generation == generation:  # the re-join failed: do not spin
                    failures += 1
                    if self._backoff(failures):
                        return
                continue
            with self.cv:
                current = None if p in self.resync else self.awaiting.get(p)
                if generation != self.generation or current is not task:
                    continue  # the world changed while we pulled; look again
                ready = task is None or version >= min_version
                if ready:
                    self.resync.discard(p)
                    self.awaiting.pop(p, None)
                    self.undelivered[p] += 1
                    self.inbox.put(Arrival(p, version, params, job))
                    self.cv.notify_all()
            if ready:
                waited_since = None
                continue
            # The round holding our push has not closed yet: ask again (not in a tight loop, in
            # case the server caps the wait far below pull_wait_s).
            if waited_since is None:
                waited_since = time.monotonic()
            elif time.monotonic() - waited_since > max(60.0, 6 * self.cfg.pull_wait_s):
                logger.warning("learner=%s fragment=%d still waiting for version %d (server at %d)",
                               self.client.learner_id, p, min_version, version)
                waited_since = time.monotonic()
            if self.stopping.wait(self.cfg.retry_initial_s):
                return

    def overlap_steps(self) -> int:
        """Steps until this learner needs a pushed fragment back: the strict-overlap bound, or
        its H (the next push of the same fragment), for the Synchronizer's adaptive grace."""
        if self.cfg.strict_overlap:
            return max(1, self.cfg.overlap_steps)
        return max(1, self.inner_steps or self.cfg.sync_every)

    def _heartbeat_loop(self) -> None:
        while not self.stopping.wait(self.heartbeat_s):
            generation = self.generation
            clock = self.clock
            try:
                reply = self.client.heartbeat(clock.counters(), clock.step_time_s, self.overlap_steps())
            except grpc.RpcError as e:
                if self.stopping.is_set():
                    return
                code = e.code()
                self._failed(f"heartbeat failed: {code.name} {e.details()}")
                if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    self.recover(generation, fresh=code == grpc.StatusCode.NOT_FOUND)
                continue
            self.healthy = True
            self.inner_steps = reply.inner_steps
            if reply.server_epoch != self.epoch:
                self.recover(generation)


def versions_of(msg: Any, num: int) -> list[int]:
    out = [0] * num
    for fv in msg:
        if fv.fragment_id < num:
            out[fv.fragment_id] = fv.version
    return out
