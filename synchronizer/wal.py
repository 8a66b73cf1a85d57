"""The write-ahead log: what the Synchronizer acknowledged, on disk before it says so.

A push's reply, a Join's reply and a round's outer step each wait until their record is durable
(`wait`): a writer thread writes each record as it is appended, and a syncer thread fsyncs once
for all that was written meanwhile (group commit), so many pushes share one fsync and none waits
for another's write to end an fsync. Replay (`replay`) repeats the same arithmetic:
the pushes of each round in the order they were added, then its outer step.

Segments are `wal/wal-NNNNNNNNNN.log`, their records as `synchronizer.walformat` encodes them.
A checkpoint seals the current segment (`seal`), and once written, `release` lets go of the
sealed segments it covers (`synchronizer.segments` says which: a stream that stalls is cut by the
Synchronizer's idle-stream timeout, so none keeps its segments for ever). Their files are kept as
spares (`wal/spare-NNNNNNNNNN.log`, at most as many as that release let go), and each new
segment is written over a spare's bytes when there is one: on a filesystem such as ext4 an fsync
of blocks already written waits for the data alone, where one of appended blocks also commits
their allocation and the file's new length (measured here: 3 MB written and fdatasync'd in a
loop, 1.35-1.75x the bytes per second over a spare). What a spare held past the new segment's end
never reads as its records (`synchronizer.walformat`: every checksum holds its segment's
number). Disk use stays bounded by what the checkpoint interval lets accumulate, spares
included. Once fsynced, a batch's pages are dropped from the page cache (`Disk.forget`), after
its records are marked durable: no reply waits for the drop.

A write or fsync that fails (a full disk, an I/O error) keeps the records in memory and retries
every `RETRY_S`; meanwhile `failure` says why, new pushes are refused by the caller, and nothing
acknowledged is lost. File operations go through `synchronizer.disk.Disk`, so tests can inject
faults and cut the power.

A record is durable once its segment is fsynced and the segment's name is in the directory: a
new segment's entry (and the log directory's own, the first time) is fsynced before anything is
written to it; a released segment is renamed to a spare or unlinked only once the checkpoint that
covers it is durable.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from synchronizer.disk import Disk
from synchronizer.segments import Segments
from synchronizer.walformat import (
    PART,
    Record,
    encode,
    header,
    list_segments,
    numbered,
    read_segment,
)

logger = logging.getLogger(__name__)

RETRY_S = 1.0  # a failed write is retried this often
IDLE_SYNC_S = 0.05  # parts written and nothing queued since for this long are fsynced
SPARE = "spare-{:010d}.log"  # a released segment's file, kept to be written over by a new one


class WalError(Exception):
    """A record could not be made durable in time (the message says why)."""

    def __init__(self, message: str, disk_full: bool) -> None:
        super().__init__(message)
        self.disk_full = disk_full


class Wal:
    def __init__(
        self,
        directory: Path,
        segment_bytes: int,
        disk: Disk | None = None,
        on_fsync: Callable[[float], None] = lambda _seconds: None,
    ) -> None:
        self.directory = directory
        self.on_fsync = on_fsync
        self.segment_bytes = segment_bytes
        self.disk = disk or Disk()
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.queue: list[tuple[int, Record]] = []
        self.appended = 0  # tickets handed out
        self.durable = 0  # every ticket up to this one is on disk
        self.failure: str | None = None  # why the last write failed, until one succeeds
        self.disk_full = False
        self.closing = False
        self.segments = Segments(directory)
        self.fd: int | None = None
        self.size = 0
        self.synced_size = 0  # of the open segment, fsynced
        self.written = 0  # records at the head of the queue written and not yet durable
        # the syncer's next fsync: everything up to this ticket, written up to this size of fd
        self.sync_ticket = 0
        self.sync_size = 0
        self.sync_fd = -1
        self.syncing = False  # an fsync is running
        self.sync_error: OSError | None = None  # the syncer's, until the writer handles it
        self.halted = False  # the writer cuts the file: the syncer starts nothing
        self.stopped = False  # the syncer ends
        self.seal_wanted = False
        self.sealed_upto = 0
        self.written_bytes = 0  # into segments since this process started, replayed ones included
        self.spares: list[Path] = []  # released segments' files, oldest first (under the lock)
        self.writer: threading.Thread | None = None
        self.syncer: threading.Thread | None = None

    # Start ---------------------------------------------------------------------------------

    def replay(self) -> Iterator[Record]:
        """Every intact record on disk, oldest first. A damaged record ends its segment (the
        rest of that segment is cut off); call before `start`."""
        self.spares = sorted(self.directory.glob(SPARE.replace("{:010d}", "*")))
        for number, path in list_segments(self.directory):
            with path.open("rb") as f:
                reusable = numbered(f.read(256)) == number  # a SEGMENT record fits
            seg = self.segments.add(
                number, path, sealed=True, size=path.stat().st_size, reusable=reusable
            )
            self.written_bytes += seg.size
            count = 0
            for record in read_segment(path):
                self.segments.noted(seg, record, replayed=True)
                count += 1
                yield record
            logger.debug("replayed %d records of %s", count, path.name)
        self.segments.replayed()

    def start(self) -> None:
        """Opens a fresh segment after the replayed ones and starts the writer."""
        self.disk.make_dirs(self.directory)
        self._open_segment()
        self.writer = threading.Thread(target=self._write_loop, name="wal-writer", daemon=True)
        self.syncer = threading.Thread(target=self._sync_loop, name="wal-syncer", daemon=True)
        self.syncer.start()
        self.writer.start()

    def _open_segment(self) -> None:
        """The next segment, its name durable before any record is written to it (a record
        fsynced into a file whose name a power cut takes is lost with it): a spare's file
        when there is one, written over from its start. Its number is used up even if this
        fails, so a retry never appends to a file this left behind."""
        number, path = self.segments.next_path()
        self.segments.last_number = number
        with self.lock:
            spare = self.spares.pop(0) if self.spares else None
        fd = self.disk.reuse(spare, path) if spare is not None else self.disk.open(path)
        try:
            self.disk.fsync_dir(self.directory)
        except OSError:
            self._close_quietly(fd)
            raise
        self.fd, self.size, self.synced_size = fd, 0, 0
        with self.lock:
            self.segments.add(number, path)

    # Appending -----------------------------------------------------------------------------

    def append(self, record: Record) -> int:
        """Queues a record; returns its ticket for `wait`. Cheap: the writer thread writes."""
        with self.cv:
            self.appended += 1
            self.queue.append((self.appended, record))
            self.cv.notify_all()
            return self.appended

    def stream(self) -> int:
        """A fresh stream id for a push's PART records."""
        with self.lock:
            return self.segments.new_stream()

    def wait(self, ticket: int, timeout_s: float) -> None:
        """Returns once the ticket's record is durable; WalError if it is not within
        `timeout_s` (the record stays queued and may become durable later)."""
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while self.durable < ticket:
                left = deadline - time.monotonic()
                if left <= 0 or self.closing:
                    raise WalError(
                        f"the write-ahead log in {self.directory} is not writable ({self.failure})"
                        if self.failure
                        else f"the write-ahead log in {self.directory} took more than {timeout_s:g} s",
                        self.disk_full,
                    )
                self.cv.wait(left)

    def sync(self, timeout_s: float) -> None:
        """Returns once everything appended so far is durable; WalError if it is not within
        `timeout_s`."""
        with self.cv:
            target = self.appended
        self.wait(target, timeout_s)

    def is_durable(self, ticket: int) -> bool:
        with self.lock:
            return self.durable >= ticket

    # Writing -------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        """The writer: every file operation but the fsync happens on this thread, which writes
        each batch as it is appended and starts its writeback, while the syncer fsyncs what was
        written before it (`_sync_loop`): a record that arrives during an fsync is written at
        once and waits only for the rest of that fsync and one more. A batch holding only PART
        records asks for no fsync: a push's parts go to the disk as they land, and the fsync
        for the record that ends them (its PUSH, or an ABANDON) covers them all, or IDLE_SYNC_S
        after the last one where nothing follows. Records written and not yet durable stay at
        the head of the queue (`written`): a failed write or fsync cuts the file back to its
        last fsync and writes them again. A seal or a rotation first waits until everything
        written is durable, so a segment is closed only once fsynced whole."""
        while True:
            with self.cv:
                action = self._await_work()
                error = self.sync_error
                batch = self.queue[self.written :] if action == "write" else []
            if action == "closed":
                return
            if action == "failed":
                assert error is not None
                if not self._failed(error):
                    return
                continue
            if action == "drained":
                if self.seal_wanted:
                    self._seal_now()
                else:
                    self._rotate()
                continue
            try:
                self._write(batch)
            except OSError as e:
                if not self._failed(e):
                    return
                continue
            with self.cv:
                self.written += len(batch)
                if any(record.kind != PART for _, record in batch):
                    self._want_sync()

    def _drain_wanted(self) -> bool:
        return self.seal_wanted or (self.fd is not None and self.size >= self.segment_bytes)

    def _await_work(self) -> str:
        """Under the lock: waits until the writer has something to do, and says what: "failed"
        (the syncer's fsync failed), "closed" (the writer ends), "drained" (everything written
        is durable and a seal or a rotation is wanted) or "write" (records to write)."""
        while True:
            if self.sync_error is not None:
                return "failed"
            if self.closing and not self.queue:
                return "closed"
            if self._drain_wanted():
                if not self.written and not self.syncing:
                    return "drained"
                self._want_sync()
            elif len(self.queue) > self.written:
                return "write"
            if self.written and self.sync_ticket < self.queue[self.written - 1][0]:
                # parts written and no fsync asked for: one once nothing follows them
                if not self.cv.wait(IDLE_SYNC_S) and len(self.queue) == self.written:
                    self._want_sync()
            else:
                self.cv.wait()

    def _want_sync(self) -> None:
        """Under the lock: asks the syncer to make everything written so far durable."""
        if self.written and self.fd is not None:
            self.sync_ticket = self.queue[self.written - 1][0]
            self.sync_size = self.size
            self.sync_fd = self.fd
            self.cv.notify_all()

    def _failed(self, error: OSError) -> bool:
        """A write or an fsync failed: once the syncer is idle, cuts the file back to its last
        fsync, so the records not yet durable are written again after RETRY_S; False when the
        log is closing and the writer should end instead."""
        with self.cv:
            self.halted = True  # the syncer starts nothing while the file is cut
            while self.syncing:
                self.cv.wait()
        if self.fd is not None and self.size > self.synced_size:
            self._cut()  # never raises: a file it cannot cut is left for a fresh segment
        with self.cv:
            self.halted = False
            self.sync_error = None
            self.written = 0  # written again from the queue
            self.sync_ticket = self.durable
            if self.failure is None:
                logger.error(
                    "write-ahead log write failed (%s); pushes are refused until it can be written again, nothing acknowledged is lost",
                    error,
                )
            self.failure = f"{type(error).__name__}: {error}"
            self.disk_full = error.errno == 28  # ENOSPC
            self.cv.notify_all()
            if self.closing:
                return False
            self.cv.wait(RETRY_S)
        return True

    def _sync_loop(self) -> None:
        """The syncer: fdatasyncs what the writer asked for (`_want_sync`) while the writer
        goes on writing; then the records up to that point are durable, and only after that
        are their pages given back to be reused by the next writes rather than fresh ones
        taken (`Disk.forget`; read again only by a replay)."""
        while True:
            with self.cv:
                while not self.stopped and (
                    self.sync_ticket <= self.durable or self.sync_error is not None or self.halted
                ):
                    self.cv.wait()
                if self.stopped:
                    return
                ticket, size, fd, start = (
                    self.sync_ticket,
                    self.sync_size,
                    self.sync_fd,
                    self.synced_size,
                )
                self.syncing = True
            try:
                t0 = time.perf_counter()
                self.disk.fsync(fd)  # fdatasync: the data and the file's new length
                self.on_fsync(time.perf_counter() - t0)
            except OSError as e:
                with self.cv:
                    self.syncing = False
                    self.sync_error = e
                    self.cv.notify_all()
                continue
            with self.cv:
                self.synced_size = size
                done = 0
                while done < len(self.queue) and self.queue[done][0] <= ticket:
                    self.segments.noted(self.segments.current, self.queue[done][1])
                    done += 1
                del self.queue[:done]
                self.written -= done
                self.durable = ticket
                if self.failure is not None:
                    logger.warning("write-ahead log writable again (was: %s)", self.failure)
                self.failure = None
                self.disk_full = False
                self.cv.notify_all()
            # durable first, then the pages dropped: no acknowledgement waits for the drop (a
            # cut or a rotation waits for it, as `syncing` still says an fsync runs)
            self.disk.forget(fd, start, size - start)
            with self.cv:
                self.syncing = False
                self.cv.notify_all()

    def _write(self, batch: list[tuple[int, Record]]) -> None:
        """Writes a batch after what is written, and starts its writeback (a failure leaves
        what it wrote for `_failed` to cut)."""
        if self.fd is None:  # rotated: the next segment is opened by the write that needs it
            self._open_segment()
        assert self.fd is not None
        start = self.size
        number = self.segments.current.number
        # a segment starts with its SEGMENT record
        first: list[list[bytes | memoryview]] = [[header(number)]] if start == 0 else []
        try:
            for parts in itertools.chain(first, (encode(r, number) for _, r in batch)):
                for part in parts:
                    view = memoryview(part).cast("B")
                    while view:
                        n = self.disk.write(self.fd, view)
                        view = view[n:]
                        self.size += n
        finally:
            self.segments.current.size = self.size
            self.written_bytes += self.size - start
        self.disk.start_writeback(self.fd, start, self.size - start)

    def _cut(self) -> None:
        """Cuts what was written since the last fsync, so the retry appends to an intact log
        (never while the syncer fsyncs)."""
        assert self.fd is not None
        try:
            self.disk.truncate(self.fd, self.synced_size)
            self.written_bytes -= self.size - self.synced_size  # written again
            self.size = self.segments.current.size = self.synced_size
        except OSError:  # cannot even truncate: go on in a fresh segment
            self._rotate()

    def _rotate(self) -> None:
        """Seals the current segment. The next is opened by the next write, which handles a
        failure to create it as any failed write (retried, `failure` says why); a rotation that
        raised here would end the writer and, with it, every later acknowledgement."""
        if self.fd is None:
            return
        self._close_quietly(self.fd)
        self.fd, self.size, self.synced_size = None, 0, 0
        with self.lock:
            self.segments.current.sealed = True

    def _close_quietly(self, fd: int) -> None:
        try:
            self.disk.close(fd)
        except OSError:
            pass

    def _seal_now(self) -> None:
        if self.size > 0:
            self._rotate()
        with self.cv:
            self.seal_wanted = False
            self.sealed_upto = self.segments.last_sealed()
            self.cv.notify_all()

    # Checkpoints ---------------------------------------------------------------------------

    def disk_bytes(self) -> int:
        """The bytes of every segment kept on disk."""
        with self.lock:
            return self.segments.bytes()

    def seal(self, timeout_s: float = 10.0) -> int:
        """Once everything appended so far is written, seals the current segment (before a
        checkpoint collects its state; the next record starts a new one); returns the number of
        the last sealed segment, 0 when that did not happen in time."""
        deadline = time.monotonic() + timeout_s
        with self.cv:
            target = self.appended
            while self.durable < target:
                left = deadline - time.monotonic()
                if left <= 0 or self.closing:
                    return 0
                self.cv.wait(left)
            self.seal_wanted = True
            self.sealed_upto = -1
            self.cv.notify_all()
            while self.sealed_upto < 0:
                left = deadline - time.monotonic()
                if left <= 0 or self.closing:
                    return 0
                self.cv.wait(left)
            return self.sealed_upto

    def release(self, upto_segment: int, versions: dict[int, int]) -> int:
        """Lets go of the sealed segments up to `upto_segment` whose every record is covered by
        a checkpoint holding `versions` (fragment id -> version); returns how many. Their files
        become spares, the oldest deleted beyond as many as this let go (the log grows by
        about that much again before the next checkpoint); a segment of the older format
        without SEGMENT records is deleted."""
        with self.cv:
            gone = self.segments.covered(upto_segment, versions)
        spared: list[Path] = []
        for s in gone:
            if s.reusable:
                spare = self.directory / SPARE.format(s.number)
                self.disk.replace(s.path, spare)
                spared.append(spare)
            else:
                self.disk.unlink(s.path)
        with self.lock:
            self.spares += spared
            extra = self.spares[: max(0, len(self.spares) - len(gone))]
            del self.spares[: len(extra)]
        for path in extra:
            self.disk.unlink(path)
        if gone:
            self.disk.fsync_dir(self.directory)
        return len(gone)

    def close(self) -> None:
        """Writes what is queued (as far as the disk lets it) and stops the writer."""
        with self.cv:
            target = self.appended
            deadline = time.monotonic() + 5.0
            while self.durable < target and time.monotonic() < deadline and self.failure is None:
                self.cv.wait(0.5)
            self.closing = True
            self.cv.notify_all()
        if self.writer is not None:
            self.writer.join(timeout=5)
        with self.cv:
            self.stopped = True
            self.cv.notify_all()
        if self.syncer is not None:
            self.syncer.join(timeout=5)
        if self.fd is not None:
            try:
                self.disk.close(self.fd)
            except OSError:
                pass
            self.fd = None
