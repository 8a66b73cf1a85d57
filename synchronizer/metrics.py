"""The Synchronizer's Prometheus metrics: names, labels, and the registry they live in.

All names are prefixed `diloco_`, in base units, with low-cardinality labels only (no learner ids,
no tensor names). One `Metrics` object per service instance, on its own `CollectorRegistry`
unless the caller passes one (the process's global `prometheus_client.REGISTRY`, to serve these
beside its own), so tests can run several servers in one process. `protos.exposition` serves the
registry without prometheus_client's `_created` series.

Duration buckets reach past the slowest figures measured at 1B parameters (docs/performance.md):
an outer step of a 250M-element fragment takes 4.5-5.5 s on 2 cores, and a checkpoint of the
whole state (about 14 bytes per parameter at ~240 MB/s of fsynced writes) about a minute.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from protos.version import version

if TYPE_CHECKING:
    from synchronizer.buffers import Fp32Buffers, Payloads

GOODPUT_BUCKETS = ("merged", "discarded", "lost")
PUSH_OUTCOMES = ("accepted", "dropped_stale", "duplicate", "refused_norm", "rejected")
LEARNER_STATES = ("alive", "dead")
ISLAND_OUTCOMES = ("assembled", "refused", "aborted", "invalid")

# Seconds. A 1B model's outer step (4.5-5.5 s per 250M-element fragment) sits mid-range, with
# room for larger fragments and slower hosts; a 1B checkpoint (about a minute) likewise.
ROUND_WAIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
ROUND_APPLY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    7.5,
    10,
    15,
    30,
    60,
    120,
)
CHECKPOINT_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 90, 120, 180, 300, 600, 1200)
WAL_FSYNC_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        private = registry is None
        self.registry = CollectorRegistry() if registry is None else registry
        r = self.registry
        if private:  # the global registry has its own (process_resident_memory_bytes, ...)
            ProcessCollector(registry=r)
        self.build_info = Gauge(
            "diloco_build_info",
            "1, labelled with the running decoupled-diloco version.",
            ["version"],
            registry=r,
        )
        self.build_info.labels(version()).set(1)
        self.learners = Gauge("diloco_learners", "Learners by lease state.", ["state"], registry=r)
        self.credential_learners = Gauge(
            "diloco_credential_learners",
            "Live learners by the credential they joined under (per-learner credentials only).",
            ["credential"],
            registry=r,
        )
        self.pushes = Counter(
            "diloco_pushes_total", "Fragment pushes by outcome.", ["outcome"], registry=r
        )
        self.island_contributions = Counter(
            "diloco_island_contributions_total",
            "Contributions of sharded islands (one slice per rank) by how their assembly ended: assembled (submitted as one push; its outcome is in diloco_pushes_total), refused (that submission was, e.g. the log failing), aborted (a rank's slice missing within slice_wait_s, or a waiting call ended) or invalid (slices that disagree, overlap or leave gaps). Nothing of an aborted or invalid one is applied.",
            ["outcome"],
            registry=r,
        )
        self.rejections = Counter(
            "diloco_rejected_requests_total",
            "Requests refused before touching state, by gRPC status code and reason.",
            ["code", "reason"],
            registry=r,
        )
        self.tokens = Counter(
            "diloco_tokens_total",
            "Tokens learners processed, by goodput bucket (each push counts its tokens in "
            "proportion to the fragment's share of the model).",
            ["bucket"],
            registry=r,
        )
        self.compute = Counter(
            "diloco_compute_seconds_total",
            "Learner compute seconds by goodput bucket.",
            ["bucket"],
            registry=r,
        )
        self.tokens_in_flight = Gauge(
            "diloco_tokens_in_flight",
            "Tokens processed but not yet merged, discarded or lost.",
            registry=r,
        )
        self.compute_in_flight = Gauge(
            "diloco_compute_seconds_in_flight",
            "Compute seconds not yet merged, discarded or lost.",
            registry=r,
        )
        self.capacity = Counter(
            "diloco_learner_capacity_seconds_total",
            "Wall-clock seconds of learner capacity (each joined learner, alive or dead, until it "
            "leaves or is forgotten): the denominator of goodput.",
            registry=r,
        )
        self.blocked = Counter(
            "diloco_learner_blocked_seconds_total",
            "Seconds learners' training loops waited on synchronization.",
            registry=r,
        )
        self.goodput = Gauge(
            "diloco_goodput_ratio",
            "Merged compute seconds over learner capacity seconds, over the configured window.",
            registry=r,
        )
        # Effective goodput (synchronizer.evaluation): absent until an evaluator reports
        self.eval_loss = Gauge(
            "diloco_eval_loss",
            "Eval loss of the served model on a held-out set, as an evaluator last reported it (by the set's name).",
            ["eval_set"],
            registry=r,
        )
        self.eval_consumed_tokens = Gauge(
            "diloco_eval_consumed_tokens",
            "Training tokens the learners had consumed (merged, discarded, lost or in flight) when that eval loss was reported.",
            ["eval_set"],
            registry=r,
        )
        self.reference_tokens = Gauge(
            "diloco_reference_tokens",
            "Training tokens the reference run (reference_curve) needed to reach the last reported eval loss.",
            ["eval_set"],
            registry=r,
        )
        self.eval_below_reference = Gauge(
            "diloco_eval_below_reference",
            "1 when the last reported eval loss is below the reference curve's best: diloco_reference_tokens is then the curve's last tokens, and the effective goodput a lower bound.",
            ["eval_set"],
            registry=r,
        )
        self.effective_goodput = Gauge(
            "diloco_effective_goodput_ratio",
            "Effective goodput: tokens the reference run needed to reach the served model's last reported eval loss, over the training tokens the learners had consumed then (1 = as good per token as the reference). Absent without reference_curve or eval report.",
            ["eval_set"],
            registry=r,
        )
        self.staleness = Histogram(
            "diloco_push_staleness",
            "Staleness (outer steps between a push's base version and the round it joins).",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=r,
        )
        self.contributors = Histogram(
            "diloco_round_contributors",
            "Contributions merged per closed round.",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=r,
        )
        self.round_share = Histogram(
            "diloco_round_share",
            "Part of a whole outer step each applied round stood for: its contributions' weight over one contribution from every recent contributor (round_share work; 1 with full). Many small shares: rounds split.",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0),
            registry=r,
        )
        self.round_wait = Histogram(
            "diloco_round_wait_seconds",
            "Seconds from a round's first contribution to its close (when an outer-step worker "
            "takes it).",
            buckets=ROUND_WAIT_BUCKETS,
            registry=r,
        )
        self.round_apply = Histogram(
            "diloco_round_apply_seconds",
            "Seconds to merge a round and apply the outer step.",
            buckets=ROUND_APPLY_BUCKETS,
            registry=r,
        )
        self.bytes_in = Counter(
            "diloco_received_bytes_total",
            "Payload bytes received, by codec.",
            ["codec"],
            registry=r,
        )
        self.bytes_out = Counter(
            "diloco_sent_bytes_total", "Payload bytes sent, by codec.", ["codec"], registry=r
        )
        self.outer_steps = Counter(
            "diloco_outer_steps_total", "Outer optimizer steps applied (all fragments).", registry=r
        )
        self.fragment_version = Gauge(
            "diloco_fragment_version", "Current version of each fragment.", ["fragment"], registry=r
        )
        self.streams_open = Gauge(
            "diloco_streams_open",
            "Push and pull streams being served (each holds a gRPC worker; at most max_concurrent_streams).",
            registry=r,
        )
        self.pulls_waiting = Gauge(
            "diloco_pulls_waiting",
            "Pulls waiting for a version that is not there yet (at most max_waiting_pulls).",
            registry=r,
        )
        self.streams_cut = Counter(
            "diloco_streams_cut",
            "Streams cancelled for making no progress within stream_idle_s, by kind (push, pull).",
            ["kind"],
            registry=r,
        )
        for kind in ("push", "pull"):
            self.streams_cut.labels(kind)  # exported at 0 from the start
        self.rounds_refused = Counter(
            "diloco_rounds_refused_total",
            "Rounds whose merged update was not applied (not finite, or beyond the bound); the fragment skipped the version and its contributions count as discarded.",
            registry=r,
        )
        self.weights_capped = Counter(
            "diloco_weights_capped_total",
            "Accepted pushes whose token weight was capped at max_weight_ratio times the median of other learners' recent ones (inflated token counts).",
            registry=r,
        )
        self.fragments_failed = Gauge(
            "diloco_fragments_failed",
            "Fragments whose outer step failed; they serve nothing until a restart (health is NOT_SERVING).",
            registry=r,
        )
        self.rpcs = Counter(
            "diloco_rpcs_total",
            "RPCs handled, by method and status code.",
            ["method", "code"],
            registry=r,
        )
        self.checkpoints = Counter("diloco_checkpoints_total", "Checkpoints written.", registry=r)
        self.checkpoint_failures = Counter(
            "diloco_checkpoint_failures_total",
            "Checkpoints that could not be written (the previous one stays the newest).",
            registry=r,
        )
        self.checkpoint_seconds = Histogram(
            "diloco_checkpoint_seconds",
            "Seconds to write one checkpoint.",
            buckets=CHECKPOINT_BUCKETS,
            registry=r,
        )
        self.checkpoint_last_success = Gauge(
            "diloco_checkpoint_last_success_timestamp_seconds",
            "Unix time the newest checkpoint last held the served state: when it was written (at start, the one restored), and again at each housekeeping tick while nothing has changed since (NaN before any).",
            registry=r,
        )
        self.checkpoint_last_success.set(math.nan)
        self.wal_fsync = Histogram(
            "diloco_wal_fsync_seconds",
            "Seconds of one write-ahead log group commit's fsync (it acknowledges every push written with it).",
            buckets=WAL_FSYNC_BUCKETS,
            registry=r,
        )
        self.wal_failing = Gauge(
            "diloco_wal_failing",
            "1 while the write-ahead log cannot be written (pushes are refused, pulls served).",
            registry=r,
        )
        self.wal_bytes = Gauge(
            "diloco_wal_bytes",
            "Bytes of write-ahead log segments on disk (let go once a checkpoint covers them, their files kept as spares for the next segments, at most as many as the latest checkpoint let go; a checkpoint starts early once the log since the last one passes checkpoint_wal_bytes, or checkpoint_log_ratio checkpoints if more).",
            registry=r,
        )
        self.memory = Gauge(
            "diloco_memory_projected_bytes",
            "Projected peak resident memory by component (synchronizer.memory), a projection and not a measurement: sum() over the components is the projected total; process_resident_memory_bytes is what the process holds.",
            ["component"],
            registry=r,
        )
        self.payload_held = Gauge(
            "diloco_payload_held_bytes",
            "Encoded push bytes rounds hold for their outer step (all fragments; with the pooled bytes at most payload_budget_bytes).",
            registry=r,
        )
        self.payload_pooled = Gauge(
            "diloco_payload_pooled_bytes",
            "Free receive buffers kept for reuse, in bytes (all fragments).",
            registry=r,
        )
        self.fp32_buffers = Gauge(
            "diloco_fp32_buffers",
            "FP32 buffers of the largest fragment's size allocated for round sums (apply_threads of them, more while rounds add pushes on arrival).",
            registry=r,
        )
        self.payloads_refused = Counter(
            "diloco_pushes_refused_payload_budget_total",
            "Pushes refused RESOURCE_EXHAUSTED because held pushes filled payload_budget_bytes for longer than the wait (the Synchronizer is behind; learners retry).",
            registry=r,
        )
        self.snapshot_bytes = Gauge(
            "diloco_snapshot_bytes",
            "Bytes of full-pull snapshots alive (within snapshot_budget_bytes; pullers of one version share one).",
            registry=r,
        )
        self.fp32_beyond = Counter(
            "diloco_fp32_buffers_beyond_pool_total",
            "FP32 round buffers allocated beyond apply_threads: rounds that added pushes on arrival because the payload budget was full.",
            registry=r,
        )
        self.shard_info = Gauge(
            "diloco_shard_info",
            "1, labelled with this Synchronizer's shard index and shard count (unsharded: shard 0 of 1), so dashboards can join other series by shard.",
            ["shard", "shards"],
            registry=r,
        )
        self.model_fraction = Gauge(
            "diloco_model_fraction",
            "Share of the model's parameters this Synchronizer serves (1 unsharded): a shard's goodput counts that share of the learners' capacity and work, so the run's goodput is sum(diloco_goodput_ratio * diloco_model_fraction).",
            registry=r,
        )
        for state in LEARNER_STATES:
            self.learners.labels(state).set(0)
        for outcome in PUSH_OUTCOMES:
            self.pushes.labels(outcome)
        for outcome in ISLAND_OUTCOMES:
            self.island_contributions.labels(outcome)
        for bucket in GOODPUT_BUCKETS:
            self.tokens.labels(bucket)
            self.compute.labels(bucket)

    def watch_buffers(self, payloads: Payloads, fp32: Fp32Buffers) -> None:
        """Exports the shared buffers' live sizes (read when scraped)."""
        self.payload_held.set_function(lambda: payloads.held_bytes)
        self.payload_pooled.set_function(lambda: payloads.pooled_bytes)
        self.fp32_buffers.set_function(lambda: fp32.live)
