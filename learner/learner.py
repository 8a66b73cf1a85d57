"""`Learner`: wraps a model and its inner optimizer, and keeps it in sync with the Synchronizer.

The training loop calls `step()` after each backward pass. `step()` runs the inner optimizer,
then merges the fresh global fragments that have arrived (after the optimizer step, so the next
forward pass sees them and no gradient is applied to parameters it was not computed at), and on
a fragment's due step (staggered: fragment p at offset p*H//P) encodes its outer gradient on the
model's device and hands it to the background. Nothing in `step()` waits on the network unless
`strict_overlap` is set (then a push's result is waited for, bounded, overlap_steps after it).

In the background (`_SyncEngine`): one sender thread streams pushes strictly in sequence order
(the Synchronizer treats a sequence number at or below the highest it has judged as a duplicate),
one puller thread per fragment fetches "the round that includes my push" (as a delta from the
version it holds when the Synchronizer still keeps the updates), and a heartbeat thread
renews the lease, reports counters and receives the Dynamic Local Updates directive. Failures are
logged, counted and retried with backoff; a lapsed lease, an unknown id or a new server epoch
leads to a re-join and, where the server's state may have changed under us, a re-pull of every
fragment. Per fragment there is at most one sync in progress; a push still unsent when the next
one comes due is superseded by it (same sequence number, so at most one of them is ever applied).

Multi-GPU islands (torchrun, default process group initialised, replicated parameters as in
DDP): rank 0 alone talks to the Synchronizer. At the end of every `step()` all ranks take part in
one small broadcast of which fragments rank 0 merged, then one broadcast per merged fragment of
its flat parameters, so the island stays identical. Every rank must call `step()`, `flush()` and
`finish()` the same number of times. Pass each rank's own `tokens`; rank 0 reports them times the
world size.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
import torch.distributed as dist

from learner.client import SyncClient, backoff_s
from learner.config import LearnerConfig
from learner.fragments import (
    ErrorFeedback,
    FragmentPlan,
    due_fragments,
    merge_fragment,
    schedule_offsets,
)
from protos import codec
from protos import diloco_pb2 as pb
from protos.spec import ModelSpec

logger = logging.getLogger(__name__)

OUTCOMES = {pb.PUSH_ACCEPTED: "accepted", pb.PUSH_DROPPED_STALE: "dropped_stale", pb.PUSH_DUPLICATE: "duplicate"}
PULL_CODECS = {"fp32": pb.CODEC_FP32, "bf16": pb.CODEC_BF16}
SCALE_DTYPES = {"fp32": pb.SCALE_FP32, "fp16": pb.SCALE_FP16}


@dataclass(frozen=True)
class LearnerStats:
    """A snapshot of a learner's progress and sync traffic (`Learner.stats`)."""

    learner_id: str
    step: int
    tokens: int
    tokens_per_s: float
    loss: float | None
    compute_s: float
    blocked_s: float
    bytes_sent: int
    bytes_received: int
    pushes: dict[str, int]  # by outcome: accepted, duplicate, dropped_stale, superseded, rejected
    pulls: int
    merges: int
    errors: int
    fragment_versions: tuple[int, ...]
    sync_every: int
    sync_state: str  # "idle", "syncing 2/4", "reconnecting"


@dataclass
class _PushJob:
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
    seq: int = 0  # assigned by _SyncEngine.submit


@dataclass
class _Arrival:
    fragment: int
    version: int
    params: torch.Tensor  # the fresh global fragment, FP32 on the host
    job: _PushJob | None  # the push this version includes; None for a re-sync


@dataclass
class _Clock:
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


