"""Power cuts at the `Disk` seam: a recording disk, and a Synchronizer run through many cuts.

`RecordingDisk` passes every file operation to the real filesystem (the page cache, as a running
process sees it) and keeps, beside it, what a power cut would leave: each file's bytes as of its
last fsync and the writes since, each directory's entries as of its last fsync and the creates,
renames and unlinks since. At an armed operation the power goes: that operation and every later
one raise `PowerCut`. `RecordingDisk.cut` then rewrites the state directory as the disk would
find it at the next boot: every unsynced byte and directory entry dropped ("drop"), or a prefix
of each file's and directory's unsynced operations kept with the last write torn at a random
byte ("torn").

`run_cuts` drives an in-process Synchronizer core (no gRPC, a manual clock, outer steps on the
pushing thread) with three learners pushing two fragments and checkpoints taken while they push,
cuts the power at a random operation of a chosen kind (a push's group commit, a checkpoint's
write, a log rotation, a release of old segments, or any), restarts on what is left, and checks:

- every push answered ACCEPTED (or DUPLICATE) is still held: its retry is answered DUPLICATE, and
  its record was in the log (a retry answered DUPLICATE for a push never logged is a loss);
- no fragment is served at a version lower than one served before, and a version served again
  has the same contents;
- the epoch is unchanged once the model was initialised, and every learner whose Join was
  answered re-joins as itself.

The suite runs a few dozen cuts; `python -m bench.durability --power-cuts N` runs N.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from protos import diloco_pb2 as pb
from protos.initmodel import init_model_requests
from synchronizer import walformat
from synchronizer.clock import ManualClock
from synchronizer.config import SynchronizerConfig
from synchronizer.core import Synchronizer
from synchronizer.disk import Disk
from synchronizer.errors import Rejected
from synchronizer.metrics import Metrics
from tests.helpers import pulled, push_header, push_messages, small_spec


class PowerCut(OSError):
    """The power is off: nothing reaches the disk any more."""

    def __init__(self) -> None:
        super().__init__(errno.EIO, "power cut")


# The recording disk -----------------------------------------------------------------------------


@dataclass
class _File:
    durable: bytes = b""
    pending: list[tuple[int, bytes] | int] = field(default_factory=list)  # (offset, data) | size
    log: bool = False  # a write-ahead log segment
    released: bool = False  # a segment unlinked: what it had made durable was held until then


@dataclass
class _Dir:
    durable: dict[str, _Node] = field(default_factory=dict)
    entries: dict[str, _Node] = field(default_factory=dict)
    # ("link", name, node) | ("unlink", name) | ("rename", src, dst): applied in this order
    pending: list[tuple[Any, ...]] = field(default_factory=list)


_Node = _File | _Dir

GROUPS = ("commit", "checkpoint", "rotation", "release", "any")


class RecordingDisk(Disk):
    """The real filesystem under `root`, plus what a power cut would leave of it."""

    def __init__(self, root: Path, tree: _Dir | None = None) -> None:
        self.root = root
        self.tree = tree or _Dir()
        self.lock = threading.Lock()
        self.fds: dict[int, tuple[_File, Path, int]] = {}  # fd -> file, path, position
        self.off = threading.Event()
        self.armed: tuple[str, int] | None = None  # (group, operations of it left before the cut)
        self.cut_at = ""  # the operation the power went at
        self.counts: Counter[str] = Counter()
        self.log_files: list[_File] = []  # every segment this disk created
        # the pushes reused segments had made durable before their files were written over
        self.reused_logged: set[tuple[str, int]] = set()
        self.last_log_op = ""

    # Arming ------------------------------------------------------------------------------

    def arm(self, group: str, n: int) -> None:
        """The power goes at the `n`-th operation of `group` (see `GROUPS`) from now."""
        with self.lock:
            self.armed = (group, n)

    def power_off(self, what: str = "idle") -> None:
        with self.lock:
            if not self.off.is_set():
                self.cut_at = what
                self.off.set()

    def _op(self, kind: str, path: Path) -> None:
        """Counts an operation; raises PowerCut when it is the armed one, or the power is off."""
        if self.off.is_set():
            raise PowerCut()
        in_log = path.parent.name == "wal" or path.name == "wal"
        if in_log:
            if kind == "fsync_dir":
                group = "rotation" if self.last_log_op in ("open", "reuse", "mkdir") else "release"
            else:
                group = {
                    "open": "rotation",
                    "reuse": "rotation",
                    "mkdir": "rotation",
                    "unlink": "release",
                    "rename": "release",
                }.get(kind, "commit")
            self.last_log_op = kind
        elif path.name.startswith(("ckpt-", ".tmp-ckpt-")) or kind == "fsync_dir":
            group = "checkpoint"
        else:
            group = "startup"
        self.counts[group] += 1
        if self.armed is not None and self.armed[0] in (group, "any"):
            left = self.armed[1] - 1
            self.armed = (self.armed[0], left)
            if left <= 0:
                self.cut_at = f"{group}: {kind} {path.name}"
                self.armed = None
                self.off.set()
                raise PowerCut()

    # The model ---------------------------------------------------------------------------

    def _dir(self, path: Path) -> _Dir:
        node: _Node = self.tree
        for part in path.relative_to(self.root).parts:
            assert isinstance(node, _Dir)
            node = node.entries[part]
        assert isinstance(node, _Dir), f"{path} is not a directory"
        return node

    def _link(self, path: Path, node: _Node) -> None:
        d = self._dir(path.parent)
        d.entries[path.name] = node
        d.pending.append(("link", path.name, node))

    # Disk ----------------------------------------------------------------------------------

    def open(self, path: Path) -> int:
        with self.lock:
            self._op("open", path)
            existed = path.exists()
            fd = super().open(path)
            if existed:
                f = self._dir(path.parent).entries[path.name]
                assert isinstance(f, _File)
            else:
                f = _File(log=path.parent.name == "wal")
                self._link(path, f)
                if f.log:
                    self.log_files.append(f)
            self.fds[fd] = (f, path, os.fstat(fd).st_size)
            return fd

    def reuse(self, old: Path, path: Path) -> int:
        assert old.parent == path.parent, "renames stay in one directory"
        with self.lock:
            self._op("reuse", path)
            fd = super().reuse(old, path)
            f = self._renamed(old, path)
            assert isinstance(f, _File)
            self.reused_logged |= _pushes_in(f.durable)
            self.fds[fd] = (f, path, 0)
            return fd

    def create(self, path: Path) -> int:
        with self.lock:
            self._op("create", path)
            fd = super().create(path)
            f = _File()
            self._link(path, f)
            self.fds[fd] = (f, path, 0)
            return fd

    def write(self, fd: int, data: bytes | memoryview) -> int:
        with self.lock:
            f, path, at = self.fds[fd]
            self._op("write", path)
            n = super().write(fd, data)
            f.pending.append((at, bytes(memoryview(data)[:n])))
            self.fds[fd] = (f, path, at + n)
            return n

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        with self.lock:
            f, path, _ = self.fds[fd]
            self._op("write", path)
            n = super().pwrite(fd, data, offset)
            f.pending.append((offset, bytes(memoryview(data)[:n])))
            return n

    def fsync(self, fd: int) -> None:
        with self.lock:
            f, path, _ = self.fds[fd]
            self._op("fsync", path)
            f.durable = _apply(f.durable, f.pending)
            f.pending.clear()

    def truncate(self, fd: int, size: int) -> None:
        with self.lock:
            f, path, at = self.fds[fd]
            self._op("truncate", path)
            super().truncate(fd, size)
            f.pending.append(size)
            self.fds[fd] = (f, path, min(at, size))

    def close(self, fd: int) -> None:
        with self.lock:
            _, path, _ = self.fds[fd]
            self._op("close", path)
            del self.fds[fd]
            super().close(fd)

    def replace(self, src: Path, dst: Path) -> None:
        assert src.parent == dst.parent, "renames stay in one directory"
        with self.lock:
            self._op("rename", dst)
            super().replace(src, dst)
            self._renamed(src, dst)

    def _renamed(self, src: Path, dst: Path) -> _Node:
        """The model's side of a rename in one directory (under the lock): the moved node."""
        d = self._dir(src.parent)
        node = d.entries[dst.name] = d.entries.pop(src.name)
        d.pending.append(("rename", src.name, dst.name))
        return node

    def unlink(self, path: Path) -> None:
        with self.lock:
            self._op("unlink", path)
            super().unlink(path)
            d = self._dir(path.parent)
            if path.name in d.entries:
                node = d.entries.pop(path.name)
                if isinstance(node, _File) and node.log:
                    node.released = True
                d.pending.append(("unlink", path.name))

    def mkdir(self, path: Path) -> None:
        with self.lock:
            missing = []
            at = path
            while not at.exists():
                missing.append(at)
                at = at.parent
            for new in reversed(missing):
                self._op("mkdir", new)
                new.mkdir()
                self._link(new, _Dir())

    def fsync_dir(self, path: Path) -> None:
        with self.lock:
            self._op("fsync_dir", path)
            d = self._dir(path)
            d.durable = dict(d.entries)
            d.pending.clear()

    # The cut -------------------------------------------------------------------------------

    def cut(self, rng: random.Random, mode: str) -> tuple[RecordingDisk, set[tuple[str, int]]]:
        """Turns the power off (if it is not already), closes what the process left open,
        rewrites `root` as the disk would find it at the next boot (`mode` "drop" or "torn")
        and returns a fresh disk on it, with the (learner id, seq) of every push the log held:
        what survived, and what a segment deleted since had made durable."""
        self.power_off()
        with self.lock:
            for fd in list(self.fds):
                os.close(fd)
            self.fds.clear()
            survived = _survive(self.tree, rng, mode)
            logged = set(self.reused_logged)
            for f in self.log_files:
                if f.released:
                    logged |= _pushes_in(f.durable)
            for root, d in _walk(survived, self.root):
                for node in d.durable.values():
                    if isinstance(node, _File) and root.name == "wal":
                        logged |= _pushes_in(node.durable)
            for child in self.root.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
            _write_tree(survived, self.root)
        fresh = RecordingDisk(self.root, survived)
        for root, d in _walk(survived, self.root):
            if root.name == "wal":
                fresh.log_files += [n for n in d.entries.values() if isinstance(n, _File)]
        return fresh, logged


