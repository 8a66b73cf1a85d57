"""`SynchronizerConfig`: every setting of the Synchronizer service, typed and validated.

Loaded by `protos.configload.load` from a TOML/YAML file, `DILOCO_SYNC_<FIELD>` environment
variables and command-line flags (in that order of precedence); `help_groups` orders `serve
--help`. Every duration is in seconds and named `*_s`.
The defaults run on one machine with no flags at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protos.framing import CHUNK_BYTES
from synchronizer import native
from synchronizer.credentials import load_tokens
from synchronizer.evaluation import ReferenceCurve
from synchronizer.shards import resolve_index

RESERVED_WORKERS = 8  # gRPC workers no stream may take: heartbeats, joins, health checks
MIN_MESSAGE_BYTES = CHUNK_BYTES + (64 << 10)  # one wire chunk plus its framing


class SynchronizerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    env_prefix: ClassVar[str] = "DILOCO_SYNC_"
    help_groups: ClassVar[dict[str, str]] = {
        "network": "host port metrics_host metrics_port",
        "sharding": "shards shard_index",
        "rounds": "quorum grace grace_max_s grace_gamma overlap_steps max_staleness token_weight "
        "staleness_weight staleness_alpha staleness_hinge max_norm_ratio max_weight_ratio anchor "
        "round_share update_history update_history_bytes update_codec update_residual_dtype merge",
        "outer optimizer": "outer outer_lr outer_momentum outer_delay outer_warmup",
        "learners": "lease_s forget_after_s max_learners dynamic_local_updates inner_steps dlu_levels",
        "limits": "init_stall_s max_pull_wait_s max_waiting_pulls stream_idle_s slice_wait_s "
        "max_streams_per_learner max_model_params memory_limit_bytes payload_budget_bytes "
        "snapshot_budget_bytes max_spec_bytes max_message_bytes max_concurrent_streams "
        "max_unidentified_streams max_unidentified_per_peer max_workers apply_threads "
        "compute_threads kernels kernel_threads",
        "durability": "state_dir checkpoint_interval_s checkpoint_wal_bytes checkpoint_log_ratio "
        "keep_checkpoints wal "
        "wal_wait_s wal_segment_bytes shutdown_grace_s",
        "security": "auth_token admin_token tls_cert tls_key tls_client_ca learner_tokens_file "
        "client_cert_credentials max_learners_per_credential",
        "observability": "goodput_window_s reference_curve log_level log_format",
    }

    # Network
    host: str = Field(
        "127.0.0.1",
        description="Address the gRPC server binds to; 0.0.0.0 or [::] to serve other hosts",
    )
    port: int = Field(
        50051, ge=0, le=65535, description="gRPC port; 0 picks a free port (logged on start)"
    )
    metrics_host: str = Field(
        "127.0.0.1", description="Address the Prometheus metrics endpoint binds to"
    )
    metrics_port: int = Field(
        9464,
        ge=-1,
        le=65535,
        description="Prometheus metrics port; 0 picks a free port, -1 disables the endpoint",
    )
    state_dir: Path = Field(
        Path("diloco-state"),
        description="Directory for checkpoints and the write-ahead log; on start the newest complete checkpoint is restored and the log replayed",
    )

    # Sharding
    shards: int = Field(
        1,
        ge=1,
        description="Synchronizer processes the model's fragments are sharded across; each serves its share of the fragments (balanced by bytes), and learners must be given every shard's address. 1: this process serves the whole model",
    )
    shard_index: int = Field(
        -1,
        ge=-1,
        description="Which shard this process is, 0..shards-1; each needs its own state_dir. -1: 0 when shards is 1, else the StatefulSet ordinal, the trailing -N of the host name (HOSTNAME)",
    )

    # Rounds
    quorum: int = Field(
        1,
        ge=0,
        description="Minimum contributions K before a round may close; 0 means every live learner (synchronous DiLoCo)",
    )
    grace: Literal["adaptive", "peers", "fixed", "none"] = Field(
        "adaptive",
        description="After the quorum: wait adaptively while waiting is free; peers: adaptively, and also (past grace_max_s, within the free time) for learners of the first pushers' pace that are due within half their period; a fixed grace_max_s; or not at all",
    )
    grace_max_s: float = Field(
        5.0, ge=0, description="Upper bound on the grace window after the quorum is reached"
    )
    grace_gamma: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Adaptive grace = gamma * (overlap_steps * step time - quorum time - apply time)",
    )
    overlap_steps: int = Field(
        0,
        ge=0,
        description="Steps a learner trains between pushing a fragment and needing it back (tau); sizes the adaptive grace. 0: as the learners report it in heartbeats (their H, or their strict-overlap bound)",
    )
    max_staleness: int = Field(
        16,
        ge=0,
        description="Pushes staler than this many outer steps are dropped and the learner told to re-pull",
    )
    token_weight: Literal["uniform", "tokens", "tokens2_per_step"] = Field(
        "tokens2_per_step",
        description="Weight of a contribution by work done: uniform, tokens, or tokens^2/steps (Decoupled DiLoCo)",
    )
    staleness_weight: Literal["none", "poly", "hinge", "exp"] = Field(
        "none",
        description="Down-weighting of stale contributions: none, poly (1+s)^-a, hinge, exp(-a s)",
    )
    staleness_alpha: float = Field(0.5, ge=0, description="The a in the staleness factor")
    staleness_hinge: int = Field(2, ge=0, description="Staleness up to which the hinge factor is 1")
    max_norm_ratio: float = Field(
        10.0,
        ge=0,
        description="A push whose L2 norm is above this many times the median norm of the fragment's recent accepted pushes by other learners is refused (PUSH_REFUSED_NORM: nothing applied, the learner re-pulls); judged once 4 such norms are known. 0 or at least 1; 0 turns the bound off",
    )
    max_weight_ratio: float = Field(
        8.0,
        ge=0,
        description="A contribution's token weight is capped at this many times the median token weight of the fragment's recent accepted pushes by other learners, so inflated token counts cannot take a round over. 0 or at least 1; 0 turns the cap off",
    )
    anchor: Literal["current", "base"] = Field(
        "current",
        description="Re-anchor a stale delta at the current global fragment (Decoupled DiLoCo), or apply it relative to its base",
    )
    round_share: Literal["work", "full"] = Field(
        "work",
        description="How far a round's outer step goes. work: by the round's share of a whole step, its contributions' weight over one contribution from every recent contributor (a lone push of one learner in four steps about a quarter, its momentum too, so rounds that split and a last learner pushing alone after the others left move the model as far per unit of work as rounds of everyone); full: every round a whole step, whatever it holds",
    )
    update_history: int = Field(
        16,
        ge=0,
        description="Recent outer updates kept per fragment: serve delta pulls and the current anchor; 0 keeps exact FP32 parameters and allows neither",
    )
    update_history_bytes: int = Field(
        0,
        ge=0,
        description="Bytes of kept updates per fragment: fewer than update_history are kept where they do not fit (at least one). A learner further behind pulls the full parameters, and a push staler than the kept updates is merged as anchor 'base' would. 0: 0.8x the fragment's FP32 bytes (3 INT8 updates)",
    )
    update_codec: Literal["int8", "fp32"] = Field(
        "int8",
        description="How kept updates are stored and sent to delta pulls; int8 carries an error-feedback residual so nothing is lost over time",
    )
    update_residual_dtype: Literal["bf16", "fp32"] = Field(
        "bf16",
        description="How the error-feedback residual of the kept updates is stored (2 or 4 bytes per parameter); its arithmetic is FP32 either way, and bf16 moves the served parameters by far less than the int8 update codec does",
    )
    merge: Literal["mean", "radial"] = Field(
        "mean", description="Weighted mean of deltas, or radial-directional averaging per tensor"
    )

    # Outer optimizer
    outer: Literal["nesterov", "delayed_nesterov", "sgd"] = Field(
        "nesterov",
        description="Outer optimizer applied to each merged round. Nesterov is the default by measurement (docs/performance.md, Defaults chosen by measurement); Delayed Nesterov (momentum every outer_delay rounds) moves too little when each fragment sees only tens of rounds",
    )
    outer_lr: float = Field(0.7, gt=0, le=10, description="Outer learning rate")
    outer_momentum: float = Field(
        0.9, ge=0, lt=1, description="Outer momentum (Nesterov, Delayed Nesterov)"
    )
    outer_delay: int = Field(
        4,
        ge=1,
        description="Delayed Nesterov: momentum is updated every this many rounds (about the number of learners)",
    )
    outer_warmup: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="Warm-up of the outer step: each fragment's outer learning rate rises linearly over its first this many outer steps (outer_lr/N, 2*outer_lr/N, ... outer_lr); 0: none",
    )

    # Learners
    lease_s: float = Field(
        10.0,
        gt=0,
        description="A learner not heard from for this long is dead until it heartbeats or re-joins",
    )
    forget_after_s: float = Field(
        300.0, gt=0, description="A dead learner stops counting toward capacity after this long"
    )
    max_learners: int = Field(
        256, ge=1, description="Learners that may be joined at once (alive or dead)"
    )
    dynamic_local_updates: bool = Field(
        True,
        description="Tell each learner its inner steps from measured step rates: H_m = floor(v_m / v_max * inner_steps), or with inner_steps 0 its own H scaled by v_m / v_max when it runs below half the fastest learner's speed (v_max: the fastest live learner, or one that left and is not yet forgotten, see forget_after_s)",
    )
    inner_steps: int = Field(
        0,
        ge=0,
        description="H for the fastest learner under Dynamic Local Updates; 0: every learner's own H (only slow learners' is scaled)",
    )
    dlu_levels: int = Field(
        0,
        ge=0,
        le=1000,
        description="Dynamic Local Updates: the speed ratio a learner is told is rounded to a multiple of 1/dlu_levels (at least one level) and kept until its measured ratio moves more than 3/4 of a level away, so that jittering step times give the same H; 0: the measured ratio as it is",
    )

    # Limits
    init_stall_s: float = Field(
        30.0,
        gt=0,
        description="An InitModel upload that sends nothing for this long may be taken over by another learner's",
    )
    max_pull_wait_s: float = Field(
        30.0,
        ge=0,
        description="Longest a pull may wait for a minimum version (it holds a waiting slot and a gRPC worker meanwhile)",
    )
    max_waiting_pulls: int = Field(
        64,
        ge=0,
        description="Pulls that may wait for a version at once (at least learners x fragments); with all taken, a pull is answered at once with what exists",
    )
    stream_idle_s: float = Field(
        30.0,
        gt=0,
        description="A push or pull stream that moves no message for this long is cancelled (an idle or stalled client frees its slot)",
    )
    slice_wait_s: float = Field(
        30.0,
        gt=0,
        description="Longest a sharded island's slice push waits for the island's other ranks' slices of the same contribution; past it, or when one of their calls ends, every waiting slice is answered ABORTED and nothing of that contribution is applied (the island re-pulls and pushes again)",
    )
    max_streams_per_learner: int = Field(
        0,
        ge=0,
        description="Streams (transfers and waiting pulls) one learner may hold at once; 0 = the model's fragments + 2",
    )
    max_model_params: int = Field(
        20_000_000_000,
        ge=1,
        description="Largest model (in parameters) a learner may initialise; a larger spec is refused at Join",
    )
    memory_limit_bytes: int = Field(
        0,
        ge=0,
        description="Resident memory the Synchronizer may plan for; a model whose projected memory (logged, and exported as diloco_memory_projected_bytes) is above it is refused at Join, and a start on a state directory holding one exits with one line. 0 = no limit",
    )
    payload_budget_bytes: int = Field(
        0,
        ge=0,
        description="Bytes of encoded pushes kept for all fragments together: payloads held for decoding at the outer step, and receive buffers pooled for reuse. Past it, a push to a round short of its quorum is still taken (held, or added on arrival into FP32 sums of the fragment where that is cheaper); one to a round that has its quorum waits up to 10 s for outer steps to free room, then is refused RESOURCE_EXHAUSTED before it is received (the learner retries it). 0: the largest fragment's FP32 bytes, at least 256 MiB",
    )
    snapshot_budget_bytes: int = Field(
        0,
        ge=0,
        description="Bytes of full-pull snapshots alive at once for all fragments (a full pull streams a consistent encoded copy of its fragment, shared by every puller of that version, freed when the last ends). A full pull past it waits for one to end, up to max_pull_wait_s, then RESOURCE_EXHAUSTED (retry). 0: the largest fragment's FP32 bytes",
    )
    max_spec_bytes: int = Field(
        1 << 20,
        ge=1024,
        description="Largest model spec (tensor names and shapes, serialized) a Join may carry",
    )
    max_message_bytes: int = Field(
        8 << 20,
        ge=MIN_MESSAGE_BYTES,
        description=f"Largest single gRPC message accepted or sent; at least one wire chunk ({MIN_MESSAGE_BYTES} bytes)",
    )
    max_concurrent_streams: int = Field(
        32,
        ge=1,
        description="Push and pull streams served at once (each holds a gRPC worker); more get RESOURCE_EXHAUSTED",
    )
    max_unidentified_streams: int = Field(
        32,
        ge=1,
        description="Calls (of any method) waiting for their first message at once, before any says whose it is; each holds a gRPC worker and nothing else, for at most 5 s. Past it a new call displaces the oldest of the connection holding the most, so clients that open calls and send nothing cannot keep out learners that send theirs",
    )
    max_unidentified_per_peer: int = Field(
        16,
        ge=1,
        description="Of max_unidentified_streams, how many one client connection (gRPC peer) may hold; past it a new call on that connection displaces its own oldest",
    )
    max_workers: int = Field(
        0,
        ge=0,
        description=f"gRPC worker threads; at least max_concurrent_streams + max_waiting_pulls + max_unidentified_streams + {RESERVED_WORKERS}, so heartbeats, joins and health checks always find one; 0 = exactly that",
    )
    apply_threads: int = Field(
        1,
        ge=1,
        description="Threads that decode pushes, merge rounds and apply outer steps; more apply fragments in parallel on machines with cores to spare, and take CPU from receiving pushes on small ones",
    )
    compute_threads: int = Field(
        1,
        ge=1,
        description="Torch threads for decoding and outer steps; memory-bound work gains little from more, which the gRPC threads need",
    )
    kernels: Literal["auto", "native", "torch"] = Field(
        "auto",
        description="How the outer step computes on CPU: native runs the kernels of synchronizer/native.c (each push decoded and weighted, and the Nesterov step with the int8 update chain, in one pass over memory), built on first start by the machine's C compiler; torch runs torch's operations; auto runs native where a C compiler builds it, else torch. A change of kernel starts a new epoch (learners re-pull)",
    )
    kernel_threads: int = Field(
        0,
        ge=0,
        le=native.MAX_THREADS,
        description=f"Threads each native outer step splits a fragment across (at least {native.SPLIT_MIN_ELEMS:,} elements each; the numbers are the same for any count): a step is held by one core's memory bandwidth, and two nearly halve it; 0 = the cores this process may use, at most {native.AUTO_THREADS}",
    )

    # Durability
    checkpoint_interval_s: float = Field(
        60.0,
        ge=0,
        description="Seconds between periodic checkpoints, written only when something changed since the last one (with the log, once checkpoint_log_ratio allows, or after ten intervals); 0 checkpoints only on shutdown",
    )
    checkpoint_wal_bytes: int = Field(
        8 << 30,
        ge=0,
        description="A checkpoint starts early once the write-ahead log has grown by this many bytes (or checkpoint_log_ratio checkpoints, if more) since the last one started, so the log's disk use (a checkpoint lets go of the segments it covers: their files are written over by the next ones) and a restart's replay stay near it however fast pushes arrive; 0 checkpoints on the interval alone",
    )
    checkpoint_log_ratio: float = Field(
        1.0,
        ge=0,
        description="With the log, a periodic checkpoint waits until the log has grown by this many times the newest checkpoint's size (13 GB at 1B parameters), for at most ten intervals, so under load checkpoints write at most 1/ratio of the log's bytes and a restart replays at most ratio times a checkpoint; checkpoint_wal_bytes starts one early only past that too; 0 does not wait",
    )
    keep_checkpoints: int = Field(3, ge=1, description="Complete checkpoints kept in state_dir")
    wal: bool = Field(
        True,
        description="Acknowledge a push only once it is in the write-ahead log in state_dir (fsynced, group commit): a crash, even kill -9, loses nothing acknowledged, and a restart serves every version it served before with the same contents",
    )
    wal_wait_s: float = Field(
        10.0,
        gt=0,
        description="Longest a push waits for its write-ahead log record to reach the disk before it is answered UNAVAILABLE (the record stays queued)",
    )
    wal_segment_bytes: int = Field(
        64 << 20,
        ge=1 << 20,
        description="Write-ahead log segment size; the files of segments a checkpoint covers are kept as spares that the next segments are written over",
    )
    shutdown_grace_s: float = Field(
        10.0, ge=0, description="On SIGTERM: seconds in-flight RPCs get to finish"
    )

    # Security
    auth_token: str | None = Field(
        None,
        description="Bearer token every learner RPC must carry (metadata 'authorization: Bearer TOKEN')",
        json_schema_extra={"secret": True},
    )
    admin_token: str | None = Field(
        None,
        description="Bearer token for the admin Status RPC; learners' token gets PERMISSION_DENIED there",
        json_schema_extra={"secret": True},
    )
    learner_tokens_file: Path | None = Field(
        None,
        description="Per-learner credentials: a file of 'NAME TOKEN' lines the operator manages, one token per credential name; each learner sends its own token, its learner id is bound at Join to that credential, and limits are counted per credential. Instead of auth_token",
    )
    client_cert_credentials: bool = Field(
        False,
        description="Per-learner credentials under mTLS (tls_client_ca): a learner's credential is the identity its client certificate names; ids bound at Join, limits counted per credential",
    )
    max_learners_per_credential: int = Field(
        1,
        ge=1,
        description="With per-learner credentials: live learners one credential may have joined at once (each with its own streams and share of a round)",
    )
    tls_cert: Path | None = Field(None, description="PEM server certificate: serve TLS")
    tls_key: Path | None = Field(None, description="PEM private key for tls_cert")
    tls_client_ca: Path | None = Field(
        None, description="PEM CA bundle: require client certificates signed by it (mTLS)"
    )

    # Observability
    goodput_window_s: float = Field(
        300.0, gt=0, description="Window of the diloco_goodput_ratio gauge"
    )
    reference_curve: Path | None = Field(
        None,
        description="Effective goodput: a JSON ([[tokens, eval_loss], ...]) or CSV (header tokens,eval_loss) file of the eval loss a reference run (e.g. synchronous DiLoCo of the same model: python -m bench.reference) reached after each number of training tokens; evaluators' reports are then scored as reference tokens to reach their loss over tokens consumed (diloco_effective_goodput_ratio)",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level")
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Log lines as text (time, level, logger, message) or as one JSON object per line with those keys",
    )

    @model_validator(mode="after")
    def _consistent(self) -> SynchronizerConfig:
        self.shard_index = resolve_index(self.shards, self.shard_index)
        for name in ("max_norm_ratio", "max_weight_ratio"):
            ratio = getattr(self, name)
            if 0 < ratio < 1:
                raise ValueError(
                    f"{name} must be 0 (off) or at least 1, got {ratio}: below 1 it would refuse or cap honest learners' typical pushes"
                )
        needed = (
            self.max_concurrent_streams
            + self.max_waiting_pulls
            + self.max_unidentified_streams
            + RESERVED_WORKERS
        )
        if self.max_workers == 0:
            self.max_workers = needed
        elif self.max_workers < needed:
            raise ValueError(
                f"max_workers ({self.max_workers}) must be at least max_concurrent_streams ({self.max_concurrent_streams}) + max_waiting_pulls ({self.max_waiting_pulls}) + max_unidentified_streams ({self.max_unidentified_streams}) + {RESERVED_WORKERS}: "
                "every push, pull, waiting pull or call not yet identified holds a gRPC worker, and heartbeats, joins and health checks need workers of their own"
            )
        if self.anchor == "current" and self.update_history < self.max_staleness:
            raise ValueError(
                f"anchor 'current' needs update_history >= max_staleness ({self.update_history} < {self.max_staleness}): the updates a stale push missed must be kept"
            )
        if self.merge == "radial" and self.anchor == "current":
            raise ValueError(
                "radial merge re-anchors nothing: use anchor 'base' with merge 'radial'"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        if self.client_cert_credentials and self.tls_client_ca is None:
            raise ValueError("client_cert_credentials needs mTLS: tls_client_ca, tls_cert, tls_key")
        if self.learner_tokens_file is not None:
            if self.auth_token or self.client_cert_credentials:
                raise ValueError(
                    "learner_tokens_file gives each learner its own token: use it instead of auth_token and client_cert_credentials, not with them"
                )
            load_tokens(self.learner_tokens_file)  # a bad file is a configuration error
        if self.reference_curve is not None:
            ReferenceCurve.load(self.reference_curve)  # likewise
        return self

    @property
    def heartbeat_interval_s(self) -> float:
        return self.lease_s / 3
