"""The tensor codec of the wire: how a flat FP32 vector becomes payload bytes and back.

This module owns the byte layout of every ``Codec`` in ``diloco.proto`` and the quantization
itself (``encode``, ``decode``, ``decode_runs``, ``check``, ``accumulate``, ``l2_norm``). How
the bytes travel in chunks is ``protos.framing``'s job. Encode and decode are vectorised torch code that runs unchanged on CPU
and CUDA; they walk the tensor in runs of whole blocks (about 1M elements) and write into
preallocated outputs, so temporaries stay small whatever the tensor's size.

Layouts (all little-endian):

- FP32: the raw float32 values.
- BF16: the raw bfloat16 values (``x.to(torch.bfloat16)``: round to nearest even).
- INT8, INT4, FP4_E3M0 (blockwise absmax): all codes first, then one scale per block
  (float32 or float16 per ``scale_dtype``). Blocks are ``block_size`` consecutive elements; the
  last block may be partial. INT8 stores one int8 code per element; the 4-bit codecs store two
  codes per byte, element ``2i`` in the low nibble, so the code section is ``ceil(numel / 2)``
  bytes (the high nibble after an odd last element is padding and ignored on decode).

  - INT8: ``scale = absmax / 127``, ``code = clamp(round(x / scale), -127, 127)``.
  - INT4: ``scale = absmax / 7``, ``q = clamp(round(x / scale), -7, 7)``, nibble ``q + 8``
    (nibble 0 is never written; decode reads it as -7, like the clamp would).
  - FP4_E3M0 (as in Streaming DiLoCo): ``scale = absmax``; bit 3 is the sign, bits 0-2 the
    exponent field ``e``: ``e = 0`` is zero, ``e`` in 1..7 is ``scale * 2**(e - 7)``. Encoding
    rounds ``r = |x| / scale`` to the nearest representable magnitude in the linear domain (as a
    cast to a float format with no mantissa would): between ``2**k`` and ``2**(k+1)`` the
    threshold is ``1.5 * 2**k`` (ties go up), and ``r < 2**-7`` (nearer 0 than ``2**-6``)
    flushes to zero.

  The scale actually stored (after rounding to fp16 when ``scale_dtype`` is SCALE_FP16) is the
  one the encoder quantises with, so decode reproduces the encoder's values exactly. A scale of
  0 (all-zero block, or absmax too small for the scale's format) decodes the block to zeros.

Error bounds, per element ``x`` with decoded ``y``, in a block of absmax ``A``
(``delta`` is the rounding error of the stored scale ``s``: 0 for FP4 with fp32 scales,
``max(s * 2**-24, 2**-150)`` for INT8/INT4 with fp32 scales, ``max(s * 2**-11, 2**-25)`` with
fp16 scales; ``slack = A * 2**-22`` covers float32 arithmetic):

===========  ==========================================================
codec        bound on ``|x - y|``
===========  ==========================================================
FP32         0 (exact)
BF16         ``max(|x| * 2**-8, 2**-134)`` (relative 2**-8; bf16 subnormals)
INT8         ``A / 254 + 127 * delta + slack``
INT4         ``A / 14 + 7 * delta + slack``
FP4_E3M0     ``max(|x| / 3, A / 128) + delta + slack``
===========  ==========================================================

(FP4: relative error at most 1/3 for ``|x| >= A / 64``; below that the absolute error is at most
``A / 128``.) ``tests/test_codec.py`` checks exactly these bounds.

Validation: every failure raises ``CodecError`` (a ``ValueError``). ``encode`` rejects NaN/Inf
input, values beyond bf16 range for BF16, and, with fp16 scales, a block whose scale (``A/127``,
``A/7`` or ``A``) exceeds fp16's 65504. ``decode`` rejects a buffer of the wrong size, scales
that are negative/NaN/Inf or so large that ``scale * code`` would overflow (for INT8 this
includes the code -128, which the encoder never writes), and FP32/BF16 payloads carrying
NaN/Inf; decoded values are then always finite. When ``decode`` raises, ``out`` may be partly
written: decode into a scratch buffer and apply it only on success.

A payload of 0 elements is allowed: it is 0 bytes (``protos.framing`` sends it as no chunks).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch

from protos import diloco_pb2 as pb
from protos import layout

_QMAX: dict[int, int] = {pb.CODEC_INT8: 127, pb.CODEC_INT4: 7}  # FP4's scale is absmax itself
# Largest |code| the encoder writes; decode requires scale * _MAX_CODE to be finite.
_MAX_CODE: dict[int, float] = {pb.CODEC_INT8: 127.0, pb.CODEC_INT4: 7.0, pb.CODEC_FP4_E3M0: 1.0}
_RUN_ELEMS = 1 << 20  # elements per run of whole blocks in encode/decode
_FP4_FLUSH = 2.0**-7  # |x| / scale below this encodes as zero


# ---------------------------------------------------------------------------------------------
# encode


@torch.no_grad()
def encode(
    x: torch.Tensor,
    codec: int,
    block_size: int = layout.DEFAULT_BLOCK_SIZE,
    scale_dtype: int = pb.SCALE_FP32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Encode the 1-D float tensor ``x`` into a 1-D uint8 tensor on ``x.device``.

    The result has exactly ``layout.encoded_nbytes(codec, x.numel(), block_size, scale_dtype)`` bytes;
    if ``out`` is given it must be such a tensor (4-byte aligned for FP32/BF16, as any fresh
    allocation is) and is written in place. Non-fp32 inputs are converted run by run; a
    non-contiguous ``x`` is copied once.
    """
    if x.dim() != 1 or not x.is_floating_point():
        raise layout.CodecError(
            f"encode takes a 1-D float tensor, got {x.dtype} of shape {tuple(x.shape)}"
        )
    n = x.numel()
    nbytes = layout.encoded_nbytes(codec, n, block_size, scale_dtype)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    elif (
        out.dtype != torch.uint8
        or out.dim() != 1
        or out.numel() != nbytes
        or out.device != x.device
        or not out.is_contiguous()
    ):
        raise layout.CodecError(
            f"out must be a contiguous 1-D uint8 tensor of {nbytes} bytes on {x.device}, got "
            f"{out.dtype} of shape {tuple(out.shape)} on {out.device}"
        )
    if n == 0:
        return out
    x = x.contiguous()
    if codec == pb.CODEC_FP32:
        _as_dtype(out, torch.float32).copy_(x)
        _check_finite_input(x, _as_dtype(out, torch.float32), "fp32")
    elif codec == pb.CODEC_BF16:
        _as_dtype(out, torch.bfloat16).copy_(x)
        _check_finite_input(x, _as_dtype(out, torch.bfloat16), "bf16")
    else:
        _encode_blockwise(x, codec, block_size, scale_dtype, out)
    return out


