"""One fragment of the global model: the parts that serve it, put together.

A `Fragment` is its spec (tensor segments, share of the model), its `Admission` of pushes into
the open round (`synchronizer.admission`), and its `FragmentModel`: parameters, outer step and
downlink (`synchronizer.model`, `synchronizer.downlink`); it uses the Synchronizer-wide payload
budget and FP32 buffers (`synchronizer.buffers`), which every fragment shares. Two locks, never held together by a push: the
admission lock (held only to judge and accumulate one push) and the model's condition (held while
an outer step is applied or a pull is judged), so pushes never wait for an outer step and
fragments never wait for each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from protos import diloco_pb2 as pb
from protos.spec import Fragment as FragmentSpec
from synchronizer import native
from synchronizer.admission import Admission, Round, Verdict
from synchronizer.buffers import Fp32Buffers, Payloads
from synchronizer.clock import Clock
from synchronizer.config import SynchronizerConfig
from synchronizer.errors import Code, Rejected
from synchronizer.goodput import Goodput, Share
from synchronizer.merge import Accumulator, native_codec
from synchronizer.metrics import Metrics
from synchronizer.model import FragmentModel
from synchronizer.receive import Measured

EMBEDDING_HINTS = ("emb", "wte", "wpe")  # tensors merged by plain mean in radial mode


class Fragment:
    def __init__(
        self,
        spec: FragmentSpec,
        cfg: SynchronizerConfig,
        metrics: Metrics,
        goodput: Goodput,
        model_numel: int,
        payloads: Payloads,
        fp32: Fp32Buffers,
        clock: Clock,
    ) -> None:
        """`payloads` and `fp32` are shared by every fragment (`fp32` of at least this
        fragment's size)."""
        if fp32.numel < spec.numel:
            raise ValueError(
                f"fragment {spec.fragment_id} has {spec.numel} elements; FP32 buffers of "
                f"{fp32.numel} cannot hold its sums"
            )
        self.spec = spec
        self.fid = spec.fragment_id
        self.numel = spec.numel
        self.cfg = cfg
        self.share = spec.numel / max(model_numel, 1)
        offsets = spec.offsets()
        self.segments = [(s, e) for _, s, e in offsets]
        self.mean_segments = {
            i
            for i, (name, _, _) in enumerate(offsets)
            if any(h in name.lower() for h in EMBEDDING_HINTS)
        }
        self.payloads = payloads
        self.fp32 = fp32
        self.model = FragmentModel(self.fid, spec.numel, cfg)
        self.admission = Admission(
            cfg, metrics, goodput, self._new_accumulator, payloads, self.fid, clock
        )
        self.metrics = metrics
        metrics.fragment_version.labels(str(self.fid)).set(0)

    @property
    def version(self) -> int:
        return self.model.version

    def _new_accumulator(self) -> Accumulator:
        """Sums over a buffer lent by `fp32` (given back by `_release`)."""
        radial = self.cfg.merge == "radial"
        return Accumulator(
            self.numel,
            self.segments if radial else None,
            radial=radial,
            mean_segments=self.mean_segments if radial else None,
            buffer=self.fp32.take(),
            native_kernels=native.resolve(self.cfg.kernels),
        )

    def initialize(self, params: torch.Tensor, version: int = 0, adopt: bool = False) -> None:
        """See `FragmentModel.initialize`."""
        self.model.initialize(params, version, adopt)
        self.settled()

    def restore(self, tensors: Mapping[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.model.restore(tensors, meta)
        self.settled()

    def settled(self) -> None:
        """Rounds and the version gauge follow parameters set from outside (init, restore)."""
        self.admission.reset(self.model.version)
        self.metrics.fragment_version.labels(str(self.fid)).set(self.model.version)

    def submit(
        self,
        learner_id: str,
        base_version: int,
        tokens: int,
        steps: int,
        compute_s: float,
        payload: tuple[torch.Tensor, pb.PayloadHeader],
        hold: bool = False,
        journal: Callable[[Verdict], int] | None = None,
        order: tuple[str, str, int] = ("", "", 0),
        owner: str = "",
        measured: Measured | None = None,
    ) -> tuple[Verdict, Round | None]:
        """Judges one push into the open round (see `Admission.submit`)."""
        return self.admission.submit(
            learner_id,
            base_version,
            tokens,
            steps,
            self.share_of(tokens, compute_s),
            self.model.version,
            payload,
            hold,
            journal,
            order,
            owner,
            measured,
        )

    def reserve_hold(self, nbytes: int, live: Callable[[], set[str]], wait_s: float) -> bool:
        """Room in the payload budget to hold a push of `nbytes` for its outer step: True when
        it is held, False when its round already adds on arrival (it has its sums: no more
        memory).

        Past the budget the Synchronizer is behind (rounds wait for outer steps). A round that
        has not reached its quorum needs this push to ever close: it is held past the budget, or
        added on arrival when its held pushes would cost more than FP32 sums of the fragment.
        Otherwise the push waits (up to `wait_s`) for outer steps to free room, and is then
        refused RESOURCE_EXHAUSTED (the learner retries it, same seq): memory stays within the
        budget plus what rounds need to reach their quorum."""
        if self.payloads.reserve(nbytes):
            return True
        deadline = time.monotonic() + wait_s
        while True:
            adds, quorum, held = self.admission.holding(live(), self.model.version)
            if adds:
                return False
            if not quorum:
                if held + nbytes > 4 * self.numel:
                    return False  # holding would cost more than the round's FP32 sums
                self.payloads.claim(nbytes)
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                self.metrics.payloads_refused.inc()
                raise Rejected(
                    Code.RESOURCE_EXHAUSTED,
                    "payload_budget",
                    f"pushes held for outer steps fill payload_budget_bytes ({self.payloads.budget_bytes}): the Synchronizer is behind; retry this push (same seq) with backoff",
                )
            if self.payloads.wait_reserve(nbytes, min(0.5, left)):
                return True

    def share_of(self, tokens: int, compute_s: float) -> Share:
        """The part of a push's tokens and compute seconds this fragment accounts for."""
        return Share(tokens * self.share, compute_s * self.share)

    def apply(
        self,
        rnd: Round,
        settled: Callable[[str | None, float], None] = lambda _refused, _share: None,
    ) -> tuple[float, str | None, float]:
        """Decodes a taken round's held pushes, merges them and applies the outer step, in
        version order; returns the seconds it took, if the round was refused why, and its share
        of a whole step (`FragmentModel.step`, which calls `settled` before the version shows).
        The round's sums are taken from the shared FP32 buffers (unless it added on arrival and
        has them already) and given back when the step ends, whatever happens."""
        try:
            # A round still all encoded pushes the native chain can step from is handed over as
            # it is (no FP32 sums: `FragmentModel.step`), and decoded under the model's lock
            # only where the step does not take it; every other round is decoded here, outside.
            ordered = rnd.ordered() if self._steps_from_pushes(rnd) else []
            held = [(h.buf, h.header, h.weight) for h in ordered]
            t_decode = 0.0 if held else self._decode(rnd)

            def merge(share: float) -> torch.Tensor:  # over the round's sums; 0 weight: no change
                if held:  # the step did not take the pushes as they are: decoded now (timed
                    self._decode(rnd)  # as part of the step)
                acc = rnd.acc
                assert acc is not None
                return acc.merged(share=share) if acc.total_weight > 0 else acc.cleared()

            seconds, refused, share = self.model.step(
                rnd.start_version,
                merge,
                rnd.contributions,
                lambda: None if rnd.acc is None else rnd.acc.merged_max_abs,
                held,
                settled,
                [h.largest for h in ordered],
            )
        finally:
            self.discard(rnd)
        return seconds + t_decode, refused, share

    def _steps_from_pushes(self, rnd: Round) -> bool:
        """Whether the round may go to the outer step as encoded pushes: nothing added on
        arrival, mean merging, and every push one the native kernels decode."""
        return (
            rnd.acc is None
            and bool(rnd.held)
            and self.cfg.merge == "mean"
            and native.resolve(self.cfg.kernels)
            and all(native_codec(h.header) for h in rnd.held)
        )

    def _decode(self, rnd: Round) -> float:
        """The round's held pushes decoded into its sums (taken from the FP32 buffers where it
        has none yet); the seconds it took."""
        t0 = time.perf_counter()
        if rnd.acc is None:
            rnd.acc = self._new_accumulator()
        self._add_held(rnd)
        return time.perf_counter() - t0

    def discard(self, rnd: Round) -> None:
        """Gives back what a taken round holds (held payloads, its sums), once its outer step
        ended or could not run."""
        self._release([h.buf for h in rnd.held])
        rnd.held.clear()
        if rnd.acc is not None:
            self.fp32.give(rnd.acc.buffer)
            rnd.acc = None

    def _release(self, held: list[torch.Tensor]) -> None:
        """Held payloads spent: no longer held, and pooled where the budget has room."""
        self.payloads.release(sum(buf.numel() for buf in held))
        for buf in held:
            self.payloads.give(buf)

    def _add_held(self, rnd: Round) -> None:
        """Decodes the round's held pushes into its accumulator (outside the locks: a taken round
        belongs to its outer step alone)."""
        if not rnd.held:
            return
        assert rnd.acc is not None
        # A decode buffer only for radial merging: the rest add in place (FP4 in runs).
        scratch = self.fp32.take() if rnd.acc.radial else None
        held = [h.buf for h in rnd.held]
        try:
            rnd.add_held(None if scratch is None else scratch[: self.numel])
        finally:
            self._release(held)
            if scratch is not None:
                self.fp32.give(scratch)
