"""What `diloco-learner train` (`TrainOptions`) and `diloco-learner local` (`LocalOptions`) take.

Each field is one option: its default, its bound and its help are written here once, and
`demo/cli.py` makes the flags from them (`protos.cli.add_option_flags`; `json_schema_extra`
names a flag or a placeholder that differs from the field's). Code that runs the example
without the command line (`bench/`, the tests) builds the same models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from learner.config import LearnerConfig

# The bundled example syncs more often than the library's default (FEASIBILITY.md: H = 25 is best
# for a model this small and a run this short). The CLI applies it unless a file, variable or flag
# says otherwise.
EXAMPLE_SYNC_DEFAULTS = {"sync_every": 25}


class TrainOptions(BaseModel):
    """One learner's run of the example training loop (`demo.train.train`)."""

    model_config = ConfigDict(extra="forbid")

    # What to train
    steps: int = Field(
        1000, ge=0, description="inner steps; 0 only evaluates the served global model"
    )
    start_step: int = Field(
        0, ge=0, description="resume the schedule at this step (a restarted learner)"
    )
    model: str | None = Field(
        None,
        description="train your own model instead: FACTORY(learner_index, learners) returns (model, batch_fn[, eval_fn]); see demo/train.py",
        json_schema_extra={"metavar": "PKG.MODULE:FACTORY"},
    )
    data: str | None = Field(
        None,
        description="directory of text files to train on instead of the Python standard library's sources",
        json_schema_extra={"metavar": "DIR"},
    )
    max_bytes: int = Field(
        4 << 20, ge=1024, description="training bytes each learner reads from its shard"
    )
    n_layer: int = Field(2, ge=1, description="transformer blocks")
    d_model: int = Field(64, ge=1, description="model width")
    n_head: int = Field(2, ge=1, description="attention heads; must divide --d-model")
    block: int = Field(
        128, ge=1, description="context length in bytes", json_schema_extra={"flag": "--context"}
    )
    batch_size: int = Field(16, ge=1, description="sequences per inner step")
    seed: int = Field(
        0,
        ge=0,
        description="model initialisation (the same on every learner) and data order",
    )

    # Inner optimizer: AdamW, linear warm-up, cosine decay to min_lr_ratio * lr
    lr: float = Field(8e-3, gt=0, description="peak AdamW learning rate")
    warmup_steps: int = Field(50, ge=0, description="linear warm-up steps")
    min_lr_ratio: float = Field(0.1, ge=0, description="cosine decay ends at this fraction of --lr")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay on matrices")
    clip: float = Field(1.0, ge=0, description="gradient norm clip; 0 disables")

    # Syncing: the Learner's settings, or None to train alone (the same loop without a Learner)
    sync: LearnerConfig | None = Field(
        default_factory=lambda: LearnerConfig.model_validate(EXAMPLE_SYNC_DEFAULTS),
        description="the Learner's settings; None trains alone",
    )
    name: str = Field("learner", description="this learner in the log lines and the result")
    wait_for_learners: int = Field(
        0,
        ge=0,
        description="before the first step, wait until N learners have joined (start a run together)",
        json_schema_extra={"metavar": "N"},
    )
    fsdp: bool = Field(
        False,
        description="under torchrun, shard the model across the island with FSDP2 (fully_shard) instead of replicating it (DDP): each rank keeps, pushes and pulls only its own slice of every fragment",
    )
    learner_index: int = Field(0, ge=0, description="this learner's data shard, 0..learners-1")
    learners: int = Field(1, ge=1, description="number of data shards")

    # Running
    slow: float = Field(
        1.0,
        ge=1,
        description="simulate a slow learner: sleep (F-1) x step time after each step",
        json_schema_extra={"metavar": "F"},
    )
    log_every: int = Field(25, ge=1, description="steps between progress lines")
    eval_windows: int = Field(256, ge=1, description="held-out windows the eval loss averages over")
    eval_only: bool = Field(
        False,
        description="be an evaluator instead of training: join as one, pull the served model whenever its versions change (at most every --eval-every-s), evaluate it on the held-out set and report the loss to the Synchronizer (its effective goodput)",
    )
    eval_every_s: float = Field(
        5.0, gt=0, description="with --eval-only: seconds between evaluations at most"
    )
    eval_reports: int = Field(
        0, ge=0, description="with --eval-only: stop after N reports; 0 = run until stopped"
    )
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 = torch's default")
    out: str | None = Field(
        None,
        description="write the JSON result here (rewritten at every progress line)",
        json_schema_extra={"metavar": "PATH"},
    )
    resume: str | None = Field(
        None,
        description="keep this learner's checkpoint in DIR (the model, the inner optimizer and the learner's own state, every --save-every steps and on SIGTERM) and, when one is there, continue from it as the same learner",
        json_schema_extra={"metavar": "DIR"},
    )
    save_every: int = Field(
        100,
        ge=1,
        description="steps between checkpoints with --resume",
        json_schema_extra={"metavar": "N"},
    )
    session_out: str | None = Field(
        None,
        description="keep the session secret Join gave this learner in this file (mode 0600), which a restart gives back with --learner-id and --learner-session-file; the result names the file, never the secret (default: OUT.session with --out)",
        json_schema_extra={"metavar": "PATH"},
    )


