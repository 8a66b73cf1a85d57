"""A sharded (FSDP2) island's side of `Learner`: its join, its inner step, its flush and its
finish, where every rank syncs only its slices (the protocol: `learner.sharded`).

One small all-gather per inner step (`exchange`) keeps the ranks taking the same decisions:
a due fragment is pushed by every rank with the same seq only when no rank is busy with it, a
fragment is merged only when every rank has the same version of it back, and a rank behind the
others re-pulls its slice at their version first. `Learner` calls these for a sharded island
only; they use its fields, its `_push` and `_set_sync_every`, and `learner.arrivals`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import grpc
import torch

from learner import arrivals, sharded
from learner.sync import Arrival
from protos import layout

if TYPE_CHECKING:
    from learner.learner import Learner

logger = logging.getLogger(__name__)


def connect(learner: Learner) -> tuple[list[int], list[torch.Tensor] | None]:
    """A sharded island's join: rank 0 joins (the island gathers the model, one fragment at
    a time, if it must initialise it) and tells the other ranks its membership; every rank
    pulls its slices, and a rank that got an older version than another re-pulls."""
    assert learner.engine is not None and learner.client is not None
    engine, client, n, plan = learner.engine, learner.client, learner.num_fragments, learner.plan
    client.slices = plan.slices  # type: ignore[attr-defined]
    client.fragment_numels = [f.numel for f in plan.fragments]  # type: ignore[attr-defined]
    whole = [plan.params[p] for p in range(n)]
    wait_s = learner.cfg.pull_wait_s
    if learner.leader:

        def gathered() -> list[torch.Tensor]:
            sharded.Messages.tell(("gather",))
            return [sharded.gather_full(ps) for ps in whole]

        try:
            versions, fetched = engine.connect(learner.cfg.join_timeout_s, gathered)
        except BaseException as e:
            sharded.Messages.tell(("failed", f"{type(e).__name__}: {e}"))
            raise
        session = engine.session
        sharded.Messages.tell(
            (
                "joined",
                client.learner_id,
                client.session,
                client.spec_hash,  # type: ignore[attr-defined]
                session.epoch,
                session.next_seq,
                versions,
                fetched is None,
            )
        )
    else:
        while (message := sharded.Messages.hear())[0] == "gather":
            for ps in whole:
                sharded.gather_full(ps)
        if message[0] == "failed":
            raise RuntimeError(f"rank 0 of this island could not join: {message[1]}")
        _, client.learner_id, client.session, spec_hash, epoch, next_seq, versions, init = message
        client.spec_hash = spec_hash  # type: ignore[attr-defined]
        engine.session.epoch, engine.session.next_seq = epoch, next_seq
        fetched = None
        if not init:
            fetched = []
            for p in range(n):
                v, _, params = engine.pull(p, versions[p], wait_s, exact=True)
                versions[p] = v
                fetched.append(params)
    if fetched is None:  # the island's own model: each rank's slice is where deltas start
        engine.hold(versions, [plan.gather(p, "cpu") for p in range(n)])
        return versions, None
    for _ in range(10):  # a round may close between two ranks' pulls
        agreed = sharded.exchange(n, [False] * n, versions, 0, 0)
        if all(agreed.ready(p) for p in range(n)):
            break
        for p in range(n):
            top = max(agreed.versions[p])
            if versions[p] < top:
                versions[p], _, fetched[p] = engine.pull(p, top, wait_s, exact=True)
    return versions, fetched


def exchange(learner: Learner, flag: int = 0) -> sharded.Agreed:
    """Takes the arrivals waiting, then the island's exchange of what each rank has."""
    assert learner.engine is not None
    engine, ready, n = learner.engine, learner.ready, learner.num_fragments
    while (a := engine.next_arrival()) is not None:
        ready[a.fragment] = a
    return sharded.exchange(
        n,
        [engine.busy(p) for p in range(n)],
        [ready[p].version if p in ready else -1 for p in range(n)],
        engine.sync_every(),
        engine.next_seq(),
        flag,
    )


