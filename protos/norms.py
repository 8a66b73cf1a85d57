"""The L2 norm of a received payload, read from its bytes without a decoded copy.

``l2_norm`` is exact (FP32/BF16 squared run by run; blockwise codecs by each block's norm of its
codes times its scale); ``norm_estimate`` gives an upper bound from the scales alone and an
estimate from a sample of blocks, at a small fraction of a decode's cost. The Synchronizer's
push bounds judge pushes by them. Both take a payload that passed ``protos.codec.check``.
"""

from __future__ import annotations

import functools
import math

import torch

from protos import blockwise, layout
from protos import diloco_pb2 as pb


@torch.no_grad()
def l2_norm(buf: torch.Tensor, header: pb.PayloadHeader) -> float:
    """The L2 norm of ``decode(buf, header)`` for a payload that passed ``check``, without a
    decoded copy: the payload is read in runs (about 1M elements), BF16 through one run-sized
    FP32 buffer. FP32/BF16 values are squared and summed in float32 (a run whose sum overflows,
    which needs values beyond about 1e19, again in float64); quantized payloads take each
    block's norm of its codes and weight it by the block's scale in float64. The result is finite
    for any payload ``check`` accepts.
    """
    codec, n = header.codec, int(header.numel)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != header.total_bytes:
        raise layout.CodecError(
            f"payload buffer must be 1-D uint8 of {header.total_bytes} bytes, got {buf.dtype} "
            f"of shape {tuple(buf.shape)}"
        )
    if n == 0:
        return 0.0
    if codec in (pb.CODEC_FP32, pb.CODEC_BF16):
        raw = blockwise.aligned(
            buf.contiguous(), torch.float32 if codec == pb.CODEC_FP32 else torch.bfloat16
        )
        work = (
            torch.empty(min(n, blockwise.RUN_ELEMS), dtype=torch.float32, device=buf.device)
            if codec == pb.CODEC_BF16
            else None
        )
        squares = 0.0
        for start in range(0, n, blockwise.RUN_ELEMS):
            chunk = raw[start : start + blockwise.RUN_ELEMS]
            if work is not None:
                chunk = work[: chunk.numel()].copy_(chunk)
            chunk_squares = float(torch.dot(chunk, chunk))
            if math.isinf(chunk_squares):
                chunk_squares = float(torch.linalg.vector_norm(chunk, dtype=torch.float64)) ** 2
            squares += chunk_squares
        return math.sqrt(squares)
    # Blockwise: the norm of each block's codes (decoded with unit scales: at most
    # 128 * sqrt(block_size), so float32 never overflows), times its scale.
    bs = int(header.block_size)
    scales = blockwise.checked_scales(buf, codec, n, header.scale_dtype).double()
    per_byte = 1 if codec == pb.CODEC_INT8 else 2
    full = (n // bs) * bs
    run = max(1, blockwise.RUN_ELEMS // bs) * bs
    unit = torch.ones(max(1, min(run, full) // bs), dtype=torch.float32, device=buf.device)
    work = torch.empty(min(run, full), dtype=torch.float32, device=buf.device)
    idx = torch.empty(min(run, full) // per_byte, dtype=torch.int32, device=buf.device)
    block_norms = torch.empty(scales.numel(), dtype=torch.float32, device=buf.device)
    for start in range(0, full, run):
        stop = min(start + run, full)
        codes = work[: stop - start].view(-1, bs)
        blockwise.decode_run(
            buf[start // per_byte : stop // per_byte], codec, unit[: len(codes)], codes, idx
        )
        torch.linalg.vector_norm(codes, dim=1, out=block_norms[start // bs : stop // bs])
    if full < n:
        block_norms[-1] = torch.linalg.vector_norm(
            blockwise.decode_tail(buf, codec, bs, n, unit[:1])
        )
    return math.sqrt(float((block_norms.double() * scales).square().sum()))


def norm_estimate(
    buf: torch.Tensor, header: pb.PayloadHeader, sample_blocks: int = 256
) -> tuple[float, float]:
    """(estimate, upper bound) of the L2 norm of ``decode(buf, header)`` for a payload that
    passed ``check``, at a small fraction of a decode's cost. FP32/BF16: the exact norm, twice.
    Blockwise codecs: the upper bound comes from the scales alone (every value is at most its
    block's scale times the largest code), so no choice of codes exceeds it; the estimate is
    the exact norm of ``sample_blocks`` evenly spaced whole blocks (at a random offset), scaled
    to the whole. ``l2_norm`` gives the exact value where the bound is not enough.
    """
    codec, n = header.codec, int(header.numel)
    if codec in (pb.CODEC_FP32, pb.CODEC_BF16) or n == 0:
        exact = l2_norm(buf, header)
        return exact, exact
    bs = int(header.block_size)
    # checked already (`check`): read, not checked again
    squares = blockwise.scales_of(buf, codec, n, header.scale_dtype).double().square_()
    whole = n // bs
    tail = n - whole * bs
    # sum over blocks of (elements in the block) x scale^2: every block whole but the last
    total = bs * float(squares[:whole].sum()) + (tail * float(squares[whole]) if tail else 0.0)
    upper = blockwise.LARGEST_CODE[codec] * math.sqrt(total)
    if whole == 0:
        return l2_norm(buf, header), upper
    k = min(whole, sample_blocks)
    step = whole / k
    offset = float(torch.rand(()))
    idx = ((torch.arange(k, dtype=torch.float64) + offset) * step).long().clamp(max=whole - 1)
    per_byte = 1 if codec == pb.CODEC_INT8 else 2
    blocks = buf[: whole * bs // per_byte].view(whole, bs // per_byte).index_select(0, idx)
    if codec == pb.CODEC_INT8:
        code_squares = blocks.view(torch.int8).float().square().sum(1)
    else:  # each byte's two values' squares, summed, from a 256-entry table
        table = _byte_squares(codec, buf.device)
        code_squares = table.index_select(0, blocks.reshape(-1).int()).view(k, -1).sum(1)
    sampled = float((code_squares.double() * squares[idx]).sum())
    reached = bs * float(squares[idx].sum())
    # Scaled by the sampled blocks' share of the scale mass, so blocks of larger scale
    # (tensors of larger values) weigh as they do in the whole.
    estimate = math.sqrt(sampled * total / reached) if reached > 0 else 0.0
    return min(estimate, upper), upper


@functools.lru_cache(maxsize=8)
def _byte_squares(codec: int, device: torch.device) -> torch.Tensor:
    """256 FP32: for each byte of 4-bit `codec` codes, the sum of its two values' squares."""
    return blockwise.pair_table(codec, device).square().sum(1)
