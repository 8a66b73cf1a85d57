"""The learner's push/pull engine (`SyncEngine`): each fragment's sync, on background threads.

Per fragment there is at most one sync in progress, in one of these states: a push queued (not
yet answered; a push still unsent when the next one comes due is superseded by it, which keeps
its sequence number, so at most one of them is ever applied), awaiting the round that includes
an answered push, or due for a re-sync (a re-pull at the current version, after a dropped push
or a new server epoch); then an `Arrival` waits in the inbox until the training loop has merged
it. The loops that move a sync from state to state (a sender per shard, a puller per fragment)
are `learner.sync_threads`, the engine's base; one more thread runs the session's heartbeat
(`learner.session`, which also owns joins and re-joins; once the training loop says it pushes
no more (`finish_pushing`) and the last push is answered, heartbeats say so, and rounds stop
waiting for this learner). Failures are recorded and retried with backoff, never raised into
the training thread. The training thread (`learner.learner` and the modules it calls:
`joining`, `arrivals`, `sharded_island`) uses only the public methods: it submits `PushJob`s
and takes `Arrival`s.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable

import grpc
import torch

from learner.config import LearnerConfig
from learner.session import Clock, Session, Transport
from learner.sync_threads import Arrival, PushJob, SyncThreads
from protos import layout
from protos.spec import ModelSpec


class SyncEngine(SyncThreads):
    """Pushes and pulls of every fragment on background threads, within a `Session`."""

    def __init__(
        self,
        client: Transport,
        cfg: LearnerConfig,
        spec: ModelSpec,
        name: str,
        clock: Clock,
        global_params: Callable[[], list[torch.Tensor]] | None,
        pin: bool,
        *,
        numels: list[int] | None = None,
        follower: bool = False,
    ) -> None:
        """`numels`: elements of each fragment this learner holds (a sharded island rank: its
        slice's; default the whole fragment's). `follower`: a sharded island's rank other than
        0, which syncs under rank 0's membership (`Session.follower`). In a sharded island a
        push is never superseded: every rank's push of a contribution carries the same seq."""
        self.client, self.cfg, self.spec, self.pin = client, cfg, spec, pin
        self.num = len(spec.fragments)
        self.numels = numels or [f.numel for f in spec.fragments]
        self.supersede = numels is None
        self.cv = threading.Condition()
        self.stopping = threading.Event()
        self.session = Session(
            client,
            cfg,
            spec,
            name,
            clock,
            global_params,
            lock=self.cv,
            stopping=self.stopping,
            on_new_epoch=self._forget_unfinished,
            follower=follower,
        )
        # What each field holds: `SyncThreads`' annotations.
        self.queued, self.sending, self.awaiting, self.resync = {}, set(), {}, set()
        self.undelivered = [0] * self.num
        self.inbox = queue.SimpleQueue()
        self.held = [None] * self.num
        self.threads: list[threading.Thread] = []
        self.pushes, self.pulls, self.finishing = Counter(), 0, False

    # The training thread's interface ---------------------------------------------------------

    def connect(
        self,
        timeout_s: float,
        local_params: Callable[[], list[torch.Tensor]],
        offer_initial: bool = False,
    ) -> tuple[list[int], list[torch.Tensor] | None]:
        """Joins and obtains the global model: (versions, fragments to load), or (versions, None)
        when this learner's own parameters became the global model. Raises ValueError when the
        Synchronizer refuses the model, PermissionError on auth failures, TimeoutError when it
        cannot be reached within timeout_s.

        `offer_initial` (a learner that starts without a state): where a fragment was at version
        0 when it joined, its own parameters are offered as that version, since learners that
        build the model with the same code and seed hold the initial model already. The pull
        then sends only the updates since (none in a run that is just starting) and the
        version's checksum; parameters that do not match it are pulled whole."""

        local: list[torch.Tensor] = []  # gathered once, however often the join is retried

        def fetch(wait_s: float) -> tuple[list[int], list[torch.Tensor]]:
            if offer_initial and self.cfg.delta_pulls:
                if not local:
                    local.extend(local_params())
                for p in range(self.num):
                    if self.session.joined_versions[p] == 0:
                        self.held[p] = (self.session.epoch, 0, local[p])
            fetched = [self.pull(p, wait_s=wait_s, exact=True) for p in range(self.num)]
            return [v for v, _, _ in fetched], [t for _, _, t in fetched]

        versions, params, initialised = self.session.connect(timeout_s, local_params, fetch)
        if not initialised:
            return versions, params
        self.hold(versions, params)
        return versions, None

    def hold(self, versions: list[int], params: list[torch.Tensor]) -> None:
        """The exact parameters (FP32, CPU) this learner holds of each fragment at `versions`:
        where delta pulls start from."""
        self.held = [(self.session.epoch, v, t) for v, t in zip(versions, params, strict=True)]

    def busy(self, p: int) -> bool:
        """True while fragment p's last push is on the wire, or answered but its fresh version
        not yet merged (or, where pushes are not superseded, from the push on). A push on the
        wire is not superseded: it may be applied, and the one replacing it under its seq
        would then be a duplicate, its steps never merged."""
        with self.cv:
            return self._busy(p)

    def _busy(self, p: int) -> bool:
        queued = not self.supersede and p in self.queued
        return (
            queued
            or p in self.sending
            or p in self.awaiting
            or p in self.resync
            or self.undelivered[p] > 0
        )

    def submit(self, job: PushJob, seq: int = 0) -> bool:
        """Queues a push; supersedes an unanswered one of the same fragment. False if busy.
        `seq`: the push's sequence number, chosen by the caller (a sharded island's ranks
        share it); 0: the session's next."""
        p = job.fragment
        with self.cv:
            if self._busy(p):
                return False
            old = self.queued.get(p)
            if seq:
                job.seq = seq
                self.session.next_seq = max(self.session.next_seq, seq + 1)
            elif old is not None:  # never answered: the new delta already contains its progress
                job.seq = old.seq
                job.tokens += old.tokens
                job.steps += old.steps
                job.compute_s += old.compute_s
                self.pushes["superseded"] += 1
            else:
                job.seq = self.session.new_seq()
            self.queued[p] = job
            self.cv.notify_all()
            return True

    def finish_pushing(self) -> None:
        """The training loop submits no more pushes: once the last are answered, heartbeats
        tell the Synchronizer, so that rounds this learner will never push to stop waiting for
        it (learners still training may need them closed before its own rounds can close)."""
        with self.cv:
            self.finishing = True
            self._check_pushes_done()

    def next_arrival(self, wait_s: float = 0.0) -> Arrival | None:
        """The next fresh fragment to merge, waiting up to wait_s for one; None if none came.
        Call `merged` once it is merged."""
        try:
            return self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return None

    def merged(self, p: int) -> None:
        """The training loop has merged an arrival of fragment p: it may push p again."""
        with self.cv:
            self.undelivered[p] -= 1
            self.cv.notify_all()

    def in_flight(self) -> int:
        """Fragments with a sync not yet merged (queued, awaited, re-syncing or in the inbox)."""
        with self.cv:
            return sum(
                1
                for p in range(self.num)
                if p in self.queued or p in self.awaiting or p in self.resync or self.undelivered[p]
            )

    def counts(self) -> tuple[dict[str, int], int, int]:
        """(pushes by outcome, pulls, errors), consistent with each other."""
        with self.cv:
            return dict(self.pushes), self.pulls, self.session.errors

    def sync_every(self) -> int:
        """H now: the configured one, or what Dynamic Local Updates direct."""
        return self.session.sync_every()

    def next_seq(self) -> int:
        """The sequence number the next push would get."""
        with self.cv:
            return self.session.next_seq

    def seq_at_least(self, seq: int) -> None:
        """The next push gets at least `seq` (a sharded island's ranks keep rank 0's count)."""
        with self.cv:
            self.session.next_seq = max(self.session.next_seq, seq)

    def delivering(self, p: int) -> None:
        """The caller pulled fragment p itself and will merge it (and call `merged`)."""
        with self.cv:
            self.undelivered[p] += 1

    def ask_resync(self, p: int) -> None:
        """Re-pulls fragment p at the current version (its pending push is dropped)."""
        with self.cv:
            self.queued.pop(p, None)
            self.resync.add(p)
            self.cv.notify_all()

    def failed(self, message: str, fragment: int | None = None, network: bool = True) -> None:
        """Records a failure of the caller's (counted in `counts`, logged); never raises."""
        self.session.failed(message, fragment, network)

    def sync_state(self) -> str:
        """The state for stats: "reconnecting", "syncing n/P" or "idle"."""
        if not self.session.healthy:
            return "reconnecting"
        n = self.in_flight()
        return f"syncing {n}/{self.num}" if n else "idle"

    def finish(
        self, versions: list[int], leave: bool = True
    ) -> dict[int, tuple[int, torch.Tensor]]:
        """The end: stops the threads, pulls every fragment exactly (at least at `versions`) and
        leaves the Synchronizer (unless `leave` is False). Returns {fragment: (version, FP32
        parameters)} of those it pulled; a failed pull is recorded and the rest of its shard not
        waited on, and when no shard answered, no Leave is sent. Never raises."""
        self.stop()
        fresh: dict[int, tuple[int, torch.Tensor]] = {}
        unreachable: set[int] = set()  # shards
        for p in range(self.num):
            if self.client.shard_of(p) in unreachable:
                continue  # out of reach: do not wait on every fragment of it
            try:
                version, _, params = self.pull(p, versions[p], exact=True)
            except (grpc.RpcError, layout.CodecError) as e:
                self.session.failed(f"final pull failed, keeping local parameters: {e}", p)
                unreachable.add(self.client.shard_of(p))
                continue
            fresh[p] = (version, params)
        if leave and len(unreachable) < len({self.client.shard_of(p) for p in range(self.num)}):
            self.session.leave()
        return fresh

    def start(self) -> None:
        """Starts a sender per shard, a puller per fragment and the heartbeat."""
        shards = sorted({self.client.shard_of(p) for p in range(self.num)})
        loops: list[tuple[str, Callable[..., None], tuple[int, ...]]] = [
            ("push" if len(shards) == 1 else f"push-{s}", self._send_loop, (s,)) for s in shards
        ]
        loops += [(f"pull-{p}", self._pull_loop, (p,)) for p in range(self.num)]
        if not self.session.follower:  # a follower's lease is its rank 0's
            loops.append(("heartbeat", self.session.heartbeat_loop, ()))
        self.threads = [
            threading.Thread(
                target=self._guarded, args=(fn, *args), name=f"diloco-{name}", daemon=True
            )
            for name, fn, args in loops
        ]
        for t in self.threads:
            t.start()

    def stop(self, timeout_s: float = 5.0, close_channel: bool = False) -> None:
        """Stops the threads; with close_channel, RPCs in flight are cancelled first."""
        self.stopping.set()
        with self.cv:
            self.cv.notify_all()
        if close_channel:
            self.client.close()
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
