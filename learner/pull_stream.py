"""Reading a PullFragment stream after its header, into FP32 parameters: the whole fragment
(`whole`: its chunks assembled, decoded, checked against the server's crc32 where it sent one),
or the outer updates since a version the learner holds exactly (`delta`: each link's chunks
assembled, decoded and added in version order; for a sharded island's rank only the blocks
holding its runs, added to them). Any gap, message out of place or checksum mismatch raises
`layout.CodecError`, which `SyncClient.pull` answers with a full pull.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from protos import codec, framing, layout, slicing
from protos import diloco_pb2 as pb

Received = Callable[[pb.PullReply], None]  # told every message after the header (its bytes)


def whole(
    fragment_id: int,
    h: pb.PullHeader,
    messages: Iterator[pb.PullReply],
    n: int | None,
    out: torch.Tensor | None,
    received: Received,
) -> torch.Tensor:
    """The whole fragment of header `h` (`n` elements expected, or the header's), into `out`
    or a new tensor."""
    n = h.payload.numel if n is None else n
    layout.validate_header(h.payload, n, layout.PULL_CODECS)
    assembled = framing.Assembler(h.payload)
    for msg in messages:
        received(msg)
        if (kind := msg.WhichOneof("kind")) != "chunk":
            raise layout.CodecError(f"unexpected {kind!r} in the pull of fragment {fragment_id}")
        assembled.add(msg.chunk)
    target = out if out is not None else torch.empty(n, dtype=torch.float32)
    codec.decode(assembled.finish(), h.payload, target)
    if h.checksum and h.payload.codec == pb.CODEC_FP32 and framing.checksum(target) != h.checksum:
        raise layout.CodecError(f"fragment {fragment_id} version {h.version}: checksum mismatch")
    return target


def delta(
    fragment_id: int,
    h: pb.PullHeader,
    messages: Iterator[pb.PullReply],
    base: torch.Tensor,
    out: torch.Tensor | None,
    runs: Sequence[tuple[int, int]] | None,
    update_numel: int,
    received: Received,
) -> torch.Tensor:
    """`base` (the exact parameters of version `h.delta_from`) plus the updates after it, each
    turning version - 1 into version, into `out` or a new tensor. `runs`: a sharded island
    rank's runs of the fragment (whose whole updates have `update_numel` elements), or None."""
    if out is not None and out.numel() != base.numel():
        raise layout.CodecError(
            f"fragment {fragment_id}: held {base.numel()} elements, {out.numel()} expected"
        )
    target = out if out is not None else torch.empty(base.numel(), dtype=torch.float32)
    target.copy_(base)
    scratch = torch.empty_like(target)
    ranges: slicing.Ranges = []
    expected = h.delta_from + 1
    link: pb.DeltaLink | None = None
    asm: framing.Assembler | None = None
    for msg in messages:
        received(msg)
        kind = msg.WhichOneof("kind")
        if kind == "link" and asm is None:
            link = msg.link
            if link.version != expected:
                raise layout.CodecError(
                    f"fragment {fragment_id}: update {link.version} arrived, {expected} expected"
                )
            if runs is None:
                layout.validate_header(link.payload, target.numel())
            else:  # the blocks of the whole update that hold this rank's runs
                if not slicing.cuttable(link.payload):
                    raise layout.CodecError(
                        f"fragment {fragment_id}: an update whose blocks cannot be cut"
                    )
                update = pb.PayloadHeader(
                    codec=link.payload.codec, numel=update_numel, block_size=link.payload.block_size
                )
                ranges = slicing.covering(runs, update)
                layout.validate_header(link.payload, sum(b - a for a, b in ranges))
                if scratch.numel() < link.payload.numel:
                    scratch = torch.empty(int(link.payload.numel))
            asm = framing.Assembler(link.payload)
        elif kind == "chunk" and asm is not None:
            asm.add(msg.chunk)
        else:
            raise layout.CodecError(
                f"unexpected {kind!r} in the delta pull of fragment {fragment_id}"
            )
        if asm is not None and link is not None and asm.complete:
            if runs is None:
                target.add_(codec.decode(asm.finish(), link.payload, scratch))
            else:
                part = scratch[: link.payload.numel]
                codec.decode(asm.finish(), link.payload, part)
                slicing.add_runs(target, part, runs, ranges)
            expected, asm = expected + 1, None
    if asm is not None or expected - 1 != h.version or expected - 1 - h.delta_from != h.links:
        raise layout.CodecError(
            f"fragment {fragment_id}: the delta to version {h.version} is incomplete"
        )
    if h.checksum and framing.checksum(target) != h.checksum:
        raise layout.CodecError(
            f"fragment {fragment_id} version {h.version}: checksum mismatch after the delta"
        )
    return target
