"""The wire codec: documented error bounds, byte layouts, validation, chunking and reassembly."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from protos import blockwise
from protos import codec as C
from protos import diloco_pb2 as pb
from protos import framing as F
from protos import layout as L

FP32, BF16, INT8, INT4, FP4 = (
    pb.CODEC_FP32,
    pb.CODEC_BF16,
    pb.CODEC_INT8,
    pb.CODEC_INT4,
    pb.CODEC_FP4_E3M0,
)
ALL_CODECS = [FP32, BF16, INT8, INT4, FP4]
BLOCKWISE = [INT8, INT4, FP4]
SCALES = [pb.SCALE_FP32, pb.SCALE_FP16]
# (relative, absolute) half-ulp of the stored scale's format: the `delta` of the module docstring
SCALE_ROUNDING: dict[int, tuple[float, float]] = {
    pb.SCALE_FP32: (2.0**-24, 2.0**-150),
    pb.SCALE_FP16: (2.0**-11, 2.0**-25),
}


def documented_bound(x: torch.Tensor, codec: int, scale_dtype: int, bs: int) -> torch.Tensor:
    """The per-element error bound of the module docstring's table, in float64."""
    x = x.double()
    if codec == FP32:
        return torch.zeros_like(x)
    if codec == BF16:
        return torch.clamp(x.abs() * 2.0**-8, min=2.0**-134)
    n = x.numel()
    nblocks = -(-n // bs)
    padded = torch.zeros(nblocks * bs, dtype=torch.float64)
    padded[:n] = x.abs()
    absmax = padded.view(nblocks, bs).amax(dim=1).repeat_interleave(bs)[:n]
    slack = absmax * 2.0**-22
    rel, abs_ = SCALE_ROUNDING[scale_dtype]
    if codec in (INT8, INT4):
        qmax = 127 if codec == INT8 else 7
        delta = torch.clamp(absmax / qmax * rel, min=abs_)
        return absmax / (2 * qmax) + qmax * delta + slack
    delta = (
        torch.zeros_like(absmax)
        if scale_dtype == pb.SCALE_FP32
        else torch.clamp(absmax * rel, min=abs_)
    )
    return torch.maximum(x.abs() / 3, absmax / 128) + delta + slack


def roundtrip(x: torch.Tensor, codec: int, scale_dtype: int = pb.SCALE_FP32, bs: int = 256):
    header = L.make_header(codec, x.numel(), bs, scale_dtype)
    buf = C.encode(x, codec, bs, scale_dtype)
    assert buf.dtype == torch.uint8 and buf.numel() == header.total_bytes
    return C.decode(buf, header, torch.full((x.numel(),), float("nan")))


def assert_within_bound(x: torch.Tensor, codec: int, scale_dtype: int, bs: int = 256) -> None:
    y = roundtrip(x, codec, scale_dtype, bs)
    assert torch.isfinite(y).all()
    err = (x.double() - y.double()).abs()
    bound = documented_bound(x, codec, scale_dtype, bs)
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), (
        f"{L.codec_name(codec)}: element {worst} x={float(x[worst])!r} y={float(y[worst])!r} "
        f"err={float(err[worst])!r} > bound={float(bound[worst])!r}"
    )


