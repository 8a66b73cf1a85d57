"""Receiving payloads from the wire: every check a push or an initial model passes first.

A push header's counters and versions, a payload header against the fragment it claims, chunk
order and total size, and the values themselves (`codec.check`: right size, finite scales,
no NaN/Inf) are validated here before anything touches state. Each failure raises `Rejected`
with the precise code and a message a person can act on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch

from protos import blockwise, codec, framing, layout
from protos import diloco_pb2 as pb
from synchronizer import native, wire
from synchronizer.errors import Code, Rejected, invalid


def check_push_header(h: pb.PushHeader, version: int, needs_tokens: bool) -> None:
    """Sequence number, counters and base version of a push to a fragment at `version`."""
    if h.seq < 1:
        raise invalid("bad_seq", "push seq must be >= 1 (number pushes from JoinReply.next_seq)")
    if h.steps < 1 or (needs_tokens and h.tokens < 1):
        raise invalid(
            "bad_counters",
            f"a push must cover at least one step and one token (got steps={h.steps}, tokens={h.tokens})",
        )
    if not (math.isfinite(h.compute_s) and h.compute_s >= 0):
        raise invalid("bad_counters", "compute_s must be finite and non-negative")
    if h.base_version > version:
        raise Rejected(
            Code.FAILED_PRECONDITION,
            "future_version",
            f"base version {h.base_version} of fragment {h.fragment_id} is ahead of the server's {version} "
            f"(the Synchronizer restarted from an older checkpoint?); re-pull the fragment",
        )


def validate_payload(header: pb.PayloadHeader, numel: int, allowed: tuple[int, ...]) -> None:
    try:
        layout.validate_header(header, numel, allowed)
    except layout.CodecError as e:
        raise invalid("bad_payload_header", str(e)) from None


def add_chunk(asm: framing.Assembler, chunk: pb.Chunk | wire.RawChunk) -> None:
    if isinstance(chunk, wire.RawChunk):  # bytes as received, not copied into a message
        offset, data, start, size = chunk.offset, chunk.source, chunk.start, chunk.size
    else:  # read the bytes field once: each read copies it (so would ByteSize())
        offset, data, start = chunk.offset, chunk.data, 0
        size = len(data)
    if offset + size > asm.total_bytes:
        raise Rejected(
            Code.RESOURCE_EXHAUSTED,
            "oversized",
            f"chunk at offset {offset} of {size} bytes runs past the payload's {asm.total_bytes} bytes",
        )
    try:
        asm.add_data(offset, data, start, size)
    except layout.CodecError as e:
        raise invalid("bad_chunk", str(e)) from None


class Measured(NamedTuple):
    """What the check of a received push measured of its FP32 or BF16 values (`checked`)."""

    largest: float  # the greatest |value|: bounds the push in a merged delta
    norm: float  # the L2 norm: judged by the push bounds


def payload(
    messages: Iterator[Any],
    header: pb.PayloadHeader,
    buffer: torch.Tensor,
    landed: Callable[[int], None] | None = None,
) -> tuple[pb.PayloadHeader, Measured | None]:
    """Receives a push's chunks into `buffer` and checks the values (`checked`); returns a copy
    of the (validated) header that the round may keep, and what the check measured. `landed(end)` is told after each chunk that the buffer holds the payload's first
    `end` bytes (the write-ahead log writes them meanwhile)."""
    asm = framing.Assembler(header, buffer=buffer)
    for msg in messages:
        if msg.WhichOneof("kind") != "chunk":
            raise invalid("bad_stream", "only chunks may follow the PushHeader")
        add_chunk(asm, msg.chunk)
        if landed is not None:
            landed(asm.received)
    if not asm.complete:
        raise invalid(
            "incomplete",
            f"stream ended after {asm.received} of {asm.total_bytes} bytes; nothing was applied",
        )
    kept = pb.PayloadHeader()
    kept.CopyFrom(header)
    try:
        measured = checked(asm.finish(), kept)
    except layout.CodecError as e:
        raise invalid("bad_values", f"payload rejected: {e}") from None
    return kept, measured


def checked(buf: torch.Tensor, header: pb.PayloadHeader) -> Measured | None:
    """`codec.check` of a received payload (CodecError where it fails); for FP32 and BF16
    values, where the native kernels are built, their largest magnitude (finiteness) and L2
    norm in one pass (`native.absmax_and_norm`: for BF16 a third of the time of torch's two
    passes), returned for the push bounds and the outer step (None otherwise: they take them
    themselves). Both are exact, so this does not depend on `--kernels`, as the crc32 does
    not."""
    values = header.codec in (pb.CODEC_FP32, pb.CODEC_BF16) and native.available()
    codec.check(buf, header, scan_values=not values)
    if not values or header.numel == 0:
        return None
    dtype = torch.float32 if header.codec == pb.CODEC_FP32 else torch.bfloat16
    largest, norm = native.absmax_and_norm(blockwise.aligned(buf, dtype))
    if not math.isfinite(largest):
        raise codec.not_finite(header.codec)
    return Measured(largest, norm)


def init_fragments(
    messages: Iterator[pb.InitModelRequest],
    known: Callable[[int], object],
    numels: Mapping[int, int],
    progress: Callable[[], None] = lambda: None,
) -> list[torch.Tensor]:
    """The FP32 parameters of every fragment in `numels` (id -> elements) from an InitModel
    stream, in the order of `numels`, each exactly once, checked finite: the received buffers
    themselves, viewed as FP32 (hand them over, no copy needed). `known(fid)` raises for a
    fragment id that is not to be uploaded here (not in the model, or another shard's);
    `progress()` is called for every message that arrives."""
    got: dict[int, torch.Tensor] = {}
    asm: framing.Assembler | None = None
    header = pb.PayloadHeader()
    fid = -1
    for msg in messages:
        progress()
        kind = msg.WhichOneof("kind")
        if kind == "fragment":
            if asm is not None:
                raise invalid(
                    "bad_stream",
                    f"fragment {fid} ended after {asm.received} of {asm.total_bytes} bytes",
                )
            fid = msg.fragment.fragment_id
            known(fid)
            if fid in got:
                raise invalid("bad_stream", f"fragment {fid} was sent twice")
            header = msg.fragment.payload
            validate_payload(header, numels[fid], (pb.CODEC_FP32,))
            asm = framing.Assembler(header)
        elif kind == "chunk":
            if asm is None:
                raise invalid("bad_stream", "a chunk arrived before its InitFragmentHeader")
            add_chunk(asm, msg.chunk)
        else:
            raise invalid("bad_stream", f"unexpected {kind!r} message inside InitModel")
        if asm is not None and asm.complete:
            try:
                buf = asm.finish()
                codec.check(buf, header)
                # The received bytes themselves (FP32, aligned: no copy); the scratch, whose
                # pages are never touched then, is decoded into only for an unaligned buffer.
                got[fid] = codec.values(buf, header, torch.empty(numels[fid]))
            except layout.CodecError as e:
                raise invalid("bad_values", f"payload rejected: {e}") from None
            asm = None
    if asm is not None:
        raise invalid(
            "bad_stream",
            f"stream ended after {asm.received} of {asm.total_bytes} bytes of fragment {fid}",
        )
    missing = [f for f in numels if f not in got]
    if missing:
        raise invalid("bad_stream", f"InitModel ended without fragments {missing}")
    return [got[f] for f in numels]
