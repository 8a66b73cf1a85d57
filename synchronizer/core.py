"""The Synchronizer itself, without gRPC: the served model, its learners, and keeping them.

`Synchronizer` owns the model spec and its `Fragment`s, the learner `Registry`, goodput
accounting, the `Rounds` closer, the background housekeeping (lease reaping, capacity ticks,
periodic checkpoints), checkpoint save and restore, and the health of the whole (a failed
fragment makes it unhealthy, with the reason). Its methods take and return the wire's protobuf
messages; a request it refuses raises `Rejected` before it touches any state. The gRPC servicer
(`synchronizer.service`) only translates RPCs and refusals.

Every payload is validated before it touches state (`synchronizer.receive`): header, chunk
order and size, finiteness. A push is acknowledged once its bytes are received and validated;
the outer-step worker decodes it into its round, so learners never wait for a decode.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from google.protobuf.message import DecodeError
from safetensors import SafetensorError, safe_open

from protos import diloco_pb2 as pb
from protos import framing, layout
from protos.spec import ModelSpec
from synchronizer import checkpoint, memory, receive, shards, wire
from synchronizer.buffers import (
    Fp32Buffers,
    Payloads,
    Snapshots,
    fp32_kept,
    payload_budget,
    snapshot_budget,
)
from synchronizer.config import SynchronizerConfig
from synchronizer.downlink import Link
from synchronizer.errors import Code, Rejected, invalid
from synchronizer.fragments import Fragment
from synchronizer.goodput import Goodput
from synchronizer.grace import GraceWindow
from synchronizer.journal import Journal, load_epoch
from synchronizer.leases import DLU_RATIO, LearnerRecord, Registry
from synchronizer.metrics import Metrics
from synchronizer.model import FragmentFailed
from synchronizer.rounds import Rounds
from synchronizer.shards import Layout
from synchronizer.streams import SLOT_PATIENCE_S, Call, Stream, Streams
from synchronizer.wal import Disk

logger = logging.getLogger(__name__)

PUSH_CODECS = (pb.CODEC_FP32, pb.CODEC_BF16, pb.CODEC_INT8, pb.CODEC_INT4, pb.CODEC_FP4_E3M0)
PULL_CODECS = (pb.CODEC_FP32, pb.CODEC_BF16)
# A push past the payload budget, to a round that has its quorum, waits this long for outer
# steps to free room before it is refused RESOURCE_EXHAUSTED (the learner retries it).
PAYLOAD_WAIT_S = 10.0
OUTCOME_LABEL = {
    pb.PUSH_ACCEPTED: "accepted",
    pb.PUSH_DROPPED_STALE: "dropped_stale",
    pb.PUSH_DUPLICATE: "duplicate",
    pb.PUSH_REFUSED_NORM: "refused_norm",
}

PushMessages = Iterable[pb.PushRequest | wire.RawChunk]


@dataclass
class InitClaim:
    """An InitModel upload under way: who, and when its stream last moved."""

    learner_id: str
    progress_at: float = field(default_factory=time.monotonic)

    def touch(self) -> None:
        self.progress_at = time.monotonic()


def _known_fragment(fragment_id: int, count: int) -> None:
    if fragment_id >= count:
        raise Rejected(
            Code.NOT_FOUND,
            "unknown_fragment",
            f"fragment {fragment_id} does not exist; the model has fragments 0..{count - 1}",
        )


def _spec_of(meta: dict[str, Any]) -> ModelSpec:
    """The model spec a checkpoint's metadata carries."""
    msg = pb.ModelSpec()
    msg.ParseFromString(base64.b64decode(meta["spec"]))
    return ModelSpec.from_proto(msg)


def _stored(state_dir: Path) -> tuple[dict[str, Any], ModelSpec] | None:
    """The newest checkpoint's metadata and spec, read without its tensors (None when there is
    none, or it cannot be read: restoring then decides)."""
    found = checkpoint.list_checkpoints(state_dir)
    if not found:
        return None
    try:
        with safe_open(str(found[-1][1]), framework="pt") as f:
            meta = json.loads((f.metadata() or {})[checkpoint.META_KEY])
        return meta, _spec_of(meta)
    except (SafetensorError, OSError, KeyError, ValueError, DecodeError):
        return None