def _apply(data: bytes, ops: list[tuple[int, bytes] | int]) -> bytes:
    out = bytearray(data)
    for op in ops:
        if isinstance(op, int):
            del out[op:]
            continue
        at, chunk = op
        if len(out) < at:
            out.extend(bytes(at - len(out)))
        out[at : at + len(chunk)] = chunk
    return bytes(out)


def _survive(d: _Dir, rng: random.Random, mode: str) -> _Dir:
    """What a directory (and everything under it) holds after the power cut: every node's
    durable state plus, in "torn" mode, a random prefix of its unsynced operations."""
    entries = dict(d.durable)
    keep = rng.randint(0, len(d.pending)) if mode == "torn" else 0
    for op in d.pending[:keep]:
        if op[0] == "link":
            entries[op[1]] = op[2]
        elif op[0] == "unlink":
            entries.pop(op[1], None)
        elif op[1] in entries:  # a rename whose source's creation was not kept moves nothing
            entries[op[2]] = entries.pop(op[1])
    out = _Dir()
    for name, node in entries.items():
        if isinstance(node, _Dir):
            out.entries[name] = _survive(node, rng, mode)
        else:
            data = node.durable
            if mode == "torn" and node.pending:
                kept = rng.randint(0, len(node.pending))
                data = _apply(data, node.pending[:kept])
                if kept < len(node.pending):  # the next write torn at a random byte
                    torn = node.pending[kept]
                    if not isinstance(torn, int):
                        at, chunk = torn
                        data = _apply(data, [(at, chunk[: rng.randint(0, len(chunk))])])
            out.entries[name] = _File(durable=data, log=node.log)
    out.durable = dict(out.entries)
    return out


