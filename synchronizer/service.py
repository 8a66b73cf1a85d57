"""The gRPC servicer: validates every request at the boundary, then drives the global model.

Owns the served model (its spec and fragments), the learner registry, goodput accounting, the
background housekeeping (lease reaping, capacity ticks, periodic checkpoints) and restore from
the newest checkpoint. Anything that crosses the wire is checked before it touches state; a
refusal aborts with the precise status code and a message a person can act on, is counted in
`diloco_rejected_requests_total`, and leaves the global model bit-for-bit unchanged.
"""

from __future__ import annotations

import base64
import functools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import grpc
import torch

from protos import codec, framing
from protos import diloco_pb2 as pb
from protos import diloco_pb2_grpc as pb_grpc
from protos.spec import ModelSpec
from synchronizer import checkpoint, wire
from synchronizer.config import SynchronizerConfig
from synchronizer.fragments import FragmentState, GraceWindow, Rounds
from synchronizer.goodput import Goodput, Share
from synchronizer.leases import LearnerRecord, LeaseError, Registry
from synchronizer.metrics import Metrics

logger = logging.getLogger(__name__)

PUSH_CODECS = (pb.CODEC_FP32, pb.CODEC_BF16, pb.CODEC_INT8, pb.CODEC_INT4, pb.CODEC_FP4_E3M0)
PULL_CODECS = (pb.CODEC_FP32, pb.CODEC_BF16)
OUTCOME_LABEL = {pb.PUSH_ACCEPTED: "accepted", pb.PUSH_DROPPED_STALE: "dropped_stale", pb.PUSH_DUPLICATE: "duplicate"}


