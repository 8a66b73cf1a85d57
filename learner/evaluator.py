"""An evaluator: pulls the Synchronizer's served model into a torch model and reports the eval
loss the caller measures on it, from which the Synchronizer computes the effective goodput.

It joins as an evaluator (its own id, session and credential, `JoinRequest.evaluator`): it never
pushes and never counts as a training learner. The caller owns the evaluation, so any model and
held-out set fit:

    ev = Evaluator(model, LearnerConfig(synchronizer="sync:50051", fragments=4))
    while training_runs:
        if ev.refresh():                      # heartbeat; pulls what changed into `model`
            ev.report(my_eval(model))         # the loss of exactly the versions pulled
        time.sleep(ev.heartbeat_interval_s)
    ev.close()

`fragments` and `fragment_strategy` must be the learners' (the spec is checked at Join). A lapsed
lease is joined again. A sharded Synchronizer gets the report on every shard, each with the
versions of its own fragments.
"""

from __future__ import annotations

import logging

import grpc
import torch

from learner.addresses import client_for
from learner.config import LearnerConfig
from learner.fragments import FragmentPlan
from protos import diloco_pb2 as pb

logger = logging.getLogger(__name__)


class Evaluator:
    def __init__(
        self, model: torch.nn.Module, config: LearnerConfig, eval_set: str = "", name: str = ""
    ) -> None:
        self.plan = FragmentPlan(model, config.fragments, config.fragment_strategy)
        self.client = client_for(config)
        self.name = name or config.name or "evaluator"
        self.eval_set = eval_set
        self.versions: dict[int, int] = {}  # the versions held in the model
        self.served: dict[int, int] = {}  # the versions the server last said it serves
        self.heartbeat_interval_s = 1.0
        self._join()

    def _join(self) -> None:
        reply = self.client.join(self.name, self.plan.spec, evaluator=True)
        self.heartbeat_interval_s = reply.heartbeat_interval_s or self.heartbeat_interval_s
        self.served = {v.fragment_id: v.version for v in reply.versions}
        logger.info("evaluator %s joined as %s", self.name, self.client.learner_id)

    def refresh(self, wait_s: float = 0.0) -> bool:
        """Renews the lease and pulls every fragment whose served version is not the one held
        into the model; True when the model changed (then evaluate and `report`). Joins again
        after a lapsed lease."""
        try:
            reply = self.client.heartbeat(pb.LearnerCounters())
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                raise
            self._join()
        else:
            self.served = {v.fragment_id: v.version for v in reply.versions}
        changed = False
        for p in range(len(self.plan)):
            if p in self.versions and self.versions[p] >= self.served.get(p, 0):
                continue
            version, _, flat = self.client.pull(
                p, self.served.get(p, 0), wait_s, pb.CODEC_FP32, out=torch.empty(self.plan.numel(p))
            )
            self.plan.scatter(p, flat)
            self.versions[p] = version
            changed = True
        return changed

    def report(self, eval_loss: float) -> pb.EvalReply:
        """Reports the eval loss of the versions now in the model."""
        reply = self.client.report_eval(eval_loss, dict(self.versions), self.eval_set)
        logger.info(
            "eval loss %.4f at versions %s%s",
            eval_loss,
            self.versions,
            f": effective goodput {reply.effective_goodput:.3f}" if reply.has_reference else "",
        )
        return reply

    def close(self) -> None:
        """Leaves (best effort) and closes the channel."""
        try:
            self.client.leave(pb.LearnerCounters())
        except grpc.RpcError as e:
            logger.info("evaluator leave failed (%s); its lease lapses instead", e.code().name)
        self.client.close()
