"""Sharded islands: a contribution that arrives as slices, one per rank, and is merged whole.

A sharded island (FSDP ranks under torchrun) joins as one learner. Each rank holds a slice of
every fragment (runs of its flat vector, `pb.Slice`) and at each sync pushes only that slice,
every rank under the island's one seq. `runs` validates a slice against its fragment, `gather`
reads a slice's runs out of a flat vector (pulls). An `Assembly` gathers the decoded slices of
one (learner, seq) into an FP32 vector of the whole fragment, checking as each arrives that it
agrees with the others and overlaps none of them; `Assemblies` keeps the pending ones. Each
slice's call waits (`Assembly.wait`, bounded by `slice_wait_s`) for the island's other ranks;
when one is missing or a waiting call ends, the assembly fails whole: every waiting slice is
answered ABORTED and nothing of the contribution is applied. The push path
(`synchronizer.pushes`) submits a complete assembly as one FP32 push of the learner.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from protos import diloco_pb2 as pb
from synchronizer.errors import Code, Rejected, invalid

MAX_RANKS = 4096  # ranks of one island
MAX_RUNS = 65536  # runs of one slice
TOUCH_S = 1.0  # a waiting slice's stream is touched this often, so the idle watchdog spares it

Runs = list[tuple[int, int]]  # (start, length) in a fragment's flat vector


def runs(s: pb.Slice, numel: int, ranked: bool = True) -> Runs:
    """The runs of `s` in a fragment of `numel` elements: ascending, disjoint, each of at least
    one element, inside the fragment, at most MAX_RUNS; with `ranked` (a push), also a rank of
    an island of 2..MAX_RANKS. INVALID_ARGUMENT otherwise."""
    if ranked:
        if not 2 <= s.ranks <= MAX_RANKS:
            raise invalid(
                "bad_slice",
                f"slice ranks {s.ranks} must be 2..{MAX_RANKS} (an island of one rank pushes the whole fragment, without a slice)",
            )
        if s.rank >= s.ranks:
            raise invalid("bad_slice", f"slice rank {s.rank} must be below its ranks {s.ranks}")
    if len(s.starts) != len(s.lengths):
        raise invalid(
            "bad_slice",
            f"a slice has {len(s.starts)} starts but {len(s.lengths)} lengths: one of each per run",
        )
    if len(s.starts) > MAX_RUNS:
        raise invalid("bad_slice", f"a slice has {len(s.starts)} runs; at most {MAX_RUNS}")
    out: Runs = []
    end = 0
    for i, (start, length) in enumerate(zip(s.starts, s.lengths, strict=True)):
        if length < 1:
            raise invalid("bad_slice", f"slice run {i} has length 0 (each run holds an element)")
        if start < end:
            raise invalid(
                "bad_slice",
                f"slice run {i} starts at {start}, before the end {end} of the run before it: runs must be ascending and disjoint",
            )
        end = start + length
        if end > numel:
            raise invalid(
                "bad_slice",
                f"slice run {i} ({start}..{end}) runs past the fragment's {numel} elements",
            )
        out.append((start, length))
    return out


def numel_of(slice_runs: Runs) -> int:
    return sum(length for _, length in slice_runs)


def gather(x: torch.Tensor, slice_runs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The elements of `slice_runs` of flat `x`, concatenated (a copy)."""
    if not slice_runs:
        return x.new_empty(0)
    return torch.cat([x[start : start + length] for start, length in slice_runs])


def stream_key(learner_id: str, s: pb.Slice | None) -> str:
    """What a stream counts toward in the per-learner stream limit: each rank of an island is a
    process of its own, with its own pushes and pulls, so each counts as a learner there."""
    if s is None or not 2 <= s.ranks <= MAX_RANKS or s.rank >= s.ranks:
        return learner_id
    return f"{learner_id}#rank{s.rank}"


@dataclass(eq=False)
class Part:
    """One rank's slice of a contribution, and how its waiting call hears of the outcome."""

    rank: int
    runs: Runs
    tokens: int
    steps: int
    compute_s: float
    wake: threading.Event = field(default_factory=threading.Event)
    ended: bool = False  # its call ended (set on gRPC's thread: only a flag and an event)
    replaced: bool = False  # the rank sent its slice again; the later part gets the reply

    def call_ended(self) -> None:
        """The call's end callback: never blocks."""
        self.ended = True
        self.wake.set()


