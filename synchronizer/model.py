"""The global parameters of one fragment and the outer step that moves them.

Per fragment: FP32 flat parameters Theta_p, the outer optimizer's state, the version v_p (outer
steps applied) and the `Downlink` that serves them. One condition variable guards all of it:
outer steps are applied strictly in version order under it, and pullers wait on it for the
version they want.

A checkpoint writes a fragment's live tensors, not copies of them (`frozen`): while it does, the
fragment is frozen, and its next outer step waits until the write is done (one fragment's write
time at most; the other fragments' outer steps go on). Pushes into its open round and pulls,
which only read the parameters, are served meanwhile.

A failed outer step fails the fragment loudly (`fail`): the reason is kept, every waiter (a later
round's outer step, a pull waiting for a version) is woken and gets `FragmentFailed` instead of
waiting for a version that will never come, and nothing is served from parameters that may be
half-updated. Only a restart from the last checkpoint brings the fragment back.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from protos import blockwise, codec, layout
from protos import diloco_pb2 as pb
from synchronizer import native, slices
from synchronizer.buffers import Snapshots
from synchronizer.config import SynchronizerConfig
from synchronizer.downlink import Downlink, Link, kept_links
from synchronizer.merge import add_native, native_codec, weighted_codes
from synchronizer.outer import make_outer, warm_up
from synchronizer.shares import RoundShares, Weighed

logger = logging.getLogger(__name__)


# Largest |merged delta| an outer step applies: far beyond any honest pseudo-gradient, and small
# enough that momentum and parameters stay finite in FP32 (max 3.4e38).
MAX_MERGED_ABS = 1e30


# Room in the bound below for the rounding of the sums it bounds (each operation is rounded
# to FP32: relative 2^-24 per push added).
_BOUND_SLACK = 1.001


def bounded_by_scales(
    pushes: Sequence[native.Push],
    summed: int,
    total: float,
    largest: Sequence[float | None] = (),
) -> bool:
    """Whether the merged delta of weighted pushes (`native.step_int8`'s: the first `summed`
    summed and divided by `total`, the rest added) is shown appliable by their scales alone:
    each push's largest code times its largest scale (for values, their largest magnitude times
    the weight), summed over the pushes, bounds every element's magnitude, so a finite bound
    within `MAX_MERGED_ABS` (with slack for rounding) proves what `unappliable` would find
    without reading a code. One reduction per push and no temporaries: a bound looser than the
    blocks' own, and still 25 orders of magnitude above any honest delta. Values are read once
    for their largest magnitude, unless `largest` gives it (the i-th push's, where known)."""
    if not pushes or total <= 0.0:
        return False
    bound = 0.0
    for i, (data, kind, scales) in enumerate(pushes):
        known = largest[i] if i < len(largest) else None
        if kind in (native.BF16, native.FP32):
            top = known if known is not None else native.absmax(data)
        else:
            top = blockwise.LARGEST_CODE[pb.CODEC_INT4 if kind == native.INT4 else pb.CODEC_INT8]
        lo, hi = (float(x) for x in torch.aminmax(scales))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return False
        term = max(-lo, hi) * top
        bound += term / total if i < summed else term
    reach = bound * _BOUND_SLACK
    return math.isfinite(reach) and reach <= MAX_MERGED_ABS


class FragmentFailed(Exception):
    """The fragment's outer step failed earlier; its state is not trusted any more."""


def unappliable(merged: torch.Tensor, max_abs: float | None = None) -> str | None:
    """Why a merged delta must not be applied (non-finite, or beyond `MAX_MERGED_ABS`), or None.
    One pass, no temporaries; none where its largest magnitude `max_abs` is known already."""
    if merged.numel() == 0:
        return None
    if max_abs is None:
        lo, hi = (float(x) for x in torch.aminmax(merged))
        max_abs = max(-lo, hi) if math.isfinite(lo) and math.isfinite(hi) else math.inf
    if not math.isfinite(max_abs):
        return "the merged delta is not finite (NaN or Inf: a weighted sum overflowed)"
    if max_abs > MAX_MERGED_ABS:
        return f"the merged delta reaches {max_abs:.3g}, beyond {MAX_MERGED_ABS:g}"
    return None


class Contributor(Weighed, Protocol):
    base_version: int


class FragmentModel:
    def __init__(self, fid: int, numel: int, cfg: SynchronizerConfig) -> None:
        self.fid = fid
        self.numel = numel
        self.cfg = cfg
        self.cv = threading.Condition()
        self.params: torch.Tensor | None = None
        self.version = 0
        self.merged = 0  # contributions merged into applied rounds, ever (checkpointed)
        self.shares = RoundShares()  # each round's share of a whole step (checkpointed)
        self.failure: str | None = None
        self.stopping = False  # shutting down: pulls stop waiting for new versions
        self.frozen = False  # a checkpoint is writing the live state: outer steps wait
        self.outer = make_outer(cfg.outer, numel, cfg.outer_lr, cfg.outer_momentum, cfg.outer_delay)
        kept = kept_links(cfg.update_history, cfg.update_history_bytes, numel, cfg.update_codec)
        self.downlink = Downlink(
            numel,
            cfg.update_codec,
            kept,
            cfg.update_residual_dtype,
            native_kernels=native.resolve(cfg.kernels),
            kernel_threads=native.kernel_threads(cfg.kernel_threads),
        )

    @property
    def initialized(self) -> bool:
        return self.params is not None

    def initialize(self, params: torch.Tensor, version: int = 0, adopt: bool = False) -> None:
        """Sets the parameters to a copy of `params`; with `adopt`, to `params` itself when it
        is flat contiguous FP32 (the caller hands it over and keeps no other reference)."""
        with self.cv:
            owned = adopt and params.dtype == torch.float32 and params.is_contiguous()
            self.params = params if owned else params.to(torch.float32).clone()
            self.version = version
            self.shares = RoundShares()
            self.downlink.changed()
            self.cv.notify_all()

    def step(
        self,
        start_version: int,
        merge: Callable[[float], torch.Tensor],
        contributions: Sequence[Contributor],
        max_abs: Callable[[], float | None] = lambda: None,
        held: Sequence[tuple[torch.Tensor, pb.PayloadHeader, float]] = (),
        settled: Callable[[str | None, float], None] = lambda _refused, _share: None,
        held_largest: Sequence[float | None] = (),
    ) -> tuple[float, str | None, float]:
        """Applies one round's outer step once the fragment is at `start_version`; returns the
        seconds it took, for a refused round why, and the round's share of a whole step
        (`synchronizer.shares`; 1 with `round_share` full). `merge(share)` returns the round's
        merged delta times its share in a buffer the outer step may write over (the round's own
        sums); `max_abs()`, its largest magnitude where the merge took it (None: measured
        here). `held`: the whole round as encoded pushes (buf, header, weight), in order, where
        `merge` would only decode and merge them: the native chain may then step from them
        directly (`_step_held`), and `merge` is not called; `held_largest`, each held push's
        greatest |value| where its check measured it (FP32/BF16). A merged delta that is not finite
        or beyond `MAX_MERGED_ABS` is refused before it touches any state: the version still
        advances (by an empty update, so rounds and delta pulls keep their order) and the
        fragment stays healthy. `settled(refused, share)` counts the round under the lock before
        the new version can be seen, so whoever holds it (a pull, Status) sees its work counted.
        Waits while a checkpoint writes the fragment (`frozen`). Raises `FragmentFailed` if the
        fragment failed while this round waited."""
        with self.cv:
            while (self.version != start_version or self.frozen) and self.failure is None:
                self.cv.wait()
            self._check_healthy()
            t0 = time.perf_counter()
            assert self.params is not None
            refused = None
            share = (
                self.shares.share(start_version, contributions)
                if self.cfg.round_share == "work"
                else 1.0
            )
            if not (
                held and self._step_held(start_version, held, held_largest, contributions, share)
            ):
                merged = merge(share)
                if self.cfg.anchor == "current":
                    self._reanchor(start_version, contributions, merged, share)
                refused = unappliable(merged, None if self.cfg.anchor == "current" else max_abs())
                if refused is not None:
                    self.downlink.skip(start_version + 1)
                elif self.downlink.history > 0:
                    step = self.outer.begin(share, self._warm(start_version))
                    self.downlink.step(self.params, merged, step, start_version + 1)
                else:
                    self.outer.step(self.params, merged, share, self._warm(start_version))
            settled(refused, share)
            self.version = start_version + 1
            if refused is None:
                self.merged += len(contributions)
            self.downlink.changed()
            self.cv.notify_all()
            return time.perf_counter() - t0, refused, share

    def _step_held(
        self,
        start_version: int,
        held: Sequence[tuple[torch.Tensor, pb.PayloadHeader, float]],
        held_largest: Sequence[float | None],
        contributions: Sequence[Contributor],
        share: float,
    ) -> bool:
        """The outer step made straight from the round's encoded pushes and re-anchoring links
        (`Downlink.step_pushes`: no FP32 sums, no pass to merge or to check them), where the
        native chain takes it: every push and link in a codec the kernels add (`native_codec`),
        codes of the chain's block size, a positive total weight, and the merged delta shown appliable by the scales alone
        (`bounded_by_scales`). The same numbers as decoding, merging, re-anchoring and stepping
        one after the other. False, with nothing changed, where it is not taken."""
        assert self.params is not None
        if not (self.outer.native and self.downlink.native_chain(self.params)):
            return False
        kept = [i for i, p in enumerate(held) if p[2] > 0.0]
        weighted = [held[i] for i in kept]
        largest = [held_largest[i] if i < len(held_largest) else None for i in kept]
        links = self._stale_links(start_version, contributions, share)
        payloads = [*weighted, *links]
        block = layout.DEFAULT_BLOCK_SIZE  # the chain's (BF16 and FP32 values have 0: none)
        if not weighted or not all(
            native_codec(h) and h.block_size in (0, block) and h.numel == self.numel
            for _, h, _ in payloads
        ):
            return False
        total = sum(w for _, _, w in weighted) / share  # the merge's divisor (`Accumulator`)
        pushes = weighted_codes(payloads, self.numel)
        if not bounded_by_scales(pushes, len(weighted), total, largest):
            return False
        step = self.outer.begin(share, self._warm(start_version))
        taken = self.downlink.step_pushes(
            self.params, pushes, len(weighted), total, step, start_version + 1
        )
        assert taken  # native_chain and native form were checked above
        return True

    def _stale_links(
        self, start_version: int, contributions: Sequence[Contributor], share: float
    ) -> list[tuple[torch.Tensor, pb.PayloadHeader, float]]:
        """What re-anchoring adds to the merged delta (anchor 'current'): the kept links since
        each stale contribution's base, as (encoded, header, weight times the round's share);
        empty where nothing is re-anchored."""
        if self.cfg.anchor != "current":
            return []
        total = sum(c.weight for c in contributions)
        stale = [
            c
            for c in contributions
            if c.base_version < start_version
            and self.downlink.covers(c.base_version, start_version)
        ]
        if total <= 0 or not stale:
            return []
        return [
            (encoded, header, behind / total * share)
            for v, header, encoded in self.downlink.chain
            if (behind := sum(c.weight for c in stale if c.base_version < v)) > 0
        ]

    def _reanchor(
        self,
        start_version: int,
        contributions: Sequence[Contributor],
        merged: torch.Tensor,
        share: float,
    ) -> None:
        """Adds share * sum_i w_i (Theta_now - Theta_{b_i}) / W: each delta anchored at the
        current fragment. A contribution staler than the kept links is left as it is
        (anchored at its base, as with anchor 'base'). Each link is decoded in runs of about 1M
        elements, with the same arithmetic, element for element, as adding the whole decoded
        link; with the native kernels every link is added in one pass, its weight folded into
        its block scales (the kernels' own numbers: the kernel in use is a replay setting)."""
        links = self._stale_links(start_version, contributions, share)
        if not links:
            return
        if (
            self.downlink.native_kernels
            and merged.device.type == "cpu"
            and all(native_codec(header) for _, header, _ in links)
        ):  # every link in one pass over the merged delta
            add_native(links, self.numel, merged)
            return
        scratch: torch.Tensor | None = None
        for encoded, header, weight in links:
            if scratch is None:
                scratch = torch.empty(codec.run_elems(header))
            for start, decoded in codec.decode_runs(encoded, header, scratch):
                merged[start : start + decoded.numel()].add_(decoded, alpha=weight)

    def fail(self, reason: str) -> None:
        """Marks the fragment failed and wakes every waiter."""
        with self.cv:
            if self.failure is None:
                self.failure = reason
            self.cv.notify_all()

    def wake(self) -> None:
        """Makes waiting pulls look again at what they wait for (one of them ended)."""
        with self.cv:
            self.cv.notify_all()

    def stop_waiting(self) -> None:
        """Shutdown: pulls waiting for a version are answered with the one there is."""
        with self.cv:
            self.stopping = True
            self.cv.notify_all()

    def _warm(self, start_version: int) -> float:
        """The outer learning rate of the step from `start_version`, over `outer_lr`."""
        return warm_up(start_version, self.cfg.outer_warmup)

    def _check_healthy(self) -> None:
        if self.failure is not None:
            raise FragmentFailed(f"fragment {self.fid} failed: {self.failure}")

    # Pulls -----------------------------------------------------------------------------------

    def wait_for(
        self, min_version: int, timeout_s: float, ended: threading.Event | None = None
    ) -> None:
        """Waits (up to `timeout_s`) until the fragment is initialised and at `min_version`,
        failed, shutting down, or `ended` is set (and `wake()` called)."""
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while (
                (self.version < min_version or self.params is None)
                and self.failure is None
                and not self.stopping
                and not (ended is not None and ended.is_set())
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cv.wait(left)

    def wait_applied(self, version: int) -> None:
        """Until the outer steps up to `version` are applied, or the fragment failed."""
        with self.cv:
            while self.version < version and self.failure is None:
                self.cv.wait(1.0)

    def served(
        self, codec_id: pb.Codec, have_version: int | None, budget: Snapshots | None = None
    ) -> tuple[Link | None, list[Link] | None, int, int]:
        """What a pull gets, judged at one version: (full snapshot or None, delta links or None,
        version, checksum). Links when `have_version` is given and the chain still covers it;
        neither when a new snapshot does not fit `budget` (wait for one to end, and ask again)."""
        with self.cv:
            self._check_healthy()
            assert self.params is not None
            links = (
                self.downlink.since(have_version, self.version)
                if have_version is not None
                else None
            )
            snap = (
                None
                if links is not None
                else self.downlink.snapshot(self.params, self.version, codec_id, budget)
            )
            return snap, links, self.version, self.downlink.checksum(self.params, self.version)

    def gathered(
        self, runs: Sequence[tuple[int, int]], have_version: int | None = None
    ) -> tuple[torch.Tensor, int, list[Link] | None]:
        """A copy of the parameters' elements in `runs` ((start, length), concatenated), the
        version they hold, and the kept updates since `have_version` when it is given and the
        chain still covers it: what a rank of a sharded island pulls."""
        with self.cv:
            self._check_healthy()
            assert self.params is not None
            links = (
                self.downlink.since(have_version, self.version)
                if have_version is not None
                else None
            )
            return slices.gather(self.params, runs), self.version, links

    # Durability ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def frozen_state(self) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, Any]]]:
        """This fragment's checkpoint at one version: its live tensors by name (parameters,
        outer state, residual, the chain's links), not copies, and its metadata. Until the block
        ends the fragment is frozen: its outer steps wait, so the tensors hold that version."""
        with self.cv:
            self._check_healthy()
            assert self.params is not None and not self.frozen
            p = f"frag.{self.fid}."
            tensors = {p + "params": self.params}
            tensors.update({p + "outer." + k: v for k, v in self.outer.state_dict().items()})
            chain_tensors, chain = self.downlink.state(p)
            tensors.update(chain_tensors)
            meta = {
                "version": self.version,
                "outer": self.cfg.outer,
                "chain": chain,
                "merged": self.merged,
                "shares": self.shares.state(),
            }
            self.frozen = True
        try:
            yield tensors, meta
        finally:
            with self.cv:
                self.frozen = False
                self.cv.notify_all()

    def restore(self, tensors: Mapping[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Takes this fragment's state from a checkpoint's `tensors` (read by name, one at a
        time: a lazily loading mapping reads only this fragment's) and adopts what it reads."""
        p = f"frag.{self.fid}."
        self.initialize(tensors[p + "params"], int(meta["version"]), adopt=True)
        outer_prefix = p + "outer."
        if meta.get("outer") == self.cfg.outer:
            self.outer.load_state_dict(
                {k[len(outer_prefix) :]: tensors[k] for k in tensors if k.startswith(outer_prefix)}
            )
        else:
            logger.warning(
                "fragment %d: checkpoint has %s outer state, configured %s: starting it fresh",
                self.fid,
                meta.get("outer"),
                self.cfg.outer,
            )
        with self.cv:
            self.merged = int(meta.get("merged", 0))
            self.shares.restore(meta.get("shares", {}))
            self.downlink.restore(tensors, meta.get("chain", []), p)
