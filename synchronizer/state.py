"""The Synchronizer's state on disk: start-up checks, checkpoints, restore and log replay.

At start, before anything is loaded or written, `check_at_start` refuses a state directory of
another shard layout or a model that cannot fit `memory_limit_bytes`. `State.restore` loads the
newest complete checkpoint (`synchronizer.checkpoint`) into the served model and the learner
registry; `State.replay` repeats the write-ahead log on top of it (`synchronizer.journal`) and
starts the log. `State.save` writes a checkpoint atomically, one frozen fragment at a time, and
lets the log segments it covers go; a checkpoint that cannot be written is an ERROR record, a
metric and part of the Synchronizer's health, never an exception out of the service.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError
from safetensors import SafetensorError, safe_open

from protos import diloco_pb2 as pb
from protos.spec import ModelSpec
from synchronizer import checkpoint, memory, shards
from synchronizer.clock import Clock
from synchronizer.config import SynchronizerConfig
from synchronizer.goodput import Goodput
from synchronizer.journal import Journal
from synchronizer.leases import Registry
from synchronizer.metrics import Metrics
from synchronizer.model import FragmentFailed
from synchronizer.served import ServedModel, export_memory

logger = logging.getLogger(__name__)


def spec_of(meta: dict[str, Any]) -> ModelSpec:
    """The model spec a checkpoint's metadata carries."""
    msg = pb.ModelSpec()
    msg.ParseFromString(base64.b64decode(meta["spec"]))
    return ModelSpec.from_proto(msg)


def stored(state_dir: Path) -> tuple[dict[str, Any], ModelSpec] | None:
    """The newest checkpoint's metadata and spec, read without its tensors (None when there is
    none, or it cannot be read: restoring then decides)."""
    found = checkpoint.list_checkpoints(state_dir)
    if not found:
        return None
    try:
        with safe_open(str(found[-1][1]), framework="pt") as f:
            meta = json.loads((f.metadata() or {})[checkpoint.META_KEY])
        return meta, spec_of(meta)
    except (SafetensorError, OSError, KeyError, ValueError, DecodeError):
        return None


def check_at_start(cfg: SynchronizerConfig, metrics: Metrics) -> None:
    """Refuses to start, before anything is loaded or written, on a state directory of another
    shard layout (`ShardLayoutError`), or when the fixed costs, or this shard's part of the
    model the state directory holds, cannot fit `memory_limit_bytes` (`MemoryLimitError`); logs
    what each parameter of a model will cost."""
    found = stored(cfg.state_dir)
    sizes: list[int] = []
    if found is not None:
        meta, spec = found
        shards.check_stored(meta, spec, cfg.shards, cfg.shard_index)
        owned = shards.Layout.of(spec, cfg.shards, cfg.shard_index).owned
        sizes = [spec.fragments[fid].numel for fid in owned]
    why = memory.over_limit(cfg, sizes)
    if why is not None:
        raise memory.MemoryLimitError(f"refusing to start: {why}")
    export_memory(metrics, memory.project(cfg, []))
    per_param, fixed = memory.bytes_per_param(cfg)
    limit = cfg.memory_limit_bytes
    logger.info(
        "memory projection: %.1f bytes per model parameter (%.1fx its FP32 bytes) + %.0f MiB; %s",
        per_param,
        per_param / 4,
        fixed / (1 << 20),
        f"memory_limit_bytes {limit:,} fits about {int((limit - fixed) / per_param):,} parameters"
        if limit
        else "no memory_limit_bytes",
    )