def gaussian(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def mixed_magnitudes(n: int, seed: int = 0) -> torch.Tensor:
    """Blocks with scales from 1e-12 to 1e4 (fp16 scales hold them), values spread over 1e-9..1."""
    g = torch.Generator().manual_seed(seed)
    block_scale = 10.0 ** torch.randint(-12, 5, (n // 64 + 1,), generator=g).double()
    within = 10.0 ** (-9 * torch.rand(n, generator=g, dtype=torch.float64))
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return (block_scale.repeat_interleave(64)[:n] * within * sign).float()


# ---------------------------------------------------------------------------------------------
# error bounds


@pytest.mark.parametrize("scale_dtype", SCALES, ids=["fp32scale", "fp16scale"])
@pytest.mark.parametrize("codec", ALL_CODECS, ids=L.codec_name)
@pytest.mark.parametrize("n", [1, 255, 257, 1000])
def test_gaussian_roundtrip_error_within_documented_bound(n, codec, scale_dtype):
    assert_within_bound(gaussian(n, seed=n), codec, scale_dtype)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=L.codec_name)
def test_million_element_odd_length_roundtrip_within_bound(codec):
    assert_within_bound(gaussian(1_000_003), codec, pb.SCALE_FP32)


@pytest.mark.parametrize("scale_dtype", SCALES, ids=["fp32scale", "fp16scale"])
@pytest.mark.parametrize("codec", ALL_CODECS, ids=L.codec_name)
@pytest.mark.parametrize(
    "data",
    [
        lambda: mixed_magnitudes(5000),
        lambda: gaussian(700) * 1e-30,
        lambda: gaussian(700) * 1e-40,  # float32 subnormals
        lambda: torch.tensor([1e-45, -1e-45, 0.0] * 100),  # smallest subnormal: scale underflows
        lambda: torch.cat([gaussian(300), torch.zeros(300), gaussian(300) * 1e4]),
    ],
    ids=["mixed", "tiny", "subnormal", "min_subnormal", "zeros_between_blocks"],
)
def test_extreme_and_mixed_magnitudes_stay_within_bound(data, codec, scale_dtype):
    assert_within_bound(data(), codec, scale_dtype, bs=64)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=L.codec_name)
def test_huge_magnitudes_with_fp32_scales_stay_within_bound(codec):
    x = gaussian(1000) * 1e30
    x[7] = 3.0e38  # near float32 max: int8/int4 scale * code must not overflow
    x[8] = -3.0e38
    assert_within_bound(x, codec, pb.SCALE_FP32)


@pytest.mark.parametrize("scale_dtype", SCALES, ids=["fp32scale", "fp16scale"])
@pytest.mark.parametrize("codec", ALL_CODECS, ids=L.codec_name)
def test_all_zeros_decode_to_exact_zeros(codec, scale_dtype):
    y = roundtrip(torch.zeros(513), codec, scale_dtype)
    assert torch.equal(y, torch.zeros(513))


def test_all_zero_block_has_zero_scale_and_zero_codes():
    buf = C.encode(torch.zeros(10), INT8, block_size=10)
    assert buf.tolist() == [0] * 14


@pytest.mark.parametrize("codec", BLOCKWISE, ids=L.codec_name)
def test_fp16_scales_make_the_payload_smaller(codec):
    assert L.encoded_nbytes(codec, 1024, 256, pb.SCALE_FP16) == (
        L.encoded_nbytes(codec, 1024, 256, pb.SCALE_FP32) - 4 * 2
    )


@pytest.mark.parametrize(
    ("codec", "ok", "too_big"),
    [(INT8, 1e6, 1e7), (INT4, 4e5, 5e5), (FP4, 65504.0, 7e4)],
    ids=["int8", "int4", "fp4"],
)
def test_fp16_scale_beyond_fp16_range_is_rejected(codec, ok, too_big):
    x = gaussian(512)
    x[3] = ok  # the scale (absmax / qmax, or absmax for fp4) still fits in fp16
    assert_within_bound(x, codec, pb.SCALE_FP16)
    x[300] = too_big
    with pytest.raises(L.CodecError, match="fp16"):
        C.encode(x, codec, scale_dtype=pb.SCALE_FP16)


def test_non_fp32_strided_and_grad_requiring_inputs_encode_like_plain_fp32():
    x = gaussian(1000)
    strided = torch.stack([x, -x], dim=1)[:, 0]
    assert not strided.is_contiguous()
    assert torch.equal(C.encode(strided, FP4), C.encode(x, FP4))
    assert torch.equal(C.encode(x.clone().requires_grad_(), INT8), C.encode(x, INT8))
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        assert torch.equal(C.encode(xd, INT8), C.encode(xd.float(), INT8))
        assert torch.equal(C.encode(xd, FP32), C.encode(xd.float(), FP32))


def test_run_size_does_not_change_the_bytes(monkeypatch):
    """Encode/decode walk the tensor in runs of whole blocks; the run length is invisible."""
    x = gaussian(10_001)
    for codec in ALL_CODECS:
        header = L.make_header(codec, x.numel(), 64)
        whole = C.encode(x, codec, 64)
        decoded = C.decode(whole, header, torch.empty(x.numel()))
        monkeypatch.setattr(blockwise, "RUN_ELEMS", 200)  # several runs, the last one short
        assert torch.equal(C.encode(x, codec, 64), whole)
        assert torch.equal(C.decode(whole, header, torch.empty(x.numel())), decoded)
        monkeypatch.undo()


# ---------------------------------------------------------------------------------------------
# byte layouts


def test_fp32_layout_is_raw_little_endian_float32():
    buf = C.encode(torch.tensor([1.5, -2.0]), FP32)
    assert bytes(buf.tolist()) == struct.pack("<2f", 1.5, -2.0)


def test_bf16_rounds_to_nearest_even():
    x = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8])  # ties: to 1.0 and to 1 + 2**-6
    assert roundtrip(x, BF16).tolist() == [1.0, 1.0 + 2.0**-6]


