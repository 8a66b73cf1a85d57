"""The blockwise absmax quantizers of the wire: INT8, INT4 and FP4_E3M0 codes with one scale per block.

Owns the code section and the scales of a blockwise payload (its layout and error bounds are
documented in ``protos.codec``, which dispatches to this module): ``encode`` and ``decode`` of
whole payloads, walking them in runs of whole blocks (``RUN_ELEMS``, about 1M elements) through
small reused buffers; ``checked_scales``, which every reader of a received payload goes
through; ``decode_run`` and ``decode_tail`` for the whole blocks and the partial last one; the
word-wise INT4 unpacking and the 4-bit lookup tables. Also the two byte-view helpers every
codec uses (``aligned``, ``all_finite``). Every failure raises ``layout.CodecError``.
"""

from __future__ import annotations

import functools
import math

import torch

from protos import diloco_pb2 as pb
from protos import layout

_QMAX: dict[int, int] = {pb.CODEC_INT8: 127, pb.CODEC_INT4: 7}  # FP4's scale is absmax itself
# Largest |code| the encoder writes; decode requires scale * MAX_CODE to be finite.
MAX_CODE: dict[int, float] = {pb.CODEC_INT8: 127.0, pb.CODEC_INT4: 7.0, pb.CODEC_FP4_E3M0: 1.0}
# Largest |code| a checked payload may hold and decode: INT8's -128 is never written but decodes.
LARGEST_CODE: dict[int, float] = {**MAX_CODE, pb.CODEC_INT8: 128.0}
RUN_ELEMS = 1 << 20  # elements per run of whole blocks in encode/decode
_FP4_FLUSH = 2.0**-7  # |x| / scale below this encodes as zero


