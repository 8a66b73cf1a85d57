"""How contributions to a round are weighted and merged into one pseudo-gradient.

A contribution's weight is a token weight times a staleness factor (`token_weight`,
`staleness_factor`). An `Accumulator` keeps the running sums of one round of one fragment, so
memory stays O(fragment) however many learners contribute, and produces the merged delta: the
weighted mean, or the radial-directional average of Decoupled DiLoCo (norms and directions
averaged separately, per tensor). Pure arithmetic: no locking, no I/O; the caller validates
finiteness of every delta before adding it.
"""

from __future__ import annotations

import math

import torch

from protos import blockwise, codec
from protos import diloco_pb2 as pb
from synchronizer import native, shares

TOKEN_WEIGHTS = ("uniform", "tokens", "tokens2_per_step")
STALENESS_FACTORS = ("none", "poly", "hinge", "exp")


def token_weight(kind: str, tokens: int, steps: int) -> float:
    """A contribution's weight from the work it covers.

    uniform: 1. tokens: tokens. tokens2_per_step: tokens**2 / steps (Decoupled DiLoCo: rewards
    both more data and larger batches per step). The service rejects nonsense counts before this
    point; here steps < 1 is read as 1, and tokens < 1 gives weight 0.0 for the token kinds (a
    push that covers no data contributes nothing) while uniform stays 1.0.
    """
    if kind not in TOKEN_WEIGHTS:
        raise ValueError(f"token weight must be one of {TOKEN_WEIGHTS}, got {kind!r}")
    if kind == "uniform":
        return 1.0
    if tokens < 1:
        return 0.0
    if kind == "tokens":
        return float(tokens)
    return tokens * tokens / max(steps, 1)


def staleness_factor(kind: str, staleness: int, alpha: float = 0.5, hinge: int = 2) -> float:
    """Down-weighting of a contribution computed `staleness` outer steps ago (s >= 0).

    none: 1. poly: (1 + s)**-alpha. hinge: 1 while s <= hinge, then 1 / (1 + alpha * (s - hinge))
    (the "hinge" function of FedAsync, Xie et al. 2019, with a = alpha, b = hinge).
    exp: exp(-alpha * s). All equal 1 at s = 0 and never increase with s.
    """
    if kind not in STALENESS_FACTORS:
        raise ValueError(f"staleness factor must be one of {STALENESS_FACTORS}, got {kind!r}")
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if not (math.isfinite(alpha) and alpha >= 0.0):
        raise ValueError(f"staleness alpha must be a finite number >= 0, got {alpha}")
    if hinge < 0:
        raise ValueError(f"staleness hinge must be >= 0, got {hinge}")
    if kind == "poly":
        return (1.0 + staleness) ** -alpha
    if kind == "hinge":
        return 1.0 if staleness <= hinge else 1.0 / (1.0 + alpha * (staleness - hinge))
    if kind == "exp":
        return math.exp(-alpha * staleness)
    return 1.0


NATIVE_KINDS = {
    pb.CODEC_INT8: native.INT8,
    pb.CODEC_INT4: native.INT4,
    pb.CODEC_BF16: native.BF16,
    pb.CODEC_FP32: native.FP32,
}


def native_codec(header: pb.PayloadHeader) -> bool:
    """Whether the native kernels add this payload's codec (all but FP4)."""
    return header.codec in NATIVE_KINDS


def add_native(
    payloads: list[tuple[torch.Tensor, pb.PayloadHeader, float]],
    numel: int,
    out: torch.Tensor,
    overwrite: bool = False,
) -> None:
    """out (= with `overwrite`, else +=) sum of weight x decode(payload), in order, by the
    native kernel (`native.accumulate`): checked payloads of `numel` elements in a codec it
    takes (`native_codec`), the weight folded into each block's scale as `codec.accumulate`
    folds it; one pass over `out` per run of payloads whose codes have one block size."""
    start = 0
    while start < len(payloads):
        size = 0  # the run's block size: its first payload of codes' (values have none)
        stop = start
        while stop < len(payloads):
            own = int(payloads[stop][1].block_size)
            if own and size and own != size:
                break
            size = size or own
            stop += 1
        pushes = weighted_codes(payloads[start:stop], numel)
        block = size or native.RUN_ELEMS
        native.accumulate(pushes, numel, block, out, overwrite=overwrite and start == 0)
        start = stop