def test_int8_layout_is_codes_then_fp32_scales():
    buf = C.encode(torch.tensor([127.0, -63.5, 0.0, 2.0, 4.0]), INT8, block_size=4)
    codes, scales = buf[:5].view(torch.int8).tolist(), bytes(buf[5:].tolist())
    assert codes == [127, -64, 0, 2, 127]  # -63.5 rounds half to even
    assert scales == struct.pack("<2f", 1.0, 4.0 / 127)


def test_int4_packs_two_codes_per_byte_low_nibble_first():
    x = torch.tensor([7.0, -7.0, 1.0, 0.0, -3.5])  # odd length: last byte's high nibble is padding
    buf = C.encode(x, INT4, block_size=4, scale_dtype=pb.SCALE_FP16)
    assert buf.numel() == 3 + 2 * 2
    assert buf[0] == (7 + 8) | (-7 + 8) << 4
    assert buf[1] == (1 + 8) | (0 + 8) << 4
    assert int(buf[2]) & 15 == -7 + 8
    assert bytes(buf[3:].tolist()) == struct.pack("<2e", 1.0, 0.5)


def test_fp4_rounds_to_nearest_power_of_two_and_flushes_below_half_the_smallest():
    lo = 2.0**-6  # smallest non-zero magnitude, relative to the block absmax
    x = torch.tensor([1.0, -0.5, 0.3, 0.2, 0.76, 0.74, lo * 0.51, lo * 0.49, lo * 1.4, 0.0, -1.0])
    expected = [1.0, -0.5, 0.25, 0.25, 1.0, 0.5, lo, 0.0, lo, 0.0, -1.0]
    assert roundtrip(x, FP4, bs=12).tolist() == expected


def test_fp4_codes_are_sign_bit_and_exponent_field():
    buf = C.encode(torch.tensor([4.0, -1.0, 2.0**-4, 0.0]), FP4, block_size=4)
    # 4 -> e=7; -1 = 4 * 2**-2 -> sign | e=5; 2**-4 = 4 * 2**-6 -> e=1; 0 -> 0
    assert buf[:2].tolist() == [7 | (8 | 5) << 4, 1 | 0 << 4]
    assert bytes(buf[2:].tolist()) == struct.pack("<f", 4.0)


# ---------------------------------------------------------------------------------------------
# rejected input


@pytest.mark.parametrize("codec", ALL_CODECS, ids=L.codec_name)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_encode_rejects_nan_and_inf(codec, bad):
    x = gaussian(300)
    x[257] = bad
    with pytest.raises(L.CodecError, match="NaN or Inf"):
        C.encode(x, codec)


def test_bf16_encode_rejects_values_beyond_bf16_range():
    with pytest.raises(L.CodecError, match="range of bf16"):
        C.encode(torch.tensor([1.0, 3.4e38]), BF16)


def test_encode_rejects_non_1d_and_non_float_tensors():
    with pytest.raises(L.CodecError, match="1-D float"):
        C.encode(torch.zeros(2, 2), INT8)
    with pytest.raises(L.CodecError, match="1-D float"):
        C.encode(torch.zeros(4, dtype=torch.int32), INT8)


def encoded_int8_with_scale(scale: float, scale_dtype: int = pb.SCALE_FP32):
    x = gaussian(512)
    header = L.make_header(INT8, 512, 256, scale_dtype)
    buf = C.encode(x, INT8, scale_dtype=scale_dtype)
    fmt = "<f" if scale_dtype == pb.SCALE_FP32 else "<e"
    size = struct.calcsize(fmt)
    buf[512 + size : 512 + 2 * size] = torch.tensor(
        list(struct.pack(fmt, scale)), dtype=torch.uint8
    )
    return buf, header


@pytest.mark.parametrize(
    ("scale", "scale_dtype"),
    [
        (float("nan"), pb.SCALE_FP32),
        (-1.0, pb.SCALE_FP32),
        (float("inf"), pb.SCALE_FP32),
        (3.0e38, pb.SCALE_FP32),  # finite, but scale * 127 overflows float32
        (2.7e36, pb.SCALE_FP32),  # scale * 127 is 3.43e38: beyond float32, not float64
        (float("nan"), pb.SCALE_FP16),
        (-0.5, pb.SCALE_FP16),
    ],
    ids=["nan", "negative", "inf", "overflowing", "overflowing_fp32", "fp16_nan", "fp16_negative"],
)
def test_decode_rejects_bad_scales(scale, scale_dtype):
    buf, header = encoded_int8_with_scale(scale, scale_dtype)
    with pytest.raises(L.CodecError, match="block 1 has scale"):
        C.decode(buf, header, torch.empty(512))


@pytest.mark.parametrize("codec", [INT4, FP4], ids=L.codec_name)
def test_decode_rejects_bad_scales_of_4bit_codecs(codec):
    header = L.make_header(codec, 100, 50)
    buf = C.encode(gaussian(100), codec, block_size=50)
    buf[-4:] = torch.tensor(list(struct.pack("<f", float("nan"))), dtype=torch.uint8)
    with pytest.raises(L.CodecError, match="block 1 has scale"):
        C.decode(buf, header, torch.empty(100))


