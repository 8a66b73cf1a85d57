"""The tensor codec of the wire: how a flat FP32 vector becomes payload bytes and back.

This module owns the byte layout of every ``Codec`` in ``diloco.proto`` and the quantization
itself (``encode``, ``decode``, ``decode_runs``, ``check``, ``accumulate``, ``l2_norm``). This
module dispatches on the codec and handles FP32/BF16; the blockwise quantizers are
``protos.blockwise``'s, the norms of a payload ``protos.norms``' (``l2_norm`` and
``norm_estimate`` are taken from there, so ``codec.l2_norm`` works as before). How
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

from collections.abc import Iterator

import torch

from protos import blockwise, layout
from protos import diloco_pb2 as pb
from protos.norms import l2_norm as l2_norm
from protos.norms import norm_estimate as norm_estimate

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
        blockwise.encode(x, codec, block_size, scale_dtype, out)
    return out


def _as_dtype(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 ``buf`` as ``dtype``; writes go through only if ``buf`` is aligned."""
    size = torch.empty((), dtype=dtype).element_size()
    if buf.storage_offset() % size or buf.data_ptr() % size:
        raise layout.CodecError(
            f"buffer is not aligned to {size} bytes; pass a freshly allocated tensor"
        )
    return buf.view(dtype)


def _check_finite_input(x: torch.Tensor, encoded: torch.Tensor, name: str) -> None:
    if blockwise.all_finite(encoded):
        return
    if not blockwise.all_finite(x):
        raise layout.CodecError("cannot encode a tensor containing NaN or Inf")
    raise layout.CodecError(
        f"values beyond the range of {name} (|x| > {torch.finfo(encoded.dtype).max})"
    )