class Synchronizer:
    def __init__(
        self, cfg: SynchronizerConfig, metrics: Metrics | None = None, disk: Disk | None = None
    ) -> None:
        """`disk`: the write-ahead log's file operations (tests inject faults there)."""
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self._check_state_at_start()
        self.metrics.shard_info.labels(str(cfg.shard_index), str(cfg.shards)).set(1)
        logger.info("shard %d of %d", cfg.shard_index, cfg.shards)
        self.journal = Journal(cfg, self.metrics, disk)
        # A history of versions starts with the checkpoint an initialisation writes.
        self.epoch = load_epoch(cfg, bool(checkpoint.list_checkpoints(cfg.state_dir)))
        self.registry = Registry(cfg.lease_s, cfg.max_learners, cfg.forget_after_s)
        self.goodput = Goodput(self.metrics, cfg.goodput_window_s)
        self.grace = GraceWindow(cfg)
        self.model_lock = threading.Lock()
        self.spec: ModelSpec | None = None
        self.layout: Layout | None = None  # this shard's fragments of the served spec
        self.fragments: list[Fragment] = []  # the fragments this shard owns, in id order
        self.by_id: dict[int, Fragment] = {}
        self.rounds: Rounds | None = None
        self.initialized = False
        self.init_claim: InitClaim | None = None  # the InitModel upload under way, if any
        self.proposed: dict[str, ModelSpec] = {}  # specs live learners joined with, before init
        self.streams = Streams(cfg, self.metrics)
        self.init_cv = threading.Condition(self.model_lock)  # notified once initialised
        self.failures: dict[int, str] = {}  # fragment id -> why its outer step failed
        self.checkpoint_failure: str | None = None  # why the last checkpoint could not be written
        self.checkpointed: dict[
            int, int
        ] = {}  # fragment id -> its version in the newest checkpoint
        self.health_listeners: list[Callable[[str], None]] = []  # told the reason once unhealthy
        self.stopping = threading.Event()
        self.checkpoint_lock = threading.Lock()
        self._restore()
        self._replay()
        self.housekeeper = threading.Thread(
            target=self._housekeeping, name="housekeeping", daemon=True
        )
        self.housekeeper.start()

    # Model -----------------------------------------------------------------------------------

    def _layout(self, spec: ModelSpec) -> Layout:
        return Layout.of(spec, self.cfg.shards, self.cfg.shard_index)

    def _set_spec(self, spec: ModelSpec) -> None:
        """Serves `spec`: state (parameters, outer state, buffers) for this shard's fragments
        only, sized by them."""
        self.spec = spec
        self.layout = self._layout(spec)
        owned = [spec.fragments[fid] for fid in self.layout.owned]
        numel = sum(f.numel for f in owned)
        projection = memory.project(self.cfg, [f.numel for f in owned])
        self._export_memory(projection)
        logger.info(
            "memory projection for %d parameters in %d fragments: %s",
            numel,
            len(owned),
            memory.describe(projection, numel),
        )
        if self.cfg.shards > 1:
            logger.info(
                "serving as %s: %d of the model's %d parameters",
                self.layout.describe(),
                numel,
                spec.numel,
            )
        self.streams.limit_per_learner(len(owned))
        largest = max((f.numel for f in owned), default=0)
        payloads = Payloads(payload_budget(self.cfg.payload_budget_bytes, largest))
        self.snapshots = Snapshots(snapshot_budget(self.cfg.snapshot_budget_bytes, largest))
        self.metrics.snapshot_bytes.set_function(lambda: self.snapshots.alive_bytes)
        kept = fp32_kept(self.cfg.apply_threads, self.cfg.merge)
        fp32 = Fp32Buffers(largest, kept, self.metrics.fp32_beyond.inc)
        self.metrics.watch_buffers(payloads, fp32)
        self.fragments = [
            Fragment(f, self.cfg, self.metrics, self.goodput, spec.numel, payloads, fp32)
            for f in owned
        ]
        self.by_id = {frag.fid: frag for frag in self.fragments}
        self.rounds = Rounds(
            self.fragments,
            self.grace,
            self.metrics,
            self.goodput,
            self.registry.live_ids,
            self.cfg.apply_threads,
            self._fragment_failed,
            self.journal.durable,
        )
        for frag in self.fragments:
            frag.admission.journal = self.journal.round_journal(frag)

    def _check_state_at_start(self) -> None:
        """Refuses to start, before anything is loaded or written, on a state directory of
        another shard layout (`ShardLayoutError`), or when the fixed costs, or this shard's
        part of the model the state directory holds, cannot fit `memory_limit_bytes`
        (`MemoryLimitError`); logs what each parameter of a model will cost."""
        stored = _stored(self.cfg.state_dir)
        sizes: list[int] = []
        if stored is not None:
            meta, spec = stored
            shards.check_stored(meta, spec, self.cfg.shards, self.cfg.shard_index)
            sizes = [spec.fragments[fid].numel for fid in self._layout(spec).owned]
        why = memory.over_limit(self.cfg, sizes)
        if why is not None:
            raise memory.MemoryLimitError(f"refusing to start: {why}")
        self._export_memory(memory.project(self.cfg, []))
        per_param, fixed = memory.bytes_per_param(self.cfg)
        limit = self.cfg.memory_limit_bytes
        logger.info(
            "memory projection: %.1f bytes per model parameter (%.1fx its FP32 bytes) + %.0f MiB; %s",
            per_param,
            per_param / 4,
            fixed / (1 << 20),
            f"memory_limit_bytes {limit:,} fits about {int((limit - fixed) / per_param):,} parameters"
            if limit
            else "no memory_limit_bytes",
        )

    def _export_memory(self, projection: dict[str, int]) -> None:
        for component, nbytes in projection.items():
            self.metrics.memory.labels(component).set(nbytes)

    def versions(self) -> list[pb.FragmentVersion]:
        return [pb.FragmentVersion(fragment_id=f.fid, version=f.version) for f in self.fragments]

    def fragment(self, fragment_id: int) -> Fragment:
        """This shard's fragment `fragment_id`: NOT_FOUND outside the model, `wrong_shard`
        when another shard serves it."""
        _known_fragment(fragment_id, len(self.spec.fragments) if self.spec is not None else 0)
        if self.layout is not None:
            self.layout.refuse_unowned(fragment_id)
        return self.by_id[fragment_id]

    def _require_initialized(self) -> None:
        if not self.initialized:
            raise Rejected(
                Code.FAILED_PRECONDITION,
                "not_initialized",
                "the model has no parameters yet: the first learner must call InitModel (or run `diloco-synchronizer init FILE`)",
            )

    def _check_spec_hash(self, spec_hash: str) -> None:
        assert self.spec is not None
        if spec_hash != self.spec.spec_hash:
            raise Rejected(
                Code.FAILED_PRECONDITION,
                "spec_mismatch",
                f"spec hash {spec_hash[:12]!r} does not match the served model's {self.spec.spec_hash[:12]!r}; re-join with the served model's spec",
            )

    # Health ----------------------------------------------------------------------------------

    @property
    def unhealthy(self) -> str | None:
        """Why the Synchronizer cannot serve its whole model or keep it, or None while all is
        well. Only failed fragments turn gRPC health NOT_SERVING: with failing checkpoints the
        model is still served, and a restart would not mend the disk."""
        problems = [f"fragment {fid}: {why}" for fid, why in sorted(self.failures.items())]
        if self.checkpoint_failure is not None:
            problems.append(f"checkpoints failing: {self.checkpoint_failure}")
        if self.journal.failure is not None:
            problems.append(f"write-ahead log failing (pushes refused): {self.journal.failure}")
        return "; ".join(problems) or None

    def _fragment_failed(self, frag: Fragment, reason: str) -> None:
        frag.model.fail(reason)
        self.failures[frag.fid] = reason
        self.metrics.fragments_failed.set(len(self.failures))
        logger.error(
            "fragment %d failed and serves nothing until a restart from the last checkpoint: %s",
            frag.fid,
            reason,
        )
        for listener in self.health_listeners:
            listener(reason)

    def _unavailable(self, frag: Fragment) -> Rejected:
        return Rejected(
            Code.UNAVAILABLE,
            "fragment_failed",
            f"fragment {frag.fid} failed ({frag.model.failure}); the Synchronizer must be restarted from its last checkpoint; retry with backoff",
        )

    # Learners --------------------------------------------------------------------------------

    def join(self, request: pb.JoinRequest) -> pb.JoinReply:
        """Admits a learner. Before the model is initialised any well-formed spec within the
        size limits is accepted and kept as that learner's proposal: the served spec is set
        only by a successful initialisation (InitModel or `init`), so a bogus Join decides
        nothing. After it, a learner must bring the served spec."""
        size = request.spec.ByteSize()
        if size > self.cfg.max_spec_bytes:
            raise invalid(
                "spec_too_large",
                f"the model spec is {size} bytes serialized; this Synchronizer takes at most max_spec_bytes={self.cfg.max_spec_bytes}",
            )
        try:
            spec = ModelSpec.from_proto(request.spec)
        except ValueError as e:
            raise invalid("bad_spec", f"model spec is malformed: {e}") from None
        if spec.numel > self.cfg.max_model_params:
            raise invalid(
                "model_too_large",
                f"the model has {spec.numel} parameters; this Synchronizer serves at most max_model_params={self.cfg.max_model_params}",
            )
        layout = shards.check_join(request, spec, self.cfg.shards, self.cfg.shard_index)
        too_big = memory.over_limit(self.cfg, [spec.fragments[fid].numel for fid in layout.owned])
        if too_big is not None:
            if self.cfg.shards > 1:
                too_big = f"{layout.describe()}: {too_big}"
            raise Rejected(Code.RESOURCE_EXHAUSTED, "over_memory_limit", too_big)
        with self.model_lock:
            if self.spec is not None and spec.spec_hash != self.spec.spec_hash:
                raise Rejected(
                    Code.FAILED_PRECONDITION,
                    "spec_mismatch",
                    f"model spec does not match the served model: {self.spec.describe_difference(spec)}",
                )
            needs_init = not self.initialized
        rec, session, revived = self.registry.join(
            request.learner_name, request.learner_id, request.session
        )
        rec.spec_hash = spec.spec_hash
        self.journal.joined(self.registry, rec)
        if needs_init:
            with self.model_lock:
                self.proposed[spec.spec_hash] = spec
                live = self.registry.live_specs()
                for h in [h for h in self.proposed if h not in live]:
                    del self.proposed[h]
        logger.info(
            "learner %s (%s) %s", rec.learner_id, rec.name, "re-joined" if revived else "joined"
        )
        return pb.JoinReply(
            learner_id=rec.learner_id,
            lease_s=self.cfg.lease_s,
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
            server_epoch=self.epoch,
            versions=self.versions(),
            needs_init=needs_init,
            next_seq=rec.max_seq + 1,
            session=session,
            shards=layout.shards,
            shard_index=layout.index,
            owned_fragments=layout.owned,
            **self._inner_steps(rec),
        )

    def _inner_steps(self, rec: LearnerRecord) -> dict[str, Any]:
        """The Dynamic Local Updates directive of a Join or Heartbeat reply: H_m when the
        Synchronizer has an H (`inner_steps`), else the scale of the learner's own H, given
        only to a learner below DLU_RATIO of the fastest's speed: measured step times of equal
        learners jitter, and each change of H moves that learner's push schedule."""
        if not self.cfg.dynamic_local_updates:
            return {}
        if self.cfg.inner_steps:
            return {"inner_steps": self.registry.inner_steps_for(rec, self.cfg.inner_steps)}
        ratio = self.registry.speed_ratio(rec)
        return {"inner_steps_scale": ratio} if ratio < DLU_RATIO else {}

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        rec = self.registry.alive(request.learner_id, request.session)
        self._report(rec, request.counters, request.step_time_s)
        self.grace.observe(overlap_steps=request.overlap_steps)
        return pb.HeartbeatReply(
            server_epoch=self.epoch,
            lease_s=self.cfg.lease_s,
            versions=self.versions(),
            **self._inner_steps(rec),
        )

    def _report(self, rec: LearnerRecord, counters: pb.LearnerCounters, step_time_s: float) -> None:
        if not all(
            math.isfinite(x) and x >= 0
            for x in (counters.compute_s, counters.blocked_s, step_time_s)
        ):
            raise invalid("bad_counters", "counters and step time must be finite and non-negative")
        blocked = self.registry.report(rec, counters, step_time_s)
        self.metrics.blocked.inc(blocked)
        self.goodput.report(rec.learner_id, float(rec.tokens), rec.compute_s)
        if step_time_s > 0:
            self.grace.observe(step_time=step_time_s)

    def leave(self, request: pb.LeaveRequest) -> pb.LeaveReply:
        rec = self.registry.alive(request.learner_id, request.session, renew=False)
        self._report(rec, request.counters, 0.0)
        self.registry.leave(request.learner_id)
        self.goodput.died(request.learner_id)
        logger.info("learner %s (%s) left", rec.learner_id, rec.name)
        if self.rounds is not None:
            self.rounds.check_all()
        return pb.LeaveReply()

    def status(self) -> pb.StatusReply:
        with self.registry.lock:
            learners = [
                pb.LearnerStatus(
                    learner_id=r.learner_id,
                    name=r.name,
                    state=r.state,
                    counters=r.counters(),
                    inner_steps=0,
                )
                for r in self.registry.learners.values()
            ]
        return pb.StatusReply(
            server_epoch=self.epoch,
            initialized=self.initialized,
            spec_hash=self.spec.spec_hash if self.spec else "",
            versions=self.versions(),
            learners=learners,
            outer_steps=sum(f.version for f in self.fragments),
            goodput=self.goodput.ratio(),
            unhealthy=self.unhealthy or "",
            shards=self.cfg.shards,
            shard_index=self.cfg.shard_index,
        )

    # Model transfer --------------------------------------------------------------------------

    def init_model(self, messages: Iterator[pb.InitModelRequest]) -> pb.InitModelReply:
        first = next(messages, None)
        if first is None or first.WhichOneof("kind") != "start":
            raise invalid("bad_stream", "InitModel must start with an InitStart message")
        rec = self.registry.alive(first.start.learner_id, first.start.session)
        with self.model_lock:
            spec = self.spec if self.initialized else self.proposed.get(rec.spec_hash)
        if spec is None:
            raise Rejected(
                Code.FAILED_PRECONDITION,
                "no_spec",
                "this learner's model spec is not known: call Join with it first",
            )
        if first.start.spec_hash != spec.spec_hash:
            raise Rejected(
                Code.FAILED_PRECONDITION,
                "spec_mismatch",
                f"spec hash {first.start.spec_hash[:12]!r} is not the one this learner joined with ({spec.spec_hash[:12]!r}); re-join with the model's spec",
            )
        claim = InitClaim(first.start.learner_id)
        with self.model_lock:
            if self.initialized:
                raise Rejected(
                    Code.ALREADY_EXISTS,
                    "already_initialized",
                    "the model is already initialised; pull its fragments instead",
                )
            held = self.init_claim
            if held is not None and time.monotonic() - held.progress_at < self.cfg.init_stall_s:
                raise Rejected(
                    Code.ALREADY_EXISTS,
                    "already_initialized",
                    f"the model is being initialised by learner {held.learner_id}; pull its fragments instead",
                )
            if held is not None:
                logger.warning(
                    "InitModel of learner %s made no progress for %.0f s: learner %s takes over",
                    held.learner_id,
                    time.monotonic() - held.progress_at,
                    claim.learner_id,
                )
            self.init_claim = claim
        try:
            layout = self._layout(spec)
            numels = {fid: spec.fragments[fid].numel for fid in layout.owned}

            def progress() -> None:  # an upload longer than a lease keeps it while it moves
                claim.touch()
                self.registry.renew(rec)

            def known(fid: int) -> None:
                _known_fragment(fid, len(spec.fragments))
                layout.refuse_unowned(fid)

            received = receive.init_fragments(messages, known, numels, progress)
            with self.model_lock:
                if self.init_claim is not claim:
                    raise Rejected(
                        Code.ALREADY_EXISTS,
                        "already_initialized",
                        f"this upload stalled for more than init_stall_s ({self.cfg.init_stall_s:g} s) and another learner took over; pull its fragments instead",
                    )
                self._set_spec(spec)
                for frag, params in zip(self.fragments, received, strict=True):
                    frag.initialize(params, adopt=True)  # the upload's buffers, not copies
                received.clear()  # the fragments hold the only references
                self.initialized = True
                self.proposed.clear()
                self.init_cv.notify_all()
                logger.info(
                    "serving a model of %d parameters in %d fragments (spec %s)%s",
                    spec.numel,
                    len(spec.fragments),
                    spec.spec_hash[:12],
                    f" as {layout.describe()}" if layout.shards > 1 else "",
                )
        finally:
            with self.model_lock:
                if self.init_claim is claim:
                    self.init_claim = None
        logger.info("model initialised by learner %s", first.start.learner_id)
        with self.registry.held(
            rec
        ):  # the first checkpoint is the server's time, not the learner's
            self.save_checkpoint()
        return pb.InitModelReply(versions=self.versions())

    def push(self, messages: PushMessages, call: Call | None = None) -> pb.PushReply:
        """Receives, validates and judges one push; the reply says what became of it."""
        with contextlib.ExitStack() as held:
            stream = held.enter_context(self.streams.transfer("push", call or Call()))
            reply, frag = self._push(stream, held, stream.moving(messages))
        self.metrics.pushes.labels(OUTCOME_LABEL[reply.outcome]).inc()
        if frag is not None and self.rounds is not None:
            self.rounds.check(frag)
        return reply

    def _push(
        self,
        stream: Stream,
        held: contextlib.ExitStack,
        messages: Iterator[pb.PushRequest | wire.RawChunk],
    ) -> tuple[pb.PushReply, Fragment | None]:
        first = next(messages, None)
        if not isinstance(first, pb.PushRequest) or first.WhichOneof("kind") != "header":
            raise invalid("bad_stream", "PushFragment must start with a PushHeader")
        h = first.header
        rec = self.registry.alive(h.learner_id, h.session)
        self.journal.refuse_if_failing()
        held.enter_context(self.streams.claimed(rec.learner_id))
        stream.owned_by(rec.learner_id, lambda: self.registry.renew(rec))
        self._require_initialized()
        self._check_spec_hash(h.spec_hash)
        frag = self.fragment(h.fragment_id)
        if frag.model.failure is not None:
            raise self._unavailable(frag)
        receive.check_push_header(h, frag.version, self.cfg.token_weight != "uniform")
        rec.check_counts("push counts", h.tokens, h.steps, h.compute_s)
        seen = self.registry.seen_reply(rec, h.seq)
        if seen is not None:
            for _ in messages:  # drain: the client may still be streaming the repeat
                pass
            return self._duplicate(rec, h.seq, seen), None
        receive.validate_payload(h.payload, frag.numel, PUSH_CODECS)
        nbytes = int(h.payload.total_bytes)
        # Its bytes count against the payload budget from before they arrive: a push that does
        # not fit is refused before it is received (see `_room_to_hold`).
        reserved = self._room_to_hold(frag, nbytes)
        kept = False
        received: torch.Tensor | None = None
        try:
            received = frag.payloads.take(nbytes)
            # Validated now, decoded by the outer step: the reply need not wait for the decode.
            header = receive.payload(messages, h.payload, received)
            self.metrics.bytes_in.labels(layout.codec_name(h.payload.codec)).inc(nbytes)
            with rec.push_lock:  # judging and recording a seq is atomic per learner
                seen = self.registry.seen_reply(
                    rec, h.seq
                )  # a concurrent retry may have won the race
                if seen is not None:
                    return self._duplicate(rec, h.seq, seen), None
                verdict, rnd = frag.submit(
                    rec.learner_id,
                    h.base_version,
                    h.tokens,
                    h.steps,
                    h.compute_s,
                    (received, header),
                    hold=reserved,
                    journal=self.journal.push_journal(frag, h, received, rec.name, reserved),
                    order=(rec.name, rec.learner_id, h.seq),
                )
                kept = reserved and verdict.outcome == pb.PUSH_ACCEPTED  # the round owns it now
                reply = pb.PushReply(
                    outcome=verdict.outcome,
                    round_version=verdict.round_version,
                    current_version=verdict.current_version,
                    staleness=verdict.staleness,
                    weight=verdict.weight,
                    message=verdict.message,
                )
                self.registry.record_reply(rec, h.seq, reply, verdict.ticket)
                try:  # acknowledged only once durable
                    self.journal.wait(verdict.ticket)
                except Rejected:
                    if not kept:  # its log record still reads the buffer: never reuse it
                        kept = True
                        if reserved:
                            frag.payloads.release(nbytes)
                    raise
        finally:
            if not kept:
                if reserved:
                    frag.payloads.release(nbytes)
                if received is not None:
                    frag.payloads.give(received)
        return reply, frag if rnd is not None else None

    def _room_to_hold(self, frag: Fragment, nbytes: int) -> bool:
        """Room in the payload budget to hold a push for its outer step: True when it is held,
        False when its round already adds on arrival (it has its sums: no more memory).

        Past the budget the Synchronizer is behind (rounds wait for outer steps). A round that
        has not reached its quorum needs this push to ever close: it is held past the budget, or
        added on arrival when its held pushes would cost more than FP32 sums of the fragment.
        Otherwise the push waits (up to PAYLOAD_WAIT_S) for outer steps to free room, and is
        then refused RESOURCE_EXHAUSTED (the learner retries it, same seq): memory stays within
        the budget plus what rounds need to reach their quorum."""
        if frag.payloads.reserve(nbytes):
            return True
        deadline = time.monotonic() + PAYLOAD_WAIT_S
        while True:
            rnd, _, quorum = frag.admission.closability(
                self.registry.live_ids(), frag.model.version
            )
            if rnd is not None and rnd.acc is not None:
                return False
            if not quorum:
                held = sum(x.buf.numel() for x in rnd.held) if rnd is not None else 0
                if held + nbytes > 4 * frag.numel:
                    return False  # holding would cost more than the round's FP32 sums
                frag.payloads.claim(nbytes)
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                self.metrics.payloads_refused.inc()
                raise Rejected(
                    Code.RESOURCE_EXHAUSTED,
                    "payload_budget",
                    f"pushes held for outer steps fill payload_budget_bytes ({frag.payloads.budget_bytes}): the Synchronizer is behind; retry this push (same seq) with backoff",
                )
            if frag.payloads.wait_reserve(nbytes, min(0.5, left)):
                return True

    def _duplicate(self, rec: LearnerRecord, seq: int, seen: pb.PushReply) -> pb.PushReply:
        """The reply to a repeated seq, once what it repeats is durable."""
        self.journal.wait(self.registry.ticket_of(rec, seq))
        reply = pb.PushReply()
        reply.CopyFrom(seen)
        if reply.outcome == pb.PUSH_ACCEPTED:
            reply.outcome = pb.PUSH_DUPLICATE
            reply.message = "this push was already accepted; it was not applied again"
        return reply

    def pull(self, request: pb.PullRequest, call: Call | None = None) -> Iterator[pb.PullReply]:
        """The fragment's parameters (or the updates since `have_version`), judged at one
        version, after waiting (bounded, in a waiting slot) for `min_version`. Everything runs
        on the first `next()`: a refusal is raised there, before anything is sent."""
        call = call or Call()
        rec = self.registry.alive(request.learner_id, request.session)
        codec_id = request.codec or pb.CODEC_FP32
        if codec_id not in PULL_CODECS:
            raise invalid("bad_codec", "pulls are served as CODEC_FP32 or CODEC_BF16")
        if not (math.isfinite(request.wait_s) and request.wait_s >= 0):
            raise invalid("bad_wait", "wait_s must be finite and non-negative")
        if self.initialized:
            self.fragment(request.fragment_id)
        with contextlib.ExitStack() as held:
            held.enter_context(self.streams.claimed(rec.learner_id))
            with self.streams.waiting() as free:
                if free:
                    self._wait_for_pull(request, call)
                stream = held.enter_context(
                    self.streams.transfer("pull", call, SLOT_PATIENCE_S if free else 0.0)
                )
            stream.owned_by(rec.learner_id, lambda: self.registry.renew(rec))
            self._require_initialized()
            frag = self.fragment(request.fragment_id)
            self._check_spec_hash(rec.spec_hash)  # the spec this learner joined with
            have = request.have_version if request.delta_ok else None
            snap, links, version, checksum = self._served(frag, codec_id, have, call)
            yield from stream.moving(
                self._stream_pull(frag.fid, request.have_version, snap, links, version, checksum)
            )

    def _served(
        self, frag: Fragment, codec_id: pb.Codec, have: int | None, call: Call
    ) -> tuple[Link | None, list[Link] | None, int, int]:
        """`FragmentModel.served` within the snapshot budget: a full pull that finds it spent
        waits (up to max_pull_wait_s, or until its client cancels) for a snapshot to end, then
        is refused RESOURCE_EXHAUSTED."""
        deadline = time.monotonic() + self.cfg.max_pull_wait_s
        ended: threading.Event | None = None
        while True:
            try:
                snap, links, version, checksum = frag.model.served(codec_id, have, self.snapshots)
            except FragmentFailed:
                raise self._unavailable(frag) from None
            if snap is not None or links is not None:
                return snap, links, version, checksum
            if ended is None:  # only a pull that waits hears when its call ends
                ended = threading.Event()
                call.on_end(ended.set)
            if time.monotonic() >= deadline or ended.is_set():
                raise Rejected(
                    Code.RESOURCE_EXHAUSTED,
                    "snapshot_budget",
                    f"full pulls in flight hold the whole snapshot_budget_bytes ({self.snapshots.budget_bytes}); retry with backoff",
                )
            self.snapshots.wait(min(1.0, deadline - time.monotonic()))

    def _wait_for_pull(self, request: pb.PullRequest, call: Call) -> None:
        """Waits (up to the bounded wait) until the model is initialised and the fragment at
        `min_version`; returns as soon as the client cancels."""
        wait_s = min(request.wait_s, self.cfg.max_pull_wait_s)
        fid = request.fragment_id
        if wait_s <= 0 or (
            self.initialized
            and fid in self.by_id
            and request.min_version <= self.by_id[fid].version
        ):
            return
        deadline = time.monotonic() + wait_s
        ended = threading.Event()

        def wake() -> None:
            ended.set()
            with self.init_cv:
                self.init_cv.notify_all()
            for frag in list(self.fragments):
                frag.model.wake()

        call.on_end(wake)
        with self.init_cv:
            while not self.initialized and not ended.is_set() and not self.stopping.is_set():
                if not self.init_cv.wait(max(0.0, deadline - time.monotonic())):
                    return
        if self.initialized and fid in self.by_id:
            self.by_id[fid].model.wait_for(request.min_version, deadline - time.monotonic(), ended)

    def _stream_pull(
        self,
        fid: int,
        have_version: int,
        snap: tuple[int, pb.PayloadHeader, torch.Tensor] | None,
        links: list[tuple[int, pb.PayloadHeader, torch.Tensor]] | None,
        version: int,
        checksum: int,
    ) -> Iterator[pb.PullReply]:
        if links is not None:
            yield pb.PullReply(
                header=pb.PullHeader(
                    fragment_id=fid,
                    version=version,
                    server_epoch=self.epoch,
                    delta_from=have_version,
                    links=len(links),
                    checksum=checksum,
                )
            )
            for v, link_header, link_buf in links:
                yield pb.PullReply(link=pb.DeltaLink(version=v, payload=link_header))
                for chunk in framing.iter_chunks(link_buf):
                    yield pb.PullReply(chunk=chunk)
                self.metrics.bytes_out.labels(layout.codec_name(link_header.codec)).inc(
                    link_header.total_bytes
                )
            return
        assert snap is not None
        _, header, buf = snap
        yield pb.PullReply(
            header=pb.PullHeader(
                fragment_id=fid,
                version=version,
                server_epoch=self.epoch,
                payload=header,
                checksum=checksum,
            )
        )
        for chunk in framing.iter_chunks(buf):
            yield pb.PullReply(chunk=chunk)
        self.metrics.bytes_out.labels(layout.codec_name(header.codec)).inc(header.total_bytes)

    # Housekeeping and durability -------------------------------------------------------------

    def _housekeeping(self) -> None:
        period = min(0.5, self.cfg.lease_s / 4)
        last_checkpoint = time.monotonic()
        while not self.stopping.wait(period):
            try:
                for rec in self.registry.reap():
                    self.goodput.died(rec.learner_id)
                self.streams.cut_idle()
                if self.rounds is not None:
                    self.rounds.check_all()
                self.goodput.tick(self.registry.capacity_slots())
                for state, n in self.registry.counts().items():
                    self.metrics.learners.labels(state).set(n)
                interval = self.cfg.checkpoint_interval_s
                if interval > 0 and time.monotonic() - last_checkpoint >= interval:
                    last_checkpoint = time.monotonic()
                    threading.Thread(
                        target=self.save_checkpoint, name="checkpoint", daemon=True
                    ).start()
            except Exception:  # housekeeping must outlive a bad tick
                logger.exception("housekeeping tick failed")

    def save_checkpoint(self) -> bool:
        """Writes the state atomically; False if it could not (nothing to save before the model
        is initialised counts as saved). While a fragment is failed nothing is written: the
        newest checkpoint stays the last healthy state. A write that fails (a full disk, a
        read-only volume) is an ERROR record, `diloco_checkpoint_failures_total` and part of
        `unhealthy` until a later one succeeds; the service keeps serving."""
        if not self.initialized or self.spec is None:
            return True
        if self.failures:
            logger.error(
                "no checkpoint written while a fragment is failed (%s); a restart resumes from the last healthy one",
                self.unhealthy,
            )
            return False
        try:
            self._write_checkpoint(self.spec)
        except FragmentFailed as e:  # failed while the state was being collected
            logger.error("no checkpoint written: %s", e)
            return False
        except Exception as e:  # noqa: BLE001 - any failure to save must be loud, not a lost traceback
            self.checkpoint_failure = f"{type(e).__name__}: {e}"
            self.metrics.checkpoint_failures.inc()
            newest = checkpoint.list_checkpoints(self.cfg.state_dir)
            logger.error(
                "checkpoint to %s failed (%s); the newest on disk is still %s",
                self.cfg.state_dir,
                self.checkpoint_failure,
                newest[-1][1].name if newest else "none",
            )
            return False
        self.checkpoint_failure = None
        return True

    def _write_checkpoint(self, spec: ModelSpec) -> None:
        """Writes every fragment's live state, one frozen fragment at a time. Lock order: the
        checkpoint lock, then the log's seal, then each fragment's condition only to freeze and
        thaw it (never held during the write); the freeze is released before the log is
        truncated. An outer step waiting on a frozen fragment holds no lock (its log record is
        durable before it waits), so it only waits, for at most one fragment's write time."""
        t0 = time.perf_counter()
        with self.checkpoint_lock:
            sealed = self.journal.seal()  # the log from here on is not in this checkpoint
            spec_text = base64.b64encode(spec.to_proto().SerializeToString()).decode()
            frag_meta = []
            # No copies: one fragment at a time is frozen at its version (its outer steps wait;
            # pushes and pulls go on) while its live tensors are written.
            room = checkpoint.HEADER_ROOM + len(spec_text) + 512 * self.cfg.max_learners
            with checkpoint.Writer(self.cfg.state_dir, self.cfg.keep_checkpoints, room) as writer:
                for frag in self.fragments:
                    with frag.model.frozen_state() as (tensors, m):
                        writer.add(tensors)
                    frag_meta.append(m)
                meta = {
                    "format": 1,
                    "spec": spec_text,
                    "fragments": frag_meta,
                    "learners": self.registry.snapshot(),
                    **self._layout(spec).meta(),
                }
                path = writer.finish(meta)
            versions = {
                f.fid: int(m["version"]) for f, m in zip(self.fragments, frag_meta, strict=True)
            }
            self.journal.release(sealed, versions)
            self.checkpointed = versions
        self.metrics.checkpoints.inc()
        self.metrics.checkpoint_seconds.observe(time.perf_counter() - t0)
        logger.info(
            "checkpoint %s written (versions %s)", path.name, [f.version for f in self.fragments]
        )

    def _restore(self) -> None:
        found = checkpoint.load_latest(self.cfg.state_dir)
        if found is None:
            return
        tensors, meta, path = found
        spec = _spec_of(meta)
        # Checked at start against the newest checkpoint; again for the one that loaded.
        shards.check_stored(meta, spec, self.cfg.shards, self.cfg.shard_index)
        self._set_spec(spec)
        for frag, fmeta in zip(self.fragments, meta["fragments"], strict=True):
            frag.restore(tensors, fmeta)
        self.checkpointed = {frag.fid: frag.version for frag in self.fragments}
        self.initialized = True
        self.registry.restore(meta.get("learners", []))
        logger.info("restored %s: versions %s", path, [f.version for f in self.fragments])

    def _replay(self) -> None:
        """Repeats what the write-ahead log holds beyond the checkpoint, then starts the log."""
        pushes, rounds = self.journal.replay(
            self.by_id, self.registry, self.goodput, self._fragment_failed
        )
        for frag in self.fragments:
            frag.settled()
        if pushes or rounds:
            logger.info(
                "replayed the write-ahead log: %d pushes, %d rounds; versions %s (epoch %s)",
                pushes,
                rounds,
                [f.version for f in self.fragments],
                self.epoch,
            )
        self.journal.start()

    def unsaved(self) -> str:
        """The versions served since the newest checkpoint, fragment by fragment ('' if none)."""
        spans = []
        for f in self.fragments:
            first = self.checkpointed.get(f.fid, 0) + 1
            if f.version > first:
                spans.append(f"fragment {f.fid} versions {first}-{f.version}")
            elif f.version == first:
                spans.append(f"fragment {f.fid} version {first}")
        return ", ".join(spans)

    def close(self) -> bool:
        """Stops housekeeping, answers waiting pulls, merges every acknowledged contribution,
        writes a final checkpoint; False if that checkpoint could not be written."""
        self.stopping.set()
        with self.init_cv:
            self.init_cv.notify_all()
        self.housekeeper.join(timeout=5)
        for frag in self.fragments:
            frag.model.stop_waiting()
        if self.rounds is not None:
            self.rounds.flush()
            self.rounds.shutdown()
        saved = self.save_checkpoint()
        self.journal.close()
        return saved