def test_decode_accepts_foreign_int8_code_minus_128_unless_it_overflows():
    buf, header = encoded_int8_with_scale(3.4e38 / 128)
    buf[300] = 128  # int8 -128, never written by encode
    assert float(C.decode(buf, header, torch.empty(512))[300]) == pytest.approx(-3.4e38)
    buf, header = encoded_int8_with_scale(3.4e38 / 127)  # 127 * scale fits, 128 * scale does not
    C.decode(buf, header, torch.empty(512))
    buf[300] = 128
    with pytest.raises(L.CodecError, match="-128"):
        C.decode(buf, header, torch.empty(512))


def test_decode_reads_foreign_int4_nibble_zero_as_minus_7():
    buf = C.encode(torch.tensor([7.0, 1.0]), INT4, block_size=2)
    buf[0] = 0x90  # low nibble 0 (never written), high nibble 9 (q = 1)
    assert C.decode(buf, L.make_header(INT4, 2, 2), torch.empty(2)).tolist() == [-7.0, 1.0]


@pytest.mark.parametrize("codec", [FP32, BF16], ids=L.codec_name)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_decode_rejects_nan_or_inf_in_raw_payloads(codec, bad):
    buf = C.encode(gaussian(10), codec)
    dtype = torch.float32 if codec == FP32 else torch.bfloat16
    buf.view(dtype)[4] = bad
    with pytest.raises(L.CodecError, match="NaN or Inf"):
        C.decode(buf, L.make_header(codec, 10), torch.empty(10))


def test_decode_rejects_buffer_and_output_of_the_wrong_size():
    header = L.make_header(INT8, 100)
    buf = C.encode(gaussian(100), INT8)
    with pytest.raises(L.CodecError, match="bytes"):
        C.decode(buf[:-1], header, torch.empty(100))
    with pytest.raises(L.CodecError, match="elements"):
        C.decode(buf, header, torch.empty(99))
    with pytest.raises(L.CodecError, match="float32"):
        C.decode(buf, header, torch.empty(100, dtype=torch.float64))


def test_decode_reads_a_payload_at_an_unaligned_offset():
    x = gaussian(33)
    buf = C.encode(x, FP32)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), buf])[1:]
    assert torch.equal(C.decode(shifted, L.make_header(FP32, 33), torch.empty(33)), x)


# ---------------------------------------------------------------------------------------------
# headers and sizes


@pytest.mark.parametrize("scale_dtype", SCALES, ids=["fp32scale", "fp16scale"])
@pytest.mark.parametrize("codec", ALL_CODECS, ids=L.codec_name)
@pytest.mark.parametrize(("n", "bs"), [(0, 256), (1, 2), (7, 4), (256, 256), (1001, 64)])
def test_encoded_nbytes_matches_encode_and_header(n, bs, codec, scale_dtype):
    nbytes = L.encoded_nbytes(codec, n, bs, scale_dtype)
    assert C.encode(gaussian(n), codec, bs, scale_dtype).numel() == nbytes
    header = L.make_header(codec, n, bs, scale_dtype)
    assert header.total_bytes == nbytes
    L.validate_header(header, expected_numel=n)


def test_encoded_nbytes_formulas():
    assert L.encoded_nbytes(FP32, 5) == 20
    assert L.encoded_nbytes(BF16, 5) == 10
    assert L.encoded_nbytes(INT8, 5, 4) == 5 + 2 * 4
    assert L.encoded_nbytes(INT4, 5, 4, pb.SCALE_FP16) == 3 + 2 * 2
    assert L.encoded_nbytes(FP4, 1000, 256) == 500 + 4 * 4


def test_make_header_stores_no_block_size_for_raw_codecs():
    header = L.make_header(BF16, 10, block_size=128, scale_dtype=pb.SCALE_FP16)
    assert (header.block_size, header.scale_dtype, header.total_bytes) == (0, pb.SCALE_FP32, 20)
    assert L.make_header(INT4, 10, block_size=4).block_size == 4


