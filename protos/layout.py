"""Payload headers: which codecs exist, how many bytes a payload of each takes, and whether a
``PayloadHeader`` describes one this side can decode.

Owns the codec names (``codec_name``, ``parse_codec``), payload sizes (``encoded_nbytes``),
``make_header`` and ``validate_header``, and ``CodecError``, which every codec and framing check
raises. The byte layouts themselves, and encoding into them, are ``protos.codec``'s.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import cast

from protos import diloco_pb2 as pb

DEFAULT_BLOCK_SIZE = 256

CODEC_NAMES: dict[str, int] = {
    "fp32": pb.CODEC_FP32,
    "bf16": pb.CODEC_BF16,
    "int8": pb.CODEC_INT8,
    "int4": pb.CODEC_INT4,
    "fp4": pb.CODEC_FP4_E3M0,
}
NAMES_BY_CODEC: dict[int, str] = {v: k for k, v in CODEC_NAMES.items()}
BLOCKWISE = (pb.CODEC_INT8, pb.CODEC_INT4, pb.CODEC_FP4_E3M0)
PULL_CODECS = (pb.CODEC_FP32, pb.CODEC_BF16, pb.CODEC_INT8)  # of a full pull (PullRequest.codec)
SCALE_BYTES: dict[int, int] = {pb.SCALE_FP32: 4, pb.SCALE_FP16: 2}
SCALE_NAMES: dict[int, str] = {pb.SCALE_FP32: "fp32", pb.SCALE_FP16: "fp16"}


class CodecError(ValueError):
    """A payload, header or tensor that the codec cannot accept; the message says why."""


def codec_name(codec: int) -> str:
    """The short name ("int8", ...) of a ``pb.Codec`` value."""
    try:
        return NAMES_BY_CODEC[codec]
    except KeyError:
        raise CodecError(
            f"unknown codec {codec}; expected one of {allowed_names(CODEC_NAMES.values())}"
        ) from None


def parse_codec(name: str) -> int:
    """The ``pb.Codec`` value of a short name such as "int8" (case-insensitive)."""
    try:
        return CODEC_NAMES[name.strip().lower()]
    except KeyError:
        raise CodecError(
            f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}"
        ) from None


def allowed_names(codecs: Collection[int]) -> str:
    return ", ".join(NAMES_BY_CODEC.get(c, str(c)) for c in codecs)


def _check_params(codec: int, numel: int, block_size: int, scale_dtype: int) -> None:
    codec_name(codec)
    if numel < 0:
        raise CodecError(f"numel must be >= 0, got {numel}")
    if scale_dtype not in SCALE_BYTES:
        raise CodecError(f"unknown scale dtype {scale_dtype}; expected SCALE_FP32 or SCALE_FP16")
    if codec in BLOCKWISE and (block_size <= 0 or block_size % 2):
        raise CodecError(
            f"block_size must be a positive even number for {codec_name(codec)}, got {block_size}"
        )


def code_bytes(codec: int, numel: int) -> int:
    if codec == pb.CODEC_FP32:
        return 4 * numel
    if codec == pb.CODEC_BF16:
        return 2 * numel
    if codec == pb.CODEC_INT8:
        return numel
    return (numel + 1) // 2


def encoded_nbytes(
    codec: int,
    numel: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale_dtype: int = pb.SCALE_FP32,
) -> int:
    """Exact payload size in bytes of ``numel`` elements; block_size/scale_dtype only matter
    for the blockwise codecs."""
    _check_params(codec, numel, block_size, scale_dtype)
    nbytes = code_bytes(codec, numel)
    if codec in BLOCKWISE:
        nbytes += -(-numel // block_size) * SCALE_BYTES[scale_dtype]
    return nbytes


def make_header(
    codec: int,
    numel: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale_dtype: int = pb.SCALE_FP32,
) -> pb.PayloadHeader:
    """The header for a payload; ``block_size`` and ``scale_dtype`` are stored as 0 (fp32)
    for FP32/BF16, which have neither."""
    if codec not in BLOCKWISE:
        block_size, scale_dtype = 0, pb.SCALE_FP32
    return pb.PayloadHeader(
        codec=cast(pb.Codec, codec),  # the enum types are ints at run time
        numel=numel,
        block_size=block_size,
        scale_dtype=cast(pb.ScaleDtype, scale_dtype),
        total_bytes=encoded_nbytes(codec, numel, block_size, scale_dtype),
    )


def validate_header(
    header: pb.PayloadHeader,
    expected_numel: int,
    allowed: Collection[int] | None = None,
    max_block_size: int = 1 << 20,
) -> None:
    """Raise ``CodecError`` unless ``header`` describes a payload this side can decode.

    For FP32/BF16, ``block_size`` and ``scale_dtype`` are not used (``make_header`` sets 0).
    """
    codec = header.codec
    if codec not in NAMES_BY_CODEC:
        raise CodecError(
            f"payload codec {codec} is unknown or unspecified; "
            f"set it to one of {allowed_names(CODEC_NAMES.values())}"
        )
    if allowed is not None and codec not in allowed:
        raise CodecError(
            f"codec {codec_name(codec)} is not accepted here; allowed: {allowed_names(allowed)}"
        )
    if header.numel != expected_numel:
        raise CodecError(
            f"payload has {header.numel} elements but {expected_numel} were expected "
            "(does the fragment plan match?)"
        )
    if codec in BLOCKWISE:
        if header.block_size == 0 or header.block_size % 2 or header.block_size > max_block_size:
            raise CodecError(
                f"block_size {header.block_size} is invalid for {codec_name(codec)}: "
                f"it must be even and in 2..{max_block_size}"
            )
    scale_dtype = header.scale_dtype if codec in BLOCKWISE else pb.SCALE_FP32
    if scale_dtype not in SCALE_BYTES:
        raise CodecError(f"unknown scale dtype {scale_dtype}; expected SCALE_FP32 or SCALE_FP16")
    expected = encoded_nbytes(codec, header.numel, header.block_size, scale_dtype)
    if header.total_bytes != expected:
        raise CodecError(
            f"total_bytes {header.total_bytes} does not match {expected}, the size of "
            f"{header.numel} elements as {codec_name(codec)}"
            + (
                f" with block_size {header.block_size} and {SCALE_NAMES[scale_dtype]} scales"
                if codec in BLOCKWISE
                else ""
            )
        )