def weighted_codes(
    payloads: list[tuple[torch.Tensor, pb.PayloadHeader, float]], numel: int
) -> list[native.Push]:
    """The native kernels' form of checked payloads (`native.Push`): INT8 or INT4 codes with
    each block's scale times the payload's weight, or BF16 or FP32 values with the weight.
    Scales are not checked again: a push's were at receive (`codec.check`, before it was
    accepted or logged), a link's are the Synchronizer's own."""
    pushes = []
    for buf, h, weight in payloads:
        kind = NATIVE_KINDS[h.codec]
        if kind in (native.BF16, native.FP32):
            dtype = torch.bfloat16 if kind == native.BF16 else torch.float32
            data = blockwise.aligned(buf.contiguous(), dtype)
            scales = torch.tensor([weight], dtype=torch.float32)
        else:
            data = buf.contiguous()
            scales = blockwise.scales_of(buf, h.codec, numel, h.scale_dtype) * weight
        pushes.append((data, kind, scales))
    return pushes


class Accumulator:
    """Running sums for one round of one fragment: O(fragment) memory, not O(learners).

    Mean mode keeps S = sum_i w_i d_i and merges to S / sum_i w_i.

    Radial mode (Decoupled DiLoCo's radial-directional averaging) works per segment (one tensor
    of the flat fragment): it keeps R = sum_i w_i ||d_i|| and U = sum_i w_i d_i / ||d_i||, and
    merges to (R / sum_i w_i) * U / ||U||, i.e. the weighted mean norm along the direction of the
    weighted sum of unit directions (zero where that sum is zero). A zero-norm delta adds no
    direction but still counts its weight, so it pulls the mean norm down. Segments listed in
    `mean_segments` (e.g. embeddings) are merged by the plain weighted mean even in radial mode.

    `segments` are the (start, end) ranges of the fragment's tensors, in order and tiling
    [0, numel); without them radial mode treats the whole fragment as one segment. Deltas must
    be flat FP32 of length `numel` on the accumulator's device.

    `buffer` is the storage of the sums (flat contiguous FP32 of at least `numel` elements, its
    contents ignored: e.g. one lent by a pool, given back after the outer step); allocated when
    not given.

    With `native_kernels`, payloads in mean mode on CPU (all but FP4) are decoded and added by
    `native.accumulate` (`add_payloads` takes a round's held pushes in one pass over the sums)
    and the merge divides by `native.merge`, which also takes the merged delta's largest
    magnitude (`merged_max_abs`).
    """

    def __init__(
        self,
        numel: int,
        segments: list[tuple[int, int]] | None = None,
        radial: bool = False,
        mean_segments: set[int] | None = None,
        device: torch.device | str = "cpu",
        buffer: torch.Tensor | None = None,
        native_kernels: bool = False,
    ) -> None:
        if numel < 1:
            raise ValueError(f"numel must be >= 1, got {numel}")
        segments = list(segments) if segments is not None else [(0, numel)]
        expected_start = 0
        for i, (start, end) in enumerate(segments):
            if start != expected_start or end <= start:
                raise ValueError(
                    f"segments must tile [0, {numel}) in order with no empty range; segment {i} "
                    f"is ({start}, {end}), expected it to start at {expected_start}"
                )
            expected_start = end
        if expected_start != numel:
            raise ValueError(f"segments end at {expected_start}, expected {numel}")
        mean_segments = set(mean_segments or ())
        bad = sorted(i for i in mean_segments if not 0 <= i < len(segments))
        if bad:
            raise ValueError(f"mean_segments {bad} are out of range for {len(segments)} segments")
        self.numel = numel
        self.radial = radial
        self.segments = segments
        self.mean_segments = mean_segments
        self._radial_segments = [i for i in range(len(segments)) if i not in mean_segments]
        if buffer is None:
            buffer = torch.empty(numel, dtype=torch.float32, device=device)
        elif buffer.dtype != torch.float32 or buffer.dim() != 1 or buffer.numel() < numel:
            raise ValueError(
                f"buffer must be flat FP32 of at least {numel} elements, got {buffer.dtype} "
                f"of shape {tuple(buffer.shape)}"
            )
        self.buffer = buffer
        self._sum = buffer[:numel]  # S, or U per segment
        self._fresh = True  # _sum holds nothing yet: the first add writes it (no zeroing pass)
        self._norm_sums = [0.0] * len(segments)  # R per segment (radial mode only)
        self._total_weight = 0.0
        self._count = 0
        self.native_kernels = native_kernels and not radial and self._sum.device.type == "cpu"
        self.merged_max_abs: float | None = None  # from the last native merge, else None

    @property
    def total_weight(self) -> float:
        """Sum of the weights added so far."""
        return self._total_weight

    @property
    def count(self) -> int:
        """Number of `add` calls with a positive weight."""
        return self._count

    def reset(self) -> None:
        """Empty the sums for the next round, keeping the buffer."""
        self._fresh = True
        self.merged_max_abs = None
        self._norm_sums = [0.0] * len(self.segments)
        self._total_weight = 0.0
        self._count = 0

    def add(self, delta: torch.Tensor, weight: float) -> None:
        """Accumulate one contribution `delta` with `weight` >= 0 (0 counts toward nothing)."""
        weight = _check_weight("weight", weight)
        self._check_vector("delta", delta)
        if weight == 0.0:
            return
        if not self.radial:
            if self._fresh:
                torch.mul(delta, weight, out=self._sum)
                self._fresh = False
            else:
                self._sum.add_(delta, alpha=weight)
        else:
            self._materialize()
            norms = _segment_norms(delta, [self.segments[i] for i in self._radial_segments])
            for i, norm in zip(self._radial_segments, norms, strict=True):
                if norm > 0.0:
                    start, end = self.segments[i]
                    self._sum[start:end].add_(delta[start:end], alpha=weight / norm)
                    self._norm_sums[i] += weight * norm
            for i in self.mean_segments:
                start, end = self.segments[i]
                self._sum[start:end].add_(delta[start:end], alpha=weight)
        self._total_weight += weight
        self._count += 1

    def add_payload(
        self,
        buf: torch.Tensor,
        header: pb.PayloadHeader,
        weight: float,
        scratch: torch.Tensor | None = None,
    ) -> None:
        """`add` of an encoded contribution that passed `codec.check`: decoded and weighted in
        one pass in mean mode (`codec.accumulate`: FP4 decodes in runs of about 1M elements);
        radial mode decodes into `scratch` (FP32, numel; allocated when not given)."""
        if self.radial:
            self.add(
                codec.decode(
                    buf,
                    header,
                    scratch
                    if scratch is not None
                    else torch.empty(self.numel, device=self._sum.device),
                ),
                weight,
            )
            return
        weight = _check_weight("weight", weight)
        if int(header.numel) != self.numel:
            raise ValueError(f"payload must have {self.numel} elements, got {header.numel}")
        if weight == 0.0:
            return
        if self._native(header):
            self._add_native([(buf, header, weight)])
            return
        codec.accumulate(buf, header, self._sum, weight, overwrite=self._fresh)
        self._fresh = False
        self._total_weight += weight
        self._count += 1

    def add_payloads(
        self,
        payloads: list[tuple[torch.Tensor, pb.PayloadHeader, float]],
        scratch: torch.Tensor | None = None,
    ) -> None:
        """`add_payload` of each (buf, header, weight) in order; where the native kernels take
        them all, in one pass over the sums (the same numbers as one by one)."""
        weighted = [p for p in payloads if _check_weight("weight", p[2]) > 0.0]
        if weighted and all(self._native(h) and int(h.numel) == self.numel for _, h, _ in weighted):
            self._add_native(weighted)
            return
        for buf, header, weight in payloads:
            self.add_payload(buf, header, weight, scratch)

    def _native(self, header: pb.PayloadHeader) -> bool:
        return self.native_kernels and native_codec(header)

    def _add_native(self, payloads: list[tuple[torch.Tensor, pb.PayloadHeader, float]]) -> None:
        """The native kernel's sum of payloads it takes (checked, positive weights)."""
        add_native(payloads, self.numel, self._sum, overwrite=self._fresh)
        self._fresh = False
        self._total_weight += sum(w for _, _, w in payloads)
        self._count += len(payloads)

    def add_tensor_weighted(self, vec: torch.Tensor, weight_sum: float) -> None:
        """Add an already-weighted vector (sum_i w_i x_i) to S; mean mode only.

        `weight_sum` (sum_i w_i) is added to `total_weight`: pass 0.0 when those weights were
        already counted by `add`, e.g. for an anchor correction of contributions added before.
        `count` is unchanged. Radial mode has no weighted sum to add to: NotImplementedError.
        """
        if self.radial:
            raise NotImplementedError("add_tensor_weighted is only defined in mean mode")
        weight_sum = _check_weight("weight_sum", weight_sum)
        self._check_vector("vec", vec)
        self._materialize()
        self._sum.add_(vec)
        self._total_weight += weight_sum

    def merged(self, out: torch.Tensor | None = None, share: float = 1.0) -> torch.Tensor:
        """Write the merged delta times `share` (in (0, 1]: the round's part of a whole outer
        step, `synchronizer.shares`; folded into the divisor, sum / (W / share)) into `out`
        (flat FP32, numel) and return it. Without `out` it is written over the sums themselves
        (no buffer of its own): the accumulator then holds nothing until `reset`, and the
        caller may write over the result."""
        if out is None:
            out = self._sum
        self._check_vector("out", out)
        if self._total_weight == 0.0:
            raise ValueError("cannot merge a round whose total weight is 0")
        total = self._total_weight / shares.checked(share)
        self.merged_max_abs = None
        if self.native_kernels and out is self._sum and not self._fresh:
            self.merged_max_abs = native.merge(self._sum, total)
            return out
        if not self.radial:
            return torch.div(self._sum, total, out=out)
        self._materialize()
        radial = self._radial_segments
        direction_norms = _segment_norms(self._sum, [self.segments[i] for i in radial])
        for i, direction_norm in zip(radial, direction_norms, strict=True):
            start, end = self.segments[i]
            if direction_norm > 0.0:
                scale = self._norm_sums[i] / total / direction_norm
                torch.mul(self._sum[start:end], scale, out=out[start:end])
            else:
                out[start:end].zero_()
        for i in self.mean_segments:
            start, end = self.segments[i]
            torch.div(self._sum[start:end], total, out=out[start:end])
        return out

    def cleared(self) -> torch.Tensor:
        """The sums' buffer, zeroed: a round that merges to no change (the caller may write
        over it; `reset` before reuse)."""
        self._fresh = False
        return self._sum.zero_()

    def _materialize(self) -> None:
        if self._fresh:
            self._sum.zero_()
            self._fresh = False

    def _check_vector(self, name: str, t: torch.Tensor) -> None:
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if t.shape != (self.numel,):
            raise ValueError(
                f"{name} must be flat with {self.numel} elements, got {tuple(t.shape)}"
            )


def _check_weight(name: str, weight: float) -> float:
    weight = float(weight)
    if not (math.isfinite(weight) and weight >= 0.0):
        raise ValueError(f"{name} must be a finite number >= 0, got {weight}")
    return weight


def _segment_norms(flat: torch.Tensor, segments: list[tuple[int, int]]) -> list[float]:
    """L2 norm of each (start, end) range of `flat`, with one device sync for all of them."""
    if not segments:
        return []
    norms = [torch.linalg.vector_norm(flat[start:end]) for start, end in segments]
    return torch.stack(norms).tolist()