def test_validate_header_accepts_a_made_header_with_allowed_codec():
    L.validate_header(L.make_header(INT8, 10), 10, allowed={INT8, FP32})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"numel": 11}, "11 elements but 10 were expected"),
        ({"total_bytes": 15}, "total_bytes 15 does not match"),
        ({"codec": 99}, "unknown or unspecified"),
        ({"codec": pb.CODEC_UNSPECIFIED}, "unknown or unspecified"),
        ({"codec": INT4}, "int4 is not accepted here; allowed: fp32, int8"),
        ({"block_size": 0}, "block_size 0 is invalid"),
        ({"block_size": 3}, "block_size 3 is invalid"),
        ({"block_size": 1 << 21}, "must be even and in 2..1048576"),
        ({"scale_dtype": 7}, "unknown scale dtype 7"),
    ],
)
def test_validate_header_rejects(change, message):
    header = L.make_header(INT8, 10)
    for field, value in change.items():
        setattr(header, field, value)
    with pytest.raises(L.CodecError, match=message):
        L.validate_header(header, expected_numel=10, allowed=[FP32, INT8])


def test_codec_names_round_trip_and_unknown_names_list_the_choices():
    for name, codec in L.CODEC_NAMES.items():
        assert L.codec_name(codec) == name
        assert L.parse_codec(name) == codec
    assert L.parse_codec("INT4") == INT4
    with pytest.raises(L.CodecError, match="fp32, bf16, int8, int4, fp4"):
        L.parse_codec("int2")
    with pytest.raises(L.CodecError, match="unknown codec 0"):
        L.codec_name(pb.CODEC_UNSPECIFIED)


def test_encoded_nbytes_rejects_bad_parameters():
    with pytest.raises(L.CodecError, match="block_size"):
        L.encoded_nbytes(INT8, 10, block_size=0)
    with pytest.raises(L.CodecError, match="numel"):
        L.encoded_nbytes(INT8, -1)
    with pytest.raises(L.CodecError, match="scale dtype"):
        L.encoded_nbytes(INT8, 10, scale_dtype=5)


# ---------------------------------------------------------------------------------------------
# encode into a preallocated buffer


def test_encode_with_out_writes_in_place():
    x = gaussian(1000)
    out = torch.zeros(L.encoded_nbytes(INT4, 1000), dtype=torch.uint8)
    result = C.encode(x, INT4, out=out)
    assert result is out
    assert torch.equal(out, C.encode(x, INT4))


def test_encode_rejects_out_of_the_wrong_size_or_dtype():
    x = gaussian(100)
    with pytest.raises(L.CodecError, match="104 bytes"):
        C.encode(x, INT8, out=torch.empty(103, dtype=torch.uint8))
    with pytest.raises(L.CodecError, match="uint8"):
        C.encode(x, INT8, out=torch.empty(104, dtype=torch.int8))


# ---------------------------------------------------------------------------------------------
# chunks and reassembly


def test_payload_spanning_several_chunks_reassembles_and_decodes_identically():
    x = gaussian(10_000)
    header = L.make_header(INT8, x.numel(), 128)
    buf = C.encode(x, INT8, 128)
    chunks = list(F.iter_chunks(buf, chunk_bytes=1000))
    assert len(chunks) == math.ceil(buf.numel() / 1000)
    assert [c.offset for c in chunks] == list(range(0, buf.numel(), 1000))
    assembler = F.Assembler(header, max_bytes=header.total_bytes)
    for chunk in chunks:
        assert not assembler.complete
        assembler.add(chunk)
    assert assembler.complete
    received = assembler.finish()
    assert torch.equal(received, buf)
    y = C.decode(received, header, torch.empty(x.numel()))
    assert torch.equal(y, C.decode(buf, header, torch.empty(x.numel())))


def test_empty_payload_is_no_chunks_and_assembles_immediately():
    header = L.make_header(INT8, 0)
    buf = C.encode(torch.empty(0), INT8)
    assert header.total_bytes == 0 and list(F.iter_chunks(buf)) == []
    assembler = F.Assembler(header)
    assert assembler.complete and assembler.finish().numel() == 0
    assert C.decode(assembler.finish(), header, torch.empty(0)).numel() == 0


