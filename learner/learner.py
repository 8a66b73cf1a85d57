"""`Learner`: wraps a model and its inner optimizer, and keeps it in sync with the Synchronizer.

Two ways into a training loop. The loop keeps its own `opt.step()` and `zero_grad()`: the
learner hooks the inner optimizer (a post-step hook), so each real optimizer step (one a
`GradScaler` skipped for inf/NaN gradients is not one) is an inner step, with its tokens from
the `tokens=` argument (a number per optimizer step, or a callable asked after each step).
Or the loop calls `learner.step()` after each backward pass instead of `opt.step()`. Either way,
after the optimizer step the learner merges the fresh global fragments that have arrived (after
the optimizer step, so the next forward pass sees them and no gradient is applied to parameters
it was not computed at), and on a fragment's due step (staggered: fragment p at offset
p*H//P) encodes its outer gradient on the model's device and hands it to the background.
Nothing in `step()` waits on the network unless `strict_overlap` is set: then a push's result
is merged exactly overlap_steps (tau) after it, waited for (bounded) when late and held back
when early (`learner.overlap`).

The background side is `learner.sync.SyncEngine` (pushes, pulls, retries, within a
`learner.session.Session`: joins, re-joins, heartbeats); `Learner` uses only the engine's public
methods. It talks through a transport (`learner.session.Transport`), built from the settings by
`learner.addresses.client_for` unless one is given: against a sharded Synchronizer (several
addresses in `synchronizer`) a `learner.shards.ShardedClient`, which routes each fragment to its
shard; nothing else changes.

Multi-GPU islands (torchrun): rank 0 alone talks to the Synchronizer and broadcasts what it merged
(`learner.island`). Every rank must call `step()`, `flush()` and `finish()` the same number of
times. Pass each rank's own `tokens`; rank 0 reports them times the world size. A model sharded
with FSDP2 (`fully_shard`) makes a sharded island instead: every rank pushes and pulls only its
own slice of each fragment, under rank 0's membership (`learner.sharded`).

This module is the loop's side: settings, the inner step, pushes, the end. The join is
`learner.joining`; merging what comes back (and strict overlap), `learner.arrivals`; a sharded
island's join, step, flush and finish, `learner.sharded_island`; the stats, `learner.stats`;
a restart's state, `learner.resume`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from learner import arrivals, joining, resume, sharded_island, stats
from learner.config import LearnerConfig
from learner.fragments import (
    ErrorFeedback,
    FragmentPlan,
    Schedule,
)
from learner.island import Island
from learner.overlap import StrictOverlap
from learner.session import Clock, Transport
from learner.stats import LearnerStats
from learner.sync import Arrival, PushJob, SyncEngine
from protos import diloco_pb2 as pb
from protos import layout

logger = logging.getLogger(__name__)

SCALE_DTYPES = {"fp32": pb.SCALE_FP32, "fp16": pb.SCALE_FP16}


class Learner:
    """Trains `model` with `inner_optimizer` as one learner of a Decoupled DiLoCo run.

    Settings are `LearnerConfig` fields, as keyword arguments or `config=` (keywords win).
    `inner_optimizer` may be None when the caller steps its optimizer itself before `step()`.
    Given one, the learner hooks it: the loop's own `inner_optimizer.step()` is then an inner
    step (do not also call `step()`, which steps the optimizer itself), with `tokens` (a count
    per optimizer step, or a callable returning the last step's) and `record(loss=...)` for the
    loss shown in stats. The hook is removed when the learner finishes or closes.
    `state` (from `state_dict()`, saved with the model and optimizer, whose saved states the
    caller loads first) resumes a restarted learner as itself; see `state_dict`.
    `start_step`: the run's step a learner without a state starts at (a restart whose state was
    lost, joining as a new learner): its fragments are then due at the same steps of the run as
    the other learners', so its pushes meet theirs in the same rounds. Its step, token and
    compute counters still count its own steps from 0.
    `transport` replaces the client the settings would build (tests pass an in-memory fake); the
    learner closes it when it stops. The constructor joins the Synchronizer and loads the global
    model (initialising it from this model's parameters if there is none yet); it raises if that
    is impossible within `join_timeout_s`. After that, network trouble is logged and counted,
    never raised.
    `metrics_registry`: a Prometheus registry to add the `diloco_learner_*` metrics to (served on
    `metrics_port` when that is set, else by the caller's own exporter); by default they get a
    registry of their own, served only with `metrics_port`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer | None,
        *,
        config: LearnerConfig | None = None,
        transport: Transport | None = None,
        tokens: int | Callable[[], int] | None = None,
        state: dict[str, Any] | None = None,
        metrics_registry: CollectorRegistry | None = None,
        start_step: int = 0,
        **settings: Any,
    ) -> None:
        if not isinstance(start_step, int) or isinstance(start_step, bool) or start_step < 0:
            raise ValueError(f"start_step must be an integer >= 0, got {start_step!r}")
        if start_step and state is not None:
            raise ValueError(
                "start_step is for a learner that starts without its state; one resumed from "
                "its state continues its own schedule"
            )
        cfg = config or LearnerConfig()
        if settings:
            cfg = LearnerConfig.model_validate({**cfg.model_dump(), **settings})
        self.cfg = cfg
        self.model = model
        self.optimizer = inner_optimizer
        self.plan = FragmentPlan(model, cfg.fragments, cfg.fragment_strategy)
        self.num_fragments = len(self.plan)
        self.param_device = next(model.parameters()).device
        self.device = self._state_device(cfg.device)
        self.codec_id = layout.parse_codec(cfg.codec)
        self.scale_dtype = SCALE_DTYPES[cfg.scale_dtype]
        self.island = Island(self.plan, self.param_device)
        self.leader, self.world = self.island.leader, self.island.world
        self.sharded = self.plan.slices is not None
        if self.sharded and cfg.strict_overlap:
            raise ValueError("strict_overlap is not supported for a sharded (FSDP2) island yet")
        if self.sharded and state is not None:
            raise ValueError("resume is not supported for a sharded (FSDP2) island yet")
        self.talks = self.leader or self.sharded  # this rank talks to the Synchronizer
        self.ready: dict[int, Arrival] = {}  # a sharded island's arrivals not yet agreed on
        self.phase = start_step  # the run's steps before this learner's first (the schedule's)
        self.schedule = Schedule(cfg.sync_every, self.num_fragments, start_step)
        self.clock = Clock()
        self.merges = 0
        self.deferred: set[int] = set()  # due while busy: pushed as soon as the fragment is free
        self.overlap = StrictOverlap(cfg.overlap_steps)  # filled only with strict_overlap
        self.flushing = False  # the end: every result is merged as it comes
        self.since_push = [
            [0, 0, 0.0] for _ in range(self.num_fragments)
        ]  # tokens, steps, compute_s
        self.base: list[torch.Tensor] = []
        self.versions = [0] * self.num_fragments
        self.ef = ErrorFeedback(
            [self.plan.numel(p) for p in range(self.num_fragments)] if self.talks else [],
            self.device,
            cfg.error_feedback,
        )
        self.client: Transport | None = None
        self.engine: SyncEngine | None = None
        self.joining_bytes = 0  # bytes sent by the time it had joined (`stats`)
        self.closed = False
        self.metrics_port: int | None = None  # bound port of the /metrics endpoint, if serving
        self._stop_metrics: Callable[[], None] | None = None
        if state is not None:
            numels = [self.plan.numel(p) for p in range(self.num_fragments)]
            resume.check_state(state, numels, self.leader)
            resume.restore_clock(self, state)
        if self.talks:
            joining.connect(self, transport, state)
            if self.leader and (cfg.metrics_port >= 0 or metrics_registry is not None):
                self._serve_metrics(metrics_registry)
        elif transport is not None:
            transport.close()  # only rank 0 talks to the Synchronizer
        if not self.sharded:
            self.island.broadcast(set(range(self.num_fragments)), announce=False)
        self.tokens_per_step = tokens
        self.pending_loss: float | None = None
        self.stepping = False  # inside step(): the optimizer hook leaves the step to it
        self.hooked_steps = 0  # inner steps the optimizer hook took (then step() is refused)
        self.hook = (
            inner_optimizer.register_step_post_hook(self._optimizer_stepped)
            if inner_optimizer is not None
            else None
        )
        self.last_step_end = time.perf_counter()

    def _state_device(self, choice: str) -> torch.device:
        if choice == "auto":
            return self.param_device
        if choice == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device='cuda' but CUDA is not available here")
            return self.param_device if self.param_device.type == "cuda" else torch.device("cuda")
        return torch.device("cpu")

    # Resume ----------------------------------------------------------------------------------

    def state_dict(self, timeout_s: float | None = None) -> dict[str, Any]:
        """What a restarted learner needs to continue as itself, to save beside the model's and
        the inner optimizer's state and give back as `Learner(..., state=...)`: its learner id
        and session, the fragment versions it holds and their global parameters (what its next
        outer gradients are measured from), its error-feedback residuals, the step, tokens and
        sync schedule, the work not yet pushed, and the next push sequence number.

        Flushes first (bounded by `timeout_s`, default `finish_timeout_s`; collective under
        torchrun): a state saved with a push in flight would push that push's progress again
        after a restart. RuntimeError when the flush does not complete: save again later."""
        if self.closed:
            raise RuntimeError("state_dict() after finish() or close()")
        if self.sharded:
            raise RuntimeError("resume is not supported for a sharded (FSDP2) island yet")
        if not self.flush(timeout_s):
            raise RuntimeError(
                "syncs are still in flight (the Synchronizer is slow or unreachable): no "
                "consistent state to save now; save again later"
            )
        return resume.snapshot(self)

    def _serve_metrics(self, registry: CollectorRegistry | None) -> None:
        """The learner's metrics on its own port (metrics_port >= 0), in `registry` when given
        (the caller's, served by their exporter when metrics_port is -1)."""
        from learner.metrics import register_learner_metrics, start_learner_metrics

        try:
            if self.cfg.metrics_port >= 0:
                self.metrics_port, self._stop_metrics = start_learner_metrics(
                    lambda: self.stats, self.cfg.metrics_port, self.cfg.metrics_host, registry
                )
            else:
                assert registry is not None
                self._stop_metrics = register_learner_metrics(lambda: self.stats, registry)
        except BaseException:
            self.close()
            raise

    # The training loop -----------------------------------------------------------------------

    def step(self, tokens: int = 0, loss: float | None = None) -> None:
        """One inner step: optimizer.step(), then merge arrivals and push the fragments due.

        `tokens`: tokens this step trained on; the Synchronizer weighs contributions by them
        (0: the constructor's `tokens`; when there are none either, each step counts as one
        token). `loss` is only reported in stats.
        """
        if self.closed:
            raise RuntimeError("step() after finish() or close()")
        if self.hooked_steps:
            raise RuntimeError(
                "the inner optimizer was stepped directly, which already makes an inner step (the "
                "learner hooks it): call either optimizer.step() or learner.step(), not both"
            )
        t_enter = time.perf_counter()
        if self.optimizer is not None:
            self.stepping = True
            try:
                self.optimizer.step()
            finally:
                self.stepping = False
        self._inner_step(t_enter, tokens or self._step_tokens(), loss)

    def record(self, *, loss: float | None = None) -> None:
        """The loss of the step being trained, shown in stats (for loops that step the optimizer
        themselves; `step()` takes it as an argument)."""
        self.pending_loss = loss

    def _step_tokens(self) -> int:
        t = self.tokens_per_step
        return int(t() if callable(t) else t or 0)

    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The inner optimizer's post-step hook: the loop stepped it itself."""
        if self.stepping or self.closed:
            return
        self.hooked_steps += 1
        loss, self.pending_loss = self.pending_loss, None
        self._inner_step(time.perf_counter(), self._step_tokens(), loss)

    def _inner_step(self, t_enter: float, tokens: int, loss: float | None) -> None:
        """What follows an optimizer step: the clock, then merges and pushes (rank 0), then the
        island's broadcast."""
        compute = time.perf_counter() - self.last_step_end  # forward/backward + optimizer step
        c = self.clock
        own, tokens = tokens, tokens * self.world
        c.step += 1
        c.tokens += tokens
        c.compute_s += compute
        c.step_time_s = compute if c.step == 1 else 0.9 * c.step_time_s + 0.1 * compute
        if loss is not None:
            c.loss = float(loss)
        c.recent.append((t_enter, c.tokens))
        for acc in self.since_push:
            acc[0] += own if self.sharded else tokens  # a slice's push: this rank's tokens
            acc[1] += 1
            acc[2] += compute
        if self.sharded:
            sharded_island.step(self)
        else:
            merged: set[int] = set()
            if self.leader:
                merged = self._sync_step()
            self.island.broadcast(merged)
        self.last_step_end = time.perf_counter()

    def reset_clock(self) -> None:
        """Start timing the next step now: call it after setup done between construction and the
        first forward pass (an evaluation, a barrier), which is not compute for the goodput."""
        self.last_step_end = time.perf_counter()

    def _sync_step(self) -> set[int]:
        assert self.engine is not None
        self._set_sync_every(self.engine.sync_every())
        merged = arrivals.take_all(self)
        for p in sorted(set(self.schedule.due(self.schedule_step())) | self.deferred):
            self._push(p)
        if self.cfg.strict_overlap:
            merged |= arrivals.wait_overlap(self)
        return merged

    def schedule_step(self) -> int:
        """The run's step the fragment schedule is at: this learner's steps after `start_step`."""
        return self.phase + self.clock.step

    @property
    def sync_every(self) -> int:
        """H now: the configured one, or what Dynamic Local Updates last directed."""
        return self.schedule.sync_every

    def _set_sync_every(self, h: int) -> None:
        if h != self.sync_every:
            logger.info(
                "learner=%s sync_every %d -> %d (Dynamic Local Updates)",
                self.learner_id,
                self.sync_every,
                h,
            )
            self.schedule.set_sync_every(h)

    def _push(self, p: int, seq: int = 0) -> None:
        assert self.engine is not None
        if not seq and self.engine.busy(p):
            self.deferred.add(p)
            return
        try:
            with torch.no_grad():
                theta = self.plan.gather(p, self.device)
                encoded, header, residual = self.ef.encode(
                    p, self.base[p] - theta, self.codec_id, self.cfg.block_size, self.scale_dtype
                )
        except layout.CodecError as e:  # NaN/Inf in the parameters: never send them
            self.engine.failed(f"push skipped at step {self.clock.step}: {e}", p, network=False)
            self.deferred.discard(p)
            if seq:  # the island's other ranks push this seq: theirs is aborted, all re-pull
                self.engine.ask_resync(p)
            return
        payload, ready = encoded, None
        if encoded.device.type == "cuda":
            payload = torch.empty(encoded.numel(), dtype=torch.uint8, pin_memory=True)
            payload.copy_(encoded, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        tokens, steps, compute_s = self.since_push[p]
        anchor = theta if self.cfg.merge == "rebase" else None
        steps = max(1, int(steps))
        tokens = int(tokens) if tokens > 0 else steps  # no tokens reported: weigh by steps
        job = PushJob(
            p,
            self.versions[p],
            tokens,
            steps,
            float(compute_s),
            payload,
            header,
            residual,
            anchor,
            self.clock.step,
            ready,
        )
        if not self.engine.submit(job, seq):
            self.deferred.add(p)
            return
        self.deferred.discard(p)
        self.since_push[p] = [0, 0, 0.0]
        if self.cfg.strict_overlap:
            self.overlap.pushed(p, self.clock.step)

    # Ending ----------------------------------------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits (bounded) for every sync in flight and merges the results; True if all came
        back. Pushes that were due but deferred are not sent. Collective under torchrun."""
        done, merged = True, set[int]()
        talking = self.engine is not None and not self.closed
        deadline = time.monotonic() + (
            self.cfg.finish_timeout_s if timeout_s is None else timeout_s
        )
        if self.sharded and talking:
            return sharded_island.flush(self, deadline)
        if self.leader and talking:
            done = arrivals.drain(self, deadline, merged)
        self.island.broadcast(merged)
        return done

    def finish(self, timeout_s: float | None = None) -> None:
        """Flushes syncs in flight, pushes every fragment's steps since its last push and merges
        their rounds (`final_push`), overwrites the model with the newest global parameters
        (FP32, every fragment), leaves the Synchronizer and stops. The flushes together wait at
        most `timeout_s` (default `finish_timeout_s`). Collective under torchrun."""
        if self.closed:
            return
        deadline = time.monotonic() + (
            self.cfg.finish_timeout_s if timeout_s is None else timeout_s
        )
        self.flush(timeout_s)
        if self.cfg.final_push:  # every rank: the flush is collective
            if self.sharded and self.engine is not None:
                sharded_island.push_rest(self)
            elif self.leader and self.engine is not None:
                for p in range(self.num_fragments):
                    if self.since_push[p][1] > 0:  # inner steps not in any push yet
                        self._push(p)
        if self.leader and not self.sharded and self.engine is not None:
            self.engine.finish_pushing()
        if self.cfg.final_push:
            self.flush(max(0.0, deadline - time.monotonic()))
        if self.sharded and self.engine is not None:
            sharded_island.finish(self)
            self.close()
            return
        if self.leader and self.engine is not None:
            for p, (version, fresh) in self.engine.finish(self.versions).items():
                self.plan.scatter(p, fresh)
                self.base[p] = fresh.to(self.device)
                self.versions[p] = version
            logger.info(
                "learner=%s finished at step %d with versions %s",
                self.learner_id,
                self.clock.step,
                self.versions,
            )
        self.island.broadcast(set(range(self.num_fragments)), announce=False)
        self.close()

    def close(self) -> None:
        """Stops the background threads and closes the channel (no final pull, no Leave)."""
        if self.closed:
            return
        self.closed = True
        if self.hook is not None:
            self.hook.remove()
        if self._stop_metrics is not None:
            self._stop_metrics()
        if self.engine is not None:
            self.engine.stop(close_channel=True)
        elif self.client is not None:
            self.client.close()

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.close()

    # Progress --------------------------------------------------------------------------------

    @property
    def learner_id(self) -> str:
        return self.client.learner_id if self.client is not None else ""

    @property
    def stats(self) -> LearnerStats:
        return stats.of(self)
