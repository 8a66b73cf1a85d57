"""The background side of the learner's push/pull engine (`learner.sync.SyncEngine`): what
moves a fragment's sync from one state to the next, and the jobs and arrivals it moves.

`SyncThreads` is the engine's base: one sender loop per shard streams that shard's queued
pushes in sequence order (so a shard that is down holds back only its own fragments' pushes)
and records each answer (awaiting its round, or due for a re-sync); one puller loop per
fragment fetches "the round that includes my push" (as a delta from the version it holds when
the Synchronizer still keeps the updates) and puts an `Arrival` in the inbox. A loop that fails
records it and retries with backoff; a lapsed lease, an unknown id or a new server epoch goes to
`Session.recover`, and a new epoch of one shard makes the session drop that shard's unfinished
syncs here (`_forget_unfinished`). The state these loops move, and the training thread's side,
are `SyncEngine`'s.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from learner.client import backoff_s
from learner.config import LearnerConfig
from learner.session import REJOIN_CODES, Push, Session, Transport
from protos import diloco_pb2 as pb
from protos import layout

logger = logging.getLogger(__name__)


OUTCOMES = {
    pb.PUSH_ACCEPTED: "accepted",
    pb.PUSH_DROPPED_STALE: "dropped_stale",
    pb.PUSH_DUPLICATE: "duplicate",
    pb.PUSH_REFUSED_NORM: "refused_norm",
}


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


class SyncThreads:
    """The engine's background loops, over the state `SyncEngine.__init__` sets up."""

    client: Transport
    cfg: LearnerConfig
    pin: bool
    numels: list[int]
    cv: threading.Condition
    stopping: threading.Event
    session: Session
    queued: dict[int, PushJob]  # pushes not yet answered (supersedable)
    sending: set[int]  # fragments whose queued push is on the wire now
    awaiting: dict[int, tuple[PushJob, int]]  # answered pushes: (job, min_version)
    resync: set[int]  # fragments to re-pull at their current version
    undelivered: list[int]  # arrivals in the inbox not yet merged
    inbox: queue.SimpleQueue[Arrival]
    # Per fragment, the last version pulled exactly, as (epoch, version, FP32 on the CPU): the
    # starting point of delta pulls. Never modified in place.
    held: list[tuple[str, int, torch.Tensor] | None]
    pushes: Counter[str]
    pulls: int
    finishing: bool  # the training loop submits no more pushes (`finish_pushing`)

    def pull(
        self, p: int, min_version: int = 0, wait_s: float = 0.0, exact: bool = False
    ) -> tuple[int, str, torch.Tensor]:
        """(version, server epoch, FP32 parameters) of fragment p, now, on the caller's thread:
        as a delta from the version held when possible; `exact` forces FP32 whatever
        pull_codec says. Raises `grpc.RpcError` or `CodecError` (the caller records it)."""
        out = torch.empty(self.numels[p], dtype=torch.float32, pin_memory=self.pin)
        have, held = None, self.held[p]
        if self.cfg.delta_pulls and held is not None and held[0] == self.session.epoch:
            have = (held[1], held[2])
        codec_id = (
            pb.CODEC_FP32
            if exact or self.cfg.delta_pulls
            else layout.CODEC_NAMES[self.cfg.pull_codec]
        )
        version, epoch, params = self.client.pull(
            p, min_version, wait_s, codec_id, out=out, have=have
        )
        self.held[p] = (epoch, version, params) if codec_id == pb.CODEC_FP32 else None
        with self.cv:
            self.pulls += 1
        return version, epoch, params

    def _check_pushes_done(self) -> None:
        """With cv held: finishing and no push unanswered, said once."""
        if self.finishing and not (self.queued or self.sending or self.session.pushes_done):
            self.session.done_pushing()

    def _guarded(self, loop: Callable[..., None], *args: int) -> None:
        """Runs a background loop; a bug in it is logged and the loop restarted, not lost."""
        failures = 0
        while not self.stopping.is_set():
            try:
                loop(*args)
                return
            except Exception:
                self.session.failed(
                    "background sync loop crashed; restarting it", network=False, exc_info=True
                )
                if self._backoff(failures):
                    return
                failures += 1

    def _backoff(self, failures: int) -> bool:
        """Sleeps before a retry; True if the engine is stopping."""
        return self.stopping.wait(
            backoff_s(failures, self.cfg.retry_initial_s, self.cfg.retry_max_s)
        )

    def _forget_unfinished(self, fragments: list[int]) -> int:
        """A new server epoch of these fragments' shard (the session calls this with cv held):
        their unanswered and awaited pushes are dropped, the progress staying in the local
        parameters, and they are re-pulled. Returns how many syncs were dropped."""
        dropped = 0
        for p in fragments:
            dropped += (self.queued.pop(p, None) is not None) + (
                self.awaiting.pop(p, None) is not None
            )
        self.resync.update(fragments)
        return dropped

    def _next_push(self, shard: int) -> PushJob | None:
        """The queued push of this shard's fragments with the lowest seq; the caller holds cv."""
        jobs = [j for p, j in self.queued.items() if self.client.shard_of(p) == shard]
        return min(jobs, key=lambda j: j.seq, default=None)

    def _send_loop(self, shard: int) -> None:
        failures, refused = 0, 0
        while True:
            with self.cv:
                job = None
                while not self.stopping.is_set() and (job := self._next_push(shard)) is None:
                    self.cv.wait()
                if self.stopping.is_set() or job is None:
                    return
                generation = self.session.generation
                self.sending.add(job.fragment)
            p = job.fragment
            if job.ready is not None:
                job.ready.synchronize()
            try:
                reply = self.client.push(
                    Push(
                        p,
                        job.seq,
                        job.base_version,
                        job.tokens,
                        job.steps,
                        job.compute_s,
                        job.payload,
                        job.header,
                    )
                )
            except grpc.RpcError as e:
                with self.cv:
                    self.sending.discard(p)  # unsent after all: a newer delta may supersede it
                if self.stopping.is_set():
                    return
                code = e.code()
                self.session.failed(
                    f"push seq={job.seq} base_version={job.base_version} failed: {code.name} {e.details()}",
                    p,
                )
                if (
                    code == grpc.StatusCode.INVALID_ARGUMENT
                ):  # retrying cannot help; progress stays local
                    self._drop(job, "rejected")
                elif code == grpc.StatusCode.ABORTED:
                    # A sharded island's contribution that not every rank's slice reached:
                    # nothing was applied; every rank re-pulls (progress stays local).
                    self._drop(job, "aborted", resync=True)
                elif code in REJOIN_CODES:
                    # A lapsed lease or a restarted server: re-join (which re-pulls everything on a
                    # new epoch) and retry. Refused again after that (e.g. a base version ahead of
                    # the server's): drop the push and re-pull the fragment.
                    if refused == job.seq:
                        self._drop(job, "rejected", resync=True)
                    else:
                        refused = job.seq
                        self.session.recover(generation)
                if self._backoff(failures):
                    return
                failures += 1
                continue
            except BaseException:  # a bug: `_guarded` restarts the loop, which sends it again
                with self.cv:
                    self.sending.discard(p)
                raise
            failures, refused = 0, 0
            self.session.succeeded()
            outcome = OUTCOMES.get(reply.outcome, "rejected")
            with self.cv:
                self.sending.discard(p)
                self.pushes[outcome] += 1
                if p in self.queued and self.queued[p].seq == job.seq:
                    del self.queued[p]  # the sent job, or one that superseded it under its seq
                if p in self.resync:
                    pass  # a re-join on a new epoch happened meanwhile: the re-pull decides
                elif outcome in ("accepted", "duplicate"):
                    self.awaiting[p] = (job, reply.round_version or job.base_version + 1)
                else:
                    self.resync.add(p)
                self._check_pushes_done()
                self.cv.notify_all()
            # Refused for its norm: nothing was applied, and this learner's updates are far from
            # the others' (a diverging run, or a bound too tight for this run's schedule).
            log = {"dropped_stale": logger.info, "refused_norm": logger.warning}.get(
                outcome, logger.debug
            )
            log(
                "learner=%s fragment=%d seq=%d base_version=%d push %s: round_version=%d staleness=%d %s",
                self.client.learner_id,
                p,
                job.seq,
                job.base_version,
                outcome,
                reply.round_version,
                reply.staleness,
                reply.message,
            )

    def _drop(self, job: PushJob, outcome: str, resync: bool = False) -> None:
        with self.cv:
            if self.queued.get(job.fragment) is job:
                del self.queued[job.fragment]
                self.pushes[outcome] += 1
                if resync:
                    self.resync.add(job.fragment)
            self._check_pushes_done()
            self.cv.notify_all()

    def _pull_loop(self, p: int) -> None:
        failures = 0
        waited_since: float | None = None
        while True:
            with self.cv:
                while (
                    not self.stopping.is_set() and p not in self.resync and p not in self.awaiting
                ):
                    self.cv.wait()
                if self.stopping.is_set():
                    return
                task = None if p in self.resync else self.awaiting[p]
                generation, epoch = self.session.generation, self.session.epoch
            job, min_version = task if task is not None else (None, 0)
            try:
                version, server_epoch, params = self.pull(
                    p, min_version, self.cfg.pull_wait_s if task else 0.0
                )
            except (grpc.RpcError, layout.CodecError) as e:
                if self.stopping.is_set():
                    return
                if isinstance(e, grpc.RpcError):
                    code, detail = e.code(), f"{e.code().name} {e.details()}"
                else:
                    code, detail = None, str(e)
                self.session.failed(f"pull min_version={min_version} failed: {detail}", p)
                if code in REJOIN_CODES:
                    self.session.recover(generation)
                if self._backoff(failures):
                    return
                failures += 1
                continue
            failures = 0
            self.session.succeeded()
            if server_epoch != epoch:
                self.session.recover(
                    generation, server_epoch
                )  # the server restarted: re-join, re-pull everything
                if self.session.generation == generation:  # the re-join failed: do not spin
                    failures += 1
                    if self._backoff(failures):
                        return
                continue
            with self.cv:
                current = None if p in self.resync else self.awaiting.get(p)
                if generation != self.session.generation or current is not task:
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
                logger.warning(
                    "learner=%s fragment=%d still waiting for version %d (server at %d)",
                    self.client.learner_id,
                    p,
                    min_version,
                    version,
                )
                waited_since = time.monotonic()
            if self.stopping.wait(self.cfg.retry_initial_s):
                return