def test_iter_chunks_default_size_and_cpu_only():
    buf = torch.arange(256, dtype=torch.uint8).repeat(F.CHUNK_BYTES // 256 * 2 + 1)
    chunks = list(F.iter_chunks(buf))
    assert [len(c.data) for c in chunks] == [F.CHUNK_BYTES, F.CHUNK_BYTES, 256]
    assert b"".join(c.data for c in chunks) == bytes(buf.tolist())
    with pytest.raises(L.CodecError, match="uint8 CPU"):
        next(F.iter_chunks(torch.zeros(4)))


def assembler_for(total: int, max_bytes: int | None = None) -> F.Assembler:
    return F.Assembler(pb.PayloadHeader(total_bytes=total), max_bytes=max_bytes)


def test_assembler_rejects_out_of_order_chunk():
    assembler = assembler_for(10)
    assembler.add(pb.Chunk(offset=0, data=b"abcd"))
    with pytest.raises(L.CodecError, match="offset 6 arrived, expected offset 4"):
        assembler.add(pb.Chunk(offset=6, data=b"ef"))
    with pytest.raises(L.CodecError, match="offset 0 arrived, expected offset 4"):
        assembler.add(pb.Chunk(offset=0, data=b"abcd"))  # a replayed chunk


def test_assembler_rejects_chunk_overflowing_the_payload():
    assembler = assembler_for(5)
    assembler.add(pb.Chunk(offset=0, data=b"abc"))
    with pytest.raises(L.CodecError, match="overflows the payload of 5 bytes"):
        assembler.add(pb.Chunk(offset=3, data=b"def"))


def test_assembler_rejects_empty_chunk():
    with pytest.raises(L.CodecError, match="empty chunk"):
        assembler_for(5).add(pb.Chunk(offset=0, data=b""))


def test_assembler_finish_before_all_bytes_arrived_is_an_error():
    assembler = assembler_for(8)
    assembler.add(pb.Chunk(offset=0, data=b"abc"))
    with pytest.raises(L.CodecError, match="stream ended after 3 of 8 bytes"):
        assembler.finish()


def test_assembler_refuses_payload_larger_than_max_bytes():
    with pytest.raises(L.CodecError, match="exceeds the limit of 100 bytes"):
        assembler_for(101, max_bytes=100)
    assembler_for(100, max_bytes=100)


# ---------------------------------------------------------------------------------------------
# CUDA (runs only where a GPU is present: conftest skips `cuda` tests elsewhere)


@pytest.mark.cuda
@pytest.mark.parametrize("scale_dtype", SCALES, ids=["fp32scale", "fp16scale"])
@pytest.mark.parametrize("codec", ALL_CODECS, ids=L.codec_name)
def test_cuda_encode_and_decode_match_cpu(codec, scale_dtype):
    x = mixed_magnitudes(100_001)
    header = L.make_header(codec, x.numel(), 256, scale_dtype)
    cpu = C.encode(x, codec, 256, scale_dtype)
    gpu = C.encode(x.cuda(), codec, 256, scale_dtype)
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.cpu(), cpu)
    out = torch.empty(x.numel(), device="cuda")
    assert torch.equal(
        C.decode(gpu, header, out).cpu(), C.decode(cpu, header, torch.empty(x.numel()))
    )


@pytest.mark.cuda
def test_cuda_encode_rejects_nan():
    x = gaussian(1000).cuda()
    x[999] = float("nan")
    with pytest.raises(L.CodecError, match="NaN or Inf"):
        C.encode(x, INT4)


# ---------------------------------------------------------------------------------------------
# check, accumulate and the word-wise INT4 decode


def _bad_payloads() -> list[tuple[str, torch.Tensor, pb.PayloadHeader]]:
    """Payloads that decode rejects, one of each kind."""
    cases = []
    for codec in (FP32, BF16):
        buf = C.encode(gaussian(10), codec)
        buf.view(torch.float32 if codec == FP32 else torch.bfloat16)[4] = float("nan")
        cases.append((L.codec_name(codec) + "-nan", buf, L.make_header(codec, 10)))
    for codec in BLOCKWISE:
        buf = C.encode(gaussian(512), codec)
        scales = buf[L.encoded_nbytes(codec, 512) - 8 :].view(torch.float32)
        scales[1] = float("inf")
        cases.append((L.codec_name(codec) + "-inf-scale", buf, L.make_header(codec, 512)))
    buf = C.encode(torch.full((512,), 3.4e38), INT8)  # 127 * scale fits, 128 * scale does not
    buf[300] = 128
    cases.append(("int8-minus-128-overflow", buf, L.make_header(INT8, 512)))
    return cases


