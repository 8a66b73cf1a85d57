"""One fragment of the global model: the parts that serve it, put together.

A `Fragment` is its spec (tensor segments, share of the model), its `Admission` of pushes into
the open round (`synchronizer.rounds`), the buffers and held-bytes budget of its push path
(`synchronizer.buffers`), and its `FragmentModel`: parameters, outer step and downlink
(`synchronizer.model`, `synchronizer.downlink`). Two locks, never held together by a push: the
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
from synchronizer.buffers import HELD_FP32_COPIES, POOL_FP32_COPIES, BufferPool, HeldBudget
from synchronizer.config import SynchronizerConfig
from synchronizer.goodput import Goodput, Share
from synchronizer.merge import Accumulator
from synchronizer.metrics import Metrics
from synchronizer.model import FragmentModel
from synchronizer.rounds import Admission, Round, Verdict

EMBEDDING_HINTS = ("emb", "wte", "wpe")  # tensors merged by plain mean in radial mode


class Fragment:
    def __init__(
        self,
        spec: FragmentSpec,
        cfg: SynchronizerConfig,
        metrics: Metrics,
        goodput: Goodput,
        model_numel: int,
    ) -> None:
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
        # Pooled buffers, and payloads held for the outer step (`synchronizer.memory` counts both).
        self.pool = BufferPool(spec.numel, POOL_FP32_COPIES * 4 * spec.numel)
        self.held = HeldBudget(HELD_FP32_COPIES * 4 * spec.numel)
        self.model = FragmentModel(self.fid, spec.numel, cfg)
        self.admission = Admission(
            cfg, metrics, goodput, self._new_accumulator, self.pool, self.held, self.fid
        )
        self.metrics = metrics
        metrics.fragment_version.labels(str(self.fid)).set(0)

    @property
    def version(self) -> int:
        return self.model.version

    def _new_accumulator(self) -> Accumulator:
        radial = self.cfg.merge == "radial"
        return Accumulator(
            self.numel,
            self.segments if radial else None,
            radial=radial,
            mean_segments=self.mean_segments if radial else None,
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
        )

    def share_of(self, tokens: int, compute_s: float) -> Share:
        """The part of a push's tokens and compute seconds this fragment accounts for."""
        return Share(tokens * self.share, compute_s * self.share)

    def apply(self, rnd: Round) -> tuple[float, str | None]:
        """Decodes a taken round's held pushes, merges them and applies the outer step, in
        version order; returns the seconds it took and, if the round was refused, why."""
        t_decode = time.perf_counter()
        self._add_held(rnd)
        t_decode = time.perf_counter() - t_decode
        acc = rnd.acc

        def merge() -> torch.Tensor:  # in place over the round's sums; zero weights: no change
            return acc.merged() if acc.total_weight > 0 else acc.cleared()

        seconds, refused = self.model.step(rnd.start_version, merge, rnd.contributions)
        acc.reset()
        self.admission.recycle(acc)
        return seconds + t_decode, refused

    def _add_held(self, rnd: Round) -> None:
        """Decodes the round's held pushes into its accumulator (outside the locks: a taken round
        belongs to its outer step alone)."""
        if not rnd.held:
            return
        # A decode buffer only where one is needed (radial merge, FP4): the rest add in place.
        needs_scratch = rnd.acc.radial or any(h.header.codec == pb.CODEC_FP4_E3M0 for h in rnd.held)
        scratch = self.pool.take() if needs_scratch else None
        held = [h.buf for h in rnd.held]
        try:
            rnd.add_held(scratch)
        finally:
            for buf in held:
                self.pool.give(buf)
            if scratch is not None:
                self.pool.give(scratch)
            self.held.release(sum(buf.numel() for buf in held))