def _walk(d: _Dir, path: Path) -> list[tuple[Path, _Dir]]:
    found = [(path, d)]
    for name, node in d.entries.items():
        if isinstance(node, _Dir):
            found += _walk(node, path / name)
    return found


def _write_tree(d: _Dir, path: Path) -> None:
    for name, node in d.entries.items():
        if isinstance(node, _Dir):
            (path / name).mkdir()
            _write_tree(node, path / name)
        else:
            (path / name).write_bytes(node.durable)


def _pushes_in(segment: bytes) -> set[tuple[str, int]]:
    return {
        (str(r.meta["learner_id"]), int(r.meta["seq"]))
        for r in walformat.records_of(segment)
        if r.kind == walformat.PUSH
    }


# The run ----------------------------------------------------------------------------------------

SPEC = small_spec((12_000, 8_000, 10_000, 10_000), fragments=2)  # ~80 KB pushes of FP32
SETTINGS: dict[str, Any] = {
    "checkpoint_interval_s": 0,
    "wal": True,
    "wal_segment_bytes": 1 << 20,  # a rotation every dozen pushes or so
    "wal_wait_s": 30.0,
    "keep_checkpoints": 2,
    "lease_s": 120.0,
    "max_norm_ratio": 0,
    "quorum": 2,
    "grace": "none",
}
LEARNERS = 3
PUSHES = 8  # per learner and life
CHECKPOINTS = 2  # per life, taken while the learners push
# Operations of each group in one life, about: the cut falls on one of them.
TYPICAL = {"commit": 85, "checkpoint": 38, "rotation": 5, "release": 4, "any": 135}