class RunEncoder:
    """``encode`` of one 1-D tensor run by run, the same bytes as encoding it at once, each
    run's decoded values (``decode_runs``'s, element for element) ready as soon as it is
    written: a caller can encode a run, decode it and use both while they are in cache.

    Runs come in order from element 0, each of whole blocks except the last, which may end with
    the partial block; ``out`` holds the encoded tensor once the last run is in."""

    def __init__(
        self,
        codec: int,
        numel: int,
        run: int,
        device: torch.device | str = "cpu",
        block_size: int = layout.DEFAULT_BLOCK_SIZE,
        scale_dtype: int = pb.SCALE_FP32,
        out: torch.Tensor | None = None,
    ) -> None:
        self.header = layout.make_header(codec, numel, block_size, scale_dtype)
        self.codec, self.numel = codec, numel
        nbytes = int(self.header.total_bytes)
        if out is None:
            out = torch.empty(nbytes, dtype=torch.uint8, device=device)
        elif out.dtype != torch.uint8 or out.numel() != nbytes:
            raise ValueError(f"out must be {nbytes} uint8 bytes, got {out.numel()} {out.dtype}")
        self.out = out  # written whole: each run's codes and scales
        self.next = 0  # where the next run starts
        self.blockwise = codec in blockwise.MAX_CODE
        self.bs = int(self.header.block_size) if self.blockwise else 1
        if run < 1 or run % self.bs:
            raise ValueError(f"a run must be a positive multiple of the block size {self.bs}")
        if self.blockwise:
            self.per_byte = 1 if codec == pb.CODEC_INT8 else 2
            self.code_bytes = layout.code_bytes(codec, numel)
            blocks = run // self.bs
            self.absmax = torch.empty(blocks, dtype=torch.float32, device=device)
            self.scales = torch.empty(blocks, dtype=torch.float32, device=device)
            self.work = blockwise.Work(run, torch.device(device))
            self.idx = torch.empty(run // self.per_byte, dtype=torch.int32, device=device)

    def encode(self, x: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
        """Encodes the next run ``x`` (FP32) into ``out`` and returns its decoded values (in
        ``decoded``, FP32 of at least ``x.numel()`` elements, or a view of ``out`` for FP32).
        ``layout.CodecError`` on NaN or Inf (``out`` is then partly written)."""
        start, stop = self.next, self.next + x.numel()
        if stop > self.numel or (stop < self.numel and x.numel() % self.bs):
            raise ValueError(
                f"run [{start}, {stop}) is not whole blocks of a {self.numel}-element tensor"
            )
        self.next = stop
        if self.codec == pb.CODEC_FP32:
            vals = _as_dtype(self.out, torch.float32)[start:stop].copy_(x)
            _check_finite_input(x, vals, "fp32")
            return vals
        if self.codec == pb.CODEC_BF16:
            vals16 = _as_dtype(self.out, torch.bfloat16)[start:stop].copy_(x)
            _check_finite_input(x, vals16, "bf16")
            return decoded[: x.numel()].copy_(vals16)
        bs, per_byte = self.bs, self.per_byte
        full = min(stop, (self.numel // bs) * bs)  # whole blocks of this run end here
        out = decoded[: x.numel()]
        if full > start:
            nb = (full - start) // bs
            self._blocks(x[: full - start].view(nb, bs), start, nb, out[: full - start])
        if stop > full:  # the partial last block, zero-padded as `encode` does
            tail = torch.zeros(1, bs, dtype=torch.float32, device=x.device)
            tail[0, : stop - full] = x[full - start :]
            codes = torch.empty(bs // per_byte, dtype=torch.uint8, device=x.device)
            self._blocks(tail, full, 1, None, codes)
            self.out[full // per_byte : self.code_bytes] = codes[
                : self.code_bytes - full // per_byte
            ]
            out[full - start :] = blockwise.decode_tail(
                self.out, self.codec, bs, self.numel, self.scales[:1]
            )
        return out

    def _blocks(
        self,
        v: torch.Tensor,
        start: int,
        nb: int,
        decoded: torch.Tensor | None,
        codes: torch.Tensor | None = None,
    ) -> None:
        """Encodes the ``nb`` whole blocks ``v`` that start at element ``start``: codes into
        ``codes`` (default: their place in ``out``), scales into ``out``; decodes them into
        ``decoded`` when given."""
        bs, per_byte = self.bs, self.per_byte
        if codes is None:
            codes = self.out[start // per_byte : (start + nb * bs) // per_byte]
        absmax, scales = self.absmax[:nb], self.scales[:nb]
        scale_dtype = int(self.header.scale_dtype)
        blockwise.encode_run(v, self.codec, scale_dtype, absmax, scales, codes, self.work)
        if not bool(torch.isfinite(absmax).all()):
            raise layout.CodecError("cannot encode a tensor containing NaN or Inf")
        b0 = start // bs
        if scale_dtype == pb.SCALE_FP16:
            if not bool(torch.isfinite(scales).all()):
                raise layout.CodecError(
                    f"a block's absmax ({float(absmax.max()):.6g}) is beyond what an fp16 scale "
                    f"holds for {layout.codec_name(self.codec)} (max scale 65504); use fp32 scales"
                )
            at = self.code_bytes + 2 * b0
            self.out[at : at + 2 * nb].copy_(scales.to(torch.float16).view(torch.uint8))
        else:
            at = self.code_bytes + 4 * b0
            self.out[at : at + 4 * nb].copy_(scales.view(torch.uint8))
        if decoded is not None:
            blockwise.decode_run(codes, self.codec, scales, decoded.view(nb, bs), self.idx)


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
        out.copy_(blockwise.aligned(buf, dtype))
        if not blockwise.all_finite(out):
            raise layout.CodecError(f"{layout.codec_name(codec)} payload contains NaN or Inf")
        return out
    blockwise.decode(buf, codec, header.block_size, header.scale_dtype, out)
    return out


@torch.no_grad()
def check(buf: torch.Tensor, header: pb.PayloadHeader, scan_values: bool = True) -> None:
    """Validate a received payload as ``decode`` would, without decoding it.

    Raises ``layout.CodecError`` exactly when ``decode`` would. It reads only the scales of a quantized
    payload (one read pass over FP32/BF16 values), so a receiver can accept a push at once and
    decode it later (``values``) knowing that the decode will succeed. Without ``scan_values``
    FP32/BF16 values are not read: the caller shows them finite itself (``not_finite`` is the
    error where they are not).
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
        if scan_values and not blockwise.all_finite(blockwise.aligned(buf.contiguous(), dtype)):
            raise not_finite(codec)
        return
    scales = blockwise.checked_scales(buf, codec, n, header.scale_dtype)
    if codec == pb.CODEC_INT8 and not bool(torch.isfinite(scales * 128.0).all()):
        decode(buf, header, torch.empty(n, dtype=torch.float32, device=buf.device))  # rare: scans


def not_finite(codec: int) -> layout.CodecError:
    """The error of a payload whose FP32/BF16 values are not all finite."""
    return layout.CodecError(f"{layout.codec_name(codec)} payload contains NaN or Inf")


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
    passed ``check``: one pass over ``out`` for FP32 and whole-block INT8/INT4 payloads (the
    weight is folded into the block scales); BF16 run by run through a run-sized FP32 scratch
    (weighted in FP32, as its decoded values are: weighting the BF16 values themselves would
    round each product to BF16 again); otherwise decoded through ``scratch`` (FP32, numel), or
    without one run by run (about 1M elements each), element for element the same.
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
    if codec == pb.CODEC_FP32:
        vals = blockwise.aligned(buf.contiguous(), torch.float32)
    elif full > 0 and words:
        raw_scales = blockwise.checked_scales(buf, codec, n, header.scale_dtype)
        # Not in place: FP32 scales are a view of the payload, which must stay as received.
        scales = (raw_scales * weight).unsqueeze(1)
        run = max(1, blockwise.RUN_ELEMS // bs) * bs
        for start in range(0, full, run):
            stop = min(start + run, full)
            codes = buf[start // per_byte : stop // per_byte]
            q = codes.view(torch.int8) if codec == pb.CODEC_INT8 else blockwise.int4_values(codes)
            o, sc = out[start:stop].view(-1, bs), scales[start // bs : stop // bs]
            if overwrite:
                torch.mul(q.view(o.shape), sc, out=o)
            else:
                o.addcmul_(q.view(o.shape), sc)
        if full < n:  # the partial last block, decoded alone
            vals = blockwise.decode_tail(buf, codec, bs, n, raw_scales[-1:])
            if overwrite:
                torch.mul(vals, weight, out=out[full:])
            else:
                out[full:].add_(vals, alpha=weight)
        return
    elif scratch is None or codec == pb.CODEC_BF16:  # run by run through a run-sized scratch
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
    bs = int(header.block_size) if header.codec in blockwise.MAX_CODE else 1
    return min(int(header.numel), max(1, blockwise.RUN_ELEMS // bs) * bs)


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
        raw = blockwise.aligned(buf, torch.float32 if codec == pb.CODEC_FP32 else torch.bfloat16)
        for start in range(0, n, run):
            vals = raw[start : start + run]
            yield start, vals if codec == pb.CODEC_FP32 else scratch[: vals.numel()].copy_(vals)
        return
    bs = int(header.block_size)
    scales = blockwise.checked_scales(buf, codec, n, header.scale_dtype)
    per_byte = 1 if codec == pb.CODEC_INT8 else 2
    full = (n // bs) * bs
    idx = torch.empty(run // per_byte, dtype=torch.int32, device=buf.device)
    for start in range(0, n, run):
        stop = min(start + run, n)
        out = scratch[: stop - start]
        whole = min(stop, full)
        if whole > start:
            blockwise.decode_run(
                buf[start // per_byte : whole // per_byte],
                codec,
                scales[start // bs : whole // bs],
                out[: whole - start].view(-1, bs),
                idx,
            )
        if stop > full:
            out[full - start :] = blockwise.decode_tail(buf, codec, bs, n, scales[-1:])
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
