"""The Synchronizer's side of the write-ahead log: which decisions are logged, how a restart
replays them, and what the server epoch means.

Logged, each before it is acknowledged: a Join (the learner, its session hash), an accepted
push (payload as received, learner, seq, base version, counts, the weight it was merged with, the
version of its round) and a round closing into a version (`synchronizer.wal`). The outer step of
a round waits until its ROUND record is durable, so no version is ever served that a restart
could not compute again.

Restart = checkpoint + replay: pushes and rounds the checkpoint already holds are skipped; every
other logged push is added to its round in the logged order with its logged weight, and every
logged round is applied, so each version comes back with the same contents (outer steps are
deterministic for fixed settings: the codec and `compute_threads`, which are kept in
`state_dir/epoch.json`). Pushes of a round that was still open stay in it, acknowledged, and the
duplicate table answers their retries with PUSH_DUPLICATE.

The epoch names a history of versions: it changes only when that history is lost (a new state
directory, the log turned off, or replay settings that differ from the ones it was written
with). Learners that see the same epoch after a restart keep what they hold.
"""

from __future__ import annotations

import base64
import json
import logging
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from protos import diloco_pb2 as pb
from synchronizer import native
from synchronizer.admission import Verdict
from synchronizer.config import SynchronizerConfig
from synchronizer.crc import crc32
from synchronizer.disk import Disk
from synchronizer.errors import Code, Rejected
from synchronizer.leases import Registry
from synchronizer.metrics import Metrics
from synchronizer.outer import FUSED_SGD
from synchronizer.records import LearnerRecord
from synchronizer.wal import Wal, WalError
from synchronizer.walformat import ABANDON, JOIN, PART, PUSH, ROUND, Record

if TYPE_CHECKING:
    from synchronizer.fragments import Fragment
    from synchronizer.goodput import Goodput
    from synchronizer.rounds import Rounds

logger = logging.getLogger(__name__)

EPOCH_FILE = "epoch.json"


# The settings the arithmetic of a logged round depends on (its weights are logged): replayed
# under others, a version served before could come back with other contents, so a change of any
# of them (a new default after an upgrade included) starts a new epoch and learners re-pull.
REPLAY_SETTINGS = (
    "compute_threads",
    "merge",
    "anchor",
    "round_share",
    "outer",
    "outer_lr",
    "outer_momentum",
    "outer_delay",
    "outer_warmup",
    "update_codec",
    "update_history",
    "update_history_bytes",
    "update_residual_dtype",
)

# Raised when the code computes a logged round differently under the same settings, so a log
# written by the code before is replayed under a new epoch, never into other contents. 2: a
# round's first BF16 push weighted in FP32 (it was rounded to BF16 again). 3: BF16 and FP32
# pushes added by the native kernels, where they run (torch's add fused the multiply).
ARITHMETIC_REVISION = 3


def replay_settings(cfg: SynchronizerConfig) -> dict[str, Any]:
    """The settings outer-step arithmetic depends on: a replay under others could differ. A
    shard's log holds its own fragments only, so its layout is one of them (unsharded state
    keeps the settings it always had)."""
    settings = {name: getattr(cfg, name) for name in REPLAY_SETTINGS}
    # How an outer step computes (the native kernels, torch's fused SGD kernel, or the same
    # operations one by one): a log written under one is not replayed under another.
    if native.resolve(cfg.kernels):
        settings["outer_kernel"] = "native"
    else:
        settings["outer_kernel"] = "fused_sgd" if FUSED_SGD is not None else "ops"
    settings["arithmetic"] = ARITHMETIC_REVISION
    if cfg.shards > 1:
        settings["shard_layout"] = [cfg.shards, cfg.shard_index]
    return settings


