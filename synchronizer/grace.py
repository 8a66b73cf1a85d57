"""The adaptive grace window: how long a round that reached its quorum may wait for more.

Decoupled DiLoCo: waiting is free while the learners are still training on what they have, so
grace = gamma * (tau * step_time - quorum_time - apply_time), from exponential moving averages of
the learners' step time (heartbeats), the time rounds take to reach their quorum and the time an
outer step takes, capped by `grace_max_s`. `fixed` waits `grace_max_s`, `none` not at all.
"""

from __future__ import annotations

import threading

from synchronizer.config import SynchronizerConfig


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

    def observe(
        self,
        step_time: float = 0.0,
        quorum_time: float = -1.0,
        apply_time: float = -1.0,
        overlap_steps: int = 0,
    ) -> None:
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
