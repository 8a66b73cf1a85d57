"""One fragment of the global model: its parameters, outer optimizer, version and rounds.

Per fragment: FP32 flat parameters Theta_p, the outer optimizer's state, the version v_p (outer
steps applied) and at most one open round collecting weighted outer gradients. Two locks: `lock`
guards the open round (held only to judge and accumulate one push), `apply_lock` guards the
parameters (held while an outer step is applied or a snapshot taken), so pushes never wait for an
outer step and fragments never wait for each other. Rounds are closed by `Rounds`' worker
threads, strictly in version order; pullers wait on a condition for the version they want.

Round policy (Decoupled DiLoCo): a round may close once it holds K contributions (K = quorum,
capped by the live learners; quorum 0 = every live learner, i.e. synchronous DiLoCo). It closes
at once when every live learner has contributed, otherwise after the grace window, which
`GraceWindow` sizes from moving averages so that waiting stays free for the learners. While a
fragment's previous outer step is still being applied its open round keeps collecting instead
of closing, so a busy Synchronizer batches pushes rather than queueing outer steps (and holds
at most two round buffers per fragment).

A push is acknowledged once its bytes are received and validated (`codec.check`): the round
holds the encoded payload and the outer step's worker decodes it into the accumulator, weight
folded into the block scales (`codec.accumulate`). Held payloads are bounded by a budget of two
FP32 copies of the fragment; past it a push is decoded on arrival, after the ones held before
it, so the sums are taken in arrival order either way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from protos import codec, framing
from protos import diloco_pb2 as pb
from protos.spec import Fragment as FragmentSpec
from synchronizer.config import SynchronizerConfig
from synchronizer.goodput import Goodput, Share
from synchronizer.merge import Accumulator, staleness_factor, token_weight
from synchronizer.metrics import Metrics
from synchronizer.outer import make_outer

logger = logging.getLogger(__name__)

EMBEDDING_HINTS = ("emb", "wte", "wpe")  # tensors merged by plain mean in radial mode


class GraceWindow:
    """Adaptive grace: gamma * (tau * step_time - quorum_time - apply_time), capped (EMAs).

    tau is `overlap_steps` when configured, else what the learners report in heartbeats (their
    H, or their strict-overlap bound), else 1.
    """

    def __init__(self, cfg: SynchronizerConfig, beta: float = 0.8) -> None:
        self.cfg = cfg
        self.beta = beta
        self.step_time = 0.0
        self.overlap_steps = 0.0  # tau as the learners report it, when the config leaves it to them
        self.quorum_time = 0.0
        self.apply_time = 0.0
        self.lock = threading.Lock()

    def _ema(self, old: float, new: float) -> float:
        return new if old == 0.0 else self.beta * old + (1 - self.beta) * new

    def observe(self, step_time: float = 0.0, quorum_time: float = -1.0, apply_time: float = -1.0, overlap_steps: int = 0) -> None:
        with self.lock:
            if step_time > 0:
                self.step_time = self._ema(self.step_time, step_time)
            if overlap_steps > 0:
                self.overlap_steps = self._ema(self.overlap_steps, float(overlap_steps))
            if quorum_time >= 0:
                self.quorum_time = self._ema(self.quorum_time, quorum_time)
            if apply_time >= 0:
                self.apply_time = self._ema(self.apply_time, apply_time)

    def seconds(self) -> float:
        cfg = self.cfg
        if cfg.grace == "none":
            return 0.0
        if cfg.grace == "fixed":
            return cfg.grace_max_s
        with self.lock:
            tau = cfg.overlap_steps or self.overlap_steps or 1.0
            free = tau * self.step_time - self.quorum_time - self.apply_time
        return min(cfg.grace_max_s, max(0.0, cfg.grace_gamma * free))


@dataclass
class Contribution:
    learner_id: str
    base_version: int
    weight: float
    share: Share


@dataclass
class Round:
    start_version: int  # the round's outer step turns this version into start_version + 1
    acc: Accumulator
    opened_at: float = field(default_factory=time.monotonic)
    contributions: list[Contribution] = field(default_factory=list)
    quorum_at: float | None = None
    timer: threading.Timer | None = None
    expired: bool = False  # the grace window ran out
    closing: bool = False
    # Accepted pushes not yet added to `acc`: (payload bytes, header, weight), already validated.
    # The outer-step worker decodes and adds them, so acknowledging a push costs no decode.
    deferred: list[tuple[torch.Tensor, pb.PayloadHeader, float]] = field(default_factory=list)


@dataclass
class Verdict:
    """What became of a push, as the fragment judged it."""

    outcome: pb.PushOutcome
    round_version: int
    current_version: int
    staleness: int
    weight: float


class FragmentState:
    def __init__(self, spec: FragmentSpec, cfg: SynchronizerConfig, metrics: Metrics, goodput: Goodput, model_numel: int) -> None:
        self.spec = spec
        self.fid = spec.fragment_id
        self.numel = spec.numel
        self.cfg = cfg
        self.metrics = metrics
        self.goodput = goodput
        self.share = spec.numel / max(model_numel, 1)
        offsets = spec.offsets()
        self.segments = [(s, e) for _, s, e in offsets]
        self.mean_segments = {i for i, (name, _, _) in enumerate(offsets) if any(h in name.lower() for h in EMBEDDING_HINTS)}
        self.lock = threading.Lock()
        self.apply_lock = threading.Lock()
        self.cv = threading.Condition(self.apply_lock)
        self.params: torch.Tensor | None = None
        self.version = 0
        self.pending_version = 0  # version after every round already handed to the closers
        self.outer = make_outer(cfg.outer, spec.numel, cfg.outer_lr, cfg.outer_momentum, cfg.outer_delay)
        # The last update_history outer updates as sent to delta pulls: (version, header, bytes).
        # Canonical parameters are the sum of exactly these decoded updates, so a learner that
        # applies them in order holds the same parameters bit for bit.
        self.chain: deque[tuple[int, pb.PayloadHeader, torch.Tensor]] = deque()
        self.chain_codec = codec.parse_codec(cfg.update_codec)
        self.residual: torch.Tensor | None = None  # error feedback of the update codec
        self.checksums: dict[int, int] = {}
        self.round: Round | None = None
        self.spare: Accumulator | None = None
        self.merged_buf = torch.empty(0)
        self.chain_buf = torch.empty(0)  # the newest update as decoded, before it is added
        # Push buffers by size (-1: FP32 decode), kept for reuse up to two FP32 copies of the
        # fragment: a fresh 100 MB buffer costs about 30 ms of page faults here, 8x a reuse.
        self.buffers: dict[int, list[torch.Tensor]] = {}
        self.pooled_bytes = 0
        self.pool_budget = 2 * 4 * spec.numel
        # Payload bytes held by rounds for decoding at the outer step; beyond the budget (two
        # FP32 copies of the fragment) pushes are decoded on arrival instead, bounding memory.
        self.deferred_bytes = 0
        self.defer_budget = 2 * 4 * spec.numel
        self.snapshots: dict[pb.Codec, tuple[int, pb.PayloadHeader, torch.Tensor]] = {}
        self.metrics.fragment_version.labels(str(self.fid)).set(0)

    @property
    def applying(self) -> bool:
        """A taken round's outer step has not finished yet."""
        return self.pending_version != self.version

    @property
    def initialized(self) -> bool:
        return self.params is not None

    def initialize(self, params: torch.Tensor, version: int = 0) -> None:
        with self.cv:
            self.params = params.to(torch.float32).clone()
            self.version = self.pending_version = version
            self.snapshots.clear()
            self.cv.notify_all()
        self.metrics.fragment_version.labels(str(self.fid)).set(version)

    def _new_accumulator(self) -> Accumulator:
        if self.spare is not None:  # the previous round's buffer, zeroed after its outer step
            acc, self.spare = self.spare, None
            return acc
        radial = self.cfg.merge == "radial"
        return Accumulator(self.numel, self.segments if radial else None, radial=radial, mean_segments=self.mean_segments if radial else None)

    # Pushes ----------------------------------------------------------------------------------

    def take_buffer(self, nbytes: int | None = None) -> torch.Tensor:
        """A reusable buffer for one push: FP32 of the fragment's size (decoding), or uint8 of
        `nbytes` (receiving). Fresh large allocations page-fault on every push; these do not."""
        key = -1 if nbytes is None else nbytes
        with self.lock:
            pool = self.buffers.get(key)
            if pool:
                buf = pool.pop()
                self.pooled_bytes -= buf.nbytes
                return buf
        if nbytes is None:
            return torch.empty(self.numel, dtype=torch.float32)
        return torch.empty(nbytes, dtype=torch.uint8)

    def give_buffer(self, buf: torch.Tensor) -> None:
        key = -1 if buf.dtype == torch.float32 else buf.numel()
        with self.lock:
            if self.pooled_bytes + buf.nbytes <= self.pool_budget:
                self.buffers.setdefault(key, []).append(buf)
                self.pooled_bytes += buf.nbytes

    def reserve(self, nbytes: int) -> bool:
        """Claims room to hold a payload of `nbytes` until the outer step (False: decode it now)."""
        with self.lock:
            if self.deferred_bytes + nbytes > self.defer_budget:
                return False
            self.deferred_bytes += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self.lock:
            self.deferred_bytes -= nbytes

    def submit(
        self,
        learner_id: str,
        base_version: int,
        tokens: int,
        steps: int,
        compute_s: float,
        payload: tuple[torch.Tensor, pb.PayloadHeader],
        hold: bool = False,
    ) -> tuple[Verdict, Round | None]:
        """Judges one push (its encoded bytes and header) and adds it to the open round; returns
        the verdict and its round.

        With `hold` (room `reserve`d by the caller) an accepted payload belongs to the round,
        whose outer step decodes and adds it; otherwise it is added now, under the round lock,
        after the pushes held before it. The caller has validated the base version (not ahead
        of `version`) and the values (`codec.check`: finite, right size).
        """
        spent: list[torch.Tensor] = []
        share = Share(tokens * self.share, compute_s * self.share)
        with self.lock:
            start = self.round.start_version if self.round is not None else self.pending_version
            staleness = start - base_version
            self.metrics.staleness.observe(staleness)
            if staleness > self.cfg.max_staleness:
                self.goodput.discarded(learner_id, share)
                return Verdict(pb.PUSH_DROPPED_STALE, start + 1, self.version, staleness, 0.0), None
            weight = token_weight(self.cfg.token_weight, tokens, steps) * staleness_factor(
                self.cfg.staleness_weight, staleness, self.cfg.staleness_alpha, self.cfg.staleness_hinge
            )
            if self.round is None:
                self.round = Round(start, self._new_accumulator())
            rnd = self.round
            if hold:
                rnd.deferred.append((payload[0], payload[1], weight))
            else:
                spent = self._add_deferred_locked(rnd)  # first, to keep arrival order
                rnd.acc.add_payload(payload[0], payload[1], weight)
            rnd.contributions.append(Contribution(learner_id, base_version, weight, share))
            self.goodput.accepted(learner_id, share)
            verdict = Verdict(pb.PUSH_ACCEPTED, start + 1, self.version, staleness, weight)
        for buf in spent:
            self.give_buffer(buf)
        return verdict, rnd

    @staticmethod
    def _drain(rnd: Round, scratch: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Adds the round's held pushes to its accumulator, in arrival order; returns their
        buffers (for the pool, and for the held-bytes count)."""
        spent = [buf for buf, _, _ in rnd.deferred]
        try:
            for buf, header, weight in rnd.deferred:
                rnd.acc.add_payload(buf, header, weight, scratch)
        finally:
            rnd.deferred.clear()
        return spent

    def _add_deferred_locked(self, rnd: Round) -> list[torch.Tensor]:
        """`_drain` of an open round (a push past the budget is about to be added). Caller
        holds `lock`."""
        spent = self._drain(rnd)
        self.deferred_bytes -= sum(buf.numel() for buf in spent)
        return spent

    def closability(self, live: set[str]) -> tuple[Round | None, bool, bool]:
        """(open round, close it now, quorum reached), judged together under the round lock."""
        with self.lock:
            rnd = self.round
            if rnd is None or rnd.closing or not rnd.contributions:
                return None, False, False
            contributed = {c.learner_id for c in rnd.contributions}
            if self.cfg.quorum == 0:  # synchronous: every live learner, nobody else to wait for
                done = live <= contributed
                return rnd, done and not self.applying, done
            k = max(1, min(self.cfg.quorum, len(live)))
            if len(rnd.contributions) < k:
                return rnd, False, False
            if rnd.quorum_at is None:
                rnd.quorum_at = time.monotonic()
            ready = live <= contributed or self.cfg.grace == "none" or rnd.expired
            # While the previous round's outer step is still being applied the open round keeps
            # collecting (a busy Synchronizer batches pushes instead of queueing outer steps).
            return rnd, ready and not self.applying, True

    def take_round(self, rnd: Round) -> bool:
        """Marks the round as closing and opens the way for the next; False if already taken."""
        with self.lock:
            if self.round is not rnd or rnd.closing:
                return False
            rnd.closing = True
            self.round = None
            self.pending_version = rnd.start_version + 1
            if rnd.timer is not None:
                rnd.timer.cancel()
            return True

    # Outer step ------------------------------------------------------------------------------

    def _add_deferred(self, rnd: Round) -> None:
        """Decodes the round's deferred pushes into its accumulator (outside the locks: a taken
        round belongs to its outer step alone)."""
        if not rnd.deferred:
            return
        # A decode buffer only where one is needed (radial merge, FP4): the rest add in place.
        scratch = self.take_buffer() if rnd.acc.radial or any(h.codec == pb.CODEC_FP4_E3M0 for _, h, _ in rnd.deferred) else None
        held = [buf for buf, _, _ in rnd.deferred]
        try:
            self._drain(rnd, scratch)
        finally:
            for buf in held:
                self.give_buffer(buf)
            if scratch is not None:
                self.give_buffer(scratch)
            self.release(sum(buf.numel() for buf in held))

    def apply(self, rnd: Round) -> float:
        """Merges a taken round and applies the outer step, in version order; returns seconds."""
        t_decode = time.perf_counter()
        self._add_deferred(rnd)
        t_decode = time.perf_counter() - t_decode
        with self.cv:
            while self.version != rnd.start_version:
                self.cv.wait()
            t0 = time.perf_counter() - t_decode
            assert self.params is not None
            if self.merged_buf.numel() != self.numel:
                self.merged_buf = torch.empty(self.numel, dtype=torch.float32)
            if rnd.acc.total_weight == 0:  # only zero-weight contributions: nothing to merge
                merged = self.merged_buf.zero_()
            else:
                merged = rnd.acc.merged(self.merged_buf)
            if self.cfg.anchor == "current":
                self._reanchor(rnd, merged)
            if self.cfg.update_history > 0:
                self._step_through_chain(merged, rnd.start_version + 1)
            else:
                self.outer.step(self.params, merged)
            self.version = rnd.start_version + 1
            self.snapshots.clear()
            self.cv.notify_all()
            seconds = time.perf_counter() - t0
        rnd.acc.reset()
        with self.lock:
            self.spare = rnd.acc
        self.metrics.fragment_version.labels(str(self.fid)).set(self.version)
        return seconds

    def _step_through_chain(self, merged: torch.Tensor, version: int) -> None:
        """Outer step through the update chain: canonical params += decode(encode(update + residual)).

        The outer optimizer's update f * d is folded into the residual in one pass, so the
        parameters are written once, by the same single add a learner applying the chain does.
        """
        assert self.params is not None
        if self.residual is None:
            self.residual = torch.zeros(self.numel)
        factor = self.outer.direction(merged)
        update = torch.add(self.residual, merged, alpha=factor, out=merged)  # merged is scratch now
        header = codec.make_header(self.chain_codec, self.numel)
        encoded = codec.encode(update, self.chain_codec)  # fresh: pulls may still be streaming old links
        if self.chain_buf.numel() != self.numel:
            self.chain_buf = torch.empty(self.numel)
        decoded = codec.values(encoded, header, self.chain_buf)
        torch.sub(update, decoded, out=self.residual)
        self.params.add_(decoded)
        self.chain.append((version, header, encoded))
        while len(self.chain) > self.cfg.update_history:
            self.chain.popleft()

    def _reanchor(self, rnd: Round, merged: torch.Tensor) -> None:
        """Adds sum_i w_i (Theta_now - Theta_{b_i}) / W: each delta anchored at the current fragment."""
        total = sum(c.weight for c in rnd.contributions)
        stale = [c for c in rnd.contributions if c.base_version < rnd.start_version]
        if total <= 0 or not stale:
            return
        update = torch.empty(self.numel)
        for v, header, encoded in self.chain:
            behind = sum(c.weight for c in stale if c.base_version < v)
            if behind > 0:
                merged.add_(codec.decode(encoded, header, update), alpha=behind / total)

    # Pulls -----------------------------------------------------------------------------------

    def wait_for(self, min_version: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while self.version < min_version or self.params is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cv.wait(left)

    def snapshot(self, codec_id: pb.Codec) -> tuple[int, pb.PayloadHeader, torch.Tensor]:
        """(version, header, encoded CPU bytes) of the current parameters, shared by pullers."""
        with self.cv:
            cached = self.snapshots.get(codec_id)
            if cached is not None and cached[0] == self.version:
                return cached
            assert self.params is not None
            header = codec.make_header(codec_id, self.numel)
            buf = codec.encode(self.params, codec_id).cpu()
            snap = (self.version, header, buf)
            self.snapshots[codec_id] = snap
            return snap

    # Durability ------------------------------------------------------------------------------

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        with self.cv:
            assert self.params is not None
            p = f"frag.{self.fid}."
            tensors = {p + "params": self.params.clone()}
            tensors.update({p + "outer." + k: v.clone() for k, v in self.outer.state_dict().items()})
            tensors.update({p + f"chain.{i}": buf.clone() for i, (_, _, buf) in enumerate(self.chain)})
            if self.residual is not None:
                tensors[p + "residual"] = self.residual.clone()
            chain = [[v, h.codec, h.block_size] for v, h, _ in self.chain]
            return tensors, {"version": self.version, "outer": self.cfg.outer, "chain": chain}

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        p = f"frag.{self.fid}."
        self.initialize(tensors[p + "params"], int(meta["version"]))
        outer_prefix = p + "outer."
        if meta.get("outer") == self.cfg.outer:
            self.outer.load_state_dict({k[len(outer_prefix):]: v for k, v in tensors.items() if k.startswith(outer_prefix)})
        else:
            logger.warning("fragment %d: checkpoint has %s outer state, configured %s: starting it fresh", self.fid, meta.get("outer"), self.cfg.outer)
        with self.cv:
            self.residual = tensors.get(p + "residual")
            self.chain = deque(
                (int(v), codec.make_header(int(c), self.numel, int(b) or codec.DEFAULT_BLOCK_SIZE), tensors[p + f"chain.{i}"])
                for i, (v, c, b) in enumerate(meta.get("chain", []))
            )
            while len(self.chain) > self.cfg.update_history:
                self.chain.popleft()

    # Delta pulls -----------------------------------------------------------------------------

    def checksum(self) -> int:
        """crc32 of the current canonical parameters (cached per version)."""
        with self.cv:
            crc = self.checksums.get(self.version)
            if crc is None:
                assert self.params is not None
                crc = framing.checksum(self.params)
                self.checksums = {self.version: crc}
            return crc

    def chain_since(self, have_version: int) -> tuple[int, list[tuple[int, pb.PayloadHeader, torch.Tensor]]] | None:
        """(current version, the kept updates after have_version), or None if some are gone."""
        with self.cv:
            if have_version > self.version:
                return None
            links = [link for link in self.chain if link[0] > have_version]
            if len(links) != self.version - have_version:
                return None
            return self.version, links


class Rounds:
    """Decides when rounds close and closes them on worker threads (never on gRPC threads)."""

    def __init__(self, fragments: list[FragmentState], grace: GraceWindow, metrics: Metrics, goodput: Goodput, live: Callable[[], set[str]], threads: int) -> None:
        self.fragments = fragments
        self.grace = grace
        self.metrics = metrics
        self.goodput = goodput
        self.live = live
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="outer-step")

    def check(self, frag: FragmentState) -> None:
        """Re-evaluates a fragment's open round: close it now, or arm its grace timer."""
        rnd, close_now, quorum = frag.closability(self.live())
        if rnd is None:
            return
        if close_now:
            self._close(frag, rnd)
        elif quorum and rnd.timer is None:
            wait = self.grace.seconds()
            timer = threading.Timer(wait, self._expire, args=(frag, rnd))
            timer.daemon = True
            with frag.lock:
                if rnd.timer is None and not rnd.closing:
                    rnd.timer = timer
                    timer.start()

    def _expire(self, frag: FragmentState, rnd: Round) -> None:
        with frag.lock:
            rnd.expired = True
        self.check(frag)

    def check_all(self) -> None:
        for frag in self.fragments:
            self.check(frag)

    def _close(self, frag: FragmentState, rnd: Round) -> None:
        if not frag.take_round(rnd):
            return
        now = time.monotonic()
        if rnd.quorum_at is not None:
            self.grace.observe(quorum_time=rnd.quorum_at - rnd.opened_at)
        self.metrics.round_wait.observe(now - rnd.opened_at)
        try:
            self.pool.submit(self._apply, frag, rnd)
        except RuntimeError:  # shutting down: the final flush applies it in order instead
            frag.apply(rnd)

    def _apply(self, frag: FragmentState, rnd: Round) -> None:
        try:
            seconds = frag.apply(rnd)
        except Exception:  # a bug here must not kill the worker silently
            logger.exception("outer step of fragment %d round %d failed", frag.fid, rnd.start_version + 1)
            raise
        self.grace.observe(apply_time=seconds)
        self.metrics.round_apply.observe(seconds)
        self.metrics.contributors.observe(len(rnd.contributions))
        self.metrics.outer_steps.inc()
        self.goodput.merged([c.share for c in rnd.contributions])
        logger.debug("fragment %d -> version %d from %d contributions in %.4fs", frag.fid, frag.version, len(rnd.contributions), seconds)
        self.check(frag)  # the next round may have filled up while this one was applied

    def flush(self) -> None:
        """Closes every open round that holds anything (shutdown: merge what was acknowledged)."""
        for frag in self.fragments:
            rnd = frag.round
            if rnd is not None and rnd.contributions:
                self._close(frag, rnd)
        for frag in self.fragments:
            with frag.cv:
                while frag.version < frag.pending_version:
                    frag.cv.wait(1.0)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)
