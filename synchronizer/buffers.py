"""Reusable buffers for pushes, and the budget of payload bytes rounds may hold.

`BufferPool` keeps receive buffers (uint8, by size) and decode buffers (FP32 of the fragment's
size) for reuse up to a byte budget: a fresh 100 MB buffer costs about 30 ms of page faults here,
8x a reuse. `HeldBudget` bounds the encoded payloads a fragment's rounds hold for decoding at the
outer step; past it a push is decoded on arrival instead, so memory stays bounded whatever the
learners do.
"""

from __future__ import annotations

import threading

import torch

# Budgets per fragment, in FP32 copies of the fragment (4 bytes x numel each).
POOL_FP32_COPIES = 2  # buffers pooled for reuse
HELD_FP32_COPIES = 2  # encoded payloads rounds hold for the outer step


class BufferPool:
    def __init__(self, numel: int, budget_bytes: int) -> None:
        self.numel = numel
        self.budget_bytes = budget_bytes
        self.pooled_bytes = 0
        self._free: dict[int, list[torch.Tensor]] = {}  # by size; -1: FP32 decode buffers
        self._lock = threading.Lock()

    def take(self, nbytes: int | None = None) -> torch.Tensor:
        """A buffer for one push: FP32 of the fragment's size (decoding), or uint8 of `nbytes`
        (receiving); pooled when one is free, else fresh."""
        key = -1 if nbytes is None else nbytes
        with self._lock:
            pool = self._free.get(key)
            if pool:
                buf = pool.pop()
                self.pooled_bytes -= buf.nbytes
                return buf
        if nbytes is None:
            return torch.empty(self.numel, dtype=torch.float32)
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        """Returns a buffer for reuse (dropped when the pool is at its budget)."""
        key = -1 if buf.dtype == torch.float32 else buf.numel()
        with self._lock:
            if self.pooled_bytes + buf.nbytes <= self.budget_bytes:
                self._free.setdefault(key, []).append(buf)
                self.pooled_bytes += buf.nbytes


class HeldBudget:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.held_bytes = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> bool:
        """Claims room to hold a payload of `nbytes` until the outer step (False: decode it now)."""
        with self._lock:
            if self.held_bytes + nbytes > self.budget_bytes:
                return False
            self.held_bytes += nbytes
            return True

    def claim(self, nbytes: int) -> None:
        """Counts a payload held whatever the budget (a replayed round holds what it held)."""
        with self._lock:
            self.held_bytes += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.held_bytes -= nbytes
