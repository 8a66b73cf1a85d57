"""The native outer-step kernels (synchronizer/native.c): each against the same arithmetic done
by torch one IEEE operation at a time, bit for bit; the Synchronizer's use of them (rounds,
the update chain a learner replays, the epoch they belong to); and what happens where they
cannot be built."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from protos import blockwise, codec, layout
from protos import diloco_pb2 as pb
from protos.spec import ModelSpec
from synchronizer import crc, journal, native, native_build, receive
from synchronizer.clock import ManualClock
from synchronizer.config import SynchronizerConfig
from synchronizer.core import Synchronizer
from synchronizer.downlink import Downlink
from synchronizer.fragments import Fragment
from synchronizer.merge import Accumulator, weighted_codes
from synchronizer.model import bounded_by_scales
from synchronizer.outer import Nesterov, make_outer
from tests.core_helpers import CoreClient, make_core
from tests.helpers import small_spec

BS = layout.DEFAULT_BLOCK_SIZE
N = 7 * BS + 77  # a partial last block, and an odd element count (an INT4 half byte)


@pytest.fixture(autouse=True)
def kernels() -> None:
    try:
        native.load()
    except native.NativeUnavailable as e:
        pytest.skip(f"no native kernels here: {e}")


def _push(codec_id: int, seed: int, n: int = N) -> tuple[torch.Tensor, pb.PayloadHeader]:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e-3
    return codec.encode(x, codec_id), layout.make_header(codec_id, n)


def _codes(buf: torch.Tensor, h: pb.PayloadHeader, n: int) -> torch.Tensor:
    """The code values of an INT8 or INT4 payload, as FP32 (exact small integers)."""
    code_bytes = buf[: layout.code_bytes(h.codec, n)]
    if h.codec == pb.CODEC_INT8:
        return code_bytes.view(torch.int8).float()
    return blockwise.int4_values(code_bytes)[:n].float()


def _reference_sum(
    pushes: list[tuple[torch.Tensor, pb.PayloadHeader, float]], n: int
) -> torch.Tensor:
    """sum_k code_k * (scale_k * w_k), or value_k * w_k for BF16 and FP32 (in FP32): each
    product rounded, then added, in order."""
    total: torch.Tensor | None = None
    for buf, h, w in pushes:
        if h.codec in (pb.CODEC_BF16, pb.CODEC_FP32):
            values = codec.decode(buf, h, torch.empty(n))  # BF16 values are exact in FP32
            term = torch.mul(values, torch.tensor(w, dtype=torch.float32))
        else:
            scales = blockwise.checked_scales(buf, h.codec, n, h.scale_dtype) * w
            term = torch.mul(_codes(buf, h, n), scales.repeat_interleave(int(h.block_size))[:n])
        total = term if total is None else torch.add(total, term)
    assert total is not None
    return total


@pytest.mark.parametrize("first", [pb.CODEC_INT4, pb.CODEC_BF16, pb.CODEC_FP32])
def test_accumulate_is_each_push_weighted_and_added_in_order_bit_for_bit(first: int) -> None:
    # Codes and values in one round, whichever comes first (values have no block size)
    pushes = [
        (*_push(first, 1), 0.5),
        (*_push(pb.CODEC_INT8, 2), 3.0),
        (*_push(pb.CODEC_BF16, 3), 1.25),
        (*_push(pb.CODEC_FP32, 4), 0.3),
        (*_push(pb.CODEC_INT4, 5), 1.0),
    ]
    total = 6.05
    together = Accumulator(N, native_kernels=True)
    together.add_payloads(pushes)
    one_by_one = Accumulator(N, native_kernels=True)
    for buf, h, w in pushes:
        one_by_one.add_payload(buf, h, w)
    expected = _reference_sum(pushes, N)
    assert torch.equal(together.merged(), expected / total)
    assert torch.equal(one_by_one.merged(), expected / total)
    assert together.count == 5 and together.total_weight == pytest.approx(total)
    torch_path = Accumulator(N)  # torch's kernels: the same values within rounding
    torch_path.add_payloads(pushes)
    assert torch.allclose(torch_path.merged(), expected / total, rtol=1e-6, atol=1e-9)


def test_values_payloads_at_an_odd_offset_are_added_as_at_an_aligned_one() -> None:
    # A BF16 or FP32 payload received at an address its values are not aligned to (a slice of
    # a larger buffer) is read as aligned values, the same numbers
    for codec_id in (pb.CODEC_BF16, pb.CODEC_FP32):
        buf, h = _push(codec_id, 6)
        shifted = torch.empty(buf.numel() + 1, dtype=torch.uint8)
        shifted[1:] = buf
        sums = []
        for payload in (buf, shifted[1:]):
            acc = Accumulator(N, native_kernels=True)
            acc.add_payload(payload, h, 2.0)
            sums.append(acc.merged())
        assert torch.equal(sums[0], sums[1])
        assert torch.equal(sums[0], _reference_sum([(buf, h, 2.0)], N) / 2.0)


def test_absmax_is_the_largest_magnitude_and_shows_what_is_not_finite() -> None:
    x = torch.randn(N, generator=torch.Generator().manual_seed(7))
    x[123] = -40.0
    for dtype in (torch.bfloat16, torch.float32):
        values = x.to(dtype)
        assert native.absmax(values) == 40.0
        assert native.absmax(torch.zeros(5, dtype=dtype)) == 0.0
        broken = values.clone()
        broken[9] = float("-inf")
        assert native.absmax(broken) == float("inf")
        broken[9] = float("nan")
        assert math.isnan(native.absmax(broken))
    with pytest.raises(ValueError, match="BF16 or FP32"):
        native.absmax(torch.zeros(4, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_received_pushs_values_are_checked_and_their_norm_taken_in_one_pass(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The norm of FP32/BF16 values from the check's pass, within rounding of the exact one,
    # finite for values whose squares overflow FP32; what is not finite is refused with
    # codec.check's error, and without the kernels the check is torch's and gives no norm.
    codec_id = pb.CODEC_BF16 if dtype == torch.bfloat16 else pb.CODEC_FP32
    x = torch.randn(3 * 4096 + 5, generator=torch.Generator().manual_seed(8))
    for scale in (1e-3, 1e30):
        values = (x * scale).to(dtype)
        largest, norm = native.absmax_and_norm(values)
        exact = float(torch.linalg.vector_norm(values.double()))
        assert largest == float(values.abs().max()) and norm == pytest.approx(exact, rel=1e-6)
        buf, h = codec.encode(values.float(), codec_id), layout.make_header(codec_id, x.numel())
        assert receive.checked(buf, h) == (largest, norm)
    broken = x.to(dtype)
    broken[4096 + 3] = float("nan")
    largest, norm = native.absmax_and_norm(broken)
    assert math.isnan(largest) and norm == math.inf
    bad = broken.view(torch.uint8).clone()
    with pytest.raises(layout.CodecError, match=str(codec.not_finite(codec_id))):
        receive.checked(bad, h)
    assert native.absmax_and_norm(torch.zeros(0, dtype=dtype)) == (0.0, 0.0)
    monkeypatch.setattr(native, "available", lambda: False)
    assert receive.checked(buf, h) is None
    with pytest.raises(layout.CodecError, match="NaN or Inf"):
        receive.checked(bad, h)


def test_a_round_mixing_codecs_and_zero_weights_adds_what_the_torch_path_adds() -> None:
    pushes = [
        (*_push(pb.CODEC_FP32, 4), 1.0),
        (*_push(pb.CODEC_INT4, 5), 0.0),  # counts toward nothing
        (*_push(pb.CODEC_INT8, 6), 2.0),
        (*_push(pb.CODEC_BF16, 7), 1.0),
    ]
    native_acc, torch_acc = Accumulator(N, native_kernels=True), Accumulator(N)
    native_acc.add_payloads(pushes)
    torch_acc.add_payloads(pushes)
    assert native_acc.count == torch_acc.count == 3
    assert torch.allclose(native_acc.merged(), torch_acc.merged(), rtol=1e-6, atol=1e-9)


def test_merge_divides_in_place_and_gives_the_largest_magnitude() -> None:
    acc = Accumulator(N, native_kernels=True)
    acc.add_payload(*_push(pb.CODEC_INT8, 8), 3.0)
    sums = acc._sum.clone()
    merged = acc.merged()
    assert torch.equal(merged, sums / 3.0)
    assert acc.merged_max_abs == float(merged.abs().max())
    sums[11] = float("nan")
    assert native.merge(sums.clone(), 1.0) != native.merge(sums.clone(), 1.0)  # NaN
    sums[11] = float("inf")
    assert native.merge(sums, 1.0) == float("inf")


def _reference_chain(
    params: torch.Tensor,
    momentum: torch.Tensor,
    grad: torch.Tensor,
    residual: torch.Tensor,
    lr: float,
    mu: float,
    nu: float,
) -> torch.Tensor:
    """The chain's Nesterov step (momentum decayed by mu, looked ahead by nu), one IEEE
    operation per torch call (no fused multiply-add); updates its arguments in place and
    returns the link's bytes."""
    n = params.numel()
    momentum.copy_(torch.add(torch.mul(momentum, mu), grad))
    d = torch.add(grad, torch.mul(momentum, nu))
    u = torch.add(residual.float(), torch.mul(d, -lr))
    nb = -(-n // BS)
    padded = torch.zeros(nb * BS)
    padded[:n] = u
    scales = padded.view(nb, BS).abs().amax(dim=1) / torch.tensor([127.0])
    divisor = torch.where(scales > 0, scales, 1.0).repeat_interleave(BS)[:n]
    q = torch.div(u, divisor).round()
    values = torch.mul(q, scales.repeat_interleave(BS)[:n])
    params.copy_(torch.add(params, values))
    residual.copy_(torch.sub(u, values).to(residual.dtype))
    return torch.cat([q.to(torch.int8).view(torch.uint8), scales.view(torch.uint8)])


@pytest.mark.parametrize("share", [1.0, 0.3])
@pytest.mark.parametrize("residual_dtype", ["bf16", "fp32"])
def test_nesterov_chain_is_the_separate_operations_bit_for_bit_and_a_learner_replays_it(
    residual_dtype: str, share: float
) -> None:
    # share < 1: a partial step (`synchronizer.shares`) decays by 0.9**share, looks ahead by
    # share * 0.9; the torch path (no native kernels) computes the same operations.
    gen = torch.Generator().manual_seed(9)
    start = torch.randn(N, generator=gen)
    params, outer = start.clone(), Nesterov(N, lr=0.7, momentum=0.9)
    down = Downlink(N, "int8", 8, residual_dtype, native_kernels=True)
    ref_params, ref_momentum = start.clone(), torch.zeros(N)
    ref_residual = torch.zeros(N, dtype=down.residual_dtype)
    learner = start.clone()
    decay, look = (0.9, 0.9) if share == 1.0 else (0.9**share, share * 0.9)
    torch_params, torch_outer = start.clone(), Nesterov(N, lr=0.7, momentum=0.9)
    torch_down = Downlink(N, "int8", 8, residual_dtype, native_kernels=False)
    for version in range(1, 5):
        merged = torch.randn(N, generator=gen) * 1e-2
        down.step(params, merged, outer.begin(share), version)
        torch_down.step(torch_params, merged, torch_outer.begin(share), version)
        link = _reference_chain(ref_params, ref_momentum, merged, ref_residual, 0.7, decay, look)
        v, header, encoded = down.chain[-1]
        assert v == version and torch.equal(encoded, link)
        assert torch.equal(params, ref_params)
        assert torch.equal(outer.momentum_buffer, ref_momentum)
        assert down.residual is not None and torch.equal(down.residual, ref_residual)
        learner.add_(codec.decode(encoded, header, torch.empty(N)))  # what a delta pull does
        assert torch.equal(learner, params)
        assert torch.allclose(torch_params, params, rtol=0, atol=1e-6)


@pytest.mark.parametrize("residual_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nesterov", [True, False])
def test_a_step_from_encoded_pushes_is_accumulate_merge_reanchor_and_chain_bit_for_bit(
    residual_dtype: torch.dtype, nesterov: bool
) -> None:
    summed = weighted_codes(
        [
            (*_push(pb.CODEC_BF16, 20), 0.75),
            (*_push(pb.CODEC_INT8, 21), 1.0),
            (*_push(pb.CODEC_INT4, 22), 2.0),
            (*_push(pb.CODEC_FP32, 23), 0.5),
        ],
        N,
    )
    links = weighted_codes([(*_push(pb.CODEC_INT8, 24), 0.25)], N)  # added after the division
    gen = torch.Generator().manual_seed(25)
    start = torch.randn(N, generator=gen)
    momentum = torch.randn(N, generator=gen) * 1e-3
    residual = (torch.randn(N, generator=gen) * 1e-4).to(residual_dtype)
    mu = 0.9 if nesterov else 0.0
    got = []
    for fused in (True, False):
        p, m, r = start.clone(), momentum.clone(), residual.clone()
        codes, scales = torch.empty(N, dtype=torch.uint8), torch.empty(-(-N // BS))
        if fused:
            finite = native.step_int8(
                summed + links, 4, 4.25, p, m if nesterov else None, r, codes, scales, BS, -0.7, mu
            )
        else:
            merged = torch.empty(N)
            native.accumulate(summed, N, BS, merged, overwrite=True)
            native.merge(merged, 4.25)
            native.accumulate(links, N, BS, merged, overwrite=False)
            finite = native.chain_int8(
                p, m if nesterov else None, merged, r, codes, scales, BS, -0.7, mu
            )
        assert finite
        got.append((p, m, r, codes, scales))
    for fused, separate in zip(*got, strict=True):
        assert torch.equal(fused, separate)
    assert not torch.equal(got[0][0], start)


def test_ranges_cover_a_fragment_in_whole_blocks_one_per_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(native, "SPLIT_MIN_ELEMS", 1000)
    n = 10 * 2 * BS + 77
    for threads in (1, 2, 3, 4, 64):
        got = native.ranges(n, BS, threads)
        assert len(got) == min(threads, n // 1000)
        sizes = [hi - lo for lo, hi in got]
        assert max(sizes) - min(sizes) <= 2 * BS  # balanced
        assert got[0][0] == 0 and got[-1][1] == n
        assert all(hi == lo2 for (_, hi), (lo2, _) in zip(got, got[1:], strict=False))
        assert all(lo % (2 * BS) == 0 for lo, _ in got)  # whole blocks and whole INT4 bytes
    assert native.ranges(999, BS, 8) == [(0, 999)]  # not worth a thread's hand-off
    assert native.kernel_threads(3) == 3
    assert 1 <= native.kernel_threads(0) <= native.AUTO_THREADS
    with pytest.raises(ValueError, match="kernel_threads"):
        native.kernel_threads(-1)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("fused", [True, False])
def test_a_step_split_across_threads_is_the_one_thread_step_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, fused: bool, threads: int
) -> None:
    # Odd element count, INT4 and BF16 pushes and a link added after the division: every
    # range starts on a whole block and a whole INT4 byte, so each block is computed as on one
    # thread.
    n = 6 * 2 * BS + 77
    monkeypatch.setattr(native, "SPLIT_MIN_ELEMS", 2 * BS)
    assert len(native.ranges(n, BS, threads)) == threads
    pushes = weighted_codes(
        [
            (*_push(pb.CODEC_INT4, 31, n), 1.0),
            (*_push(pb.CODEC_INT8, 32, n), 2.0),
            (*_push(pb.CODEC_BF16, 30, n), 0.5),
        ],
        n,
    )
    links = weighted_codes([(*_push(pb.CODEC_INT8, 33, n), 0.25)], n)
    gen = torch.Generator().manual_seed(34)
    start, merged = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    momentum = torch.randn(n, generator=gen) * 1e-3
    residual = (torch.randn(n, generator=gen) * 1e-4).to(torch.bfloat16)
    got = []
    for k in (1, threads):
        p, m, r = start.clone(), momentum.clone(), residual.clone()
        codes, scales = torch.empty(n, dtype=torch.uint8), torch.empty(-(-n // BS))
        if fused:
            ok = native.step_int8(
                pushes + links, 3, 3.5, p, m, r, codes, scales, BS, -0.7, 0.9, threads=k
            )
        else:
            ok = native.chain_int8(p, m, merged, r, codes, scales, BS, -0.7, 0.9, threads=k)
        assert ok
        got.append((p, m, r, codes, scales))
    for one, split in zip(*got, strict=True):
        assert torch.equal(one, split)
    assert not torch.equal(got[0][0], start)
    # a block that is not finite in the last range only still fails the whole step
    merged[-5] = float("inf")
    codes, scales = torch.empty(n, dtype=torch.uint8), torch.empty(-(-n // BS))
    p, m, r = start.clone(), momentum.clone(), residual.clone()
    assert not native.chain_int8(p, m, merged, r, codes, scales, BS, -0.7, 0.9, threads=threads)


def test_the_synchronizer_splits_its_steps_across_the_threads_it_is_given(tmp_path: Path) -> None:
    for setting, want in ((2, 2), (0, native.kernel_threads(0))):
        core = make_core(tmp_path / str(setting), ManualClock(), kernel_threads=setting)
        try:
            spec = small_spec()
            learner = CoreClient(core, spec, "a")
            learner.join()
            learner.init([torch.zeros(f.numel) for f in spec.fragments])
            assert core.model.fragment(0).model.downlink.kernel_threads == want
        finally:
            core.close()


def _stale_rounds(
    core: Synchronizer, spec: ModelSpec, codecs: tuple[int, ...] = (pb.CODEC_INT8, pb.CODEC_INT4)
) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    """Three learners push deltas to fragment 0 from stale bases, four times each, in `codecs`
    by turns (anchor 'current' re-anchors them through the kept links); the fragment's
    version, parameters and links after."""
    n = spec.fragments[0].numel
    learners = [CoreClient(core, spec, name) for name in "abc"]
    for learner in learners:
        learner.join()
    gen = torch.Generator().manual_seed(3)
    learners[0].init([torch.randn(f.numel, generator=gen) for f in spec.fragments])
    frag = core.model.fragment(0)
    for turn in range(4):
        for i, learner in enumerate(learners):
            delta = torch.randn(n, generator=gen) * 1e-2
            codec_id = codecs[(3 * turn + i) % len(codecs)]
            base = max(0, frag.version - i)
            reply = learner.push(0, delta, codec_id, base=base, tokens=100 + 10 * i)
            assert reply.outcome == pb.PUSH_ACCEPTED
    assert frag.model.params is not None
    links = [encoded.clone() for _, _, encoded in frag.model.downlink.chain]
    return frag.version, frag.model.params.clone(), links


@pytest.mark.parametrize(
    ("quorum", "codecs"),
    [
        (1, (pb.CODEC_INT8, pb.CODEC_INT4)),
        (2, (pb.CODEC_INT8, pb.CODEC_INT4)),
        (2, (pb.CODEC_BF16, pb.CODEC_INT8, pb.CODEC_INT4)),  # two held: within FP32 sums' bytes
        (1, (pb.CODEC_FP32, pb.CODEC_BF16)),
    ],
)
def test_rounds_step_from_their_encoded_pushes_with_no_fp32_sums_and_the_same_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quorum: int, codecs: tuple[int, ...]
) -> None:
    # A core whose rounds step from their held pushes and one that decodes them into FP32
    # sums first end with the same parameters and links, bit for bit, and the first never
    # took FP32 sums.
    spec = small_spec()
    ends = []
    for fused in (True, False):
        with monkeypatch.context() as patch:
            if not fused:
                patch.setattr(Fragment, "_steps_from_pushes", lambda self, rnd: False)
            core = make_core(
                tmp_path / str(fused), ManualClock(), quorum=quorum, grace="none", anchor="current"
            )
            try:
                ends.append((*_stale_rounds(core, spec, codecs), core.model.fragment(0).fp32.live))
            finally:
                core.close()
    (version, params, links, live), (version2, params2, links2, live2) = ends
    assert version == version2 >= 12 // quorum - 1
    assert torch.equal(params, params2)
    assert len(links) == len(links2) and all(map(torch.equal, links, links2))
    assert (live, live2 > 0) == (0, True)


def test_a_synchronizer_splitting_its_steps_serves_the_versions_of_one_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kernel_threads 3 against 1, on a fragment split in 3 (the threshold lowered to fit a
    # small model): every version, parameter and link the same, bit for bit.
    monkeypatch.setattr(native, "SPLIT_MIN_ELEMS", 2 * BS)
    spec = small_spec((3000, 2000), fragments=1)
    assert len(native.ranges(spec.fragments[0].numel, BS, 3)) == 3
    splits: list[int] = []
    real = native._in_parallel

    def counted(calls: list[Callable[[], bool]]) -> bool:
        splits.append(len(calls))
        return real(calls)

    monkeypatch.setattr(native, "_in_parallel", counted)
    ends = []
    for threads in (1, 3):
        core = make_core(
            tmp_path / str(threads),
            ManualClock(),
            grace="none",
            anchor="current",
            kernel_threads=threads,
        )
        try:
            ends.append(_stale_rounds(core, spec))
        finally:
            core.close()
    (version, params, links), (version2, params2, links2) = ends
    assert version == version2 == 12
    assert torch.equal(params, params2)
    assert len(links) == len(links2) and all(map(torch.equal, links, links2))
    assert set(splits) == {1, 3} and splits.count(3) == splits.count(1)  # 12 steps each way


def test_a_round_its_scales_cannot_show_appliable_is_judged_on_its_merged_delta(
    tmp_path: Path,
) -> None:
    # An INT8 push whose scales bound the merged delta beyond MAX_MERGED_ABS is decoded and
    # judged as before: refused, nothing changed but the version; one within is stepped from.
    small = weighted_codes([(*_push(pb.CODEC_INT8, 26), 1.0)], N)
    assert bounded_by_scales(small, 1, 1.0)
    assert not bounded_by_scales(small, 1, 1e-40)  # divided by a tiny total weight
    for bad in (math.nan, math.inf):  # scales are checked at receive; a bound never passes them
        codes, kind, scales = small[0]
        scales = scales.clone()
        scales[3] = bad
        assert not bounded_by_scales([(codes, kind, scales)], 1, 1.0)
    huge = codec.encode(torch.full((N,), 1e31), pb.CODEC_INT8)
    assert not bounded_by_scales(
        weighted_codes([(huge, layout.make_header(pb.CODEC_INT8, N), 1.0)], N), 1, 1.0
    )
    for codec_id in (pb.CODEC_BF16, pb.CODEC_FP32):  # values: bounded by their largest
        values = torch.zeros(N)
        values[-3] = -1e31
        big = weighted_codes([(codec.encode(values, codec_id), _push(codec_id, 27)[1], 1.0)], N)
        assert not bounded_by_scales(big, 1, 1.0)
        assert bounded_by_scales(big, 1, 100.0)  # divided by the total weight: within
        assert not bounded_by_scales(small + big, 1, 100.0)  # a link is not divided
    with _one_learner(tmp_path) as (core, learner, frag):
        n = frag.numel
        huge = torch.full((n,), 1e31)
        assert learner.push(0, huge, pb.CODEC_INT8).outcome == pb.PUSH_ACCEPTED
        refused = core.metrics.registry.get_sample_value("diloco_rounds_refused_total")
        assert refused == 1 and frag.version == 1 and frag.fp32.live == 1
        assert frag.model.params is not None and not frag.model.params.any()
        assert learner.push(0, torch.ones(n), pb.CODEC_INT8, base=1).outcome == pb.PUSH_ACCEPTED
        assert frag.version == 2 and frag.model.params.any()


@contextlib.contextmanager
def _one_learner(tmp_path: Path) -> Iterator[tuple[Synchronizer, CoreClient, Fragment]]:
    """A core of quorum 1 (no grace) with one learner joined and the model initialised to
    zeros; the core, the learner and fragment 0."""
    spec = small_spec()
    core = make_core(tmp_path, ManualClock(), quorum=1, grace="none")
    try:
        learner = CoreClient(core, spec, "a")
        learner.join()
        learner.init([torch.zeros(f.numel) for f in spec.fragments])
        yield core, learner, core.model.fragment(0)
    finally:
        core.close()


def test_a_round_of_values_is_bounded_by_what_their_check_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # BF16 and FP32 pushes are read for their largest magnitude once, by the check that takes
    # their norm: the outer step that steps from them reads none of their values to bound
    # them; a push whose check measured nothing (no kernels for it) is read by the step.
    reads: list[int] = []
    real = native.absmax

    def counted(values: torch.Tensor) -> float:
        reads.append(values.numel())
        return real(values)

    monkeypatch.setattr(native, "absmax", counted)
    with _one_learner(tmp_path) as (_, learner, frag):
        n = frag.numel
        for version, codec_id in enumerate((pb.CODEC_BF16, pb.CODEC_FP32)):
            delta = torch.full((n,), 1e-3)
            reply = learner.push(0, delta, codec_id, base=version)
            assert reply.outcome == pb.PUSH_ACCEPTED
        assert frag.version == 2 and frag.fp32.live == 0 and reads == []
        monkeypatch.setattr(native, "available", lambda: False)
        assert learner.push(0, torch.full((n,), 1e-3), pb.CODEC_BF16, base=2).outcome == (
            pb.PUSH_ACCEPTED
        )
        assert frag.version == 3 and frag.fp32.live == 0 and reads == [n]


def test_the_chain_stays_within_the_int8_bound_of_the_exact_update() -> None:
    params, outer = torch.zeros(N), make_outer("sgd", N, lr=1.0)
    down = Downlink(N, "int8", 2, "fp32", native_kernels=True)
    merged = torch.randn(N, generator=torch.Generator().manual_seed(2))
    down.step(params, merged, outer.begin(), 1)
    # one step of plain SGD with lr 1 from zero: the parameters are -merged, encoded in INT8
    # (error at most half a step of the block's scale), and the residual holds the rest exactly
    blocks = torch.zeros(-(-N // BS) * BS)
    blocks[:N] = merged
    half_step = (blocks.view(-1, BS).abs().amax(dim=1) / 127 / 2).repeat_interleave(BS)[:N]
    assert bool(((params + merged).abs() <= half_step * (1 + 1e-6)).all())
    assert down.residual is not None
    assert torch.equal(down.residual, -merged - params)


def test_an_update_that_is_not_finite_is_refused() -> None:
    down = Downlink(N, "int8", 2, native_kernels=True)
    merged = torch.zeros(N)
    merged[5] = float("inf")
    with pytest.raises(layout.CodecError, match="not finite"):
        down.step(torch.zeros(N), merged, make_outer("nesterov", N).begin(), 1)


def test_other_steps_and_codecs_take_the_torch_path() -> None:
    # Delayed Nesterov and a 4-bit chain have no native kernel: same result as without one
    gen = torch.Generator().manual_seed(4)
    for kind, update_codec in (("delayed_nesterov", "int8"), ("nesterov", "int4")):
        start, merged = torch.randn(N, generator=gen), torch.randn(N, generator=gen) * 1e-2
        results = []
        for use in (True, False):
            params, outer = start.clone(), make_outer(kind, N, delay=1)
            down = Downlink(N, update_codec, 2, native_kernels=use)
            down.step(params, merged.clone(), outer.begin(), 1)
            results.append(params)
        assert torch.equal(results[0], results[1])


def test_every_helper_is_inlined_into_the_kernels_own_copies() -> None:
    # A helper left out of line is compiled once, for the baseline target: each kernel's AVX2
    # copy then calls SSE code for its loops (the update chain ran 1.6x slower so).
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm here to read the object's symbols")
    listed = subprocess.run([nm, str(native.load().path)], capture_output=True, text=True)
    local = {line.split()[-1] for line in listed.stdout.splitlines() if " t " in line}
    source = native.SOURCE.read_text()
    helpers = set(re.findall(r"^(?:INLINE|static)\b[^(;=]*?(\w+)\(", source, re.MULTILINE))
    assert {"codes_of", "chain_block"} <= helpers
    assert not {name.split(".")[0] for name in local} & helpers


def test_the_kernel_in_use_is_a_replay_setting(tmp_path: Path) -> None:
    on = journal.replay_settings(SynchronizerConfig(state_dir=tmp_path, kernels="auto"))
    off = journal.replay_settings(SynchronizerConfig(state_dir=tmp_path, kernels="torch"))
    assert on["outer_kernel"] == "native" and off["outer_kernel"] != "native"


def test_without_a_compiler_auto_runs_torch_and_native_is_a_clear_error(
    monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(native_build, "_built", {})
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc nor clang there
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "empty"))  # nothing built before
    assert native.resolve("torch") is False
    assert native.resolve("auto") is False
    with pytest.raises(native.NativeUnavailable, match="no C compiler"):
        native.resolve("native")
    with pytest.raises(ValueError, match="kernels must be one of"):
        native.resolve("fast")


def test_serve_with_kernels_native_and_no_compiler_exits_2_with_the_reason(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PATH": str(tmp_path), "DILOCO_NATIVE_CACHE": str(tmp_path / "cache")}
    env.pop("CC", None)
    done = subprocess.run(
        [sys.executable, "-m", "synchronizer.cli", "serve", "--kernels", "native", "--port", "0"]
        + ["--metrics-port", "-1", "--state-dir", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "kernels native: no C compiler found" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_a_build_is_cached_and_shared_by_processes(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(native_build, "_built", {})
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    built = native.load()
    assert built.path.parent == tmp_path and built.path.exists()
    monkeypatch.setattr(native_build, "_built", {})
    assert native.load().path == built.path  # found, not built again
    assert [p.name for p in tmp_path.iterdir()] == [built.path.name]  # no temporary left


def test_an_object_built_before_loads_without_a_compiler(monkeypatch, tmp_path: Path) -> None:
    # as in the container image: built into its cache at build time, run where no compiler is
    monkeypatch.setattr(native_build, "_built", {})
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    built = native.load().path
    monkeypatch.setattr(native_build, "_built", {})
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.delenv("CC", raising=False)
    assert native.resolve("native") is True
    assert native.load().path == built


def test_the_built_object_is_readable_by_other_users(monkeypatch, tmp_path: Path) -> None:
    # the image builds it as root and runs the Synchronizer as another user (CI: the image's
    # Synchronizer fell back to torch because the object was private to its builder)
    monkeypatch.setattr(native_build, "_built", {})
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    mode = native.load().path.stat().st_mode
    assert mode & 0o044 == 0o044 & ~_umask()


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def test_a_cached_object_that_cannot_load_is_the_reason_given(monkeypatch, tmp_path: Path) -> None:
    name = native.load().path.name  # the object's name on this machine
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / name).write_bytes(b"not a shared object")
    monkeypatch.setenv(native.CACHE_ENV, str(cache))
    monkeypatch.setattr(native_build, "_built", {})
    monkeypatch.setattr(native_build.tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(native.NativeUnavailable) as got:
        native.load()
    assert str(cache) in str(got.value) and "no C compiler" in str(got.value)
    assert str(got.value).index(str(cache)) < str(got.value).index("no C compiler")


def test_crc32_is_zlibs_for_every_length_offset_start_value_and_buffer_kind() -> None:
    g = torch.Generator().manual_seed(7)
    data = bytes(torch.randint(0, 256, (3 * crc.CRC_MIN_BYTES + 300,), generator=g).tolist())
    view = memoryview(data)  # read-only, as a replayed segment is
    lengths = [0, 1, 15, 16, 17, 63, 64, 65, 79, 80, 127, 128, 129]
    lengths += [crc.CRC_MIN_BYTES + d for d in (-1, 0, 1, 15, 16, 63, 64, 100)]
    lengths += [3 * crc.CRC_MIN_BYTES + 7]
    for length in lengths:
        for offset in (0, 1, 5, 16, 33):  # unaligned starts too
            for value in (0, 1, 0xFFFFFFFF, 0x1234ABCD):
                part = view[offset : offset + length]
                want = zlib.crc32(part, value)
                assert crc.crc32(part, value) == want, (length, offset, value)
    big = bytearray(data)
    assert crc.crc32(big) == zlib.crc32(big)
    assert crc.crc32(data) == zlib.crc32(data)
    # chained: the crc of a whole is the crc of its second part started from the first's
    cut = crc.CRC_MIN_BYTES + 3
    assert crc.crc32(view[cut:], crc.crc32(view[:cut])) == zlib.crc32(data)
    x = torch.randn(crc.CRC_MIN_BYTES, generator=g)
    assert crc.crc32(x) == zlib.crc32(x.numpy().tobytes())
    assert crc.crc32(x[:10]) == zlib.crc32(x[:10].numpy().tobytes())
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        crc.crc32(x[::2])


def test_crc32_folds_where_the_cpu_has_carry_less_multiplication() -> None:
    # Where the CPU has PCLMULQDQ and SSE4.1 the folding path must be in use: without it every
    # checksum of the log and of a version's parameters runs at zlib's speed.
    flags = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if platform.machine() != "x86_64" or not {"pclmulqdq", "sse4_1"} <= flags:
        pytest.skip("no PCLMULQDQ and SSE4.1 here")
    assert crc.crc32_folding()


def test_crc32_without_the_kernels_is_zlibs(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(native_build, "_built", {})
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc nor clang there
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "empty"))  # nothing built before
    data = os.urandom(2 * crc.CRC_MIN_BYTES + 5)
    assert not crc.crc32_folding()
    assert crc.crc32(data, 9) == zlib.crc32(data, 9)