class LocalOptions(BaseModel):
    """The main job on one machine (`demo.local.run`): a Synchronizer and N learners."""

    model_config = ConfigDict(extra="forbid")

    learners: int = Field(4, ge=1, description="learners (each one process, or one island)")
    island_size: int = Field(
        1,
        ge=1,
        description="ranks per learner: each learner is a torchrun island of this many processes (gloo on CPU, NCCL on GPUs; gradients averaged as in DDP, each rank reading its own data shard) whose rank 0 alone talks to the Synchronizer",
    )
    fsdp: bool = Field(
        False,
        description="with --island-size 2 or more: islands shard the model with FSDP2 (each rank syncs only its slice) instead of replicating it",
    )
    shards: int = Field(
        1,
        ge=1,
        description="Synchronizer processes sharing the fragments (at most --fragments); 1 = one unsharded Synchronizer",
    )
    steps: int = Field(
        1000,
        ge=1,
        description="inner steps per learner; the slow one takes steps/slow-factor",
    )
    out: Path = Field(
        Path("runs/local"),
        description="directory for summary.json, summary.png, per-learner results and logs",
    )
    # Left out, these two are picked from the learners (a factory given the fields above)
    slow_learner: int = Field(
        default_factory=lambda data: 1 if data.get("learners", 0) >= 2 else -1,
        description="index of the slow learner; -1 for none (default: 1 when there are 2 or more learners)",
    )
    slow_factor: float = Field(3.0, ge=1, description="how many times slower it runs")
    kill_learner: int = Field(
        default_factory=lambda data: 2 if data.get("learners", 0) >= 3 else -1,
        description="index of the learner killed mid-run and restarted; -1 for none (default: 2 when there are 3 or more learners)",
    )
    kill_at: float = Field(0.4, ge=0, description="kill it after this fraction of its steps")
    kill_rank: int = Field(
        -1,
        ge=-1,
        description="with --island-size 2 or more: SIGKILL only this rank of the killed learner's island (torchrun then ends the others); -1 = the whole island",
    )
    restart_after_s: float = Field(
        5.0, ge=0, description="restart it this long after the kill"
    )  # past the lease
    # 2 beat 1 clearly here (eval 1.75 vs 2.42, no stale drops)
    quorum: int = Field(
        2,
        ge=0,
        description="Synchronizer: contributions before a round may close; 0 = every live learner",
    )
    grace: Literal["adaptive", "fixed", "none"] = Field(
        "adaptive", description="Synchronizer: grace window after the quorum"
    )
    lease_s: float = Field(
        3.0, gt=0, description="Synchronizer: a learner silent this long is dead"
    )
    sync_every: int = Field(25, ge=1, description="H: inner steps between syncs of a fragment")
    fragments: int = Field(4, ge=1, description="P: fragments of the model")
    codec: str = Field("int4", description="push codec: fp32, bf16, int8, int4, fp4")
    data: str | None = Field(
        None,
        description="directory of text files instead of the Python stdlib sources",
        json_schema_extra={"metavar": "DIR"},
    )
    seed: int = Field(0, ge=0, description="model initialisation and data order")
    log_every: int = Field(10, ge=1, description="steps between a learner's progress lines")
    train_args: list[str] = Field(
        default_factory=list, description="extra flags for every `diloco-learner train`"
    )
    synchronizer_args: list[str] = Field(
        default_factory=list, description="extra flags for `diloco-synchronizer serve`"
    )
    plot: bool = Field(True, description="write summary.png")
    live: bool | None = Field(
        None, description="redraw progress in place (default: when stdout is a terminal)"
    )