class Violation(AssertionError):
    pass


@dataclass
class Learner:
    name: str
    learner_id: str = ""
    session: str = ""
    joined: bool = False  # its Join was answered
    seq: int = 0
    versions: dict[int, int] = field(default_factory=dict)
    in_flight: dict[int, int] = field(default_factory=dict)  # seq -> fragment, no answer yet


@dataclass
class Report:
    cuts: int = 0
    restarts: int = 0
    by_group: Counter[str] = field(default_factory=Counter)
    by_mode: Counter[str] = field(default_factory=Counter)
    acked: int = 0  # pushes answered ACCEPTED before a cut
    duplicates: int = 0  # retries of acknowledged pushes answered DUPLICATE
    unanswered_held: int = 0  # pushes cut before their answer, held after the restart
    unanswered_redone: int = 0  # ... not held, accepted on their retry
    versions_checked: int = 0  # (fragment, version) served again and compared
    served: int = 0  # versions served
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, other: Report) -> None:
        for name in (
            "cuts",
            "restarts",
            "acked",
            "duplicates",
            "unanswered_held",
            "unanswered_redone",
            "versions_checked",
            "served",
            "seconds",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.by_group.update(other.by_group)
        self.by_mode.update(other.by_mode)
        self.violations += other.violations

    def summary(self) -> str:
        groups = ", ".join(f"{g} {n}" for g, n in sorted(self.by_group.items()))
        modes = ", ".join(f"{m} {n}" for m, n in sorted(self.by_mode.items()))
        return "\n".join(
            [
                f"power cuts: {self.cuts} ({groups}; {modes}), {self.restarts} restarts, {self.seconds:.1f} s",
                f"pushes acknowledged before a cut: {self.acked}; their retries answered DUPLICATE: {self.duplicates}",
                f"pushes cut before their answer: {self.unanswered_held} held, {self.unanswered_redone} accepted again on retry",
                f"versions served: {self.served}; served again after a restart and compared: {self.versions_checked}",
                f"violations: {len(self.violations)}"
                + "".join(f"\n  - {v}" for v in self.violations[:20]),
            ]
        )


def delta(learner_id: str, seq: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{learner_id}/{seq}".encode()))
    return torch.randn(numel, generator=g) * 1e-2


class Life:
    """One run of the Synchronizer between two power cuts."""

    def __init__(self, state_dir: Path, disk: RecordingDisk, clock: ManualClock) -> None:
        cfg = SynchronizerConfig(state_dir=state_dir, **SETTINGS)
        self.disk = disk
        self.core = Synchronizer(
            cfg, Metrics(CollectorRegistry()), disk=disk, clock=clock, inline_outer_steps=True
        )
        self.core.start(housekeeping=False)
        # The moment the power goes, whatever waits on the log is woken and its writer stopped.
        self.watcher = threading.Thread(target=self._stop_at_cut, name="power-watcher")
        self.watcher.start()

    def _stop_at_cut(self) -> None:
        self.disk.off.wait()
        self.core.stopping.set()
        self.core.journal.close()

    def end(self) -> None:
        """The power goes now, if it has not yet."""
        self.disk.power_off()
        self.watcher.join()

    def join(self, learner: Learner) -> pb.JoinReply:
        reply = self.core.join(
            pb.JoinRequest(
                learner_name=learner.name,
                spec=SPEC.to_proto(),
                learner_id=learner.learner_id,
                session=learner.session,
            )
        )
        learner.learner_id, learner.session = reply.learner_id, reply.session
        learner.seq = max(learner.seq, reply.next_seq - 1)
        return reply

    def push(self, learner: Learner, fid: int, seq: int, base: int) -> pb.PushReply:
        numel = SPEC.fragments[fid].numel
        h, buf = push_header(
            learner.learner_id,
            learner.session,
            SPEC,
            fid,
            delta(learner.learner_id, seq, numel),
            pb.CODEC_FP32,
            base,
            seq,
        )
        return self.core.push(push_messages(h, buf, 1 << 16))

    def pull(self, learner: Learner, fid: int) -> tuple[int, torch.Tensor]:
        return pulled(
            self.core.pull(
                pb.PullRequest(
                    learner_id=learner.learner_id, session=learner.session, fragment_id=fid
                )
            )
        )


class PowerCuts:
    """The learners' view across lives, and the checks made after each restart."""

    def __init__(self, state_dir: Path, seed: int) -> None:
        self.state_dir = state_dir
        self.rng = random.Random(seed)
        self.clock = ManualClock()
        self.report = Report()
        self.learners = [Learner(f"learner-{i}") for i in range(LEARNERS)]
        self.acked: dict[tuple[str, int], int] = {}  # (learner id, seq) -> fragment
        self.earlier: dict[tuple[str, int], int] = {}  # acknowledged and checked after a cut
        self.contents: dict[tuple[int, int], int] = {}  # (fragment, version) -> crc32 served
        self.highest: dict[int, int] = {}  # fragment -> highest version served
        self.floor: dict[int, int] = {}  # fragment -> highest version served before the last cut
        self.epoch = ""  # once the model was initialised
        self.initialized = False  # InitModel answered
        self.logged: set[tuple[str, int]] = set()
        self.last_cut = "none"
        self.lock = threading.Lock()

    def violation(self, what: str) -> None:
        with self.lock:
            self.report.violations.append(f"{what} (after the cut at {self.last_cut})")

    def served(self, fid: int, version: int, params: torch.Tensor) -> None:
        crc = zlib.crc32(params.numpy().tobytes())
        with self.lock:
            self.report.served += 1
            # Pulls of one life run concurrently: one may serve a version while another is
            # already served its successor. What the cut must never undo is a version served
            # in an earlier life.
            if version < self.floor.get(fid, 0):
                self.report.violations.append(
                    f"fragment {fid} served at version {version} after {self.floor[fid]} (after the cut at {self.last_cut})"
                )
            self.highest[fid] = max(self.highest.get(fid, 0), version)
            seen = self.contents.setdefault((fid, version), crc)
            if seen != crc:
                self.report.violations.append(
                    f"fragment {fid} version {version} served with other contents (after the cut at {self.last_cut})"
                )

    # One life ------------------------------------------------------------------------------

    def start(self, disk: RecordingDisk) -> Life:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        return Life(self.state_dir, disk, self.clock)

    def setup(self, life: Life) -> None:
        """Joins (or re-joins) every learner and initialises the model when it needs it."""
        for learner in self.learners:
            if learner.joined:
                session = learner.session
                try:
                    life.join(learner)
                except Rejected as e:
                    if not life.disk.off.is_set():
                        self.violation(f"{learner.name} cannot re-join as itself: {e.message}")
                    raise
                if learner.session != session:
                    self.violation(
                        f"{learner.name} re-joined under a new session: its Join was lost"
                    )
            else:
                learner.learner_id = learner.session = ""
                life.join(learner)
                learner.joined = True
        reply = life.core.status()
        if self.epoch and reply.server_epoch != self.epoch:
            self.violation(f"epoch {self.epoch} came back as {reply.server_epoch}")
        if reply.initialized:
            self.epoch = reply.server_epoch
            return
        if self.initialized:
            self.violation("an initialised model came back uninitialised")
        first = self.learners[0]
        flats = [torch.zeros(f.numel) for f in SPEC.fragments]
        life.core.init_model(
            init_model_requests(first.learner_id, first.session, SPEC.spec_hash, flats, 1 << 16)
        )
        self.initialized = True
        self.epoch = life.core.epoch

    def check(self, life: Life) -> None:
        """After a restart: versions, contents, and every push answered before the cut."""
        for fid in range(len(SPEC.fragments)):
            version, params = life.pull(self.learners[0], fid)
            if (fid, version) in self.contents:
                self.report.versions_checked += 1
            self.served(fid, version, params)
        # Every push acknowledged since the last restart, and a sample of those checked before.
        sample = self.rng.sample(sorted(self.earlier), min(len(self.earlier), 6))
        retry = {**{key: self.earlier[key] for key in sample}, **self.acked}
        for learner in self.learners:
            for (lid, seq), fid in sorted(retry.items()):
                if lid != learner.learner_id:
                    continue
                reply = life.push(learner, fid, seq, self.highest.get(fid, 0))
                if reply.outcome == pb.PUSH_DUPLICATE:
                    self.report.duplicates += 1
                else:
                    self.violation(
                        f"push {lid}/{seq} was acknowledged; its retry is answered {pb.PushOutcome.Name(reply.outcome)}"
                    )
            for seq, fid in sorted(learner.in_flight.items()):
                reply = life.push(learner, fid, seq, self.highest.get(fid, 0))
                if reply.outcome == pb.PUSH_DUPLICATE:
                    self.report.unanswered_held += 1
                    if (learner.learner_id, seq) not in self.logged:
                        self.violation(
                            f"push {learner.learner_id}/{seq} (cut before its answer) is answered DUPLICATE but was never logged: lost"
                        )
                elif reply.outcome == pb.PUSH_ACCEPTED:
                    self.report.unanswered_redone += 1
                    self.acked[(learner.learner_id, seq)] = fid
            learner.in_flight.clear()
        self.earlier.update(self.acked)
        self.acked.clear()

    def work(self, life: Life) -> None:
        """The learners push and pull while checkpoints are taken, until done or the power goes."""
        pushed = threading.Semaphore(0)

        def learner_loop(learner: Learner) -> None:
            for i in range(PUSHES):
                if life.disk.off.is_set():
                    return
                fid = (i + int(learner.name[-1])) % len(SPEC.fragments)
                learner.seq += 1
                seq = learner.seq
                learner.in_flight[seq] = fid
                try:
                    reply = life.push(learner, fid, seq, learner.versions.get(fid, 0))
                    if reply.outcome in (pb.PUSH_ACCEPTED, pb.PUSH_DUPLICATE):
                        with self.lock:
                            self.acked[(learner.learner_id, seq)] = fid
                            self.report.acked += 1
                    del learner.in_flight[seq]
                    version, params = life.pull(learner, fid)
                    learner.versions[fid] = version
                    self.served(fid, version, params)
                except Exception as e:  # noqa: BLE001 - after the cut anything may fail
                    if not life.disk.off.is_set():
                        self.violation(f"{learner.name}: {type(e).__name__}: {e}")
                    return
                finally:
                    pushed.release()

        threads = [threading.Thread(target=learner_loop, args=(lr,)) for lr in self.learners]
        for t in threads:
            t.start()

        def running() -> bool:
            return any(t.is_alive() for t in threads) and not life.disk.off.is_set()

        every = LEARNERS * PUSHES // (CHECKPOINTS + 1)
        for _ in range(CHECKPOINTS):
            done = 0
            while done < every and running():
                done += pushed.acquire(timeout=0.5)
            if not running():
                break
            life.core.save_checkpoint()
        while running():
            pushed.acquire(timeout=0.5)
        life.end()  # the power goes at the armed operation, or now if none was reached
        for t in threads:
            t.join()

    # The chain -----------------------------------------------------------------------------

    def run(self, cuts: int) -> Report:
        t0 = time.perf_counter()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        disk = RecordingDisk(self.state_dir)
        for _ in range(cuts):
            group = self.rng.choice(GROUPS)
            disk.arm(group, self.rng.randint(1, TYPICAL[group]))
            life: Life | None = None
            try:
                life = self.start(disk)
                self.setup(life)
                if self.report.cuts:
                    self.check(life)
                self.work(life)
            except Exception as e:  # noqa: BLE001 - the power went during start or the checks
                if not disk.off.is_set():
                    raise
                logging.getLogger(__name__).debug("power cut during start-up: %s", e)
            disk.power_off()
            if life is not None:
                life.end()
            mode = self.rng.choice(("drop", "torn"))
            self.report.cuts += 1
            self.report.by_group[disk.cut_at.split(":")[0]] += 1
            self.report.by_mode[mode] += 1
            self.last_cut = f"{disk.cut_at}, {mode}"
            self.floor = dict(self.highest)
            disk, logged = disk.cut(self.rng, mode)
            self.logged |= logged
            self.report.restarts += 1
        life = self.start(disk)
        self.setup(life)
        self.check(life)
        life.end()
        self.report.seconds = time.perf_counter() - t0
        return self.report


def run_cuts(workdir: Path, cuts: int, seed: int = 0, chain: int = 50) -> Report:
    """`cuts` power cuts, in chains of up to `chain` restarts each on a fresh state directory
    under `workdir` (so cuts while the first checkpoint is written come up too); the report of
    what was checked."""
    quiet: list[tuple[logging.Logger, int]] = []
    for name in ("synchronizer", "tests.powercut"):
        log = logging.getLogger(name)
        quiet.append((log, log.level))
        log.setLevel(logging.CRITICAL)
    report = Report()
    try:
        for i, start in enumerate(range(0, cuts, chain)):
            state_dir = workdir / f"state-{i}"
            report.add(PowerCuts(state_dir, seed * 1_000_003 + i).run(min(chain, cuts - start)))
            shutil.rmtree(state_dir, ignore_errors=True)
    finally:
        for log, level in quiet:
            log.setLevel(level)
    return report
