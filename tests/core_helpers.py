"""The Synchronizer's core in a test, without gRPC: a `ManualClock` the test moves, outer
steps applied on the thread that closes their round, and `CoreClient`, a learner with the same
surface as `tests.helpers.Client` that calls the core's methods with the wire's messages."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from protos import diloco_pb2 as pb
from protos.initmodel import init_model_requests
from protos.spec import ModelSpec
from synchronizer.clock import ManualClock
from synchronizer.config import SynchronizerConfig
from synchronizer.core import Synchronizer
from synchronizer.metrics import Metrics
from synchronizer.wire import RawChunk
from tests.helpers import pulled, push_header, push_messages


class CoreClient:
    """A learner that calls the core directly."""

    def __init__(self, core: Synchronizer, spec: ModelSpec, name: str = "test") -> None:
        self.core, self.spec, self.name = core, spec, name
        self.learner_id = self.session = ""
        self.seq = 0

    def join(self, again: bool = False) -> pb.JoinReply:
        reply = self.core.join(
            pb.JoinRequest(
                learner_name=self.name,
                spec=self.spec.to_proto(),
                learner_id=self.learner_id if again else "",
                session=self.session if again else "",
            )
        )
        self.learner_id, self.session = reply.learner_id, reply.session
        self.seq = max(self.seq, reply.next_seq - 1)
        return reply

    def init(self, flats: Sequence[torch.Tensor]) -> pb.InitModelReply:
        return self.core.init_model(
            init_model_requests(self.learner_id, self.session, self.spec.spec_hash, flats, 1000)
        )

    def push(
        self,
        fragment: int,
        delta: torch.Tensor,
        codec_id: int = pb.CODEC_FP32,
        base: int = 0,
        seq: int | None = None,
        tokens: int = 100,
        steps: int = 10,
        compute_s: float = 1.0,
    ) -> pb.PushReply:
        if seq is None:
            self.seq += 1
            seq = self.seq
        h, buf = push_header(
            self.learner_id,
            self.session,
            self.spec,
            fragment,
            delta,
            codec_id,
            base,
            seq,
            tokens,
            steps,
            compute_s,
        )
        return self.core.push(push_messages(h, buf))

    def pull(
        self, fragment: int, min_version: int = 0, wait_s: float = 0.0
    ) -> tuple[int, torch.Tensor]:
        replies: Iterator[pb.PullReply | RawChunk] = self.core.pull(
            pb.PullRequest(
                learner_id=self.learner_id,
                session=self.session,
                fragment_id=fragment,
                min_version=min_version,
                wait_s=wait_s,
            )
        )
        return pulled(replies)

    def heartbeat(
        self,
        steps: int = 0,
        tokens: int = 0,
        compute_s: float = 0.0,
        step_time_s: float = 0.0,
        overlap_steps: int = 0,
        pushes_done: bool = False,
    ) -> pb.HeartbeatReply:
        return self.core.heartbeat(
            pb.HeartbeatRequest(
                learner_id=self.learner_id,
                session=self.session,
                counters=pb.LearnerCounters(steps=steps, tokens=tokens, compute_s=compute_s),
                step_time_s=step_time_s,
                overlap_steps=overlap_steps,
                pushes_done=pushes_done,
            )
        )

    def leave(self) -> pb.LeaveReply:
        return self.core.leave(pb.LeaveRequest(learner_id=self.learner_id, session=self.session))

    def status(self) -> pb.StatusReply:
        return self.core.status()


def make_core(state_dir: Path, clock: ManualClock, **settings: Any) -> Synchronizer:
    """A started core on `clock`, housekeeping left to `tick()`; no log, no periodic
    checkpoints, leases of 120 s and no norm bound unless `settings` say otherwise."""
    defaults: dict[str, Any] = {
        "state_dir": state_dir,
        "checkpoint_interval_s": 0,
        "checkpoint_wal_bytes": 0,
        "wal": False,
        "lease_s": 120.0,
        "max_norm_ratio": 0,
    }
    cfg = SynchronizerConfig(**{**defaults, **settings})
    core = Synchronizer(cfg, Metrics(CollectorRegistry()), clock=clock, inline_outer_steps=True)
    return core.start(housekeeping=False)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()