@pytest.mark.parametrize(
    "name,buf,header", _bad_payloads(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_check_rejects_exactly_what_decode_rejects(name, buf, header):
    with pytest.raises(L.CodecError):
        C.decode(buf, header, torch.empty(header.numel))
    with pytest.raises(L.CodecError):
        C.check(buf, header)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=L.codec_name)
@pytest.mark.parametrize("n", [1, 300, 4096])
def test_check_accepts_what_decode_accepts(codec, n):
    buf = C.encode(gaussian(n), codec)
    C.check(buf, L.make_header(codec, n))
    with pytest.raises(L.CodecError, match="bytes"):
        C.check(buf[:-1], L.make_header(codec, n))


@pytest.mark.parametrize("codec", ALL_CODECS, ids=L.codec_name)
@pytest.mark.parametrize("n", [7, 512, 256 * 4099 + 100, 1 << 21])
def test_accumulate_adds_weight_times_the_decoded_values(codec, n):
    x = gaussian(n)
    buf, header = C.encode(x, codec), L.make_header(codec, n)
    received = buf.clone()
    decoded = C.decode(buf, header, torch.empty(n)).double()
    base = gaussian(n, seed=1)
    out = base.clone()
    C.accumulate(buf, header, out, 0.375)
    torch.testing.assert_close(out.double(), base.double() + 0.375 * decoded, rtol=1e-6, atol=1e-6)
    C.accumulate(buf, header, out, 2.0, overwrite=True, scratch=torch.empty(n))
    torch.testing.assert_close(out.double(), 2.0 * decoded, rtol=1e-6, atol=1e-7)
    assert torch.equal(buf, received)  # the weight is folded into copies of the scales


@pytest.mark.parametrize("scratch", [False, True])
def test_accumulate_weighs_bf16_values_in_fp32_as_decode_gives_them(scratch):
    # A weight that is not a power of two: weighting the BF16 values themselves rounded each
    # product to BF16 again, off by up to 2^-9 of it, where the decoded values are exact.
    n = 256 * 4099 + 100
    buf, header = C.encode(gaussian(n), BF16), L.make_header(BF16, n)
    decoded = C.decode(buf, header, torch.empty(n))
    out = torch.empty(n)
    C.accumulate(buf, header, out, 0.3, overwrite=True, scratch=torch.empty(n) if scratch else None)
    assert torch.equal(out, torch.mul(decoded, 0.3))
    C.accumulate(buf, header, out, 0.375)
    assert torch.equal(out, torch.mul(decoded, 0.3).add_(decoded, alpha=0.375))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_finite_finds_every_nan_and_inf_and_passes_values_whose_squares_overflow(dtype):
    x = gaussian(300_000).to(dtype)
    assert blockwise.all_finite(x)
    for bad in (math.nan, math.inf, -math.inf):
        for at in (0, 150_000, 299_998):
            y = x.clone()
            y[at] = bad
            assert not blockwise.all_finite(y)
            assert not blockwise.all_finite(y.view(-1, 2)[:, 0])  # not contiguous
    huge = x.clone()
    huge[7] = 3e38  # finite; its square is not
    assert blockwise.all_finite(huge)
    assert blockwise.all_finite(x.view(1, -1))


def test_accumulate_rejects_an_output_of_the_wrong_size():
    buf = C.encode(gaussian(10), INT8)
    with pytest.raises(L.CodecError, match="10 elements"):
        C.accumulate(buf, L.make_header(INT8, 10), torch.empty(11), 1.0)


def test_int4_word_wise_decode_matches_the_table_for_every_byte():
    # Every byte value, as whole aligned words (the word-wise path) and at an odd offset (the
    # table path), must give the same values.
    n = 512
    codes = torch.arange(256, dtype=torch.uint8)
    buf = torch.cat([codes, torch.ones(2, dtype=torch.float32).view(torch.uint8)])
    header = L.make_header(INT4, n)
    fast = C.decode(buf, header, torch.empty(n))
    table = blockwise.pair_table(INT4, torch.device("cpu"))[codes.long()].reshape(-1)
    assert torch.equal(fast, table)
    shifted = torch.empty(buf.numel() + 1, dtype=torch.uint8)
    shifted[1:] = buf
    assert torch.equal(C.decode(shifted[1:], header, torch.empty(n)), table)


def test_values_is_the_payload_itself_for_fp32_and_a_decode_otherwise():
    x = gaussian(100)
    buf = C.encode(x, FP32)
    v = C.values(buf, L.make_header(FP32, 100), torch.empty(100))
    assert v.data_ptr() == buf.data_ptr() and torch.equal(v, x)
    buf8 = C.encode(x, INT8)
    scratch = torch.empty(100)
    assert C.values(buf8, L.make_header(INT8, 100), scratch) is scratch


# ---------------------------------------------------------------------------------------------
# l2_norm: the norm of a payload without decoding it whole


@pytest.mark.parametrize("scale_dtype", SCALES, ids=["fp32scale", "fp16scale"])
@pytest.mark.parametrize("codec", ALL_CODECS, ids=L.codec_name)
@pytest.mark.parametrize(("n", "bs"), [(1, 2), (7, 4), (1001, 64), (256 * 4099 + 100, 256)])
def test_l2_norm_is_the_norm_of_the_decoded_payload(n, bs, codec, scale_dtype):
    x = mixed_magnitudes(n)
    buf, header = C.encode(x, codec, bs, scale_dtype), L.make_header(codec, n, bs, scale_dtype)
    expected = C.decode(buf, header, torch.empty(n)).double().norm().item()
    assert C.l2_norm(buf, header) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=L.codec_name)
