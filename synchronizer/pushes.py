"""The push path: from a PushFragment stream to an acknowledged contribution.

In the order a push meets them: its header (the server holds the call without a slot until it
arrives), the learner's lease and session (`synchronizer.leases`), the log's health
(`synchronizer.journal`), the learner's stream count and a transfer slot
(`synchronizer.streams`), the served model and fragment (`synchronizer.served`), the header and
payload checks (`synchronizer.receive`), the duplicate table (a repeated seq is answered, never
applied twice), room in the payload budget (`Fragment.reserve_hold`), the payload received into
a pooled buffer, the fragment's verdict into its open round (`synchronizer.admission`) with its
write-ahead log record, and the reply once that record is durable. Then `Rounds` looks at the
round (`synchronizer.rounds`). A push is acknowledged once its bytes are received, validated and
logged; the outer step decodes it, so learners never wait for a decode.

A slice of a sharded island's contribution (`PushHeader.slice`) passes the same checks up to
the duplicate table, then is received, decoded and scattered into its contribution's assembly
(`synchronizer.slices`), and waits for the island's other ranks; the slice that completes it
submits the whole contribution as one FP32 push of the learner, judged and logged as any push,
and every slice gets that push's reply.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

from protos import codec, layout
from protos import diloco_pb2 as pb
from synchronizer import receive, slices, wire
from synchronizer.config import SynchronizerConfig
from synchronizer.errors import Code, Rejected, invalid
from synchronizer.fragments import Fragment
from synchronizer.journal import Journal, PushStream
from synchronizer.leases import Registry
from synchronizer.metrics import Metrics
from synchronizer.records import LearnerRecord, check_credential
from synchronizer.served import ServedModel
from synchronizer.streams import Call, Streams

PUSH_CODECS = (pb.CODEC_FP32, pb.CODEC_BF16, pb.CODEC_INT8, pb.CODEC_INT4, pb.CODEC_FP4_E3M0)
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


class PushPath:
    def __init__(
        self,
        cfg: SynchronizerConfig,
        metrics: Metrics,
        model: ServedModel,
        registry: Registry,
        streams: Streams,
        journal: Journal,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.model = model
        self.registry = registry
        self.streams = streams
        self.journal = journal
        self.assemblies = slices.Assemblies()

    def push(self, messages: PushMessages, call: Call | None = None) -> pb.PushReply:
        """Receives, validates and judges one push; the reply says what became of it."""
        with contextlib.ExitStack() as held:
            reply, frag, counted = self._push(iter(messages), call or Call(), held)
        if counted:
            self.metrics.pushes.labels(OUTCOME_LABEL[reply.outcome]).inc()
        if frag is not None and self.model.rounds is not None:
            self.model.rounds.check(frag)
        return reply

    def _push(
        self,
        stream_messages: Iterator[pb.PushRequest | wire.RawChunk],
        call: Call,
        held: contextlib.ExitStack,
    ) -> tuple[pb.PushReply, Fragment | None, bool]:
        """(reply, the fragment whose round to look at or None, whether the reply counts as a
        push: a slice's does only when it submitted its island's contribution)."""
        # The server holds a call in `Streams.first_messages` until its header is here: the
        # stream takes a slot only once the header names a learner whose session is valid.
        first = next(stream_messages, None)
        if not isinstance(first, pb.PushRequest) or first.WhichOneof("kind") != "header":
            raise invalid("bad_stream", "PushFragment must start with a PushHeader")
        h = first.header
        sliced = h.HasField("slice")
        rec = self.registry.alive(h.learner_id, h.session)
        check_credential(rec, call.credential)
        if rec.evaluator:
            raise Rejected(
                Code.FAILED_PRECONDITION,
                "evaluator_push",
                f"learner {rec.learner_id!r} joined as an evaluator, which never pushes; join without evaluator to train",
            )
        self.journal.refuse_if_failing()
        held.enter_context(
            self.streams.claimed(
                slices.stream_key(rec.learner_id, h.slice if sliced else None),
                self.streams.counted(rec.credential),
            )
        )
        stream = held.enter_context(
            self.streams.transfer("push", rec.learner_id, call, lambda: self.registry.renew(rec))
        )
        messages = stream.moving(stream_messages)
        self.model.require_initialized()
        self.model.check_spec_hash(h.spec_hash)
        frag = self.model.fragment(h.fragment_id)
        if frag.model.failure is not None:
            raise self.model.unavailable(frag)
        receive.check_push_header(h, frag.version, self.cfg.token_weight != "uniform")
        self.registry.check_counts(rec, "push counts", h.tokens, h.steps, h.compute_s)
        seen = self.registry.seen_reply(rec, h.seq)
        if seen is not None:
            for _ in messages:  # drain: the client may still be streaming the repeat
                pass
            return self._duplicate(rec, h.seq, seen), None, True
        if sliced:
            return self._slice(h, rec, frag, messages, call, stream.touch)
        receive.validate_payload(h.payload, frag.numel, PUSH_CODECS)
        nbytes = int(h.payload.total_bytes)
        # Its bytes count against the payload budget from before they arrive: a push that does
        # not fit is refused before it is received (see `Fragment.reserve_hold`).
        reserved = frag.reserve_hold(nbytes, self.registry.pushing_ids, PAYLOAD_WAIT_S)
        received: torch.Tensor | None = None
        logged: PushStream | None = None
        try:
            received = frag.payloads.take(nbytes)
            logged = self.journal.stream(received)  # its bytes logged as they land
            # Validated now, decoded by the outer step: the reply need not wait for the decode.
            header, measured = receive.payload(
                messages, h.payload, received, logged.add if logged is not None else None
            )
        except BaseException:
            if reserved:
                frag.payloads.release(nbytes)
            if received is not None:
                self._give(frag, received, logged)
            raise
        self.metrics.bytes_in.labels(layout.codec_name(h.payload.codec)).inc(nbytes)
        reply, judged = self._judge(h, rec, frag, received, header, reserved, logged, measured)
        return reply, judged, True

    @staticmethod
    def _give(frag: Fragment, received: torch.Tensor, logged: PushStream | None) -> None:
        """A push's buffer back to the pool, once nothing of its stream waits to be written
        from it (otherwise it is left to be freed once written)."""
        if logged is None or logged.abandon():
            frag.payloads.give(received)

    def _judge(
        self,
        h: pb.PushHeader,
        rec: LearnerRecord,
        frag: Fragment,
        received: torch.Tensor,
        header: pb.PayloadHeader,
        reserved: bool,
        logged: PushStream | None = None,
        measured: receive.Measured | None = None,
    ) -> tuple[pb.PushReply, Fragment | None]:
        """The fragment's verdict on a received, validated push (`received`, its payload, with
        `reserved` bytes of the payload budget, both owned from here on: kept by its round or
        given back; `measured`, what its check measured), its log record (its payload in
        `logged`'s parts, when given), and the reply once that record is durable."""
        nbytes = received.numel()
        kept = False
        try:
            with rec.push_lock:  # judging and recording a seq is atomic per learner
                # a concurrent retry may have won the race
                seen = self.registry.seen_reply(rec, h.seq)
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
                    journal=self.journal.push_journal(
                        frag, h, received, rec.name, reserved, logged
                    ),
                    order=(rec.name, rec.learner_id, h.seq),
                    owner=self.streams.counted(rec.credential) or "",
                    measured=measured,
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
                self._give(frag, received, logged)
        return reply, frag if rnd is not None else None

    def _slice(
        self,
        h: pb.PushHeader,
        rec: LearnerRecord,
        frag: Fragment,
        messages: Iterator[pb.PushRequest | wire.RawChunk],
        call: Call,
        touch: Callable[[], None],
    ) -> tuple[pb.PushReply, Fragment | None, bool]:
        """One rank's slice of an island's contribution: received, decoded and scattered into
        the contribution's assembly; then its call waits (its stream touched) until the
        contribution is judged or abandoned. The slice that completes it submits it."""
        runs = slices.runs(h.slice, frag.numel)
        n = slices.numel_of(runs)
        receive.validate_payload(h.payload, n, PUSH_CODECS)
        nbytes = int(h.payload.total_bytes)
        part = slices.Part(h.slice.rank, runs, h.tokens, h.steps, h.compute_s)
        if call.on_end(part.call_ended) is False:  # the call already ended
            part.call_ended()
        received = frag.payloads.take(nbytes)
        try:
            header, _ = receive.payload(messages, h.payload, received)
            self.metrics.bytes_in.labels(layout.codec_name(h.payload.codec)).inc(nbytes)
            values = codec.values(received, header, torch.empty(n))
            asm = self._assembly(rec, h, frag)
            complete = asm.add(h, part, values)
        finally:
            if nbytes:
                frag.payloads.give(received)
        if not complete:
            return asm.wait(part, self.cfg.slice_wait_s, touch), None, False
        try:
            whole = self._whole(h, rec, asm)
            self.registry.check_counts(
                rec, "island push counts", whole.tokens, whole.steps, whole.compute_s
            )
        except BaseException as e:
            asm.fail(e)
            raise
        # From here the buffer and its reserved bytes are the push's (`_judge` keeps or frees them)
        try:
            reply, judged = self._judge(whole, rec, frag, asm.buf, whole.payload, asm.reserved)
        except Rejected as e:
            asm.finish(None, e)
            raise
        except BaseException as e:
            asm.abandon(e)
            raise
        asm.finish(reply)
        return reply, judged, True

    def _assembly(self, rec: LearnerRecord, h: pb.PushHeader, frag: Fragment) -> slices.Assembly:
        """The pending assembly of (learner, seq), or a new one: an FP32 buffer of the whole
        fragment with its bytes reserved in the payload budget, as one FP32 push's."""
        key = (rec.learner_id, h.seq)
        asm = self.assemblies.find(key)
        if asm is not None:
            return asm
        nbytes = 4 * frag.numel
        reserved = frag.reserve_hold(nbytes, self.registry.pushing_ids, PAYLOAD_WAIT_S)
        buf = frag.payloads.take(nbytes)

        def discard() -> None:
            if reserved:
                frag.payloads.release(nbytes)
            frag.payloads.give(buf)

        mine = slices.Assembly(
            key,
            h,
            frag.numel,
            buf,
            reserved,
            discard,
            self.assemblies.forget,
            lambda outcome: self.metrics.island_contributions.labels(outcome).inc(),
        )
        asm = self.assemblies.open(mine)
        if asm is not mine:  # another rank's slice opened it meanwhile
            discard()
        return asm

    @staticmethod
    def _whole(h: pb.PushHeader, rec: LearnerRecord, asm: slices.Assembly) -> pb.PushHeader:
        """The header of a complete island contribution as one push: its tokens summed over the
        ranks, its steps and compute seconds the most any rank took (the ranks compute side by
        side: the island's compute is wall time, as its heartbeat reports it), an FP32 payload."""
        parts = list(asm.parts.values())
        return pb.PushHeader(
            learner_id=rec.learner_id,
            seq=h.seq,
            spec_hash=h.spec_hash,
            fragment_id=asm.fid,
            base_version=asm.base_version,
            tokens=sum(p.tokens for p in parts),
            steps=max(p.steps for p in parts),
            compute_s=max(p.compute_s for p in parts),
            payload=layout.make_header(pb.CODEC_FP32, asm.numel),
        )

    def _duplicate(self, rec: LearnerRecord, seq: int, seen: pb.PushReply) -> pb.PushReply:
        """The reply to a repeated seq, once what it repeats is durable."""
        self.journal.wait(self.registry.ticket_of(rec, seq))
        reply = pb.PushReply()
        reply.CopyFrom(seen)
        if reply.outcome == pb.PUSH_ACCEPTED:
            reply.outcome = pb.PUSH_DUPLICATE
            reply.message = "this push was already accepted; it was not applied again"
        return reply
