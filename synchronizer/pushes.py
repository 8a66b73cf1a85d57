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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from protos import diloco_pb2 as pb
from protos import layout
from synchronizer import receive, wire
from synchronizer.config import SynchronizerConfig
from synchronizer.errors import Rejected, invalid
from synchronizer.fragments import Fragment
from synchronizer.journal import Journal
from synchronizer.leases import LearnerRecord, Registry, check_credential
from synchronizer.metrics import Metrics
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

    def push(self, messages: PushMessages, call: Call | None = None) -> pb.PushReply:
        """Receives, validates and judges one push; the reply says what became of it."""
        with contextlib.ExitStack() as held:
            reply, frag = self._push(iter(messages), call or Call(), held)
        self.metrics.pushes.labels(OUTCOME_LABEL[reply.outcome]).inc()
        if frag is not None and self.model.rounds is not None:
            self.model.rounds.check(frag)
        return reply

    def _push(
        self,
        stream_messages: Iterator[pb.PushRequest | wire.RawChunk],
        call: Call,
        held: contextlib.ExitStack,
    ) -> tuple[pb.PushReply, Fragment | None]:
        # The server holds a call in `Streams.first_messages` until its header is here: the
        # stream takes a slot only once the header names a learner whose session is valid.
        first = next(stream_messages, None)
        if not isinstance(first, pb.PushRequest) or first.WhichOneof("kind") != "header":
            raise invalid("bad_stream", "PushFragment must start with a PushHeader")
        h = first.header
        rec = self.registry.alive(h.learner_id, h.session)
        check_credential(rec, call.credential)
        self.journal.refuse_if_failing()
        held.enter_context(
            self.streams.claimed(rec.learner_id, self.streams.counted(rec.credential))
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
            return self._duplicate(rec, h.seq, seen), None
        receive.validate_payload(h.payload, frag.numel, PUSH_CODECS)
        nbytes = int(h.payload.total_bytes)
        # Its bytes count against the payload budget from before they arrive: a push that does
        # not fit is refused before it is received (see `Fragment.reserve_hold`).
        reserved = frag.reserve_hold(nbytes, self.registry.live_ids, PAYLOAD_WAIT_S)
        kept = False
        received: torch.Tensor | None = None
        try:
            received = frag.payloads.take(nbytes)
            # Validated now, decoded by the outer step: the reply need not wait for the decode.
            header = receive.payload(messages, h.payload, received)
            self.metrics.bytes_in.labels(layout.codec_name(h.payload.codec)).inc(nbytes)
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
                    journal=self.journal.push_journal(frag, h, received, rec.name, reserved),
                    order=(rec.name, rec.learner_id, h.seq),
                    owner=self.streams.counted(rec.credential) or "",
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

    def _duplicate(self, rec: LearnerRecord, seq: int, seen: pb.PushReply) -> pb.PushReply:
        """The reply to a repeated seq, once what it repeats is durable."""
        self.journal.wait(self.registry.ticket_of(rec, seq))
        reply = pb.PushReply()
        reply.CopyFrom(seen)
        if reply.outcome == pb.PUSH_ACCEPTED:
            reply.outcome = pb.PUSH_DUPLICATE
            reply.message = "this push was already accepted; it was not applied again"
        return reply
