"""`LearnerConfig`: every setting of a learner, typed and validated.

`Learner(model, opt, **settings)` builds one from keyword arguments; a process loads it with
`protos.configload.load(LearnerConfig, file, flags, environ)` (file < `DILOCO_LEARNER_<FIELD>`
environment < flags; `learner_id` and `learner_session` are `DILOCO_LEARNER_ID` and
`DILOCO_LEARNER_SESSION`). Every duration is in seconds and named `*_s`. The defaults train against a Synchronizer on
this host with no settings at all.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from protos import layout
from protos.channel import ClientTLS, parse_addresses


class LearnerConfig(ClientTLS):
    model_config = ConfigDict(extra="forbid")
    env_prefix: ClassVar[str] = "DILOCO_LEARNER_"
    help_groups: ClassVar[dict[str, str]] = {
        "where and who": "synchronizer shards name learner_id learner_session",
        "schedule": "sync_every fragments fragment_strategy final_push",
        "push encoding": "codec block_size scale_dtype error_feedback",
        "merge": "merge alpha overlap_steps strict_overlap delta_pulls pull_codec",
        "network": "rpc_timeout_s rpc_attempts pull_wait_s retry_initial_s retry_max_s "
        "join_timeout_s finish_timeout_s heartbeat_interval_s chunk_bytes",
        "security": "auth_token tls_ca tls_cert tls_key tls_server_name",
        "observability": "metrics_host metrics_port",
        "placement": "device",
    }

    # Where and who
    synchronizer: str = Field(
        default="127.0.0.1:50051",
        description="host:port of the Synchronizer's gRPC endpoint; a sharded Synchronizer: every shard's, comma-separated in any order, or one name that resolves to all of them (a Kubernetes headless Service) with shards set",
        json_schema_extra={"metavar": "HOST:PORT[,...]"},
    )
    shards: int = Field(
        default=0,
        ge=0,
        description="Shards of the Synchronizer; 0 = one per address in synchronizer. With one address, > 1 resolves its name to that many shards",
    )
    name: str = Field(
        default="",
        description="Human-readable learner name for the Synchronizer's logs; empty means host-pid",
    )
    learner_id: str = Field(
        default="",
        description="Join under this earlier learner id (a restarted learner comes back as itself); empty joins as a new learner",
    )
    learner_session: str = Field(
        default="",
        description="The session secret Join gave learner_id, which re-joining under it takes; give it as a file (--learner-session-file) or DILOCO_LEARNER_SESSION, not on the command line, which other local users can see",
        json_schema_extra={"secret": True},
    )

    # Schedule
    sync_every: int = Field(
        default=100, ge=1, description="H: inner steps between two syncs of the same fragment"
    )
    fragments: int = Field(
        default=4,
        ge=1,
        description="P: fragments the model is split into; fragment p syncs at offset p*H//P",
    )
    fragment_strategy: Literal["balanced", "strided"] = Field(
        default="balanced",
        description="Fragment plan: balanced bin-packing of tensors, or strided contiguous bands of the model",
    )
    final_push: bool = Field(
        default=True,
        description="finish() pushes every fragment's inner steps since its last push and merges their round before the final pull, so no step of the run is left out of the global model (with P fragments, on average (P-1)/(2P) x H steps per fragment would be)",
    )

    # Push encoding
    codec: str = Field(
        default="int4",
        description="Codec of pushed outer gradients: fp32, bf16, int8, int4 or fp4 (see protos.codec)",
    )
    block_size: int = Field(
        default=256,
        ge=8,
        le=1 << 20,
        description="Elements per scale block of the blockwise codecs",
    )
    scale_dtype: Literal["fp32", "fp16"] = Field(
        default="fp32", description="dtype of the per-block scales on the wire"
    )
    error_feedback: bool = Field(
        default=True,
        description="Carry each push's quantization error into the next push of that fragment",
    )

    # Merge
    merge: Literal["overwrite", "mix", "rebase"] = Field(
        default="mix",
        description="How a fresh global fragment is merged: overwrite local, mix with alpha (Streaming DiLoCo), or rebase local progress since the push onto it",
    )
    alpha: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="mix: weight of the fresh global fragment (1 = overwrite)",
    )
    overlap_steps: int = Field(
        default=1,
        ge=0,
        description="tau: inner steps a push may stay in flight; only enforced (by waiting) when strict_overlap is set",
    )
    strict_overlap: bool = Field(
        default=False,
        description="Merge each push's result exactly tau steps after the push: block the training loop until it is back when late, hold it when early (a synchronous run is then reproducible)",
    )
    delta_pulls: bool = Field(
        default=True,
        description="Ask only for the outer updates since the version held (kept INT8-coded by the Synchronizer), checked by checksum; falls back to a full FP32 pull",
    )
    pull_codec: Literal["fp32", "bf16", "int8"] = Field(
        default="fp32",
        description="Encoding of full pulls when delta_pulls is off: fp32 (exact), bf16 (2 bytes per parameter) or int8 (blockwise, about 1; the learner trains from the rounded values, the Synchronizer keeps the exact ones). With delta pulls, full pulls are FP32 so that later deltas apply exactly",
    )

    # Network behaviour
    rpc_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Deadline of each RPC (a pull that waits gets pull_wait_s on top)",
    )
    rpc_attempts: int = Field(
        default=3,
        ge=1,
        description="Attempts per RPC on UNAVAILABLE, DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED before the sync engine backs off",
    )
    pull_wait_s: float = Field(
        default=10.0,
        ge=0,
        description="How long one pull waits on the Synchronizer for the round that includes this learner's push",
    )
    retry_initial_s: float = Field(
        default=0.2,
        gt=0,
        description="First backoff after a failed RPC; doubles per failure, with jitter",
    )
    retry_max_s: float = Field(default=10.0, gt=0, description="Longest backoff between retries")
    join_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="How long the constructor keeps trying to join and fetch the initial model before raising",
    )
    finish_timeout_s: float = Field(
        default=60.0,
        ge=0,
        description="How long finish() waits for syncs in flight before the final pull",
    )
    heartbeat_interval_s: float = Field(
        default=0.0,
        ge=0,
        description="Seconds between heartbeats; 0 uses the interval the Synchronizer asks for",
    )
    chunk_bytes: int = Field(
        default=2 << 20,
        ge=1 << 12,
        le=4 << 20,
        description="Bytes per streamed chunk of a pushed payload",
    )

    # Security
    auth_token: str | None = Field(
        default=None,
        description="Bearer token sent on every RPC (metadata 'authorization: Bearer TOKEN')",
        json_schema_extra={"secret": True},
    )

    # Observability
    metrics_host: str = Field(
        default="127.0.0.1",
        description="Address the learner's Prometheus endpoint binds to (0.0.0.0 to be scraped from other hosts)",
    )
    metrics_port: int = Field(
        default=-1,
        ge=-1,
        le=65535,
        description="Port of the learner's Prometheus /metrics endpoint; 0 picks a free port, -1 disables it",
    )

    # Placement
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description="Where fragment state (base, residual) lives and pushes are encoded: auto = the model's device",
    )

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, v: str) -> str:
        layout.parse_codec(v)  # CodecError (a ValueError) names the allowed codecs
        return v

    @field_validator("synchronizer")
    @classmethod
    def _addresses(cls, v: str) -> str:
        try:
            addresses = parse_addresses(v)
        except ValueError as e:
            raise ValueError(
                f"must be host:port with a port in 1..65535 (e.g. 127.0.0.1:50051), or several, comma-separated: {e}"
            ) from None
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"lists an address twice: {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> LearnerConfig:
        if self.retry_max_s < self.retry_initial_s:
            raise ValueError("retry_max_s must be >= retry_initial_s")
        addresses = parse_addresses(self.synchronizer)
        if len(addresses) > 1 and self.shards and self.shards != len(addresses):
            raise ValueError(
                f"shards={self.shards} but synchronizer lists {len(addresses)} addresses: give "
                "one address per shard (or shards=0 to count them)"
            )
        return self
