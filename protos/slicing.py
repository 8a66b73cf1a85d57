"""A slice's share of an encoded outer update: how a rank of a sharded island pulls a delta.

A delta pull sends the fragment's kept outer updates (delta links), each encoded whole. A rank
that holds only some runs of the fragment (`pb.Slice`) needs only the blocks that hold them:
`covering` widens each run to whole blocks (a blockwise codec's block is its unit: its codes and
its one scale), `cut` takes those blocks' codes and scales out of the encoded update without
decoding it (the result is itself a valid payload of the covered elements, concatenated), and
`add_runs` adds the decoded runs to the rank's slice. A decoded element is the same value
wherever its block is decoded, so a rank that adds the cut links holds its runs of the served
parameters bit for bit, as a learner that adds the whole links holds all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protos import diloco_pb2 as pb
from protos import layout

Runs = Sequence[tuple[int, int]]  # (start, length) in a fragment's flat vector
Ranges = list[tuple[int, int]]  # (start, stop) elements of an encoded update


def cuttable(header: pb.PayloadHeader) -> bool:
    """Whether blocks can be cut out of this payload on byte boundaries (4-bit codes pack two
    elements a byte: their blocks must hold an even number)."""
    if header.codec not in layout.BLOCKWISE:
        return True
    return header.block_size > 0 and (header.codec == pb.CODEC_INT8 or header.block_size % 2 == 0)


def covering(runs: Runs, header: pb.PayloadHeader) -> Ranges:
    """The elements of the update `header` describes that hold `runs`, ascending and disjoint:
    each run widened to whole blocks for a blockwise codec (the update's last block may be
    partial), itself otherwise, and ranges that then touch or overlap joined into one."""
    out: Ranges = []
    for start, length in runs:
        stop = start + length
        if header.codec in layout.BLOCKWISE:
            bs = header.block_size
            start, stop = start // bs * bs, min(-(-stop // bs) * bs, header.numel)
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def cut(
    buf: torch.Tensor, header: pb.PayloadHeader, ranges: Ranges
) -> tuple[pb.PayloadHeader, torch.Tensor]:
    """The payload of the elements in `ranges` (from `covering`), concatenated, cut out of
    `buf` (uint8, the whole update `header` describes): the ranges' codes, then their scales."""
    codec, n = int(header.codec), int(header.numel)
    total = sum(stop - start for start, stop in ranges)
    if codec in layout.BLOCKWISE:
        bs = int(header.block_size)
        sub = layout.make_header(codec, total, bs, int(header.scale_dtype))
        width = layout.SCALE_BYTES[int(header.scale_dtype)]
        scales = layout.code_bytes(codec, n)
        parts = [buf[layout.code_bytes(codec, a) : layout.code_bytes(codec, b)] for a, b in ranges]
        parts += [buf[scales + a // bs * width : scales + -(-b // bs) * width] for a, b in ranges]
    else:
        sub = layout.make_header(codec, total)
        per = layout.code_bytes(codec, 1)
        parts = [buf[a * per : b * per] for a, b in ranges]
    out = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    if out.numel() != sub.total_bytes:
        raise layout.CodecError(
            f"cut {out.numel()} bytes for {total} elements, where the codec takes {sub.total_bytes}"
        )
    return sub, out


def add_runs(target: torch.Tensor, decoded: torch.Tensor, runs: Runs, ranges: Ranges) -> None:
    """Adds to `target` (the runs, concatenated) each run's values out of `decoded` (the
    covering ranges, concatenated)."""
    pos = at = i = 0
    for start, length in runs:
        while ranges[i][1] < start + length:  # the range that holds this run
            at += ranges[i][1] - ranges[i][0]
            i += 1
        off = at + start - ranges[i][0]
        target[pos : pos + length].add_(decoded[off : off + length])
        pos += length