class State:
    def __init__(
        self,
        cfg: SynchronizerConfig,
        metrics: Metrics,
        model: ServedModel,
        registry: Registry,
        goodput: Goodput,
        journal: Journal,
        clock: Clock,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.metrics = metrics
        self.model = model
        self.registry = registry
        self.goodput = goodput
        self.journal = journal
        self.lock = threading.Lock()  # one checkpoint at a time
        self.failure: str | None = None  # why the last checkpoint could not be written
        self.checkpointed: dict[int, int] = {}  # fragment id -> its version in the newest one
        self.size = 0  # bytes of the newest checkpoint (written, or restored at start)
        self.held = 0  # the log's written bytes (since start) the newest one holds

    def save(self, first: bool = False) -> bool:
        """Writes the state atomically; False if it could not (nothing to save before the model
        is initialised counts as saved; `first`: the model's first checkpoint, written before it
        is served). While a fragment is failed nothing is written: the
        newest checkpoint stays the last healthy state. A write that fails (a full disk, a
        read-only volume) is an ERROR record, `diloco_checkpoint_failures_total` and part of
        the Synchronizer's health until a later one succeeds; the service keeps serving."""
        model = self.model
        if not (model.initialized or first) or model.spec is None:
            return True
        if model.failures:
            logger.error(
                "no checkpoint written while a fragment is failed (%s); a restart resumes from the last healthy one",
                "; ".join(f"fragment {fid}: {why}" for fid, why in sorted(model.failures.items())),
            )
            return False
        try:
            self._write(model.spec)
        except FragmentFailed as e:  # failed while the state was being collected
            logger.error("no checkpoint written: %s", e)
            return False
        except Exception as e:  # noqa: BLE001 - any failure to save must be loud, not a lost traceback
            self.failure = f"{type(e).__name__}: {e}"
            self.metrics.checkpoint_failures.inc()
            newest = checkpoint.list_checkpoints(self.cfg.state_dir)
            logger.error(
                "checkpoint to %s failed (%s); the newest on disk is still %s",
                self.cfg.state_dir,
                self.failure,
                newest[-1][1].name if newest else "none",
            )
            return False
        self.failure = None
        return True

    def _write(self, spec: ModelSpec) -> None:
        """Writes every fragment's live state, one frozen fragment at a time. Lock order: the
        checkpoint lock, then the log's seal, then each fragment's condition only to freeze and
        thaw it (never held during the write); the freeze is released before the log is
        truncated. An outer step waiting on a frozen fragment holds no lock (its log record is
        durable before it waits), so it only waits, for at most one fragment's write time."""
        t0 = time.perf_counter()
        fragments = self.model.fragments
        with self.lock:
            held = self.journal.written_bytes()  # at most what the seal puts in this one
            sealed = self.journal.seal()  # the log from here on is not in this checkpoint
            spec_text = base64.b64encode(spec.to_proto().SerializeToString()).decode()
            frag_meta = []
            # No copies: one fragment at a time is frozen at its version (its outer steps wait;
            # pushes and pulls go on) while its live tensors are written.
            room = checkpoint.HEADER_ROOM + len(spec_text) + 512 * self.cfg.max_learners
            with checkpoint.Writer(
                self.cfg.state_dir, self.cfg.keep_checkpoints, room, self.journal.disk
            ) as writer:
                for frag in fragments:
                    with frag.model.frozen_state() as (tensors, m):
                        writer.add(tensors)
                    frag_meta.append(m)
                meta = {
                    "format": 1,
                    "spec": spec_text,
                    "fragments": frag_meta,
                    "learners": self.registry.snapshot(),
                    **self.model.layout_of(spec).meta(),
                }
                # The learners' records say which push seqs were judged (a retry of one is a
                # duplicate); a push judged after the seal is in the log, but until its record
                # is durable a power cut could take it while this checkpoint still says it
                # was judged: the checkpoint waits for the log before it becomes durable.
                self.journal.sync()
                path = writer.finish(meta)
            versions = {f.fid: int(m["version"]) for f, m in zip(fragments, frag_meta, strict=True)}
            self.journal.release(sealed, versions)
            self.checkpointed, self.size, self.held = versions, writer.at, held
        self.metrics.checkpoints.inc()
        self.metrics.checkpoint_seconds.observe(time.perf_counter() - t0)
        self.metrics.checkpoint_last_success.set(self.clock.wall())
        logger.info(
            "checkpoint %s written (versions %s)", path.name, [f.version for f in fragments]
        )

    def restore(self) -> None:
        """The newest complete checkpoint, if any, into the served model and the registry."""
        found = checkpoint.load_latest(self.cfg.state_dir)
        if found is None:
            return
        tensors, meta, path = found
        spec = spec_of(meta)
        # Checked at start against the newest checkpoint; again for the one that loaded.
        shards.check_stored(meta, spec, self.cfg.shards, self.cfg.shard_index)
        model = self.model
        model.serve(spec)
        for frag, fmeta in zip(model.fragments, meta["fragments"], strict=True):
            frag.restore(tensors, fmeta)
        self.checkpointed = {frag.fid: frag.version for frag in model.fragments}
        stat = path.stat()
        self.size = stat.st_size
        model.initialized = True
        self.registry.restore(meta.get("learners", []))
        self.metrics.checkpoint_last_success.set(stat.st_mtime)
        logger.info("restored %s: versions %s", path, [f.version for f in model.fragments])

    def replay(self, epoch: str) -> None:
        """Repeats what the write-ahead log holds beyond the checkpoint, then starts the log."""
        model = self.model
        pushes, rounds = self.journal.replay(model.by_id, self.registry, self.goodput, model.rounds)
        for frag in model.fragments:
            frag.settled()
        if pushes or rounds:
            logger.info(
                "replayed the write-ahead log: %d pushes, %d rounds; versions %s (epoch %s)",
                pushes,
                rounds,
                [f.version for f in model.fragments],
                epoch,
            )
        self.journal.start()

    def changed(self) -> bool:
        """Whether anything is served or logged that the newest checkpoint does not hold (or
        the last one could not be written): a version since, or the log grown since its seal."""
        return bool(self.failure or self.unsaved() or self.journal.written_bytes() > self.held)

    def current(self) -> None:
        """The newest checkpoint still holds the served state: its freshness, the gauge the
        checkpoint-age alert reads, is now."""
        if self.checkpointed:
            self.metrics.checkpoint_last_success.set(self.clock.wall())

    def unsaved(self) -> str:
        """The versions served since the newest checkpoint, fragment by fragment ('' if none)."""
        spans = []
        for f in self.model.fragments:
            first = self.checkpointed.get(f.fid, 0) + 1
            if f.version > first:
                spans.append(f"fragment {f.fid} versions {first}-{f.version}")
            elif f.version == first:
                spans.append(f"fragment {f.fid} version {first}")
        return ", ".join(spans)