class _SyncEngine:
    """The background side: session (join/re-join), pushes, pulls and heartbeats."""

    def __init__(
        self,
        client: SyncClient,
        cfg: LearnerConfig,
        spec: ModelSpec,
        name: str,
        clock: _Clock,
        global_params: Callable[[], list[torch.Tensor]],
        pin: bool,
    ) -> None:
        self.client, self.cfg, self.spec, self.name, self.clock = client, cfg, spec, name, clock
        self.global_params = global_params  # what to upload if a restarted server has no model
        self.pin = pin
        self.num = len(spec.fragments)
        self.cv = threading.Condition()
        self.queued: dict[int, _PushJob] = {}  # pushes not yet answered (supersedable)
        self.awaiting: dict[int, tuple[_PushJob, int]] = {}  # answered pushes: (job, min_version)
        self.resync: set[int] = set()  # fragments to re-pull at their current version
        self.undelivered = [0] * self.num  # arrivals in the inbox not yet merged
        self.inbox: queue.SimpleQueue[_Arrival] = queue.SimpleQueue()
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
                        versions = _versions(init.versions, self.num)
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

    def submit(self, job: _PushJob) -> bool:
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

    def _drop(self, job: _PushJob, outcome: str, resync: bool = False) -> None:
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
                    self.inbox.put(_Arrival(p, version, params, job))
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

    def _heartbeat_loop(self) -> None:
        while not self.stopping.wait(self.heartbeat_s):
            generation = self.generation
            clock = self.clock
            try:
                reply = self.client.heartbeat(clock.counters(), clock.step_time_s)
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


def _versions(msg: Any, num: int) -> list[int]:
    out = [0] * num
    for fv in msg:
        if fv.fragment_id < num:
            out[fv.fragment_id] = fv.version
    return out


