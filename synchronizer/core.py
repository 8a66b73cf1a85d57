"""The Synchronizer itself, without gRPC: the facade the thin servicer calls.

`Synchronizer` puts the rooms together and answers the learner RPCs that are bookkeeping alone
(Join, Heartbeat, Leave, Status, ReportEval: `synchronizer.evaluation` scores it). The rest has a module each, in the order a call meets it:

- the served model, its fragments and which failed: `synchronizer.served`;
- pushes: `synchronizer.pushes` (then `admission`, `journal`, `rounds`, `fragments`, `model`);
- pulls: `synchronizer.pulls` (then `model`, `downlink`);
- InitModel and the takeover of a stalled upload: `synchronizer.initialize`;
- start-up checks, checkpoints, restore and log replay: `synchronizer.state`.

Its methods take and return the wire's protobuf messages; a request it refuses raises
`Rejected` before it touches any state. Time comes from one `Clock` (`synchronizer.clock`);
nothing runs in the background until `start()`: the log's writer, the housekeeping thread
(`tick` every `min(0.5, lease_s / 4)` s: lease reaping, idle streams, grace checks, capacity,
periodic checkpoints). Tests drive `tick` on a `ManualClock` instead.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator
from typing import Any

from protos import diloco_pb2 as pb
from protos.spec import ModelSpec
from synchronizer import checkpoint, memory, shards, state, wire
from synchronizer.clock import Clock, SystemClock
from synchronizer.config import SynchronizerConfig
from synchronizer.credentials import Credentials, load_tokens
from synchronizer.disk import Disk
from synchronizer.errors import Code, Rejected, invalid
from synchronizer.evaluation import Evaluations, ReferenceCurve
from synchronizer.goodput import Goodput
from synchronizer.grace import GraceWindow
from synchronizer.initialize import Initializer
from synchronizer.journal import Journal, load_epoch
from synchronizer.leases import DLU_RATIO, Registry
from synchronizer.metrics import Metrics
from synchronizer.pulls import PullPath
from synchronizer.pushes import PushMessages, PushPath
from synchronizer.records import LearnerRecord
from synchronizer.served import ServedModel
from synchronizer.streams import Call, Streams

logger = logging.getLogger(__name__)


class Synchronizer:
    def __init__(
        self,
        cfg: SynchronizerConfig,
        metrics: Metrics | None = None,
        disk: Disk | None = None,
        clock: Clock | None = None,
        inline_outer_steps: bool = False,
    ) -> None:
        """Checks the state directory and restores the newest checkpoint; `start()` replays the
        log and starts the background work. `disk`: the file operations of everything kept in
        `state_dir` (tests inject faults there, and cut the power); `clock`: the time policies read (tests: a `ManualClock`);
        `inline_outer_steps`: an outer step runs on the thread that closes its round instead of
        a worker (tests: a round is applied when the call that closed it returns)."""
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self.clock = clock or SystemClock()
        state.check_at_start(cfg, self.metrics)
        self.metrics.shard_info.labels(str(cfg.shard_index), str(cfg.shards)).set(1)
        logger.info("shard %d of %d", cfg.shard_index, cfg.shards)
        self.journal = Journal(cfg, self.metrics, disk)
        # A history of versions starts with the checkpoint an initialisation writes.
        self.epoch = load_epoch(
            cfg, bool(checkpoint.list_checkpoints(cfg.state_dir)), self.journal.disk
        )
        self.registry = Registry(cfg.lease_s, cfg.max_learners, cfg.forget_after_s, self.clock)
        self.goodput = Goodput(self.metrics, cfg.goodput_window_s, self.clock)
        self.evaluations = Evaluations(
            self.metrics,
            ReferenceCurve.load(cfg.reference_curve) if cfg.reference_curve else None,
            self.registry.consumed_tokens,
        )
        self.grace = GraceWindow(cfg)
        self.streams = Streams(cfg, self.metrics, self.clock)
        self.credentials = Credentials(
            load_tokens(cfg.learner_tokens_file) if cfg.learner_tokens_file else None,
            cfg.client_cert_credentials,
        )
        self.model = ServedModel(
            cfg,
            self.metrics,
            self.clock,
            self.goodput,
            self.grace,
            self.registry,
            self.streams,
            self.journal,
            0 if inline_outer_steps else cfg.apply_threads,
        )
        self.state = state.State(
            cfg, self.metrics, self.model, self.registry, self.goodput, self.journal, self.clock
        )
        self.stopping = threading.Event()
        self.pushes = PushPath(
            cfg, self.metrics, self.model, self.registry, self.streams, self.journal
        )
        self.pulls = PullPath(
            cfg, self.metrics, self.model, self.registry, self.streams, self.epoch, self.stopping
        )
        self.initializer = Initializer(
            cfg, self.clock, self.model, self.registry, lambda: self.state.save(first=True)
        )
        self.housekeeper: threading.Thread | None = None
        self.checkpointer: threading.Thread | None = None  # the periodic checkpoint running
        self.checkpoint_mark = 0  # the log's written bytes when the last one started
        self.last_checkpoint = self.clock.monotonic()
        self.state.restore()

    def start(self, housekeeping: bool = True) -> Synchronizer:
        """Replays the log onto the restored state, starts the log's writer and (unless tests
        drive `tick` themselves) the housekeeping thread."""
        self.state.replay(self.epoch)
        self.last_checkpoint = self.clock.monotonic()
        if housekeeping:
            self.housekeeper = threading.Thread(
                target=self._housekeeping, name="housekeeping", daemon=True
            )
            self.housekeeper.start()
        return self

    # Health ----------------------------------------------------------------------------------

    @property
    def unhealthy(self) -> str | None:
        """Why the Synchronizer cannot serve its whole model or keep it, or None while all is
        well. Only failed fragments turn gRPC health NOT_SERVING: with failing checkpoints the
        model is still served, and a restart would not mend the disk."""
        problems = [f"fragment {fid}: {why}" for fid, why in sorted(self.model.failures.items())]
        if self.state.failure is not None:
            problems.append(f"checkpoints failing: {self.state.failure}")
        if self.journal.failure is not None:
            problems.append(f"write-ahead log failing (pushes refused): {self.journal.failure}")
        return "; ".join(problems) or None

    # Learners --------------------------------------------------------------------------------

    def join(self, request: pb.JoinRequest, call: Call | None = None) -> pb.JoinReply:
        """Admits a learner. Before the model is initialised any well-formed spec within the
        size limits is accepted and kept as that learner's proposal: the served spec is set
        only by a successful initialisation (InitModel or `init`), so a bogus Join decides
        nothing. After it, a learner must bring the served spec."""
        size = request.spec.ByteSize()
        if size > self.cfg.max_spec_bytes:
            raise invalid(
                "spec_too_large",
                f"the model spec is {size} bytes serialized; this Synchronizer takes at most max_spec_bytes={self.cfg.max_spec_bytes}",
            )
        try:
            spec = ModelSpec.from_proto(request.spec)
        except ValueError as e:
            raise invalid("bad_spec", f"model spec is malformed: {e}") from None
        if spec.numel > self.cfg.max_model_params:
            raise invalid(
                "model_too_large",
                f"the model has {spec.numel} parameters; this Synchronizer serves at most max_model_params={self.cfg.max_model_params}",
            )
        layout = shards.check_join(request, spec, self.cfg.shards, self.cfg.shard_index)
        too_big = memory.over_limit(self.cfg, [spec.fragments[fid].numel for fid in layout.owned])
        if too_big is not None:
            if self.cfg.shards > 1:
                too_big = f"{layout.describe()}: {too_big}"
            raise Rejected(Code.RESOURCE_EXHAUSTED, "over_memory_limit", too_big)
        with self.model.lock:
            served = self.model.spec
            if served is not None and spec.spec_hash != served.spec_hash:
                raise Rejected(
                    Code.FAILED_PRECONDITION,
                    "spec_mismatch",
                    f"model spec does not match the served model: {served.describe_difference(spec)}",
                )
            needs_init = not self.model.initialized
        credential = (call or Call()).credential
        rec, session, how = self.registry.join(
            request.learner_name,
            request.learner_id,
            request.session,
            credential,
            self.cfg.max_learners_per_credential if self.credentials.per_learner else 0,
            evaluator=request.evaluator,
        )
        rec.spec_hash = spec.spec_hash
        self.journal.joined(self.registry, rec)
        if how != "again" and not rec.evaluator:
            self.model.arrived(rec.learner_id)
        if needs_init:
            self.model.propose(spec)
        logger.info(
            "%s %s (%s) %s%s",
            "evaluator" if rec.evaluator else "learner",
            rec.learner_id,
            rec.name,
            {"new": "joined", "back": "re-joined", "again": "joined again"}[how],
            f" under credential {credential}" if self.credentials.per_learner else "",
        )
        return pb.JoinReply(
            learner_id=rec.learner_id,
            lease_s=self.cfg.lease_s,
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
            server_epoch=self.epoch,
            versions=self.model.versions(),
            needs_init=needs_init,
            next_seq=rec.max_seq + 1,
            session=session,
            shards=layout.shards,
            shard_index=layout.index,
            owned_fragments=layout.owned,
            **self._inner_steps(rec),
        )

    def _inner_steps(self, rec: LearnerRecord) -> dict[str, Any]:
        """The Dynamic Local Updates directive of a Join or Heartbeat reply: H_m when the
        Synchronizer has an H (`inner_steps`), else the scale of the learner's own H, given
        only to a learner below DLU_RATIO of the fastest's speed: measured step times of equal
        learners jitter, and each change of H moves that learner's push schedule."""
        if not self.cfg.dynamic_local_updates:
            return {}
        levels = self.cfg.dlu_levels
        if self.cfg.inner_steps:
            return {"inner_steps": self.registry.inner_steps_for(rec, self.cfg.inner_steps, levels)}
        ratio = self.registry.settled_ratio(rec, levels)
        return {"inner_steps_scale": ratio} if ratio < DLU_RATIO else {}

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatReply:
        rec = self.registry.alive(request.learner_id, request.session)
        self._report(rec, request.counters, request.step_time_s)
        self.grace.observe(overlap_steps=request.overlap_steps)
        if request.pushes_done and not rec.evaluator and self.registry.done_pushing(rec):
            logger.info(
                "learner %s (%s) pushes nothing more: rounds stop waiting for it",
                rec.learner_id,
                rec.name,
            )
            if self.model.rounds is not None:
                self.model.rounds.check_all()
        return pb.HeartbeatReply(
            server_epoch=self.epoch,
            lease_s=self.cfg.lease_s,
            versions=self.model.versions(),
            **self._inner_steps(rec),
        )

    def _report(self, rec: LearnerRecord, counters: pb.LearnerCounters, step_time_s: float) -> None:
        if not all(
            math.isfinite(x) and x >= 0
            for x in (counters.compute_s, counters.blocked_s, step_time_s)
        ):
            raise invalid("bad_counters", "counters and step time must be finite and non-negative")
        blocked = self.registry.report(rec, counters, step_time_s)
        if rec.evaluator:  # trains nothing: none of its counts are goodput's
            return
        self.metrics.blocked.inc(blocked * self.goodput.fraction)  # a shard counts its part
        self.goodput.report(rec.learner_id, float(rec.tokens), rec.compute_s)
        if step_time_s > 0:
            self.grace.observe(step_time=step_time_s)

    def leave(self, request: pb.LeaveRequest) -> pb.LeaveReply:
        # A learner whose lease lapsed may still leave: nothing of it is left to refuse.
        rec = self.registry.member(request.learner_id, request.session)
        self._report(rec, request.counters, 0.0)
        self.registry.leave(request.learner_id)
        self.goodput.died(request.learner_id, left=True)
        logger.info("learner %s (%s) left", rec.learner_id, rec.name)
        if self.model.rounds is not None:
            self.model.rounds.check_all()
        return pb.LeaveReply()

    def status(self) -> pb.StatusReply:
        with self.registry.lock:
            learners = [
                pb.LearnerStatus(
                    learner_id=r.learner_id,
                    name=r.name,
                    state=r.state,
                    counters=r.counters(),
                    inner_steps=0,
                    credential=r.credential,
                    evaluator=r.evaluator,
                )
                for r in self.registry.learners.values()
            ]
        return pb.StatusReply(
            server_epoch=self.epoch,
            initialized=self.model.initialized,
            spec_hash=self.model.spec.spec_hash if self.model.spec else "",
            versions=self.model.versions(),
            learners=learners,
            outer_steps=sum(f.version for f in self.model.fragments),
            goodput=self.goodput.ratio(),
            model_fraction=self.goodput.fraction,
            unhealthy=self.unhealthy or "",
            shards=self.cfg.shards,
            shard_index=self.cfg.shard_index,
        )

    def report_eval(self, request: pb.EvalReport) -> pb.EvalReply:
        """An evaluator's eval loss of the served model: checked (finite, non-negative, of
        versions the server has served), then scored against the reference curve."""
        rec = self.registry.alive(request.learner_id, request.session)
        if not rec.evaluator:
            raise Rejected(
                Code.FAILED_PRECONDITION,
                "not_an_evaluator",
                f"learner {rec.learner_id!r} joined to train; only a learner that joined as an evaluator (JoinRequest.evaluator) reports eval loss",
            )
        self.model.require_initialized()
        served = {f.fid: f.version for f in self.model.fragments}
        eval_set = self.evaluations.check(request, served)
        result = self.evaluations.report(eval_set, request.eval_loss)
        ratio = result.effective_goodput
        logger.info(
            "eval loss %.4f on %s from %s at %.0f tokens consumed%s",
            request.eval_loss,
            eval_set,
            rec.learner_id,
            result.consumed_tokens,
            f": effective goodput {ratio:.3f}" if ratio is not None else "",
        )
        return pb.EvalReply(
            consumed_tokens=result.consumed_tokens,
            has_reference=ratio is not None,
            reference_tokens=result.reference_tokens or 0.0,
            effective_goodput=ratio or 0.0,
            below_curve=result.below_curve,
        )

    # Transfers -------------------------------------------------------------------------------

    def init_model(self, messages: Iterator[pb.InitModelRequest]) -> pb.InitModelReply:
        return self.initializer.init_model(messages)

    def push(self, messages: PushMessages, call: Call | None = None) -> pb.PushReply:
        return self.pushes.push(messages, call)

    def pull(
        self, request: pb.PullRequest, call: Call | None = None
    ) -> Iterator[pb.PullReply | wire.RawChunk]:
        return self.pulls.pull(request, call)

    # Housekeeping and shutdown ---------------------------------------------------------------

    def tick(self) -> None:
        """One round of housekeeping at the clock's now: lapsed leases die (their unpushed work
        is lost), idle streams are cut, rounds are checked (a learner that died may be the one
        a round waited for), capacity accrues, and a checkpoint is started when one is due."""
        for rec in self.registry.reap():
            self.goodput.died(rec.learner_id)
        self.streams.cut_idle()
        if self.model.rounds is not None:
            self.model.rounds.check_all()
        self.goodput.tick(self.registry.capacity_slots())
        for learner_state, n in self.registry.counts().items():
            self.metrics.learners.labels(learner_state).set(n)
        if self.credentials.per_learner:
            live = self.registry.live_by_credential()
            for name in set(self.credentials.tokens.values()) | set(live):
                self.metrics.credential_learners.labels(name).set(live.get(name, 0))
        if self.checkpointer and self.checkpointer.is_alive():
            return
        if self.checkpoint_due():
            self.last_checkpoint = self.clock.monotonic()
            self.checkpoint_mark = self.journal.written_bytes()
            self.checkpointer = threading.Thread(
                target=self.state.save, name="checkpoint", daemon=True
            )
            self.checkpointer.start()

    def checkpoint_due(self) -> bool:
        """Whether a periodic checkpoint is due (one runs at a time).

        Only when something changed since the newest one: a version served since, or the log
        grown (a Join, a push of an open round); otherwise the newest still holds the served
        state and is reported current (`State.current`), so an idle model is not rewritten
        every interval. Then on `checkpoint_interval_s` since the last one started, or once the
        log has grown by `checkpoint_wal_bytes`. With the log, either waits until it has grown
        by `checkpoint_log_ratio` times the newest checkpoint's size: a checkpoint never
        writes more than 1/ratio of the log's bytes, the disk's load that decides how many
        learners a large model can have, and a restart replays at most ratio times one. The
        interval waits so for ten intervals at most; a retry after a failed one does not wait."""
        cfg, state = self.cfg, self.state
        grown = self.journal.written_bytes() - self.checkpoint_mark
        if not state.changed():
            state.current()
            return False
        logged = self.journal.wal is not None and state.failure is None
        floor = cfg.checkpoint_log_ratio * state.size if logged else 0.0
        if cfg.checkpoint_wal_bytes > 0 and grown >= max(cfg.checkpoint_wal_bytes, floor):
            return True
        waited = self.clock.monotonic() - self.last_checkpoint
        interval = cfg.checkpoint_interval_s
        return interval > 0 and waited >= interval and (grown >= floor or waited >= 10 * interval)

    def _housekeeping(self) -> None:
        period = min(0.5, self.cfg.lease_s / 4)
        while not self.stopping.wait(period):
            try:
                self.tick()
            except Exception:  # housekeeping must outlive a bad tick
                logger.exception("housekeeping tick failed")

    def save_checkpoint(self) -> bool:
        """See `State.save`."""
        return self.state.save()

    def close(self) -> bool:
        """Stops housekeeping, answers waiting pulls, merges every acknowledged contribution,
        writes a final checkpoint; False if that checkpoint could not be written."""
        self.stopping.set()
        with self.model.initialized_cv:
            self.model.initialized_cv.notify_all()
        if self.housekeeper is not None:
            self.housekeeper.join(timeout=5)
        for frag in self.model.fragments:
            frag.model.stop_waiting()
        self.pulls.close()
        if self.model.rounds is not None:
            self.model.rounds.flush()
            self.model.rounds.shutdown()
        saved = self.state.save()
        self.journal.close()
        return saved