class Rejected(Exception):
    """Raised inside a handler to refuse a request; turned into context.abort by `_rpc`."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def _rpc(method: str, streaming_reply: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Counts the RPC by status code and turns Rejected/LeaseError into a counted abort."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        def finish(self: SynchronizerService, context: grpc.ServicerContext, exc: BaseException | None) -> NoReturn | None:
            if isinstance(exc, Rejected | LeaseError):
                self.metrics.rejections.labels(exc.code.name, exc.reason).inc()
                self.metrics.rpcs.labels(method, exc.code.name).inc()
                if method == "PushFragment":
                    self.metrics.pushes.labels("rejected").inc()
                logger.info("%s refused (%s): %s", method, exc.code.name, exc.message)
                context.abort(exc.code, exc.message)
            if isinstance(exc, grpc.RpcError):
                # Raised by a request stream whose client went away mid-call (killed, cancelled,
                # timed out; the service makes no calls of its own): expected, and nothing of a
                # half-received push was applied.
                self.metrics.rpcs.labels(method, "CANCELLED").inc()
                logger.warning("%s: the client went away before the call completed; nothing of it was applied", method)
                raise exc
            if exc is not None:
                code = context.code() if hasattr(context, "code") and context.code() is not None else grpc.StatusCode.UNKNOWN
                self.metrics.rpcs.labels(method, getattr(code, "name", "UNKNOWN")).inc()
                if not isinstance(exc, Exception) or code == grpc.StatusCode.UNKNOWN:
                    logger.exception("%s failed", method, exc_info=exc)
                raise exc
            self.metrics.rpcs.labels(method, "OK").inc()
            return None

        if streaming_reply:

            @functools.wraps(fn)
            def gen_wrapper(self: SynchronizerService, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                try:
                    yield from fn(self, request, context)
                except BaseException as e:  # noqa: BLE001 - re-raised by finish
                    finish(self, context, e)
                finish(self, context, None)

            return gen_wrapper

        @functools.wraps(fn)
        def wrapper(self: SynchronizerService, request: Any, context: grpc.ServicerContext) -> Any:
            try:
                result = fn(self, request, context)
            except BaseException as e:  # noqa: BLE001 - re-raised by finish
                finish(self, context, e)
            finish(self, context, None)
            return result

        return wrapper

    return deco


def _invalid(reason: str, message: str) -> Rejected:
    return Rejected(grpc.StatusCode.INVALID_ARGUMENT, reason, message)


class SynchronizerService(pb_grpc.SynchronizerServicer):
    def __init__(self, cfg: SynchronizerConfig, metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self.epoch = uuid.uuid4().hex[:16]
        self.registry = Registry(cfg.lease_s, cfg.max_learners, cfg.forget_after_s)
        self.goodput = Goodput(self.metrics, cfg.goodput_window_s)
        self.grace = GraceWindow(cfg)
        self.model_lock = threading.Lock()
        self.spec: ModelSpec | None = None
        self.fragments: list[FragmentState] = []
        self.rounds: Rounds | None = None
        self.initialized = False
        self.init_in_progress = False
        self.streams = threading.BoundedSemaphore(cfg.max_concurrent_streams)
        self.stopping = threading.Event()
        self.checkpoint_lock = threading.Lock()
        self._restore()
        self.housekeeper = threading.Thread(target=self._housekeeping, name="housekeeping", daemon=True)
        self.housekeeper.start()

    # Model -----------------------------------------------------------------------------------

    def _set_spec(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.fragments = [FragmentState(f, self.cfg, self.metrics, self.goodput, spec.numel) for f in spec.fragments]
        self.rounds = Rounds(self.fragments, self.grace, self.metrics, self.goodput, self.registry.live_ids, self.cfg.apply_threads)

    def versions(self) -> list[pb.FragmentVersion]:
        return [pb.FragmentVersion(fragment_id=f.fid, version=f.version) for f in self.fragments]

    def _fragment(self, fragment_id: int) -> FragmentState:
        if fragment_id >= len(self.fragments):
            raise Rejected(
                grpc.StatusCode.NOT_FOUND,
                "unknown_fragment",
                f"fragment {fragment_id} does not exist; the model has fragments 0..{len(self.fragments) - 1}",
            )
        return self.fragments[fragment_id]

    def _require_initialized(self) -> None:
        if not self.initialized:
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                "not_initialized",
                "the model has no parameters yet: the first learner must call InitModel (or run `diloco-synchronizer init FILE`)",
            )

    def _check_spec_hash(self, spec_hash: str) -> None:
        assert self.spec is not None
        if spec_hash != self.spec.spec_hash:
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                "spec_mismatch",
                f"spec hash {spec_hash[:12]!r} does not match the served model's {self.spec.spec_hash[:12]!r}; re-join with the served model's spec",
            )

    # RPCs ------------------------------------------------------------------------------------

    @_rpc("Join")
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        try:
            spec = ModelSpec.from_proto(request.spec)
        except ValueError as e:
            raise _invalid("bad_spec", f"model spec is malformed: {e}") from None
        with self.model_lock:
            if self.spec is None:
                self._set_spec(spec)
                logger.info("serving a model of %d parameters in %d fragments (spec %s)", spec.numel, len(spec.fragments), spec.spec_hash[:12])
            elif spec.spec_hash != self.spec.spec_hash:
                raise Rejected(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "spec_mismatch",
                    f"model spec does not match the served model: {self.spec.describe_difference(spec)}",
                )
            needs_init = not self.initialized
        rec, revived = self.registry.join(request.learner_name, request.learner_id)
        logger.info("learner %s (%s) %s", rec.learner_id, rec.name, "re-joined" if revived else "joined")
        return pb.JoinReply(
            learner_id=rec.learner_id,
            lease_s=self.cfg.lease_s,
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
            server_epoch=self.epoch,
            versions=self.versions(),
            needs_init=needs_init,
            inner_steps=self._inner_steps(rec),
            next_seq=rec.max_seq + 1,
        )

    def _inner_steps(self, rec: LearnerRecord) -> int:
        if not self.cfg.dynamic_local_updates:
            return 0
        return self.registry.inner_steps_for(rec, self.cfg.inner_steps)

    @_rpc("InitModel")
    def InitModel(self, request_iterator: Iterator[pb.InitModelRequest], context: grpc.ServicerContext) -> pb.InitModelReply:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "start":
            raise _invalid("bad_stream", "InitModel must start with an InitStart message")
        self.registry.alive(first.start.learner_id)
        if self.spec is None:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, "no_spec", "no model spec yet: call Join first")
        self._check_spec_hash(first.start.spec_hash)
        with self.model_lock:
            if self.initialized or self.init_in_progress:
                raise Rejected(
                    grpc.StatusCode.ALREADY_EXISTS,
                    "already_initialized",
                    "the model is already initialised (or being initialised by another learner); pull its fragments instead",
                )
            self.init_in_progress = True
        try:
            received = self._receive_init(request_iterator)
            with self.model_lock:
                for frag, params in zip(self.fragments, received, strict=True):
                    frag.initialize(params)
                self.initialized = True
        finally:
            with self.model_lock:
                self.init_in_progress = False
        logger.info("model initialised by learner %s", first.start.learner_id)
        self.save_checkpoint()
        return pb.InitModelReply(versions=self.versions())

    def _receive_init(self, request_iterator: Iterator[pb.InitModelRequest]) -> list[torch.Tensor]:
        """Every fragment's FP32 parameters, each exactly once, checked finite."""
        got: dict[int, torch.Tensor] = {}
        asm: framing.Assembler | None = None
        header = pb.PayloadHeader()
        fid = -1
        for msg in request_iterator:
            kind = msg.WhichOneof("kind")
            if kind == "fragment":
                if asm is not None:
                    raise _invalid("bad_stream", f"fragment {fid} ended after {asm.received} of {asm.total_bytes} bytes")
                fid = msg.fragment.fragment_id
                frag = self._fragment(fid)
                if fid in got:
                    raise _invalid("bad_stream", f"fragment {fid} was sent twice")
                header = msg.fragment.payload
                self._validate_payload(header, frag.numel, (pb.CODEC_FP32,))
                asm = framing.Assembler(header)
            elif kind == "chunk":
                if asm is None:
                    raise _invalid("bad_stream", "a chunk arrived before its InitFragmentHeader")
                self._add_chunk(asm, msg.chunk)
            else:
                raise _invalid("bad_stream", f"unexpected {kind!r} message inside InitModel")
            if asm is not None and asm.complete:
                got[fid] = self._decode(asm, header, torch.empty(self.fragments[fid].numel, dtype=torch.float32))
                asm = None
        if asm is not None:
            raise _invalid("bad_stream", f"stream ended after {asm.received} of {asm.total_bytes} bytes of fragment {fid}")
        missing = [f.fid for f in self.fragments if f.fid not in got]
        if missing:
            raise _invalid("bad_stream", f"InitModel ended without fragments {missing}")
        return [got[f.fid] for f in self.fragments]

    @_rpc("Heartbeat")
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        rec = self.registry.alive(request.learner_id)
        self._report(rec, request.counters, request.step_time_s)
        self.grace.observe(overlap_steps=request.overlap_steps)
        return pb.HeartbeatReply(
            server_epoch=self.epoch,
            lease_s=self.cfg.lease_s,
            inner_steps=self._inner_steps(rec),
            versions=self.versions(),
        )

    def _report(self, rec: LearnerRecord, counters: pb.LearnerCounters, step_time_s: float) -> None:
        if not all(math.isfinite(x) and x >= 0 for x in (counters.compute_s, counters.blocked_s, step_time_s)):
            raise _invalid("bad_counters", "counters and step time must be finite and non-negative")
        blocked = self.registry.report(rec, counters, step_time_s)
        self.metrics.blocked.inc(blocked)
        self.goodput.report(rec.learner_id, float(rec.tokens), rec.compute_s)
        if step_time_s > 0:
            self.grace.observe(step_time=step_time_s)

    @_rpc("PushFragment")
    def PushFragment(self, request_iterator: Iterator[pb.PushRequest | wire.RawChunk], context: grpc.ServicerContext) -> pb.PushReply:
        if not self.streams.acquire(blocking=False):
            raise Rejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "too_many_streams",
                f"the Synchronizer is serving {self.cfg.max_concurrent_streams} streams already; retry with backoff",
            )
        try:
            return self._push(request_iterator)
        finally:
            self.streams.release()

    def _push(self, request_iterator: Iterator[pb.PushRequest | wire.RawChunk]) -> pb.PushReply:
        first = next(request_iterator, None)
        if not isinstance(first, pb.PushRequest) or first.WhichOneof("kind") != "header":
            raise _invalid("bad_stream", "PushFragment must start with a PushHeader")
        h = first.header
        rec = self.registry.alive(h.learner_id)
        self._require_initialized()
        self._check_spec_hash(h.spec_hash)
        frag = self._fragment(h.fragment_id)
        if h.seq < 1:
            raise _invalid("bad_seq", "push seq must be >= 1 (number pushes from JoinReply.next_seq)")
        if h.steps < 1 or (self.cfg.token_weight != "uniform" and h.tokens < 1):
            raise _invalid("bad_counters", f"a push must cover at least one step and one token (got steps={h.steps}, tokens={h.tokens})")
        if not (math.isfinite(h.compute_s) and h.compute_s >= 0):
            raise _invalid("bad_counters", "compute_s must be finite and non-negative")
        if h.base_version > frag.version:
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                "future_version",
                f"base version {h.base_version} of fragment {frag.fid} is ahead of the server's {frag.version} "
                f"(the Synchronizer restarted from an older checkpoint?); re-pull the fragment",
            )
        seen = self.registry.seen_reply(rec, h.seq)
        if seen is not None:
            for _ in request_iterator:  # drain: the client may still be streaming the repeat
                pass
            return self._duplicate(seen)
        self._validate_payload(h.payload, frag.numel, PUSH_CODECS)
        nbytes = int(h.payload.total_bytes)
        received = frag.take_buffer(nbytes)
        reserved = kept = False
        try:
            asm = framing.Assembler(h.payload, buffer=received)
            for msg in request_iterator:
                if msg.WhichOneof("kind") != "chunk":
                    raise _invalid("bad_stream", "only chunks may follow the PushHeader")
                self._add_chunk(asm, msg.chunk)
            if not asm.complete:
                raise _invalid("incomplete", f"stream ended after {asm.received} of {asm.total_bytes} bytes; nothing was applied")
            # Validated now, decoded by the outer step: the reply need not wait for the decode.
            # Past the memory budget for held payloads it is decoded here instead.
            header = pb.PayloadHeader()
            header.CopyFrom(h.payload)
            self._check_values(asm, header)
            reserved = frag.reserve(nbytes)
            self.metrics.bytes_in.labels(codec.codec_name(h.payload.codec)).inc(asm.total_bytes)
            with rec.push_lock:  # judging and recording a seq is atomic per learner
                seen = self.registry.seen_reply(rec, h.seq)  # a concurrent retry may have won the race
                if seen is not None:
                    return self._duplicate(seen)
                verdict, rnd = frag.submit(rec.learner_id, h.base_version, h.tokens, h.steps, h.compute_s, (received, header), hold=reserved)
                kept = reserved and verdict.outcome == pb.PUSH_ACCEPTED  # the round owns it now
                reply = pb.PushReply(
                    outcome=verdict.outcome,
                    round_version=verdict.round_version,
                    current_version=verdict.current_version,
                    staleness=verdict.staleness,
                    weight=verdict.weight,
                    message="" if verdict.outcome == pb.PUSH_ACCEPTED else f"staleness {verdict.staleness} > max_staleness {self.cfg.max_staleness}: re-pull fragment {frag.fid}",
                )
                self.registry.record_reply(rec, h.seq, reply)
        finally:
            if not kept:
                frag.give_buffer(received)
                if reserved:
                    frag.release(nbytes)
        self.metrics.pushes.labels(OUTCOME_LABEL[reply.outcome]).inc()
        if rnd is not None and self.rounds is not None:
            self.rounds.check(frag)
        return reply

    def _duplicate(self, seen: pb.PushReply) -> pb.PushReply:
        reply = pb.PushReply()
        reply.CopyFrom(seen)
        if reply.outcome == pb.PUSH_ACCEPTED:
            reply.outcome = pb.PUSH_DUPLICATE
            reply.message = "this push was already accepted; it was not applied again"
        self.metrics.pushes.labels(OUTCOME_LABEL[reply.outcome]).inc()
        return reply

    def _validate_payload(self, header: pb.PayloadHeader, numel: int, allowed: tuple[int, ...]) -> None:
        try:
            codec.validate_header(header, numel, allowed)
        except codec.CodecError as e:
            raise _invalid("bad_payload_header", str(e)) from None

    def _add_chunk(self, asm: framing.Assembler, chunk: pb.Chunk | wire.RawChunk) -> None:
        if isinstance(chunk, wire.RawChunk):  # bytes as received, not copied into a message
            offset, data, start, size = chunk.offset, chunk.source, chunk.start, chunk.size
        else:  # read the bytes field once: each read copies it (so would ByteSize())
            offset, data, start = chunk.offset, chunk.data, 0
            size = len(data)
        if offset + size > asm.total_bytes:
            raise Rejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "oversized",
                f"chunk at offset {offset} of {size} bytes runs past the payload's {asm.total_bytes} bytes",
            )
        try:
            asm.add_data(offset, data, start, size)
        except codec.CodecError as e:
            raise _invalid("bad_chunk", str(e)) from None

    def _check_values(self, asm: framing.Assembler, header: pb.PayloadHeader) -> None:
        try:
            codec.check(asm.finish(), header)
        except codec.CodecError as e:
            raise _invalid("bad_values", f"payload rejected: {e}") from None

    def _decode(self, asm: framing.Assembler, header: pb.PayloadHeader, out: torch.Tensor) -> torch.Tensor:
        try:
            return codec.decode(asm.finish(), header, out)
        except codec.CodecError as e:
            raise _invalid("bad_values", f"payload rejected: {e}") from None

    @_rpc("PullFragment", streaming_reply=True)
    def PullFragment(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[pb.PullReply]:
        self.registry.alive(request.learner_id)
        frag = self._fragment(request.fragment_id)
        codec_id = request.codec or pb.CODEC_FP32
        if codec_id not in PULL_CODECS:
            raise _invalid("bad_codec", "pulls are served as CODEC_FP32 or CODEC_BF16")
        if not (math.isfinite(request.wait_s) and request.wait_s >= 0):
            raise _invalid("bad_wait", "wait_s must be finite and non-negative")
        if not self.streams.acquire(blocking=False):
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, "too_many_streams", "too many streams; retry with backoff")
        try:
            if request.min_version > frag.version or not frag.initialized:
                frag.wait_for(request.min_version, min(request.wait_s, self.cfg.max_pull_wait_s))
            self._require_initialized()
            chain = frag.chain_since(request.have_version) if request.delta_ok else None
            if chain is None:
                version, header, buf = frag.snapshot(codec_id)
            checksum = frag.checksum()
        finally:
            self.streams.release()
        if chain is not None:
            version, links = chain
            yield pb.PullReply(header=pb.PullHeader(fragment_id=frag.fid, version=version, server_epoch=self.epoch, delta_from=request.have_version, links=len(links), checksum=checksum))
            for v, link_header, link_buf in links:
                yield pb.PullReply(link=pb.DeltaLink(version=v, payload=link_header))
                for chunk in framing.iter_chunks(link_buf):
                    yield pb.PullReply(chunk=chunk)
                self.metrics.bytes_out.labels(codec.codec_name(link_header.codec)).inc(link_header.total_bytes)
            return
        yield pb.PullReply(header=pb.PullHeader(fragment_id=frag.fid, version=version, server_epoch=self.epoch, payload=header, checksum=checksum))
        for chunk in framing.iter_chunks(buf):
            yield pb.PullReply(chunk=chunk)
        self.metrics.bytes_out.labels(codec.codec_name(codec_id)).inc(header.total_bytes)

    @_rpc("Leave")
    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        rec = self.registry.alive(request.learner_id, renew=False)
        self._report(rec, request.counters, 0.0)
        self.registry.leave(request.learner_id)
        self.goodput.died(request.learner_id)
        logger.info("learner %s (%s) left", rec.learner_id, rec.name)
        if self.rounds is not None:
            self.rounds.check_all()
        return pb.LeaveReply()

    @_rpc("Status")
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        with self.registry.lock:
            learners = [
                pb.LearnerStatus(learner_id=r.learner_id, name=r.name, state=r.state, counters=r.counters(), inner_steps=0)
                for r in self.registry.learners.values()
            ]
        return pb.StatusReply(
            server_epoch=self.epoch,
            initialized=self.initialized,
            spec_hash=self.spec.spec_hash if self.spec else "",
            versions=self.versions(),
            learners=learners,
            outer_steps=sum(f.version for f in self.fragments),
        )

    # Housekeeping and durability -------------------------------------------------------------

    def _housekeeping(self) -> None:
        period = min(0.5, self.cfg.lease_s / 4)
        last_checkpoint = time.monotonic()
        while not self.stopping.wait(period):
            try:
                for rec in self.registry.reap():
                    self.goodput.died(rec.learner_id)
                if self.rounds is not None:
                    self.rounds.check_all()
                self.goodput.tick(self.registry.capacity_slots())
                for state, n in self.registry.counts().items():
                    self.metrics.learners.labels(state).set(n)
                interval = self.cfg.checkpoint_interval_s
                if interval > 0 and time.monotonic() - last_checkpoint >= interval:
                    last_checkpoint = time.monotonic()
                    threading.Thread(target=self.save_checkpoint, name="checkpoint", daemon=True).start()
            except Exception:  # housekeeping must outlive a bad tick
                logger.exception("housekeeping tick failed")

    def save_checkpoint(self) -> None:
        """Writes the state atomically (no-op before the model is initialised)."""
        if not self.initialized or self.spec is None:
            return
        t0 = time.perf_counter()
        with self.checkpoint_lock:
            tensors: dict[str, torch.Tensor] = {}
            frag_meta = []
            for frag in self.fragments:
                t, m = frag.state()
                tensors.update(t)
                frag_meta.append(m)
            meta = {
                "format": 1,
                "spec": base64.b64encode(self.spec.to_proto().SerializeToString()).decode(),
                "fragments": frag_meta,
                "learners": self.registry.snapshot(),
            }
            path = checkpoint.save(self.cfg.state_dir, tensors, meta, self.cfg.keep_checkpoints)
        self.metrics.checkpoints.inc()
        self.metrics.checkpoint_seconds.observe(time.perf_counter() - t0)
        logger.info("checkpoint %s written (versions %s)", path.name, [f.version for f in self.fragments])

    def _restore(self) -> None:
        found = checkpoint.load_latest(self.cfg.state_dir)
        if found is None:
            return
        tensors, meta, path = found
        spec_msg = pb.ModelSpec()
        spec_msg.ParseFromString(base64.b64decode(meta["spec"]))
        self._set_spec(ModelSpec.from_proto(spec_msg))
        for frag, fmeta in zip(self.fragments, meta["fragments"], strict=True):
            frag.restore(tensors, fmeta)
        self.initialized = True
        self.registry.restore(meta.get("learners", []))
        logger.info("restored %s: versions %s", path, [f.version for f in self.fragments])

    def close(self) -> None:
        """Stops housekeeping, merges every acknowledged contribution, writes a final checkpoint."""
        self.stopping.set()
        self.housekeeper.join(timeout=5)
        if self.rounds is not None:
            self.rounds.flush()
            self.rounds.shutdown()
        self.save_checkpoint()


def open_round_shares(service: SynchronizerService) -> list[Share]:
    """Shares held in open rounds (for tests and shutdown accounting)."""
    return [c.share for f in service.fragments if f.round is not None for c in f.round.contributions]