PENDING, CLOSING, DONE = "pending", "closing", "done"


class Assembly:
    """The slices of one (learner, seq) so far, scattered into `buf`: an FP32 vector of the
    whole fragment (as uint8 bytes, the payload of the one push it becomes), with `reserved`
    bytes of the payload budget held for it and `discard` to give both back if it fails."""

    def __init__(
        self,
        key: tuple[str, int],
        h: pb.PushHeader,
        numel: int,
        buf: torch.Tensor,
        reserved: bool,
        discard: Callable[[], None],
        forget: Callable[[Assembly], None],
        ended: Callable[[str], None],
    ) -> None:
        """`discard` gives back `buf` and the reserved bytes, `forget` drops it from the
        pending ones, `ended(outcome)` counts how it ended (once): assembled, refused (the
        submission was), aborted or invalid."""
        self.key = key
        self.fid = h.fragment_id
        self.base_version = h.base_version
        self.ranks = h.slice.ranks
        self.numel = numel
        self.buf = buf
        self.reserved = reserved
        self.values = buf.view(torch.float32)
        self.covered = torch.zeros(numel, dtype=torch.bool)
        self.held = 0  # elements the current parts cover
        self.parts: dict[int, Part] = {}
        self.late: list[Part] = []  # slices that arrived once it was complete or failed
        self.state = PENDING
        self.reply: pb.PushReply | None = None
        self.error: Rejected | None = None
        self.lock = threading.Lock()
        self._discard = discard
        self._forget = forget
        self._ended = ended

    def _what(self) -> str:
        learner_id, seq = self.key
        return f"contribution seq {seq} of island {learner_id!r} to fragment {self.fid}"

    def add(self, h: pb.PushHeader, part: Part, values: torch.Tensor) -> bool:
        """Scatters one rank's decoded slice in (replacing the rank's earlier one); True when
        it completes the contribution (the caller submits it, then calls `finish`). A slice
        that disagrees with the others, or overlaps one, fails the assembly: Rejected."""
        with self.lock:
            if self.state != PENDING:
                self.late.append(part)  # it waits for (or gets) what became of the others
                part.wake.set()
                return False
            if (h.fragment_id, h.base_version, h.slice.ranks) != (
                self.fid,
                self.base_version,
                self.ranks,
            ):
                offence = invalid(
                    "slice_mismatch",
                    f"rank {part.rank}'s slice of seq {h.seq} says fragment {h.fragment_id}, base version {h.base_version}, {h.slice.ranks} ranks; "
                    f"the island's other slices say fragment {self.fid}, base version {self.base_version}, {self.ranks} ranks: nothing was applied",
                )
                self._fail(
                    Rejected(
                        Code.ABORTED,
                        "slice_mismatch",
                        f"{self._what()} was abandoned: rank {part.rank} sent a slice that disagrees with this one; nothing was applied: re-pull and push again",
                    )
                )
                raise offence
            old = self.parts.pop(part.rank, None)
            if old is not None:
                for start, length in old.runs:
                    self.covered[start : start + length] = False
                self.held -= numel_of(old.runs)
                old.replaced = True
                old.wake.set()
            offset = 0
            for start, length in part.runs:
                if bool(self.covered[start : start + length].any()):
                    error = invalid(
                        "slice_overlap",
                        f"the slices of {self._what()} overlap: rank {part.rank}'s run {start}..{start + length} holds elements another rank's slice holds; nothing was applied",
                    )
                    self._fail(error)
                    raise error
                self.covered[start : start + length] = True
                self.values[start : start + length] = values[offset : offset + length]
                offset += length
            self.parts[part.rank] = part
            self.held += offset
            if len(self.parts) < self.ranks:
                return False
            if self.held != self.numel:
                error = invalid(
                    "slice_gap",
                    f"the {self.ranks} slices of {self._what()} cover {self.held} of its {self.numel} elements (they must tile it exactly); nothing was applied",
                )
                self._fail(error)
                raise error
            self.state = CLOSING
            self.covered = torch.empty(0, dtype=torch.bool)  # not needed any more
            return True

    def finish(self, reply: pb.PushReply | None, error: Rejected | None = None) -> None:
        """What became of the submitted contribution: every waiting slice gets it."""
        with self.lock:
            self.reply, self.error = reply, error
            self._done("assembled" if error is None else "refused")

    def fail(self, error: BaseException) -> None:
        """The complete contribution cannot be submitted (`error`): every waiting slice gets it
        (ABORTED unless it is a refusal), and the buffer and reserved bytes are given back."""
        with self.lock:
            self._fail(
                error
                if isinstance(error, Rejected)
                else Rejected(
                    Code.ABORTED,
                    "slice_submit",
                    f"{self._what()} could not be submitted ({error}); re-pull and push again",
                )
            )

    def abandon(self, error: BaseException) -> None:
        """The submission raised something unexpected: the waiting slices are answered
        ABORTED (the push path gave back what the submission held)."""
        self.finish(
            None,
            Rejected(
                Code.ABORTED,
                "slice_submit",
                f"{self._what()} could not be submitted ({error}); re-pull and push again",
            ),
        )

    def wait(self, part: Part, wait_s: float, touch: Callable[[], None]) -> pb.PushReply:
        """Until the contribution is judged (its reply), or it failed, `part`'s call ended or
        `wait_s` passed (both fail it: Rejected). `touch` is called at least every TOUCH_S."""
        deadline = time.monotonic() + wait_s
        while True:
            part.wake.wait(max(0.0, min(TOUCH_S, deadline - time.monotonic())))
            touch()
            with self.lock:
                part.wake.clear()
                if self.state == DONE:
                    if self.error is not None:
                        raise self.error
                    assert self.reply is not None
                    return self.reply
                if self.state == CLOSING:
                    continue  # judged now; its log record bounds the wait (wal_wait_s)
                if part.replaced:
                    raise Rejected(
                        Code.ABORTED,
                        "slice_replaced",
                        f"rank {part.rank} sent its slice of {self._what()} again: the later push gets the reply",
                    )
                if part.ended:
                    self._fail(
                        Rejected(
                            Code.ABORTED,
                            "slice_cancelled",
                            f"{self._what()} was abandoned: rank {part.rank}'s call ended while it waited for {self._missing()}; nothing was applied: re-pull and push again",
                        )
                    )
                elif time.monotonic() >= deadline:
                    self._fail(
                        Rejected(
                            Code.ABORTED,
                            "slice_timeout",
                            f"{self._what()} was abandoned: {self._missing()} did not arrive within slice_wait_s ({wait_s:g} s); nothing was applied: re-pull and push again",
                        )
                    )

    def _missing(self) -> str:
        missing = [r for r in range(self.ranks) if r not in self.parts]
        shown = ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")
        return f"the slices of ranks {shown}" if missing else "no slice"

    def _fail(self, error: Rejected) -> None:
        """(Holding the lock.) Ends the assembly with `error` for every waiting slice and gives
        back its buffer and reserved bytes."""
        self.error = error
        self._done("invalid" if error.code == Code.INVALID_ARGUMENT else "aborted")
        self.covered = torch.empty(0, dtype=torch.bool)
        self._discard()

    def _done(self, outcome: str) -> None:
        self.state = DONE
        self._forget(self)
        self._ended(outcome)
        for p in [*self.parts.values(), *self.late]:
            p.wake.set()


class Assemblies:
    """The pending assemblies, by (learner id, seq)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], Assembly] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def find(self, key: tuple[str, int]) -> Assembly | None:
        with self._lock:
            return self._pending.get(key)

    def open(self, asm: Assembly) -> Assembly:
        """Keeps `asm` pending, unless one of its key is already: then that one (the caller
        discards its own)."""
        with self._lock:
            return self._pending.setdefault(asm.key, asm)

    def forget(self, asm: Assembly) -> None:
        with self._lock:
            if self._pending.get(asm.key) is asm:
                del self._pending[asm.key]