def step(learner: Learner) -> set[int]:
    """After an inner step: the exchange, the merges it agrees on, then the fragments due."""
    assert learner.engine is not None
    agreed = exchange(learner)
    learner._set_sync_every(agreed.sync_every)
    merged = merge_agreed(learner, agreed)
    seq = agreed.next_seq
    for p in sorted(set(learner.schedule.due(learner.schedule_step())) | learner.deferred):
        if agreed.busy[p]:  # some rank is still syncing it: every rank defers it
            learner.deferred.add(p)
            continue
        learner._push(p, seq)  # every rank, with the same seq
        seq += 1
    learner.engine.seq_at_least(seq)
    return merged


def merge_agreed(learner: Learner, agreed: sharded.Agreed) -> set[int]:
    """Merges the fragments every rank has back at the same version; a rank behind the
    others on one re-pulls it at their version (merged at the next exchange)."""
    assert learner.engine is not None
    engine, ready = learner.engine, learner.ready
    merged: set[int] = set()
    for p in range(learner.num_fragments):
        if agreed.ready(p):
            arrivals.merge(learner, ready.pop(p))
            merged.add(p)
            continue
        target = agreed.behind(p, learner.island.rank, engine.busy(p) and p not in ready)
        if target is None:
            continue
        try:
            version, _, params = engine.pull(p, target, learner.cfg.pull_wait_s)
        except (grpc.RpcError, layout.CodecError) as e:
            engine.failed(f"catching up with the island at version {target}: {e}", p)
            continue
        old = ready.get(p)
        if old is None:
            engine.delivering(p)
        ready[p] = Arrival(p, version, params, old.job if old else None)
    return merged


def push_rest(learner: Learner) -> None:
    """`finish`'s final push: every rank pushes, with the same seqs, the fragments with inner
    steps since their last push that no rank is busy with (the ranks step together, so they
    agree on which)."""
    assert learner.engine is not None
    agreed = exchange(learner)
    seq = agreed.next_seq
    for p in range(learner.num_fragments):
        if learner.since_push[p][1] > 0 and not agreed.busy[p]:
            learner._push(p, seq)
            seq += 1
    learner.engine.seq_at_least(seq)


def flush(learner: Learner, deadline: float) -> bool:
    """Exchanges until no rank has a sync in flight (True) or rank 0 gives up (False)."""
    assert learner.engine is not None
    engine = learner.engine
    while True:
        idle = engine.in_flight() == 0
        late = learner.leader and time.monotonic() > deadline
        agreed = exchange(learner, int(idle) | 2 * int(late))
        if all(f & 1 for f in agreed.flags):
            return True
        if agreed.flags[0] & 2:
            return False
        merge_agreed(learner, agreed)
        arrival = engine.next_arrival(0.05)
        if arrival is not None:
            learner.ready[arrival.fragment] = arrival


def finish(learner: Learner) -> None:
    """Every rank pulls its slices exactly, the ranks agree on one version of each fragment
    (a rank behind re-pulls), then rank 0 leaves."""
    assert learner.engine is not None
    engine, n = learner.engine, learner.num_fragments
    fresh = engine.finish(learner.versions, leave=False)
    for _ in range(10):
        agreed = sharded.exchange(
            n, [False] * n, [fresh[p][0] if p in fresh else -1 for p in range(n)], 0, 0
        )
        behind = [
            (p, max(agreed.versions[p]))
            for p in fresh
            if not agreed.ready(p) and min(agreed.versions[p]) >= 0
        ]
        if not behind:
            break
        for p, top in behind:
            if fresh[p][0] < top:
                try:
                    v, _, params = engine.pull(p, top, learner.cfg.pull_wait_s, exact=True)
                except (grpc.RpcError, layout.CodecError) as e:
                    engine.failed(f"final pull failed, keeping local parameters: {e}", p)
                    del fresh[p]
                    continue
                fresh[p] = (v, params)
    for p in range(n):
        if p in fresh and agreed.ready(p):
            version, params = fresh[p]
            learner.plan.scatter(p, params)
            learner.base[p] = params.to(learner.device)
            learner.versions[p] = version
    sharded.exchange(n, [False] * n, [-1] * n, 0, 0)  # every rank has pulled: leave
    if learner.leader:
        engine.session.leave()
    logger.info(
        "learner=%s rank %d finished at step %d with versions %s",
        learner.learner_id,
        learner.island.rank,
        learner.clock.step,
        learner.versions,
    )
