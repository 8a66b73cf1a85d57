"""Initialisation: the first parameters of the served model, uploaded by InitModel.

One upload at a time holds the claim (`InitClaim`); a second initialiser is answered
ALREADY_EXISTS and pulls instead. An upload whose stream makes no progress for `init_stall_s`
(on the core's clock) loses the claim to the next learner that tries, and is itself refused
when it ends. A successful upload sets the served spec (`ServedModel.serve`), hands the received
buffers to the fragments without copies, writes the first checkpoint (under the uploader's held
lease: the server's time, not the learner's) and only then serves the model and wakes the pulls
waiting for it; an upload whose checkpoint cannot be written is refused UNAVAILABLE and serves
nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from protos import diloco_pb2 as pb
from synchronizer import receive
from synchronizer.clock import Clock
from synchronizer.config import SynchronizerConfig
from synchronizer.errors import Code, Rejected, invalid
from synchronizer.leases import Registry
from synchronizer.served import ServedModel, known_fragment

logger = logging.getLogger(__name__)


@dataclass
class InitClaim:
    """An InitModel upload under way: who, and when its stream last moved."""

    learner_id: str
    progress_at: float


class Initializer:
    def __init__(
        self,
        cfg: SynchronizerConfig,
        clock: Clock,
        model: ServedModel,
        registry: Registry,
        save_checkpoint: Callable[[], bool],  # the first checkpoint, before the model is served
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.model = model
        self.registry = registry
        self.save_checkpoint = save_checkpoint
        self.claim: InitClaim | None = None  # the InitModel upload under way, if any

    def init_model(self, messages: Iterator[pb.InitModelRequest]) -> pb.InitModelReply:
        first = next(messages, None)
        if first is None or first.WhichOneof("kind") != "start":
            raise invalid("bad_stream", "InitModel must start with an InitStart message")
        rec = self.registry.alive(first.start.learner_id, first.start.session)
        model = self.model
        with model.lock:
            spec = model.spec if model.initialized else model.proposed.get(rec.spec_hash)
        if spec is None:
            raise Rejected(
                Code.FAILED_PRECONDITION,
                "no_spec",
                "this learner's model spec is not known: call Join with it first",
            )
        if first.start.spec_hash != spec.spec_hash:
            raise Rejected(
                Code.FAILED_PRECONDITION,
                "spec_mismatch",
                f"spec hash {first.start.spec_hash[:12]!r} is not the one this learner joined with ({spec.spec_hash[:12]!r}); re-join with the model's spec",
            )
        claim = self._take_claim(first.start.learner_id)
        try:
            layout = model.layout_of(spec)
            numels = {fid: spec.fragments[fid].numel for fid in layout.owned}

            def progress() -> None:  # an upload longer than a lease keeps it while it moves
                claim.progress_at = self.clock.monotonic()
                self.registry.renew(rec)

            def known(fid: int) -> None:
                known_fragment(fid, len(spec.fragments))
                layout.refuse_unowned(fid)

            received = receive.init_fragments(messages, known, numels, progress)
            with model.lock:
                if self.claim is not claim:
                    raise Rejected(
                        Code.ALREADY_EXISTS,
                        "already_initialized",
                        f"this upload stalled for more than init_stall_s ({self.cfg.init_stall_s:g} s) and another learner took over; pull its fragments instead",
                    )
                model.serve(spec)
                for frag, params in zip(model.fragments, received, strict=True):
                    frag.initialize(params, adopt=True)  # the upload's buffers, not copies
                received.clear()  # the fragments hold the only references
            # The first checkpoint is durable before anything is served: a model served, then
            # lost to a crash, would come back uninitialised with its logged pushes skipped.
            progress()
            with self.registry.held(rec):  # the server's time, not the learner's
                saved = self.save_checkpoint()
            with model.lock:
                if self.claim is not claim:
                    raise Rejected(
                        Code.ALREADY_EXISTS,
                        "already_initialized",
                        "another learner took over while the first checkpoint was written; pull its fragments instead",
                    )
                if not saved:
                    raise Rejected(
                        Code.UNAVAILABLE,
                        "checkpoint_failed",
                        f"the model could not be saved to {self.cfg.state_dir}, so it is not served; retry InitModel once the disk is writable",
                    )
                model.mark_initialized()
                logger.info(
                    "serving a model of %d parameters in %d fragments (spec %s)%s",
                    spec.numel,
                    len(spec.fragments),
                    spec.spec_hash[:12],
                    f" as {layout.describe()}" if layout.shards > 1 else "",
                )
        finally:
            with model.lock:
                if self.claim is claim:
                    self.claim = None
        logger.info("model initialised by learner %s", first.start.learner_id)
        return pb.InitModelReply(versions=model.versions())

    def _take_claim(self, learner_id: str) -> InitClaim:
        """The claim to initialise, unless the model is initialised or another upload holds it
        and moved within `init_stall_s` (ALREADY_EXISTS)."""
        now = self.clock.monotonic()
        claim = InitClaim(learner_id, now)
        with self.model.lock:
            if self.model.initialized:
                raise Rejected(
                    Code.ALREADY_EXISTS,
                    "already_initialized",
                    "the model is already initialised; pull its fragments instead",
                )
            held = self.claim
            if held is not None and now - held.progress_at < self.cfg.init_stall_s:
                raise Rejected(
                    Code.ALREADY_EXISTS,
                    "already_initialized",
                    f"the model is being initialised by learner {held.learner_id}; pull its fragments instead",
                )
            if held is not None:
                logger.warning(
                    "InitModel of learner %s made no progress for %.0f s: learner %s takes over",
                    held.learner_id,
                    now - held.progress_at,
                    learner_id,
                )
            self.claim = claim
        return claim