def load_epoch(cfg: SynchronizerConfig, has_state: bool, disk: Disk | None = None) -> str:
    """The epoch to serve under: the stored one while the history it names is intact. A new
    one is durable (file, then name) before it is served."""
    path = cfg.state_dir / EPOCH_FILE
    stored: dict[str, Any] = {}
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    epoch = stored.get("epoch")
    if cfg.wal and has_state and isinstance(epoch, str) and epoch:
        if stored.get("settings") == replay_settings(cfg):
            return epoch
        logger.warning(
            "replay settings changed (%s, were %s): serving under a new epoch, learners re-pull",
            replay_settings(cfg),
            stored.get("settings"),
        )
    epoch = uuid.uuid4().hex[:16]
    if cfg.wal:
        disk = disk or Disk()
        disk.make_dirs(cfg.state_dir)
        tmp = path.with_suffix(".tmp")
        fd = disk.create(tmp)
        try:
            disk.write_all(
                fd, json.dumps({"epoch": epoch, "settings": replay_settings(cfg)}).encode()
            )
            disk.fsync(fd)
        finally:
            disk.close(fd)
        disk.replace(tmp, path)
        disk.fsync_dir(cfg.state_dir)
    return epoch


# A push's bytes are logged in parts of at least this many (its last part excepted), whatever
# its chunks: a learner sending tiny chunks costs the log a record header per part, not per chunk.
PART_BYTES = 1 << 20


class PushStream:
    """A push's payload logged as it is received (PART records, from the receive buffer itself,
    no copy; checksummed by the log's writer): the disk writes the first bytes while the last
    arrive. It ends in the push's PUSH record (`end`, its last bytes logged first), or in an
    ABANDON record when the push is not accepted."""

    def __init__(self, wal: Wal, buffer: torch.Tensor) -> None:
        self.wal = wal
        self.id = wal.stream()
        self.view = memoryview(buffer.numpy().data)
        self.at = 0  # logged up to here
        self.received = 0  # landed up to here
        self.ticket = 0  # of its last part
        self.ended = False

    def add(self, end: int) -> None:
        """The buffer holds the payload's first `end` bytes now (chunks land in order)."""
        assert end >= self.received and not self.ended
        self.received = end
        if self.received - self.at >= PART_BYTES:
            self._part()

    def _part(self) -> None:
        if self.received > self.at:
            part = self.view[self.at : self.received]
            self.ticket = self.wal.append(Record(PART, {"stream": self.id, "at": self.at}, part))
            self.at = self.received

    def end(self) -> int:
        """Logs what is left of the payload; the stream's id for its PUSH record, next."""
        self._part()
        self.ended = True
        return self.id

    def abandon(self) -> bool:
        """Ends a stream whose push was not accepted (once; a logged push is not abandoned);
        returns whether its buffer may be reused: not while a part waits to be written from it
        (the bytes written must be the ones its checksum was computed over)."""
        if not self.ended:
            self.ended = True
            if self.ticket:  # parts were logged
                self.wal.append(Record(ABANDON, {"stream": self.id}))
        return self.wal.is_durable(self.ticket)