def test_l2_norm_walks_runs_and_never_decodes_whole(codec, monkeypatch):
    x = gaussian(10_001)
    buf, header = C.encode(x, codec, 64), L.make_header(codec, x.numel(), 64)
    whole = C.l2_norm(buf, header)
    monkeypatch.setattr(blockwise, "RUN_ELEMS", 200)  # several runs, the last one short
    assert C.l2_norm(buf, header) == pytest.approx(whole, rel=1e-6)
    decodes: list[int] = []
    monkeypatch.setattr(C, "decode", lambda *a, **k: decodes.append(1))
    monkeypatch.setattr(blockwise, "decode", lambda *a, **k: decodes.append(1))
    C.l2_norm(buf, header)
    assert not decodes


@pytest.mark.parametrize("codec", ALL_CODECS, ids=L.codec_name)
def test_l2_norm_of_huge_values_is_finite_and_exact(codec):
    # Squares of 1e30 overflow float32; the norm of what check accepts must not.
    x = torch.full((1000,), 1e30)
    x[::2] = -1e30
    buf, header = C.encode(x, codec), L.make_header(codec, 1000)
    C.check(buf, header)
    rel = 2**-7 if codec == BF16 else 1e-6
    assert C.l2_norm(buf, header) == pytest.approx(1e30 * math.sqrt(1000), rel=rel)


def test_l2_norm_of_nothing_is_zero():
    for codec in ALL_CODECS:
        assert C.l2_norm(C.encode(torch.empty(0), codec), L.make_header(codec, 0)) == 0.0


@pytest.mark.parametrize("codec", [INT8, INT4, FP4], ids=L.codec_name)
def test_norm_estimate_is_close_and_its_bound_holds_for_any_codes(codec):
    g = torch.Generator().manual_seed(5)
    n = 64 * 1000 + 17
    x = torch.randn(n, generator=g) * torch.linspace(0.01, 4.0, n)  # tensors of unlike scales
    buf = C.encode(x, codec, block_size=64)
    header = L.make_header(codec, n, block_size=64)
    exact = C.l2_norm(buf, header)
    estimate, upper = C.norm_estimate(buf, header)
    assert abs(estimate - exact) / exact < 0.1 and exact <= upper
    # The bound comes from the scales alone: codes all at their extreme cannot pass it.
    code_bytes = L.code_bytes(codec, n)
    buf[:code_bytes] = 0x80 if codec == INT8 else 0x77 if codec == FP4 else 0x11
    worst = C.l2_norm(buf, header)
    assert worst <= C.norm_estimate(buf, header)[1] * (1 + 1e-9)


@pytest.mark.parametrize(
    "codec_id", [pb.CODEC_FP32, pb.CODEC_BF16, pb.CODEC_INT8, pb.CODEC_INT4, pb.CODEC_FP4_E3M0]
)
@pytest.mark.parametrize("n", [1, 255, (1 << 20) + 3 * 256 + 5])
def test_decode_runs_yields_decode_values_run_by_run(codec_id: int, n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    header = L.make_header(codec_id, n)
    buf = C.encode(x, codec_id)
    whole = C.decode(buf, header, torch.empty(n))
    scratch = torch.empty(C.run_elems(header))
    rebuilt, starts = torch.empty(n), []
    for start, vals in C.decode_runs(buf, header, scratch):
        rebuilt[start : start + vals.numel()] = vals
        starts.append(start)
    assert torch.equal(rebuilt, whole)
    assert starts == list(range(0, n, C.run_elems(header)))


@pytest.mark.parametrize("n", [300, 256 * 4099 + 100, (1 << 21) + 7])
def test_accumulate_without_scratch_decodes_fp4_run_by_run_exactly_as_a_whole_decode(n):
    buf, header = C.encode(gaussian(n), FP4), L.make_header(FP4, n)
    decoded = C.decode(buf, header, torch.empty(n))
    base = gaussian(n, seed=1)
    out = base.clone()
    C.accumulate(buf, header, out, 0.375)
    assert torch.equal(out, base.clone().add_(decoded, alpha=0.375))
    C.accumulate(buf, header, out, 2.0, overwrite=True)
    assert torch.equal(out, torch.mul(decoded, 2.0))


def test_int4_values_of_every_byte_are_the_tables_including_the_never_encoded_nibble_0():
    codes = torch.arange(256, dtype=torch.uint8).repeat(4)  # whole 4-byte words, every byte
    table = blockwise.pair_table(pb.CODEC_INT4, torch.device("cpu"))
    expected = table[codes.long()].reshape(-1)
    assert torch.equal(blockwise.int4_values(codes).float(), expected)
    assert blockwise.int4_values(torch.tensor([0x00, 0x10, 0xF1], dtype=torch.uint8)).tolist() == [
        -7,
        -7,
        -7,
        -7,
        -7,
        7,
    ]
