"""A learner's join: the client and sync engine built from its settings, the join (or, with a
saved state, the re-join as itself), and the global model taken, or this model uploaded as the
initial one where there is none yet. `Learner` calls `connect` on the ranks that talk to the
Synchronizer; a sharded island's join is `learner.sharded_island.connect`.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from learner import resume, sharded_island
from learner.addresses import client_for
from learner.session import Transport
from learner.sync import SyncEngine

if TYPE_CHECKING:
    from learner.learner import Learner

logger = logging.getLogger(__name__)


def connect(learner: Learner, transport: Transport | None, state: dict[str, Any] | None) -> None:
    """Joins `learner` (its `client`, `engine`, `versions` and `base` set; the engine started);
    `transport` replaces the client its settings would build. Raises if the join is impossible
    within `join_timeout_s`, the client closed."""
    cfg, plan, n = learner.cfg, learner.plan, learner.num_fragments
    client = learner.client = transport if transport is not None else client_for(cfg)
    name = cfg.name or f"{socket.gethostname()}-{os.getpid()}"
    if learner.sharded and not hasattr(client, "slices"):
        client.close()
        raise ValueError(
            "a sharded (FSDP2) island talks to a single Synchronizer address, not to shards"
        )
    engine = learner.engine = SyncEngine(
        client,
        cfg,
        plan.spec,
        name,
        learner.clock,
        global_params=None if learner.sharded else lambda: [b.detach().cpu() for b in learner.base],
        pin=learner.device.type == "cuda",
        numels=[plan.numel(p) for p in range(n)] if learner.sharded else None,
        follower=learner.sharded and not learner.leader,
    )
    try:
        # empty: the Synchronizer assigns one; a resumed learner comes back as itself
        client.learner_id = state["learner_id"] if state else cfg.learner_id
        client.session = state["session"] if state else cfg.learner_session
        if learner.sharded:
            versions, fetched = sharded_island.connect(learner)
        else:
            versions, fetched = engine.connect(
                cfg.join_timeout_s,
                lambda: [plan.gather(p, "cpu") for p in range(n)],
                offer_initial=state is None,
            )
    except BaseException:
        client.close()
        raise
    if state is not None and resume.resumable(learner, state, versions, fetched is None):
        resume.restore_sync(learner, state)
    else:
        learner.versions = versions
        for p in range(n):
            if fetched is not None:
                plan.scatter(p, fetched[p])
            learner.base.append(
                fetched[p].to(learner.device)
                if fetched is not None
                else plan.gather(p, learner.device)
            )
    if not learner.sharded:  # (an island's ranks keep one schedule)
        learner.schedule.follow(learner.versions)
    learner.joining_bytes = client.bytes_sent
    engine.start()
    logger.info(
        "learner=%s joined %s: %d fragments of %s parameters, versions %s",
        client.learner_id,
        cfg.synchronizer,
        n,
        f"{plan.spec.numel:,}",
        learner.versions,
    )
