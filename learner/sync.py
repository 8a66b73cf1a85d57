"""The learner's push/pull engine (`SyncEngine`): each fragment's sync, on background threads.

Per fragment there is at most one sync in progress, in one of these states: a push queued (not
yet answered; a push still unsent when the next one comes due is superseded by it, which keeps
its sequence number, so at most one of them is ever applied), awaiting the round that includes
an answered push, or due for a re-sync (a re-pull at the current version, after a dropped push
or a new server epoch); then an `Arrival` waits in the inbox until the training loop has merged
it. One sender thread per shard streams that shard's queued pushes in sequence order (so a shard
that is down holds back only its own fragments' pushes), one puller thread per fragment
fetches "the round that includes my push" (as a delta from the version it holds when the
Synchronizer still keeps the updates), and one thread runs the session's heartbeat
(`learner.session`, which also owns joins and re-joins; once the training loop says it pushes
no more (`finish_pushing`) and the last push is answered, heartbeats say so, and rounds stop
waiting for this learner). Failures are recorded and retried with
backoff, never raised into the training thread; a lapsed lease, an unknown id or a new server
epoch goes to `Session.recover` (a new epoch of one shard re-pulls that shard's fragments). The
training thread (`learner.learner` and the modules it calls: `joining`, `arrivals`,
`sharded_island`) uses only the public methods: it submits `PushJob`s and takes `Arrival`s.
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
from learner.session import REJOIN_CODES, Clock, Push, Session, Transport
from protos import diloco_pb2 as pb
from protos import layout
from protos.spec import ModelSpec

logger = logging.getLogger(__name__)

OUTCOMES = {
    pb.PUSH_ACCEPTED: "accepted",
    pb.PUSH_DROPPED_STALE: "dropped_stale",
    pb.PUSH_DUPLICATE: "duplicate",
    pb.PUSH_REFUSED_NORM: "refused_norm",
}
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


class SyncEngine:
    """Pushes and pulls of every fragment on background threads, within a `Session`."""

    def __init__(
        self,
        client: Transport,
        cfg: LearnerConfig,
        spec: ModelSpec,
        name: str,
        clock: Clock,
        global_params: Callable[[], list[torch.Tensor]] | None,
        pin: bool,
        *,
        numels: list[int] | None = None,
        follower: bool = False,
    ) -> None:
        """`numels`: elements of each fragment this learner holds (a sharded island rank: its
        slice's; default the whole fragment's). `follower`: a sharded island's rank other than
        0, which syncs under rank 0's membership (`Session.follower`). In a sharded island a
        push is never superseded: every rank's push of a contribution carries the same seq."""
        self.client, self.cfg, self.spec, self.pin = client, cfg, spec, pin
        self.num = len(spec.fragments)
        self.numels = numels or [f.numel for f in spec.fragments]
        self.supersede = numels is None
        self.cv = threading.Condition()
        self.stopping = threading.Event()
        self.session = Session(
            client,
            cfg,
            spec,
            name,
            clock,
            global_params,
            lock=self.cv,
            stopping=self.stopping,
            on_new_epoch=self._forget_unfinished,
            follower=follower,
        )
        self.queued: dict[int, PushJob] = {}  # pushes not yet answered (supersedable)
        self.sending: set[int] = set()  # fragments whose queued push is on the wire now
        self.awaiting: dict[int, tuple[PushJob, int]] = {}  # answered pushes: (job, min_version)
        self.resync: set[int] = set()  # fragments to re-pull at their current version
        self.undelivered = [0] * self.num  # arrivals in the inbox not yet merged
        self.inbox: queue.SimpleQueue[Arrival] = queue.SimpleQueue()
        # Per fragment, the last version pulled exactly, as (epoch, version, FP32 on the CPU): the
        # starting point of delta pulls. Never modified in place.
        self.held: list[tuple[str, int, torch.Tensor] | None] = [None] * self.num
        self.threads: list[threading.Thread] = []
        self.pushes: Counter[str] = Counter()
        self.pulls = 0
        self.finishing = False  # the training loop submits no more pushes (`finish_pushing`)

    # The training thread's interface ---------------------------------------------------------

    def connect(
        self,
        timeout_s: float,
        local_params: Callable[[], list[torch.Tensor]],
        offer_initial: bool = False,
    ) -> tuple[list[int], list[torch.Tensor] | None]:
        """Joins and obtains the global model: (versions, fragments to load), or (versions, None)
        when this learner's own parameters became the global model. Raises ValueError when the
        Synchronizer refuses the model, PermissionError on auth failures, TimeoutError when it
        cannot be reached within timeout_s.

        `offer_initial` (a learner that starts without a state): where a fragment was at version
        0 when it joined, its own parameters are offered as that version, since learners that
        build the model with the same code and seed hold the initial model already. The pull
        then sends only the updates since (none in a run that is just starting) and the
        version's checksum; parameters that do not match it are pulled whole."""

        local: list[torch.Tensor] = []  # gathered once, however often the join is retried

        def fetch(wait_s: float) -> tuple[list[int], list[torch.Tensor]]:
            if offer_initial and self.cfg.delta_pulls:
                if not local:
                    local.extend(local_params())
                for p in range(self.num):
                    if self.session.joined_versions[p] == 0:
                        self.held[p] = (self.session.epoch, 0, local[p])
            fetched = [self.pull(p, wait_s=wait_s, exact=True) for p in range(self.num)]
            return [v for v, _, _ in fetched], [t for _, _, t in fetched]

        versions, params, initialised = self.session.connect(timeout_s, local_params, fetch)
        if not initialised:
            return versions, params
        self.hold(versions, params)
        return versions, None

    def hold(self, versions: list[int], params: list[torch.Tensor]) -> None:
        """The exact parameters (FP32, CPU) this learner holds of each fragment at `versions`:
        where delta pulls start from."""
        self.held = [(self.session.epoch, v, t) for v, t in zip(versions, params, strict=True)]

    def busy(self, p: int) -> bool:
        """True while fragment p's last push is on the wire, or answered but its fresh version
        not yet merged (or, where pushes are not superseded, from the push on). A push on the
        wire is not superseded: it may be applied, and the one replacing it under its seq
        would then be a duplicate, its steps never merged."""
        with self.cv:
            return self._busy(p)

    def _busy(self, p: int) -> bool:
        queued = not self.supersede and p in self.queued
        return (
            queued
            or p in self.sending
            or p in self.awaiting
            or p in self.resync
            or self.undelivered[p] > 0
        )

    def submit(self, job: PushJob, seq: int = 0) -> bool:
        """Queues a push; supersedes an unanswered one of the same fragment. False if busy.
        `seq`: the push's sequence number, chosen by the caller (a sharded island's ranks
        share it); 0: the session's next."""
        p = job.fragment
        with self.cv:
            if self._busy(p):
                return False
            old = self.queued.get(p)
            if seq:
                job.seq = seq
                self.session.next_seq = max(self.session.next_seq, seq + 1)
            elif old is not None:  # never answered: the new delta already contains its progress
                job.seq = old.seq
                job.tokens += old.tokens
                job.steps += old.steps
                job.compute_s += old.compute_s
                self.pushes["superseded"] += 1
            else:
                job.seq = self.session.new_seq()
            self.queued[p] = job
            self.cv.notify_all()
            return True

    def finish_pushing(self) -> None:
        """The training loop submits no more pushes: once the last are answered, heartbeats
        tell the Synchronizer, so that rounds this learner will never push to stop waiting for
        it (learners still training may need them closed before its own rounds can close)."""
        with self.cv:
            self.finishing = True
            self._check_pushes_done()

    def _check_pushes_done(self) -> None:
        """With cv held: finishing and no push unanswered, said once."""
        if self.finishing and not self.queued and not self.sending:
            if not self.session.pushes_done:
                self.session.done_pushing()

    def next_arrival(self, wait_s: float = 0.0) -> Arrival | None:
        """The next fresh fragment to merge, waiting up to wait_s for one; None if none came.
        Call `merged` once it is merged."""
        try:
            return self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return None

    def merged(self, p: int) -> None:
        """The training loop has merged an arrival of fragment p: it may push p again."""
        with self.cv:
            self.undelivered[p] -= 1
            self.cv.notify_all()

    def in_flight(self) -> int:
        """Fragments with a sync not yet merged (queued, awaited, re-syncing or in the inbox)."""
        with self.cv:
            return sum(
                1
                for p in range(self.num)
                if p in self.queued or p in self.awaiting or p in self.resync or self.undelivered[p]
            )

    def counts(self) -> tuple[dict[str, int], int, int]:
        """(pushes by outcome, pulls, errors), consistent with each other."""
        with self.cv:
            return dict(self.pushes), self.pulls, self.session.errors

    def sync_every(self) -> int:
        """H now: the configured one, or what Dynamic Local Updates direct."""
        return self.session.sync_every()

    def next_seq(self) -> int:
        """The sequence number the next push would get."""
        with self.cv:
            return self.session.next_seq

    def seq_at_least(self, seq: int) -> None:
        """The next push gets at least `seq` (a sharded island's ranks keep rank 0's count)."""
        with self.cv:
            self.session.next_seq = max(self.session.next_seq, seq)

    def delivering(self, p: int) -> None:
        """The caller pulled fragment p itself and will merge it (and call `merged`)."""
        with self.cv:
            self.undelivered[p] += 1

    def ask_resync(self, p: int) -> None:
        """Re-pulls fragment p at the current version (its pending push is dropped)."""
        with self.cv:
            self.queued.pop(p, None)
            self.resync.add(p)
            self.cv.notify_all()

    def failed(self, message: str, fragment: int | None = None, network: bool = True) -> None:
        """Records a failure of the caller's (counted in `counts`, logged); never raises."""
        self.session.failed(message, fragment, network)

    def sync_state(self) -> str:
        """The state for stats: "reconnecting", "syncing n/P" or "idle"."""
        if not self.session.healthy:
            return "reconnecting"
        n = self.in_flight()
        return f"syncing {n}/{self.num}" if n else "idle"

    def pull(
        self, p: int, min_version: int = 0, wait_s: float = 0.0, exact: bool = False
    ) -> tuple[int, str, torch.Tensor]:
        """(version, server epoch, FP32 parameters) of fragment p, now, on the caller's thread:
        as a delta from the version held when possible; `exact` forces FP32 even when
        pull_codec is bf16. Raises `grpc.RpcError` or `CodecError` (the caller records it)."""
        out = torch.empty(self.numels[p], dtype=torch.float32, pin_memory=self.pin)
        have, held = None, self.held[p]
        if self.cfg.delta_pulls and held is not None and held[0] == self.session.epoch:
            have = (held[1], held[2])
        codec_id = (
            pb.CODEC_FP32 if exact or self.cfg.delta_pulls else PULL_CODECS[self.cfg.pull_codec]
        )
        version, epoch, params = self.client.pull(
            p, min_version, wait_s, codec_id, out=out, have=have
        )
        self.held[p] = (epoch, version, params) if codec_id == pb.CODEC_FP32 else None
        with self.cv:
            self.pulls += 1
        return version, epoch, params

    def finish(
        self, versions: list[int], leave: bool = True
    ) -> dict[int, tuple[int, torch.Tensor]]:
        """The end: stops the threads, pulls every fragment exactly (at least at `versions`) and
        leaves the Synchronizer (unless `leave` is False). Returns {fragment: (version, FP32
        parameters)} of those it pulled; a failed pull is recorded and the rest of its shard not
        waited on, and when no shard answered, no Leave is sent. Never raises."""
        self.stop()
        fresh: dict[int, tuple[int, torch.Tensor]] = {}
        unreachable: set[int] = set()  # shards
        for p in range(self.num):
            if self.client.shard_of(p) in unreachable:
                continue  # out of reach: do not wait on every fragment of it
            try:
                version, _, params = self.pull(p, versions[p], exact=True)
            except (grpc.RpcError, layout.CodecError) as e:
                self.session.failed(f"final pull failed, keeping local parameters: {e}", p)
                unreachable.add(self.client.shard_of(p))
                continue
            fresh[p] = (version, params)
        if leave and len(unreachable) < len({self.client.shard_of(p) for p in range(self.num)}):
            self.session.leave()
        return fresh

    def start(self) -> None:
        """Starts a sender per shard, a puller per fragment and the heartbeat."""
        shards = sorted({self.client.shard_of(p) for p in range(self.num)})
        loops: list[tuple[str, Callable[..., None], tuple[int, ...]]] = [
            ("push" if len(shards) == 1 else f"push-{s}", self._send_loop, (s,)) for s in shards
        ]
        loops += [(f"pull-{p}", self._pull_loop, (p,)) for p in range(self.num)]
        if not self.session.follower:  # a follower's lease is its rank 0's
            loops.append(("heartbeat", self.session.heartbeat_loop, ()))
        self.threads = [
            threading.Thread(
                target=self._guarded, args=(fn, *args), name=f"diloco-{name}", daemon=True
            )
            for name, fn, args in loops
        ]
        for t in self.threads:
            t.start()

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

    # Threads ---------------------------------------------------------------------------------

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
