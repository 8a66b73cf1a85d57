"""The model this Synchronizer serves: its spec, this shard's layout of it, the fragments by id
and whether it is initialised, under one model lock; and which fragments failed.

Before initialisation it keeps the specs live learners proposed at Join (`proposed`), so the
served spec is set only by a successful InitModel (or `init`), never by a Join. `serve(spec)`
builds the fragments of this shard with their shared buffers (payload budget, FP32 sums,
snapshots, sized by the largest fragment) and the `Rounds` that closes their rounds.

A fragment whose outer step failed is kept in `failures` with the reason; listeners (the gRPC
health service) are told, and every push and pull of it is refused UNAVAILABLE.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable

from protos import diloco_pb2 as pb
from protos.spec import ModelSpec
from synchronizer import memory
from synchronizer.buffers import (
    Fp32Buffers,
    Payloads,
    Snapshots,
    fp32_kept,
    payload_budget,
    snapshot_budget,
)
from synchronizer.clock import Clock
from synchronizer.config import SynchronizerConfig
from synchronizer.errors import Code, Rejected
from synchronizer.fragments import Fragment
from synchronizer.goodput import Goodput
from synchronizer.grace import GraceWindow
from synchronizer.journal import Journal
from synchronizer.leases import Registry
from synchronizer.metrics import Metrics
from synchronizer.rounds import Rounds
from synchronizer.shards import Layout
from synchronizer.streams import Streams

logger = logging.getLogger(__name__)


def known_fragment(fragment_id: int, count: int) -> None:
    """NOT_FOUND unless `fragment_id` is one of the model's `count` fragments."""
    if fragment_id >= count:
        raise Rejected(
            Code.NOT_FOUND,
            "unknown_fragment",
            f"fragment {fragment_id} does not exist; the model has fragments 0..{count - 1}",
        )


def log_state_disk(cfg: SynchronizerConfig, sizes: list[int]) -> None:
    """Logs the state directory's projected peak disk use beside its free space: a WARNING when
    that is less (checkpoints would then fail and, with the log on, pushes be refused)."""
    need = memory.state_disk(cfg, sizes)
    try:
        free = shutil.disk_usage(cfg.state_dir).free
        held = sum(p.stat().st_size for p in cfg.state_dir.rglob("*") if p.is_file())
    except OSError:
        return
    text = (
        f"state disk projection: {need['total'] / 2**30:.1f} GiB "
        f"({cfg.keep_checkpoints} checkpoints of {need['checkpoint'] / 2**30:.1f} GiB and the one "
        f"being written, the write-ahead log up to {need['wal'] / 2**30:.1f} GiB); "
        f"{cfg.state_dir} holds {held / 2**30:.1f} GiB and has {free / 2**30:.1f} GiB more free"
    )
    if free + held < need["total"]:
        logger.warning(
            "%s: too little; lower keep_checkpoints or checkpoint_wal_bytes, or give state_dir more room",
            text,
        )
    else:
        logger.info(text)


def export_memory(metrics: Metrics, projection: dict[str, int]) -> None:
    """The projection's components; not its `total`, which a sum() over them would count twice."""
    for component, nbytes in projection.items():
        if component != "total":
            metrics.memory.labels(component).set(nbytes)