def _island() -> tuple[int, int]:
    """(rank, world size) of the torchrun island; (0, 1) without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Learner:
    """Trains `model` with `inner_optimizer` as one learner of a Decoupled DiLoCo run.

    Settings are `LearnerConfig` fields, as keyword arguments or `config=` (keywords win).
    `inner_optimizer` may be None when the caller steps its optimizer itself before `step()`.
    The constructor joins the Synchronizer and loads the global model (initialising it from this
    model's parameters if there is none yet); it raises if that is impossible within
    `join_timeout_s`. After that, network trouble is logged and counted, never raised.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer | None,
        *,
        config: LearnerConfig | None = None,
        **settings: Any,
    ) -> None:
        cfg = config or LearnerConfig()
        if settings:
            cfg = LearnerConfig.model_validate({**cfg.model_dump(), **settings})
        self.cfg = cfg
        self.model = model
        self.optimizer = inner_optimizer
        self.plan = FragmentPlan(model, cfg.fragments, cfg.fragment_strategy)
        self.num_fragments = len(self.plan)
        self.param_device = next(model.parameters()).device
        self.device = self._state_device(cfg.device)
        self.codec_id = codec.parse_codec(cfg.codec)
        self.scale_dtype = SCALE_DTYPES[cfg.scale_dtype]
        self.rank, self.world = _island()
        self.leader = self.rank == 0
        self.sync_every = cfg.sync_every
        self.offsets = schedule_offsets(self.sync_every, self.num_fragments)
        self.clock = _Clock()
        self.merges = 0
        self.deferred: set[int] = set()  # due while busy: pushed as soon as the fragment is free
        self.strict_waits: dict[int, int] = {}  # fragment -> step of its push (strict_overlap)
        self.since_push = [[0, 0, 0.0] for _ in range(self.num_fragments)]  # tokens, steps, compute_s
        self.base: list[torch.Tensor] = []
        self.versions = [0] * self.num_fragments
        self.ef = ErrorFeedback([self.plan.numel(p) for p in range(self.num_fragments)] if self.leader else [], self.device, cfg.error_feedback)
        self.client: SyncClient | None = None
        self.engine: _SyncEngine | None = None
        self.closed = False
        self.metrics_port: int | None = None  # bound port of the /metrics endpoint, if serving
        self._stop_metrics: Callable[[], None] | None = None
        if self.leader:
            self._connect()
            if cfg.metrics_port >= 0:
                self._serve_metrics()
        if self.world > 1:
            self._broadcast(set(range(self.num_fragments)), announce=False)
        self.last_step_end = time.perf_counter()

    def _state_device(self, choice: str) -> torch.device:
        if choice == "auto":
            return self.param_device
        if choice == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device='cuda' but CUDA is not available here")
            return self.param_device if self.param_device.type == "cuda" else torch.device("cuda")
        return torch.device("cpu")

    def _connect(self) -> None:
        cfg = self.cfg
        self.client = SyncClient(
            cfg.synchronizer,
            rpc_timeout_s=cfg.rpc_timeout_s,
            attempts=cfg.rpc_attempts,
            retry_initial_s=cfg.retry_initial_s,
            retry_max_s=cfg.retry_max_s,
            auth_token=cfg.auth_token,
            tls_ca=cfg.tls_ca,
            tls_cert=cfg.tls_cert,
            tls_key=cfg.tls_key,
            tls_server_name=cfg.tls_server_name,
            chunk_bytes=cfg.chunk_bytes,
        )
        self.client.learner_id = cfg.learner_id  # empty: the Synchronizer assigns one
        name = cfg.name or f"{socket.gethostname()}-{os.getpid()}"
        self.engine = _SyncEngine(
            self.client, cfg, self.plan.spec, name, self.clock,
            global_params=lambda: [b.detach().cpu() for b in self.base],
            pin=self.device.type == "cuda",
        )
        try:
            versions, fetched = self.engine.connect(
                cfg.join_timeout_s, lambda: [self.plan.gather(p, "cpu") for p in range(self.num_fragments)]
            )
        except BaseException:
            self.client.close()
            raise
        self.versions = versions
        for p in range(self.num_fragments):
            if fetched is not None:
                self.plan.scatter(p, fetched[p])
            self.base.append(fetched[p].to(self.device) if fetched is not None else self.plan.gather(p, self.device))
        self.engine.start()
        logger.info("learner=%s joined %s: %d fragments of %s parameters, versions %s",
                    self.client.learner_id, cfg.synchronizer, self.num_fragments,
                    f"{self.plan.spec.numel:,}", self.versions)

    def _serve_metrics(self) -> None:
        from learner.metrics import start_learner_metrics

        try:
            self.metrics_port, self._stop_metrics = start_learner_metrics(
                lambda: self.stats, self.cfg.metrics_port, self.cfg.metrics_host
            )
        except BaseException:
            self.close()
            raise

    # The training loop -----------------------------------------------------------------------

    def step(self, tokens: int = 0, loss: float | None = None) -> None:
        """One inner step: optimizer.step(), then merge arrivals and push the fragments due.

        `tokens`: tokens this step trained on; the Synchronizer weighs contributions by them
        (when none are given, each step counts as one token). `loss` is only reported in stats.
        """
        if self.closed:
            raise RuntimeError("step() after finish() or close()")
        t_enter = time.perf_counter()
        if self.optimizer is not None:
            self.optimizer.step()
        compute = time.perf_counter() - self.last_step_end  # forward/backward + optimizer step
        c = self.clock
        tokens = tokens * self.world
        c.step += 1
        c.tokens += tokens
        c.compute_s += compute
        c.step_time_s = compute if c.step == 1 else 0.9 * c.step_time_s + 0.1 * compute
        if loss is not None:
            c.loss = float(loss)
        c.recent.append((t_enter, c.tokens))
        for acc in self.since_push:
            acc[0] += tokens
            acc[1] += 1
            acc[2] += compute
        merged: set[int] = set()
        if self.leader:
            merged = self._sync_step()
        if self.world > 1:
            self._broadcast(merged)
        self.last_step_end = time.perf_counter()

    def _sync_step(self) -> set[int]:
        assert self.engine is not None
        h = self.engine.inner_steps or self.cfg.sync_every
        if h != self.sync_every:
            logger.info("learner=%s sync_every %d -> %d (Dynamic Local Updates)", self.engine.client.learner_id, self.sync_every, h)
            self.sync_every = h
            self.offsets = schedule_offsets(h, self.num_fragments)
        merged = self._apply_arrivals()
        for p in sorted(set(due_fragments(self.clock.step, self.sync_every, self.offsets)) | self.deferred):
            self._push(p)
        if self.cfg.strict_overlap:
            merged |= self._wait_overlap()
        return merged

    def _push(self, p: int) -> None:
        assert self.engine is not None
        if self.engine.busy(p):
            self.deferred.add(p)
            return
        try:
            with torch.no_grad():
                theta = self.plan.gather(p, self.device)
                x = self.ef.compensate(p, self.base[p] - theta)
                header = codec.make_header(self.codec_id, x.numel(), self.cfg.block_size, self.scale_dtype)
                encoded = codec.encode(x, self.codec_id, self.cfg.block_size, self.scale_dtype)
                residual = None
                if self.ef.enabled:
                    residual = self.ef.residual_after(x, codec.decode(encoded, header, torch.empty_like(x)))
        except codec.CodecError as e:  # NaN/Inf in the parameters: never send them
            self.engine._failed(f"push skipped at step {self.clock.step}: {e}", p, network=False)
            self.deferred.discard(p)
            return
        payload, ready = encoded, None
        if encoded.device.type == "cuda":
            payload = torch.empty(encoded.numel(), dtype=torch.uint8, pin_memory=True)
            payload.copy_(encoded, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        tokens, steps, compute_s = self.since_push[p]
        anchor = theta if self.cfg.merge == "rebase" else None
        steps = max(1, int(steps))
        tokens = int(tokens) if tokens > 0 else steps  # no tokens reported: weigh by steps
        job = _PushJob(p, self.versions[p], tokens, steps, float(compute_s),
                       payload, header, residual, anchor, self.clock.step, ready)
        if not self.engine.submit(job):
            self.deferred.add(p)
            return
        self.deferred.discard(p)
        self.since_push[p] = [0, 0, 0.0]
        if self.cfg.strict_overlap:
            self.strict_waits[p] = self.clock.step

    def _apply_arrivals(self) -> set[int]:
        assert self.engine is not None
        merged: set[int] = set()
        while True:
            try:
                arrival = self.engine.inbox.get_nowait()
            except queue.Empty:
                return merged
            self._merge(arrival)
            merged.add(arrival.fragment)

    @torch.no_grad()
    def _merge(self, a: _Arrival) -> None:
        assert self.engine is not None
        p = a.fragment
        fresh = a.params.to(self.device, non_blocking=True)
        theta = self.plan.gather(p, self.device)
        anchor = a.job.theta_at_push if a.job is not None else self.base[p]  # re-sync: all local progress
        self.plan.scatter(p, merge_fragment(self.cfg.merge, theta, fresh, anchor, self.cfg.alpha))
        self.base[p] = fresh  # replaced, never modified in place (a re-join may read it)
        self.versions[p] = a.version
        if a.job is not None:
            self.ef.commit(p, a.job.residual)
        self.merges += 1
        self.strict_waits.pop(p, None)
        self.engine.merged(p)
        logger.debug("learner=%s fragment=%d version=%d merged (%s) at step %d",
                     self.engine.client.learner_id, p, a.version, "round" if a.job else "re-sync", self.clock.step)

    def _wait_overlap(self) -> set[int]:
        """strict_overlap: waits for fragments pushed at least tau steps ago (bounded)."""
        assert self.engine is not None
        merged: set[int] = set()
        late = [p for p, s in self.strict_waits.items() if self.clock.step - s >= self.cfg.overlap_steps]
        if not late:
            return merged
        t0 = time.perf_counter()
        deadline = t0 + self.cfg.pull_wait_s + self.cfg.rpc_timeout_s
        while any(p in self.strict_waits for p in late) and self.engine.healthy:
            left = deadline - time.perf_counter()
            if left <= 0:
                logger.warning("learner=%s strict overlap: fragments %s not back in time, carrying on",
                               self.engine.client.learner_id, [p for p in late if p in self.strict_waits])
                break
            try:
                arrival = self.engine.inbox.get(timeout=min(left, 0.1))
            except queue.Empty:
                continue
            self._merge(arrival)
            merged.add(arrival.fragment)
        for p in late:
            self.strict_waits.pop(p, None)  # wait for a push at most once
        self.clock.blocked_s += time.perf_counter() - t0
        return merged

    # Island (torchrun) -----------------------------------------------------------------------

    @torch.no_grad()
    def _broadcast(self, merged: set[int], announce: bool = True) -> None:
        """Rank 0 sends the fragments it merged to the other ranks of the island."""
        frags = sorted(merged)
        if announce:
            mask = torch.zeros(self.num_fragments, dtype=torch.int32, device=self.param_device)
            if self.leader and frags:
                mask[frags] = 1
            dist.broadcast(mask, src=0)
            frags = mask.nonzero().flatten().tolist()
        for p in frags:
            flat = self.plan.gather(p, self.param_device) if self.leader else torch.empty(
                self.plan.numel(p), dtype=torch.float32, device=self.param_device)
            dist.broadcast(flat, src=0)
            if not self.leader:
                self.plan.scatter(p, flat)

    # Ending ----------------------------------------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits (bounded) for every sync in flight and merges the results; True if all came
        back. Pushes that were due but deferred are not sent. Collective under torchrun."""
        done, merged = True, set()
        if self.leader and self.engine is not None and not self.closed:
            deadline = time.monotonic() + (self.cfg.finish_timeout_s if timeout_s is None else timeout_s)
            while True:
                merged |= self._apply_arrivals()
                if self.engine.in_flight() == 0:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    done = False
                    logger.warning("learner=%s flush: %d syncs still in flight, giving up waiting",
                                   self.engine.client.learner_id, self.engine.in_flight())
                    break
                try:
                    arrival = self.engine.inbox.get(timeout=min(left, 0.1))
                except queue.Empty:
                    continue
                self._merge(arrival)
                merged.add(arrival.fragment)
        if self.world > 1:
            self._broadcast(merged)
        return done

    def finish(self, timeout_s: float | None = None) -> None:
        """Flushes syncs in flight, overwrites the model with the newest global parameters
        (FP32, every fragment), leaves the Synchronizer and stops. Collective under torchrun."""
        if self.closed:
            return
        self.flush(timeout_s)
        if self.leader and self.engine is not None and self.client is not None:
            self.engine.stop()
            reachable = True
            for p in range(self.num_fragments):
                try:
                    version, _, fresh = self.engine._pull(p, self.versions[p], 0.0, exact=True)
                except (grpc.RpcError, codec.CodecError) as e:
                    self.engine._failed(f"final pull failed, keeping local parameters: {e}", p)
                    reachable = False
                    break  # the Synchronizer is out of reach: do not wait on every fragment
                self.plan.scatter(p, fresh)
                self.base[p] = fresh.to(self.device)
                self.versions[p] = version
            try:
                if reachable:
                    self.client.leave(self.clock.counters())
            except grpc.RpcError as e:
                self.engine._failed(f"leave failed: {e.code().name}")
            logger.info("learner=%s finished at step %d with versions %s",
                        self.client.learner_id, self.clock.step, self.versions)
        if self.world > 1:
            self._broadcast(set(range(self.num_fragments)), announce=False)
        self.close()

    def close(self) -> None:
        """Stops the background threads and closes the channel (no final pull, no Leave)."""
        if self.closed:
            return
        self.closed = True
        if self._stop_metrics is not None:
            self._stop_metrics()
        if self.engine is not None:
            self.engine.stop(close_channel=True)
        elif self.client is not None:
            self.client.close()

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.close()

    # Progress --------------------------------------------------------------------------------

    @property
    def learner_id(self) -> str:
        return self.client.learner_id if self.client is not None else ""

    @property
    def stats(self) -> LearnerStats:
        c = self.clock
        rate = 0.0
        if len(c.recent) >= 2:
            (t0, n0), (t1, n1) = c.recent[0], c.recent[-1]
            rate = (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
        e = self.engine
        pushes, pulls, errors = e.counts() if e else ({}, 0, 0)
        return LearnerStats(
            learner_id=self.learner_id,
            step=c.step,
            tokens=c.tokens,
            tokens_per_s=rate,
            loss=c.loss,
            compute_s=c.compute_s,
            blocked_s=c.blocked_s,
            bytes_sent=self.client.bytes_sent if self.client else 0,
            bytes_received=self.client.bytes_received if self.client else 0,
            pushes=pushes,
            pulls=pulls,
            merges=self.merges,
            errors=errors,
            fragment_versions=tuple(self.versions),
            sync_every=self.sync_every,
            sync_state=("closed" if self.closed else e.sync_state()) if e else "island member",
        )