class Journal:
    """Logs the Synchronizer's decisions and replays them; a no-op without a log."""

    def __init__(self, cfg: SynchronizerConfig, metrics: Metrics, disk: Disk | None = None) -> None:
        self.cfg = cfg
        self.disk = disk or Disk()  # the state directory's file operations, checkpoints' too
        self.wal = (
            Wal(cfg.state_dir / "wal", cfg.wal_segment_bytes, self.disk, metrics.wal_fsync.observe)
            if cfg.wal
            else None
        )
        metrics.wal_failing.set_function(lambda: 0.0 if self.failure is None else 1.0)
        metrics.wal_bytes.set_function(lambda: self.wal.disk_bytes() if self.wal else 0.0)

    # Logging -------------------------------------------------------------------------------

    def refuse_if_failing(self) -> None:
        """Refuses a push up front while the log cannot be written: nothing is admitted that
        could not be made durable."""
        if self.wal is None or self.wal.failure is None:
            return
        raise Rejected(
            Code.RESOURCE_EXHAUSTED if self.wal.disk_full else Code.UNAVAILABLE,
            "wal_failing",
            f"the write-ahead log cannot be written ({self.wal.failure}): pushes are refused until it can; pulls are served; retry with backoff",
        )

    def joined(self, registry: Registry, rec: LearnerRecord) -> None:
        """Logs a learner record and waits until it is durable."""
        if self.wal is not None:
            self.wait(self.wal.append(Record(JOIN, registry.journal_of(rec))))

    def stream(self, buffer: torch.Tensor) -> PushStream | None:
        """Logs a push's bytes as they land in `buffer` (`PushStream.add`); None without a log."""
        return PushStream(self.wal, buffer) if self.wal is not None else None

    def push_journal(
        self,
        frag: Fragment,
        h: pb.PushHeader,
        payload: torch.Tensor,
        name: str,
        held: bool,
        stream: PushStream | None = None,
    ) -> Callable[[Verdict], int] | None:
        """What `Fragment.submit` calls with an accepted push's verdict (in round order). The
        record says whether the round held the payload for its outer step (added then in its
        canonical order, by learner `name`, id and seq) or added it at once. With `stream`, the
        payload is in its parts, already logged; the record names the stream."""
        wal = self.wal
        if wal is None:
            return None
        header = base64.b64encode(h.payload.SerializeToString()).decode()
        data: memoryview | bytes = b""
        crc = None
        if stream is None:
            data = memoryview(payload.numpy().data)
            crc = crc32(data)  # here, on the pushing thread, not on the writer's

        def log(verdict: Verdict) -> int:
            meta = {
                "fid": frag.fid,
                "version": verdict.round_version,
                "learner_id": h.learner_id,
                "name": name,
                "seq": h.seq,
                "base_version": h.base_version,
                "tokens": h.tokens,
                "steps": h.steps,
                "compute_s": h.compute_s,
                "weight": verdict.weight,
                "current_version": verdict.current_version,
                "staleness": verdict.staleness,
                "header": header,
                "held": held,
            }
            if stream is not None:
                meta["stream"] = stream.end()
            return wal.append(Record(PUSH, meta, data, crc))

        return log

    def round_journal(self, frag: Fragment) -> Callable[[int], int] | None:
        wal = self.wal
        if wal is None:
            return None
        return lambda version: wal.append(Record(ROUND, {"fid": frag.fid, "version": version}))

    def wait(self, ticket: int) -> None:
        """Until the ticket's record is durable; Rejected (UNAVAILABLE, or RESOURCE_EXHAUSTED
        on a full disk) when it is not within `wal_wait_s`."""
        if self.wal is None or not ticket:
            return
        try:
            self.wal.wait(ticket, self.cfg.wal_wait_s)
        except WalError as e:
            raise Rejected(
                Code.RESOURCE_EXHAUSTED if e.disk_full else Code.UNAVAILABLE,
                "wal_failing",
                f"{e}: not yet durable, so not acknowledged; retry with the same seq",
            ) from None

    def durable(self, ticket: int) -> None:
        """For an outer step: waits as long as it takes (the log retries a failing disk)."""
        if self.wal is None:
            return
        while True:
            try:
                self.wal.wait(ticket, 60.0)
                return
            except WalError:
                if self.wal.closing:
                    raise
                logger.warning("an outer step waits for the write-ahead log (%s)", self.wal.failure)

    # Replay --------------------------------------------------------------------------------

    def replay(
        self,
        fragments: Mapping[int, Fragment],
        registry: Registry,
        goodput: Goodput,
        closer: Rounds | None,
    ) -> tuple[int, int]:
        """Replays the log on top of the restored checkpoint, into `fragments` (this shard's, by
        id); returns (pushes, rounds) replayed. Rounds are applied by `closer`, as they were
        first: a round whose outer step raises fails its fragment, and the other fragments
        replay on. Call before `start`."""
        if self.wal is None:
            return 0, 0
        pushes = rounds = 0
        parts: dict[int, bytearray] = {}  # stream -> the bytes of its parts so far
        for record in self.wal.replay():
            meta = record.meta
            if record.kind == JOIN:
                registry.joined_record(meta)
                continue
            if record.kind == PART:
                got = parts.setdefault(int(meta["stream"]), bytearray())
                if len(got) == int(meta["at"]):
                    got += record.payload
                continue
            if record.kind == ABANDON:
                parts.pop(int(meta["stream"]), None)
                continue
            payload: bytes | bytearray | memoryview = record.payload
            if record.kind == PUSH and "stream" in meta:
                payload = parts.pop(int(meta["stream"]), bytearray())
            frag = fragments.get(int(meta["fid"]))
            if frag is None or closer is None:
                continue  # logged before a model existed (an initialisation never saved)
            version = int(meta["version"])
            if version <= frag.version or frag.model.failure is not None:
                continue  # the checkpoint holds it, or its fragment failed
            if record.kind == PUSH:
                if not closer.replay_close_before(frag, version):
                    continue
                header = pb.PayloadHeader.FromString(base64.b64decode(meta["header"]))
                if len(payload) != header.total_bytes:
                    logger.error(
                        "a logged push of learner %s (seq %s, fragment %d) has %d of its %d bytes: "
                        "the log is damaged where its parts were; the push is not replayed",
                        meta["learner_id"],
                        meta["seq"],
                        frag.fid,
                        len(payload),
                        header.total_bytes,
                    )
                    continue
                buf = torch.frombuffer(
                    payload if isinstance(payload, bytearray) else bytearray(payload),
                    dtype=torch.uint8,
                )
                share = frag.share_of(int(meta["tokens"]), float(meta["compute_s"]))
                rec = registry.joined_record(
                    {"learner_id": meta["learner_id"], "name": meta["learner_id"]}
                )
                frag.admission.replayed(
                    rec.learner_id,
                    int(meta["base_version"]),
                    float(meta["weight"]),
                    share,
                    (buf, header),
                    version,
                    (str(meta.get("name", "")), rec.learner_id, int(meta["seq"])),
                    bool(meta.get("held", False)),  # logs before it was recorded: added at once
                )
                goodput.accepted(rec.learner_id, share)
                reply = pb.PushReply(
                    outcome=pb.PUSH_ACCEPTED,
                    round_version=version,
                    current_version=int(meta["current_version"]),
                    staleness=int(meta["staleness"]),
                    weight=float(meta["weight"]),
                )
                registry.record_reply(rec, int(meta["seq"]), reply)
                pushes += 1
            elif record.kind == ROUND:
                if closer.replay_close_before(frag, version + 1):
                    rounds += 1
        return pushes, rounds

    def start(self) -> None:
        if self.wal is not None:
            self.wal.start()

    def sync(self) -> None:
        """Until everything logged so far is durable; WalError if not within `wal_wait_s`."""
        if self.wal is not None:
            self.wal.sync(self.cfg.wal_wait_s)

    def seal(self) -> int:
        return self.wal.seal() if self.wal is not None else 0

    def release(self, upto_segment: int, versions: dict[int, int]) -> None:
        if self.wal is not None and upto_segment:
            self.wal.release(upto_segment, versions)

    def close(self) -> None:
        if self.wal is not None:
            self.wal.close()

    def written_bytes(self) -> int:
        """The log's bytes written since start, those replayed included (0 without a log)."""
        return self.wal.written_bytes if self.wal is not None else 0

    @property
    def holds_everything(self) -> bool:
        """Whether every acknowledged push since the last checkpoint is in a healthy log."""
        return self.wal is not None and self.wal.failure is None

    @property
    def failure(self) -> str | None:
        return self.wal.failure if self.wal is not None else None