class ServedModel:
    def __init__(
        self,
        cfg: SynchronizerConfig,
        metrics: Metrics,
        clock: Clock,
        goodput: Goodput,
        grace: GraceWindow,
        registry: Registry,
        streams: Streams,
        journal: Journal,
        outer_step_threads: int,
    ) -> None:
        """`outer_step_threads`: the closer's workers (0: on the thread that closes a round)."""
        self.cfg = cfg
        self.outer_step_threads = outer_step_threads
        self.metrics = metrics
        self.clock = clock
        self.goodput = goodput
        self.grace = grace
        self.registry = registry
        self.streams = streams
        self.journal = journal
        self.lock = threading.Lock()
        self.initialized_cv = threading.Condition(self.lock)  # notified once initialised
        self.spec: ModelSpec | None = None
        self.layout: Layout | None = None  # this shard's fragments of the served spec
        self.fragments: list[Fragment] = []  # the fragments this shard owns, in id order
        self.by_id: dict[int, Fragment] = {}
        self.rounds: Rounds | None = None
        self.snapshots: Snapshots | None = None
        self.initialized = False
        self.proposed: dict[str, ModelSpec] = {}  # specs live learners joined with, before init
        self.failures: dict[int, str] = {}  # fragment id -> why its outer step failed
        self.health_listeners: list[Callable[[str], None]] = []  # told the reason once unhealthy

    def layout_of(self, spec: ModelSpec) -> Layout:
        return Layout.of(spec, self.cfg.shards, self.cfg.shard_index)

    def serve(self, spec: ModelSpec) -> None:
        """Serves `spec`: state (parameters, outer state, buffers) for this shard's fragments
        only, sized by them. Call with the model lock held, or before serving."""
        self.spec = spec
        self.layout = self.layout_of(spec)
        owned = [spec.fragments[fid] for fid in self.layout.owned]
        numel = sum(f.numel for f in owned)
        projection = memory.project(self.cfg, [f.numel for f in owned])
        export_memory(self.metrics, projection)
        logger.info(
            "memory projection for %d parameters in %d fragments: %s",
            numel,
            len(owned),
            memory.describe(projection, numel),
        )
        log_state_disk(self.cfg, [f.numel for f in owned])
        if self.cfg.shards > 1:
            logger.info(
                "serving as %s: %d of the model's %d parameters",
                self.layout.describe(),
                numel,
                spec.numel,
            )
        self.goodput.fraction = numel / max(spec.numel, 1)
        self.streams.limit_per_learner(len(owned))
        largest = max((f.numel for f in owned), default=0)
        payloads = Payloads(payload_budget(self.cfg.payload_budget_bytes, largest))
        snapshots = Snapshots(snapshot_budget(self.cfg.snapshot_budget_bytes, largest))
        self.snapshots = snapshots
        self.metrics.snapshot_bytes.set_function(lambda: snapshots.alive_bytes)
        kept = fp32_kept(self.cfg.apply_threads, self.cfg.merge)
        fp32 = Fp32Buffers(largest, kept, self.metrics.fp32_beyond.inc)
        self.metrics.watch_buffers(payloads, fp32)
        self.fragments = [
            Fragment(
                f, self.cfg, self.metrics, self.goodput, spec.numel, payloads, fp32, self.clock
            )
            for f in owned
        ]
        self.by_id = {frag.fid: frag for frag in self.fragments}
        self.rounds = Rounds(
            self.fragments,
            self.grace,
            self.metrics,
            self.goodput,
            self.registry.pushing_ids,
            self.clock,
            self.outer_step_threads,
            self.fragment_failed,
            self.journal.durable,
        )
        for frag in self.fragments:
            frag.admission.journal = self.journal.round_journal(frag)

    def mark_initialized(self) -> None:
        """The model is served from here on (model lock held): waiting pulls wake."""
        self.initialized = True
        self.proposed.clear()
        self.initialized_cv.notify_all()

    def propose(self, spec: ModelSpec) -> None:
        """Keeps a spec a learner joined with before initialisation, while a live learner
        holds it (an InitModel may then upload it)."""
        with self.lock:
            self.proposed[spec.spec_hash] = spec
            live = self.registry.live_specs()
            for h in [h for h in self.proposed if h not in live]:
                del self.proposed[h]

    def arrived(self, learner_id: str) -> None:
        """A learner joined or came back while the run is under way (`Admission.arrived`)."""
        for frag in self.fragments:
            frag.admission.arrived(learner_id, frag.version)

    def versions(self) -> list[pb.FragmentVersion]:
        return [pb.FragmentVersion(fragment_id=f.fid, version=f.version) for f in self.fragments]

    def fragment(self, fragment_id: int) -> Fragment:
        """This shard's fragment `fragment_id`: NOT_FOUND outside the model, `wrong_shard`
        when another shard serves it."""
        known_fragment(fragment_id, len(self.spec.fragments) if self.spec is not None else 0)
        if self.layout is not None:
            self.layout.refuse_unowned(fragment_id)
        return self.by_id[fragment_id]

    def require_initialized(self) -> None:
        if not self.initialized:
            raise Rejected(
                Code.FAILED_PRECONDITION,
                "not_initialized",
                "the model has no parameters yet: the first learner must call InitModel (or run `diloco-synchronizer init FILE`)",
            )

    def check_spec_hash(self, spec_hash: str) -> None:
        assert self.spec is not None
        if spec_hash != self.spec.spec_hash:
            raise Rejected(
                Code.FAILED_PRECONDITION,
                "spec_mismatch",
                f"spec hash {spec_hash[:12]!r} does not match the served model's {self.spec.spec_hash[:12]!r}; re-join with the served model's spec",
            )

    # Failed fragments ----------------------------------------------------------------------

    def fragment_failed(self, frag: Fragment, reason: str) -> None:
        frag.model.fail(reason)
        self.failures[frag.fid] = reason
        self.metrics.fragments_failed.set(len(self.failures))
        logger.error(
            "fragment %d failed and serves nothing until a restart from the last checkpoint: %s",
            frag.fid,
            reason,
        )
        for listener in self.health_listeners:
            listener(reason)

    def unavailable(self, frag: Fragment) -> Rejected:
        return Rejected(
            Code.UNAVAILABLE,
            "fragment_failed",
            f"fragment {frag.fid} failed ({frag.model.failure}); the Synchronizer must be restarted from its last checkpoint; retry with backoff",
        )