def aligned(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``buf`` reinterpreted as ``dtype``, copied first if its start is not aligned."""
    size = torch.empty((), dtype=dtype).element_size()
    if buf.storage_offset() % size or buf.data_ptr() % size:
        buf = buf.clone()
    return buf.view(dtype)


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in ``t``."""
    if t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous():
        # A finite sum of squares proves every value finite (NaN and Inf propagate into it):
        # one vectorised pass, a third of aminmax's time here. Values beyond about 1e19
        # overflow it, and then aminmax decides.
        flat = t.reshape(-1)
        if math.isfinite(float(torch.dot(flat, flat))):
            return True
    # aminmax is one pass with no temporaries and propagates NaN; Inf shows in min or max.
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def encode(x: torch.Tensor, codec: int, bs: int, scale_dtype: int, out: torch.Tensor) -> None:
    """Codes, then scales, of the 1-D ``x`` into ``out`` (uint8, ``layout.encoded_nbytes``)."""
    n, dev = x.numel(), x.device
    nblocks = -(-n // bs)
    full = (n // bs) * bs  # elements in whole blocks; the rest is one partial block
    code_bytes = layout.code_bytes(codec, n)
    codes_per_byte = 1 if codec == pb.CODEC_INT8 else 2
    absmax = torch.empty(nblocks, dtype=torch.float32, device=dev)
    scales = torch.empty(nblocks, dtype=torch.float32, device=dev)
    run = max(1, RUN_ELEMS // bs) * bs
    work = Work(min(run, full) or bs, dev)
    for start in range(0, full, run):
        stop = min(start + run, full)
        v = x[start:stop]
        if v.dtype != torch.float32:
            v = work.convert[: stop - start].copy_(v)
        b0, b1 = start // bs, stop // bs
        encode_run(
            v.view(-1, bs),
            codec,
            scale_dtype,
            absmax[b0:b1],
            scales[b0:b1],
            out[start // codes_per_byte : stop // codes_per_byte],
            work,
        )
    if full < n:  # the partial last block, zero-padded (padding does not change its absmax)
        tail = torch.zeros(bs, dtype=torch.float32, device=dev)
        tail[: n - full] = x[full:]
        tail_codes = torch.empty(bs // codes_per_byte, dtype=torch.uint8, device=dev)
        encode_run(
            tail.view(1, bs),
            codec,
            scale_dtype,
            absmax[-1:],
            scales[-1:],
            tail_codes,
            Work(bs, dev),
        )
        out[full // codes_per_byte : code_bytes] = tail_codes[: code_bytes - full // codes_per_byte]
    # One check (one device sync) for the whole tensor: NaN propagates through amax.
    if not bool(torch.isfinite(absmax).all()):
        raise layout.CodecError("cannot encode a tensor containing NaN or Inf")
    if scale_dtype == pb.SCALE_FP16:
        if not bool(torch.isfinite(scales).all()):
            raise layout.CodecError(
                f"a block's absmax ({float(absmax.max()):.6g}) is beyond what an fp16 scale "
                f"holds for {layout.codec_name(codec)} (max scale 65504); use fp32 scales"
            )
        out[code_bytes:].copy_(scales.to(torch.float16).view(torch.uint8))
    else:
        out[code_bytes:].copy_(scales.view(torch.uint8))


class Work:
    """Scratch buffers for the runs of one encode call, reused from run to run."""

    def __init__(self, elems: int, device: torch.device) -> None:
        self.elems, self.device = elems, device
        self.f32 = torch.empty(elems, dtype=torch.float32, device=device)

    # The others are made on first use: not every codec needs them.
    @functools.cached_property
    def i32(self) -> torch.Tensor:
        return torch.empty(self.elems, dtype=torch.int32, device=self.device)

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        return torch.empty(self.elems, dtype=torch.bool, device=self.device)

    @functools.cached_property
    def convert(self) -> torch.Tensor:  # fp32 copy of a non-fp32 input run
        return torch.empty(self.elems, dtype=torch.float32, device=self.device)


def encode_run(
    v: torch.Tensor,
    codec: int,
    scale_dtype: int,
    absmax: torch.Tensor,
    scales: torch.Tensor,
    codes: torch.Tensor,
    work: Work,
) -> None:
    """Encode ``v`` (nb, bs) fp32 into ``codes`` (uint8) and fill ``absmax``/``scales`` (nb)."""
    nb, bs = v.shape
    w = work.f32[: nb * bs].view(nb, bs)
    torch.abs(v, out=w)
    torch.amax(w, dim=1, out=absmax)
    qmax = _QMAX.get(codec)
    if qmax is None:
        scales.copy_(absmax)
    else:
        # Divided by a tensor on v's device, not by a Python number: CUDA computes a division by
        # a CPU scalar as a multiplication by its reciprocal, a bit off the CPU's quotient for
        # some blocks, and GPU and CPU encodes must agree bit for bit.
        torch.div(absmax, torch.full((1,), float(qmax), device=absmax.device), out=scales)
    if scale_dtype == pb.SCALE_FP16:
        scales.copy_(scales.to(torch.float16))  # quantise with the scale decode will see
    # A zero scale (all-zero block, or absmax below the scale format's range) must not divide:
    # dividing by 1 instead leaves values so small that they round to code 0.
    divisor = torch.where(scales > 0, scales, 1.0).unsqueeze(1)
    # With FP32 scales |v| / (absmax / qmax) exceeds qmax by at most rounding, so round() stays
    # in range; a rounded-down FP16 scale can push it past, hence the clamp there only.
    clamp = scale_dtype == pb.SCALE_FP16
    if codec == pb.CODEC_INT8:
        torch.div(v, divisor, out=w).round_()
        if clamp:
            w.clamp_(-127, 127)
        codes.view(torch.int8).copy_(w.view(-1))
    elif codec == pb.CODEC_INT4:
        torch.div(v, divisor, out=w).round_()
        if clamp:
            w.clamp_(-7, 7)
        pairs = w.view(-1, 2)
        packed = work.i32[: nb * bs // 2].view(torch.float32)
        torch.add(pairs[:, 0], pairs[:, 1], alpha=16, out=packed)  # lo + 16 * hi
        codes.copy_(packed.add_(136))  # (lo + 8) + 16 * (hi + 8)
    else:  # FP4_E3M0: w holds |x|, so w / scale is r in [0, 1] (a little above with fp16 scales)
        w.div_(divisor)
        flushed = torch.lt(w, _FP4_FLUSH, out=work.mask[: nb * bs].view(nb, bs))
        # Round r to the nearest power of two on its float32 bits: adding half the mantissa range
        # carries into the exponent exactly when the mantissa is >= 1.5. Biased exponent - 120 is
        # the code's exponent field (2**(e-7)); r in [2**-7, 1.5 * 2**-7) lands on 0 (it belongs
        # to 2**-6) and r >= 1.5 (possible only with a rounded fp16 scale) on 8, hence the clamp
        # to 1..7 before flushing r < 2**-7 to zero.
        e = w.view(torch.int32)
        e.add_(1 << 22).bitwise_right_shift_(23).sub_(120).clamp_(1, 7).masked_fill_(flushed, 0)
        sign = torch.bitwise_right_shift(
            v.view(torch.int32), 28, out=work.i32[: nb * bs].view(nb, bs)
        )
        e.bitwise_or_(sign.bitwise_and_(8))  # the float's sign bit, moved to bit 3
        pairs = e.view(-1, 2)
        packed = torch.add(pairs[:, 0], pairs[:, 1], alpha=16, out=work.i32[: nb * bs // 2])
        codes.copy_(packed)


def decode(buf: torch.Tensor, codec: int, bs: int, scale_dtype: int, out: torch.Tensor) -> None:
    """The values of payload ``buf`` into ``out`` (FP32, numel), after checking its scales."""
    n, dev = out.numel(), out.device
    scales = checked_scales(buf, codec, n, scale_dtype)
    codes_per_byte = 1 if codec == pb.CODEC_INT8 else 2
    full = (n // bs) * bs
    run = max(1, RUN_ELEMS // bs) * bs
    idx = torch.empty(min(run, full) // codes_per_byte, dtype=torch.int32, device=dev)
    for start in range(0, full, run):
        stop = min(start + run, full)
        decode_run(
            buf[start // codes_per_byte : stop // codes_per_byte],
            codec,
            scales[start // bs : stop // bs],
            out[start:stop].view(-1, bs),
            idx,
        )
    if full < n:
        out[full:] = decode_tail(buf, codec, bs, n, scales[-1:])
    # An int8 code of -128 (never written by encode) overflows where 127 * scale just fits;
    # only then, which needs a scale within 1% of float32's limit, is the output scanned.
    if codec == pb.CODEC_INT8 and not bool(torch.isfinite(scales * 128.0).all()):
        if not all_finite(out):
            raise layout.CodecError(
                "int8 payload decodes to Inf: code -128 with a scale near float32 max"
            )


def decode_tail(
    buf: torch.Tensor, codec: int, bs: int, n: int, scale: torch.Tensor
) -> torch.Tensor:
    """The values of the partial last block (``n % bs`` of them, FP32), decoded through a
    zero-padded copy of its codes; ``scale`` is that block's (1-element) scale."""
    per_byte = 1 if codec == pb.CODEC_INT8 else 2
    full, code_bytes = (n // bs) * bs, layout.code_bytes(codec, n)
    tail_codes = torch.zeros(bs // per_byte, dtype=torch.uint8, device=buf.device)
    tail_codes[: code_bytes - full // per_byte] = buf[full // per_byte : code_bytes]
    tail = torch.empty(1, bs, dtype=torch.float32, device=buf.device)
    decode_run(
        tail_codes,
        codec,
        scale,
        tail,
        torch.empty(bs // per_byte, dtype=torch.int32, device=buf.device),
    )
    return tail.view(-1)[: n - full]


def scales_of(buf: torch.Tensor, codec: int, n: int, scale_dtype: int) -> torch.Tensor:
    """The payload's block scales as FP32, unchecked (a view where they are FP32 and aligned):
    for payloads ``checked_scales`` passed already."""
    scale_type = torch.float32 if scale_dtype == pb.SCALE_FP32 else torch.float16
    return aligned(buf[layout.code_bytes(codec, n) :], scale_type).float()


def checked_scales(buf: torch.Tensor, codec: int, n: int, scale_dtype: int) -> torch.Tensor:
    """The payload's block scales as FP32; ``layout.CodecError`` unless every decoded value is finite.

    Checked on the (small) scales: scale * max|code| finite guarantees that every decoded value
    is finite, so the values themselves need not be scanned (but see int8's -128 in decode).
    """
    scales = scales_of(buf, codec, n, scale_dtype)
    if scales.numel() == 0:
        return scales
    # One pass, no temporaries (NaN propagates into both; the largest scale times the largest
    # code in FP32, as the decode computes it); the failing block is found only for the error.
    lo, hi = torch.aminmax(scales)
    if not (math.isfinite(lo) and lo >= 0 and math.isfinite(hi * MAX_CODE[codec])):
        bad = ~torch.isfinite(scales * MAX_CODE[codec]) | (scales < 0)
        i = int(bad.nonzero()[0, 0])
        raise layout.CodecError(
            f"block {i} has scale {float(scales[i])}: scales must be finite, >= 0 and small "
            "enough that scale * code stays finite"
        )
    return scales


def decode_run(
    codes: torch.Tensor, codec: int, scales: torch.Tensor, out: torch.Tensor, idx: torch.Tensor
) -> None:
    """Decode the uint8 ``codes`` of ``out.shape[0]`` whole blocks into ``out`` (nb, bs)."""
    if codec == pb.CODEC_INT8:
        torch.mul(codes.view(torch.int8).view(out.shape), scales.unsqueeze(1), out=out)
        return
    if codec == pb.CODEC_INT4 and codes.numel() % 4 == 0 and codes.data_ptr() % 4 == 0:
        torch.mul(int4_values(codes).view(out.shape), scales.unsqueeze(1), out=out)
        return
    # 4-bit: each byte indexes a 256 x 2 table of the (low, high) code values.
    idx = idx[: codes.numel()].copy_(codes)
    torch.index_select(pair_table(codec, out.device), 0, idx, out=out.view(-1, 2))
    out.mul_(scales.unsqueeze(1))


def int4_values(codes: torch.Tensor) -> torch.Tensor:
    """INT4 code values (int8, two per byte, low nibble first) of ``codes``: the table
    lookup's results, from byte operations: the low and high nibbles apart (a mask and a
    shift), interleaved by one stack, then b - 8 in uint8 arithmetic read as int8. Nibble 0
    (never encoded) decodes to -7, as in the table. (``decode_run`` and ``accumulate`` call it
    only for whole 4-byte words, a condition it does not need.)"""
    lo = torch.bitwise_and(codes, 15)
    hi = torch.bitwise_right_shift(codes, 4)
    values = torch.stack([lo, hi], dim=1).view(-1)
    return values.sub_(8).view(torch.int8).clamp_(min=-7)


@functools.lru_cache(maxsize=16)
def pair_table(codec: int, device: torch.device) -> torch.Tensor:
    """256 x 2 FP32: the (low, high) nibble values of each byte of 4-bit ``codec`` codes."""
    nibble = torch.arange(16)
    if codec == pb.CODEC_INT4:
        values = (nibble - 8).clamp(min=-7).float()
    else:
        e = nibble & 7
        magnitude = torch.where(e > 0, torch.exp2((e - 7).float()), 0.0)
        values = torch.where(nibble >= 8, -magnitude, magnitude)
    byte = torch.arange(256)
    return torch.stack([values[byte & 15], values[byte >> 4]], dim=1).to(device)