def _as_dtype(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 ``buf`` as ``dtype``; writes go through only if ``buf`` is aligned."""
    size = torch.empty((), dtype=dtype).element_size()
    if buf.storage_offset() % size or buf.data_ptr() % size:
        raise layout.CodecError(
            f"buffer is not aligned to {size} bytes; pass a freshly allocated tensor"
        )
    return buf.view(dtype)


def _all_finite(t: torch.Tensor) -> bool:
    # aminmax is one pass with no temporaries and propagates NaN; Inf shows in min or max.
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _check_finite_input(x: torch.Tensor, encoded: torch.Tensor, name: str) -> None:
    if _all_finite(encoded):
        return
    if not _all_finite(x):
        raise layout.CodecError("cannot encode a tensor containing NaN or Inf")
    raise layout.CodecError(
        f"values beyond the range of {name} (|x| > {torch.finfo(encoded.dtype).max})"
    )


def _encode_blockwise(
    x: torch.Tensor, codec: int, bs: int, scale_dtype: int, out: torch.Tensor
) -> None:
    n, dev = x.numel(), x.device
    nblocks = -(-n // bs)
    full = (n // bs) * bs  # elements in whole blocks; the rest is one partial block
    code_bytes = layout.code_bytes(codec, n)
    codes_per_byte = 1 if codec == pb.CODEC_INT8 else 2
    absmax = torch.empty(nblocks, dtype=torch.float32, device=dev)
    scales = torch.empty(nblocks, dtype=torch.float32, device=dev)
    run = max(1, _RUN_ELEMS // bs) * bs
    work = _Work(min(run, full) or bs, dev)
    for start in range(0, full, run):
        stop = min(start + run, full)
        v = x[start:stop]
        if v.dtype != torch.float32:
            v = work.convert[: stop - start].copy_(v)
        b0, b1 = start // bs, stop // bs
        _encode_run(
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
        _encode_run(
            tail.view(1, bs),
            codec,
            scale_dtype,
            absmax[-1:],
            scales[-1:],
            tail_codes,
            _Work(bs, dev),
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


class _Work:
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


def _encode_run(
    v: torch.Tensor,
    codec: int,
    scale_dtype: int,
    absmax: torch.Tensor,
    scales: torch.Tensor,
    codes: torch.Tensor,
    work: _Work,
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


# ---------------------------------------------------------------------------------------------
# decode


@torch.no_grad()
def decode(buf: torch.Tensor, header: pb.PayloadHeader, out: torch.Tensor) -> torch.Tensor:
    """Decode ``buf`` (1-D uint8, ``header.total_bytes``) into ``out`` (1-D fp32, ``header.numel``,
    same device) in place and return ``out``.

    Raises ``layout.CodecError`` on any size mismatch, invalid scales or non-finite values; ``out`` may
    then be partly written.
    """
    if out.dtype != torch.float32 or out.dim() != 1 or not out.is_contiguous():
        raise layout.CodecError(
            "out must be a contiguous 1-D float32 tensor, got "
            f"{out.dtype} of shape {tuple(out.shape)}"
        )
    layout.validate_header(header, expected_numel=out.numel())
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != header.total_bytes:
        raise layout.CodecError(
            f"payload buffer must be 1-D uint8 of {header.total_bytes} bytes, got {buf.dtype} "
            f"of shape {tuple(buf.shape)}"
        )
    if buf.device != out.device:
        raise layout.CodecError(f"payload is on {buf.device} but out is on {out.device}")
    n = out.numel()
    if n == 0:
        return out
    buf = buf.contiguous()
    codec = header.codec
    if codec in (pb.CODEC_FP32, pb.CODEC_BF16):
        dtype = torch.float32 if codec == pb.CODEC_FP32 else torch.bfloat16
        out.copy_(_aligned(buf, dtype))
        if not _all_finite(out):
            raise layout.CodecError(f"{layout.codec_name(codec)} payload contains NaN or Inf")
        return out
    _decode_blockwise(buf, codec, header.block_size, header.scale_dtype, out)
    return out


def _aligned(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``buf`` reinterpreted as ``dtype``, copied first if its start is not aligned."""
    size = torch.empty((), dtype=dtype).element_size()
    if buf.storage_offset() % size or buf.data_ptr() % size:
        buf = buf.clone()
    return buf.view(dtype)


def _decode_blockwise(
    buf: torch.Tensor, codec: int, bs: int, scale_dtype: int, out: torch.Tensor
) -> None:
    n, dev = out.numel(), out.device
    scales = _checked_scales(buf, codec, n, scale_dtype)
    codes_per_byte = 1 if codec == pb.CODEC_INT8 else 2
    full = (n // bs) * bs
    run = max(1, _RUN_ELEMS // bs) * bs
    idx = torch.empty(min(run, full) // codes_per_byte, dtype=torch.int32, device=dev)
    for start in range(0, full, run):
        stop = min(start + run, full)
        _decode_run(
            buf[start // codes_per_byte : stop // codes_per_byte],
            codec,
            scales[start // bs : stop // bs],
            out[start:stop].view(-1, bs),
            idx,
        )
    if full < n:
        out[full:] = _decode_tail(buf, codec, bs, n, scales[-1:])
    # An int8 code of -128 (never written by encode) overflows where 127 * scale just fits;
    # only then, which needs a scale within 1% of float32's limit, is the output scanned.
    if codec == pb.CODEC_INT8 and not bool(torch.isfinite(scales * 128.0).all()):
        if not _all_finite(out):
            raise layout.CodecError(
                "int8 payload decodes to Inf: code -128 with a scale near float32 max"
            )


def _decode_tail(
    buf: torch.Tensor, codec: int, bs: int, n: int, scale: torch.Tensor
) -> torch.Tensor:
    """The values of the partial last block (``n % bs`` of them, FP32), decoded through a
    zero-padded copy of its codes; ``scale`` is that block's (1-element) scale."""
    per_byte = 1 if codec == pb.CODEC_INT8 else 2
    full, code_bytes = (n // bs) * bs, layout.code_bytes(codec, n)
    tail_codes = torch.zeros(bs // per_byte, dtype=torch.uint8, device=buf.device)
    tail_codes[: code_bytes - full // per_byte] = buf[full // per_byte : code_bytes]
    tail = torch.empty(1, bs, dtype=torch.float32, device=buf.device)
    _decode_run(
        tail_codes,
        codec,
        scale,
        tail,
        torch.empty(bs // per_byte, dtype=torch.int32, device=buf.device),
    )
    return tail.view(-1)[: n - full]


def _checked_scales(buf: torch.Tensor, codec: int, n: int, scale_dtype: int) -> torch.Tensor:
    """The payload's block scales as FP32; ``layout.CodecError`` unless every decoded value is finite.

    Checked on the (small) scales: scale * max|code| finite guarantees that every decoded value
    is finite, so the values themselves need not be scanned (but see int8's -128 in decode).
    """
    scale_type = torch.float32 if scale_dtype == pb.SCALE_FP32 else torch.float16
    scales = _aligned(buf[layout.code_bytes(codec, n) :], scale_type).float()
    bad = ~torch.isfinite(scales * _MAX_CODE[codec]) | (scales < 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise layout.CodecError(
            f"block {i} has scale {float(scales[i])}: scales must be finite, >= 0 and small "
            "enough that scale * code stays finite"
        )
    return scales


@torch.no_grad()
def check(buf: torch.Tensor, header: pb.PayloadHeader) -> None:
    """Validate a received payload as ``decode`` would, without decoding it.

    Raises ``layout.CodecError`` exactly when ``decode`` would. It reads only the scales of a quantized
    payload (one read pass over FP32/BF16 values), so a receiver can accept a push at once and
    decode it later (``values``) knowing that the decode will succeed.
    """
    layout.validate_header(header, expected_numel=int(header.numel))
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != header.total_bytes:
        raise layout.CodecError(
            f"payload buffer must be 1-D uint8 of {header.total_bytes} bytes, got {buf.dtype} "
            f"of shape {tuple(buf.shape)}"
        )
    codec, n = header.codec, int(header.numel)
    if n == 0:
        return
    if codec in (pb.CODEC_FP32, pb.CODEC_BF16):
        dtype = torch.float32 if codec == pb.CODEC_FP32 else torch.bfloat16
        if not _all_finite(_aligned(buf.contiguous(), dtype)):
            raise layout.CodecError(f"{layout.codec_name(codec)} payload contains NaN or Inf")
        return
    scales = _checked_scales(buf, codec, n, header.scale_dtype)
    if codec == pb.CODEC_INT8 and not bool(torch.isfinite(scales * 128.0).all()):
        decode(buf, header, torch.empty(n, dtype=torch.float32, device=buf.device))  # rare: scans


@torch.no_grad()
def accumulate(
    buf: torch.Tensor,
    header: pb.PayloadHeader,
    out: torch.Tensor,
    weight: float,
    overwrite: bool = False,
    scratch: torch.Tensor | None = None,
) -> None:
    """``out += weight * decode(buf)`` (``out = ...`` with ``overwrite``), for a payload that
    passed ``check``: one pass over ``out`` for FP32, BF16 and whole-block INT8/INT4 payloads
    (the weight is folded into the block scales); otherwise decoded through ``scratch`` (FP32,
    numel), or without one run by run (about 1M elements each), element for element the same.
    """
    codec, n = header.codec, int(header.numel)
    if out.dtype != torch.float32 or out.shape != (n,) or not out.is_contiguous():
        raise layout.CodecError(f"out must be a contiguous 1-D float32 tensor of {n} elements")
    if n == 0:
        return
    bs = int(header.block_size)
    per_byte = 1 if codec == pb.CODEC_INT8 else 2
    full = (n // bs) * bs if codec in (pb.CODEC_INT8, pb.CODEC_INT4) else 0
    words = codec == pb.CODEC_INT8 or (bs % 8 == 0 and buf.data_ptr() % 4 == 0)
    if codec in (pb.CODEC_FP32, pb.CODEC_BF16):
        vals = _aligned(
            buf.contiguous(), torch.float32 if codec == pb.CODEC_FP32 else torch.bfloat16
        )
    elif full > 0 and words:
        raw_scales = _checked_scales(buf, codec, n, header.scale_dtype)
        # Not in place: FP32 scales are a view of the payload, which must stay as received.
        scales = (raw_scales * weight).unsqueeze(1)
        run = max(1, _RUN_ELEMS // bs) * bs
        for start in range(0, full, run):
            stop = min(start + run, full)
            codes = buf[start // per_byte : stop // per_byte]
            q = codes.view(torch.int8) if codec == pb.CODEC_INT8 else _int4_values(codes)
            o, sc = out[start:stop].view(-1, bs), scales[start // bs : stop // bs]
            if overwrite:
                torch.mul(q.view(o.shape), sc, out=o)
            else:
                o.addcmul_(q.view(o.shape), sc)
        if full < n:  # the partial last block, decoded alone
            vals = _decode_tail(buf, codec, bs, n, raw_scales[-1:])
            if overwrite:
                torch.mul(vals, weight, out=out[full:])
            else:
                out[full:].add_(vals, alpha=weight)
        return
    elif scratch is None:  # decoded run by run through a run-sized scratch
        run_scratch = torch.empty(run_elems(header), dtype=torch.float32, device=out.device)
        for start, part in decode_runs(buf, header, run_scratch):
            o = out[start : start + part.numel()]
            if overwrite:
                torch.mul(part, weight, out=o)
            else:
                o.add_(part, alpha=weight)
        return
    else:
        vals = decode(buf, header, scratch)
    if overwrite:
        torch.mul(vals, weight, out=out)
    else:
        out.add_(vals, alpha=weight)


def run_elems(header: pb.PayloadHeader) -> int:
    """Elements per run of ``decode_runs`` (whole blocks, about 1M): the scratch it needs."""
    bs = int(header.block_size) if header.codec in _MAX_CODE else 1
    return min(int(header.numel), max(1, _RUN_ELEMS // bs) * bs)


@torch.no_grad()
def decode_runs(
    buf: torch.Tensor, header: pb.PayloadHeader, scratch: torch.Tensor
) -> Iterator[tuple[int, torch.Tensor]]:
    """``decode`` run by run, for a payload that passed ``check`` (or that ``encode`` made):
    yields ``(start, values)`` for consecutive runs of whole blocks (``run_elems(header)``
    elements; the last run may be shorter and ends with the partial block), each decoded into
    ``scratch`` (FP32, at least ``run_elems(header)`` elements) and valid until the next run.
    An aligned FP32 payload's own bytes are yielded without a copy. The values are ``decode``'s,
    element for element, without a decoded copy of the whole payload."""
    codec, n = header.codec, int(header.numel)
    if n == 0:
        return
    run = run_elems(header)
    if scratch.dtype != torch.float32 or scratch.numel() < run or not scratch.is_contiguous():
        raise layout.CodecError(f"scratch must be contiguous FP32 of at least {run} elements")
    buf = buf.contiguous()
    if codec in (pb.CODEC_FP32, pb.CODEC_BF16):
        raw = _aligned(buf, torch.float32 if codec == pb.CODEC_FP32 else torch.bfloat16)
        for start in range(0, n, run):
            vals = raw[start : start + run]
            yield start, vals if codec == pb.CODEC_FP32 else scratch[: vals.numel()].copy_(vals)
        return
    bs = int(header.block_size)
    scales = _checked_scales(buf, codec, n, header.scale_dtype)
    per_byte = 1 if codec == pb.CODEC_INT8 else 2
    full = (n // bs) * bs
    idx = torch.empty(run // per_byte, dtype=torch.int32, device=buf.device)
    for start in range(0, n, run):
        stop = min(start + run, n)
        out = scratch[: stop - start]
        whole = min(stop, full)
        if whole > start:
            _decode_run(
                buf[start // per_byte : whole // per_byte],
                codec,
                scales[start // bs : whole // bs],
                out[: whole - start].view(-1, bs),
                idx,
            )
        if stop > full:
            out[full - start :] = _decode_tail(buf, codec, bs, n, scales[-1:])
        yield start, out


def values(buf: torch.Tensor, header: pb.PayloadHeader, scratch: torch.Tensor) -> torch.Tensor:
    """The payload's values as flat FP32: an FP32 payload's own bytes when they are aligned (no
    copy: valid while ``buf`` is), otherwise decoded into ``scratch`` (as ``decode``)."""
    if (
        header.codec == pb.CODEC_FP32
        and header.numel > 0
        and buf.is_contiguous()
        and buf.data_ptr() % 4 == 0
        and buf.numel() == header.numel * 4
    ):
        return buf.view(torch.float32)
    return decode(buf, header, scratch)


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
        raw = _aligned(
            buf.contiguous(), torch.float32 if codec == pb.CODEC_FP32 else torch.bfloat16
        )
        work = (
            torch.empty(min(n, _RUN_ELEMS), dtype=torch.float32, device=buf.device)
            if codec == pb.CODEC_BF16
            else None
        )
        squares = 0.0
        for start in range(0, n, _RUN_ELEMS):
            chunk = raw[start : start + _RUN_ELEMS]
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
    scales = _checked_scales(buf, codec, n, header.scale_dtype).double()
    per_byte = 1 if codec == pb.CODEC_INT8 else 2
    full = (n // bs) * bs
    run = max(1, _RUN_ELEMS // bs) * bs
    unit = torch.ones(max(1, min(run, full) // bs), dtype=torch.float32, device=buf.device)
    work = torch.empty(min(run, full), dtype=torch.float32, device=buf.device)
    idx = torch.empty(min(run, full) // per_byte, dtype=torch.int32, device=buf.device)
    block_norms = torch.empty(scales.numel(), dtype=torch.float32, device=buf.device)
    for start in range(0, full, run):
        stop = min(start + run, full)
        codes = work[: stop - start].view(-1, bs)
        _decode_run(
            buf[start // per_byte : stop // per_byte], codec, unit[: len(codes)], codes, idx
        )
        torch.linalg.vector_norm(codes, dim=1, out=block_norms[start // bs : stop // bs])
    if full < n:
        block_norms[-1] = torch.linalg.vector_norm(_decode_tail(buf, codec, bs, n, unit[:1]))
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
    scales = _checked_scales(buf, codec, n, header.scale_dtype).double()
    lengths = torch.full_like(scales, float(bs))
    if n % bs:
        lengths[-1] = float(n % bs)
    top = 128.0 if codec == pb.CODEC_INT8 else _MAX_CODE[codec]  # int8 codes may hold -128
    upper = top * math.sqrt(float((lengths * scales.square()).sum()))
    whole = n // bs
    if whole == 0:
        return l2_norm(buf, header), upper
    k = min(whole, sample_blocks)
    step = whole / k
    offset = float(torch.rand(()))
    idx = ((torch.arange(k, dtype=torch.float64) + offset) * step).long().clamp(max=whole - 1)
    per_byte = 1 if codec == pb.CODEC_INT8 else 2
    blocks = buf[: whole * bs // per_byte].view(whole, bs // per_byte)[idx]
    if codec == pb.CODEC_INT8:
        values = blocks.view(torch.int8).float()
    else:
        values = _pair_table(codec, buf.device)[blocks.long()].reshape(k, bs)
    sampled = float((values.square().sum(1).double() * scales[idx].square()).sum())
    total = float((lengths * scales.square()).sum())
    reached = float((lengths[idx] * scales[idx].square()).sum())
    # Scaled by the sampled blocks' share of the scale mass, so blocks of larger scale
    # (tensors of larger values) weigh as they do in the whole.
    estimate = math.sqrt(sampled * total / reached) if reached > 0 else 0.0
    return min(estimate, upper), upper


def _decode_run(
    codes: torch.Tensor, codec: int, scales: torch.Tensor, out: torch.Tensor, idx: torch.Tensor
) -> None:
    """Decode the uint8 ``codes`` of ``out.shape[0]`` whole blocks into ``out`` (nb, bs)."""
    if codec == pb.CODEC_INT8:
        torch.mul(codes.view(torch.int8).view(out.shape), scales.unsqueeze(1), out=out)
        return
    if codec == pb.CODEC_INT4 and codes.numel() % 4 == 0 and codes.data_ptr() % 4 == 0:
        torch.mul(_int4_values(codes).view(out.shape), scales.unsqueeze(1), out=out)
        return
    # 4-bit: each byte indexes a 256 x 2 table of the (low, high) code values.
    idx = idx[: codes.numel()].copy_(codes)
    torch.index_select(_pair_table(codec, out.device), 0, idx, out=out.view(-1, 2))
    out.mul_(scales.unsqueeze(1))


_SPREAD = ((16, 0x0000FFFF0000FFFF), (8, 0x00FF00FF00FF00FF), (4, 0x0F0F0F0F0F0F0F0F))
_PLUS_120 = 0x7878787878787878
_TOP_BITS = 0x8080808080808080 - (1 << 64)  # as a signed int64


def _int4_values(codes: torch.Tensor) -> torch.Tensor:
    """INT4 code values (int8, two per byte, low nibble first) of ``codes`` (4-byte aligned,
    a multiple of 4 bytes): the table lookup's results, from whole-word integer operations.

    Each 32-bit word of 8 nibbles is spread to 64 bits, one nibble per byte (shift, or, mask
    three times). Byte b in 0..15 becomes b - 8 as int8 without carries between bytes:
    (b + 120) ^ 0x80. Nibble 0 (never encoded) decodes to -7, as in the table.
    """
    x = codes.view(torch.int32).to(torch.int64).bitwise_and_(0xFFFFFFFF)
    shifted = torch.empty_like(x)
    for shift, mask in _SPREAD:
        torch.bitwise_left_shift(x, shift, out=shifted)
        x.bitwise_or_(shifted).bitwise_and_(mask)
    x.add_(_PLUS_120).bitwise_xor_(_TOP_BITS)
    return x.view(torch.int8).clamp_(min=-7)


@functools.lru_cache(maxsize=16)
def _pair_table(codec: int, device: torch.device) -> torch.Tensor:
    nibble = torch.arange(16)
    if codec == pb.CODEC_INT4:
        values = (nibble - 8).clamp(min=-7).float()
    else:
        e = nibble & 7
        magnitude = torch.where(e > 0, torch.exp2((e - 7).float()), 0.0)
        values = torch.where(nibble >= 8, -magnitude, magnitude)
    byte = torch.arange(256)
    return torch.stack([values[byte & 15], values[byte >> 4]], dim=1).to(device)
