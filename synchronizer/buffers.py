"""The Synchronizer-wide buffers of the push path: encoded payloads, and the outer steps' FP32.

`Payloads` keeps the encoded pushes of every fragment within one byte budget
(`payload_budget_bytes`): the payloads rounds hold for decoding at the outer step, and the
receive buffers pooled for reuse (by size: a fresh 100 MB buffer costs about 30 ms of page faults
here, 8x a reuse). Past the budget a push is added to its round on arrival instead, so memory
stays bounded whatever the learners do, and a round can always close.

`Fp32Buffers` lends FP32 buffers of the largest fragment's size to the outer steps (a round's
sums, and radial merging's decode buffer): a round takes one when it starts adding and gives it
back when its outer step ends, so the model holds `apply_threads` of them, not one or two per
fragment. A round that must add on arrival (the payload budget is full) takes one while it is
open; when none is free a buffer is allocated beyond the pool and counted.

`Snapshots` bounds the full-pull snapshots alive at once (`snapshot_budget_bytes`): a full pull
streams a consistent encoded copy of its fragment, shared by every puller of that version and
freed when the last of them ends; one more that does not fit waits for one to end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

AUTO_PAYLOAD_MIN_BYTES = 256 << 20  # payload_budget_bytes 0: at least this
AUTO_PAYLOAD_FP32_SHARE = 1  # payload_budget_bytes 0: the largest fragment's FP32 bytes
AUTO_SNAPSHOT_FP32_SHARE = 1  # snapshot_budget_bytes 0: the largest fragment's FP32 bytes


def payload_budget(budget_bytes: int, largest_numel: int) -> int:
    """The payload budget in bytes: `budget_bytes`, or (0) the automatic one."""
    if budget_bytes:
        return budget_bytes
    return max(AUTO_PAYLOAD_MIN_BYTES, AUTO_PAYLOAD_FP32_SHARE * 4 * largest_numel)


class Payloads:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.held_bytes = 0  # payloads rounds hold for their outer step
        self.pooled_bytes = 0  # free receive buffers kept for reuse
        self._free: dict[int, list[torch.Tensor]] = {}  # by size, oldest first
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified when held bytes are released

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of `nbytes` to receive one push into: pooled when one is free."""
        with self._lock:
            pool = self._free.get(nbytes)
            if pool:
                self.pooled_bytes -= nbytes
                return pool.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        """Returns a receive buffer for reuse; dropped where held and pooled payloads would go
        past the budget."""
        with self._lock:
            if self.held_bytes + self.pooled_bytes + buf.nbytes <= self.budget_bytes:
                self._free.setdefault(buf.numel(), []).append(buf)
                self.pooled_bytes += buf.nbytes

    def reserve(self, nbytes: int) -> bool:
        """Claims room to hold a payload of `nbytes` until the outer step (False: add it now).
        Pooled buffers make way for it."""
        with self._lock:
            if self.held_bytes + nbytes > self.budget_bytes:
                return False
            self.held_bytes += nbytes
            self._trim()
            return True

    def claim(self, nbytes: int) -> None:
        """Counts a payload held whatever the budget (a replayed round holds what it held)."""
        with self._lock:
            self.held_bytes += nbytes
            self._trim()

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.held_bytes -= nbytes
            self._room.notify_all()

    def wait_reserve(self, nbytes: int, timeout_s: float) -> bool:
        """`reserve`, waiting up to timeout_s for held payloads to be released."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self.held_bytes + nbytes > self.budget_bytes:
                left = deadline - time.monotonic()
                if left <= 0 or not self._room.wait(left):
                    return False
            self.held_bytes += nbytes
            self._trim()
            return True

    def _trim(self) -> None:
        """Drops pooled buffers, largest sizes first, until held and pooled fit the budget."""
        for size in sorted(self._free, reverse=True):
            pool = self._free[size]
            while pool and self.held_bytes + self.pooled_bytes > self.budget_bytes:
                self.pooled_bytes -= pool.pop(0).nbytes
            if not pool:
                del self._free[size]


class Fp32Buffers:
    def __init__(self, numel: int, keep: int, beyond: Callable[[], None] = lambda: None) -> None:
        """`numel`: the largest fragment's; `keep`: buffers kept for reuse (the outer steps
        that run at once, times the buffers each takes); `beyond` is called for every buffer
        allocated past `keep`."""
        self.numel = numel
        self.keep = keep
        self.live = 0  # buffers allocated and not dropped: lent or free
        self._beyond = beyond
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self) -> torch.Tensor:
        """A flat FP32 buffer of `numel` elements (its contents are garbage)."""
        with self._lock:
            if self._free:
                return self._free.pop()
            self.live += 1
            beyond = self.live > self.keep
        if beyond:
            self._beyond()
        return torch.empty(self.numel, dtype=torch.float32)

    def give(self, buf: torch.Tensor) -> None:
        """Takes a buffer back: kept while no more than `keep` are alive, else dropped."""
        with self._lock:
            if self.live > self.keep:
                self.live -= 1
            else:
                self._free.append(buf)


def fp32_kept(apply_threads: int, merge: str) -> int:
    """FP32 buffers the outer steps keep: one per apply thread for a round's sums, and one more
    for radial merging's decode buffer."""
    return apply_threads * (2 if merge == "radial" else 1)


def snapshot_budget(budget_bytes: int, largest_numel: int) -> int:
    """The full-pull snapshot budget in bytes: `budget_bytes`, or (0) the automatic one."""
    return budget_bytes or AUTO_SNAPSHOT_FP32_SHARE * 4 * largest_numel


class Snapshots:
    """Bytes of full-pull snapshots alive at once, within a budget. One snapshot is always
    allowed when none is alive, so a budget below a fragment's size slows full pulls down to
    one at a time but never stops them."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.alive_bytes = 0
        self._cv = threading.Condition()

    def try_reserve(self, nbytes: int) -> bool:
        with self._cv:
            if self.alive_bytes and self.alive_bytes + nbytes > self.budget_bytes:
                return False
            self.alive_bytes += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._cv:
            self.alive_bytes -= nbytes
            self._cv.notify_all()

    def wait(self, timeout_s: float) -> None:
        """Until a snapshot is freed, or timeout_s."""
        with self._cv:
            self._cv.wait(max(0.0, timeout_s))
