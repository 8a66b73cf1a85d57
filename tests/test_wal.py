"""Acknowledged means durable: the write-ahead log, replay after kill -9, and a failing disk."""

from __future__ import annotations

import errno
import hashlib
import json
import signal
import struct
import sys
import threading
import zlib
from pathlib import Path

import grpc
import pytest
import torch

from protos import diloco_pb2 as pb
from synchronizer import journal as journal_module
from synchronizer import wal as wal_module
from synchronizer.config import SynchronizerConfig
from synchronizer.disk import Disk
from synchronizer.leases import Registry
from synchronizer.metrics import Metrics
from synchronizer.server import start, stop
from synchronizer.wal import Wal, WalError
from synchronizer.walformat import (
    ABANDON,
    JOIN,
    PART,
    PUSH,
    ROUND,
    Record,
    list_segments,
    read_segment,
)
from tests.helpers import (
    TIMEOUT,
    Client,
    KeepsPages,
    poll,
    push_messages,
    resident_fraction,
    serve_process,
    small_spec,
    stop_serving,
)

SPEC = small_spec(fragments=2)
N0 = SPEC.fragments[0].numel


# The log itself -------------------------------------------------------------------------------


def _records(wal: Wal) -> list[tuple[int, dict, bytes]]:
    return [(r.kind, r.meta, bytes(r.payload)) for r in wal.replay()]


def test_records_come_back_in_order_and_one_fsync_covers_a_batch(tmp_path):
    fsyncs: list[float] = []
    wal = Wal(tmp_path / "wal", 1 << 20, on_fsync=fsyncs.append)
    wal.start()
    tickets = [
        wal.append(Record(PUSH, {"fid": 0, "version": 1, "i": i}, bytes([i]) * 100))
        for i in range(50)
    ]
    tickets.append(wal.append(Record(ROUND, {"fid": 0, "version": 1})))
    wal.wait(tickets[-1], TIMEOUT)
    assert all(wal.is_durable(t) for t in tickets)
    assert len(fsyncs) < len(tickets)  # group commit: fewer fsyncs than records
    wal.close()
    again = _records(Wal(tmp_path / "wal", 1 << 20))
    assert [m.get("i") for k, m, _ in again if k == PUSH] == list(range(50))
    assert again[-1][0] == ROUND and again[3][2] == bytes([3]) * 100


@pytest.mark.skipif(sys.platform != "linux", reason="page cache residency is read with mincore")
def test_what_the_log_made_durable_leaves_the_page_cache(tmp_path):
    """The log's bytes are read again only by a replay: once durable, their pages go back to be
    reused by the next write rather than fresh ones taken (on a virtual machine, a fresh page
    costs a host fault: 25 MiB written 7x slower here)."""
    resident = {}
    for name, disk in (("kept", KeepsPages()), ("forgotten", Disk())):
        wal = Wal(tmp_path / name, 1 << 30, disk)
        wal.start()
        tickets = [
            wal.append(Record(PUSH, {"fid": 0, "version": 1}, bytes([i]) * (2 << 20)))
            for i in range(4)
        ]
        wal.wait(tickets[-1], TIMEOUT)
        wal.close()  # a record is durable before its pages are dropped: the drop ends by then
        (_, path), *_ = list_segments(tmp_path / name)
        resident[name] = resident_fraction(path)
    if resident["kept"] < 0.5:
        pytest.skip(f"this filesystem does not keep written pages cached ({resident})")
    assert resident["forgotten"] < 0.1, resident
    # and the log reads back whole
    assert [p[:1] for _, _, p in _records(Wal(tmp_path / "forgotten", 1 << 30))] == [
        bytes([i]) for i in range(4)
    ]


def test_a_torn_or_damaged_tail_is_cut_and_what_precedes_it_kept(tmp_path):
    wal = Wal(tmp_path / "wal", 1 << 20)
    wal.start()
    for i in range(3):
        wal.wait(wal.append(Record(JOIN, {"learner_id": f"l{i}"})), TIMEOUT)
    wal.close()
    (_, path), *_ = list_segments(tmp_path / "wal")
    data = path.read_bytes()
    path.write_bytes(data[:-5])  # the last record torn mid-way
    assert [m["learner_id"] for _, m, _ in _records(Wal(tmp_path / "wal", 1 << 20))] == [
        "l0",
        "l1",
    ]
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0xFF  # a flipped bit in the second record
    path.write_bytes(bytes(damaged))
    assert len(_records(Wal(tmp_path / "wal", 1 << 20))) == 1


class FlakyDisk(Disk):
    """Writes fail with ENOSPC while `full` is set, as on a full filesystem."""

    def __init__(self) -> None:
        self.full = threading.Event()

    def write(self, fd: int, data: bytes | memoryview) -> int:
        if self.full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(fd, data)


def test_a_full_disk_keeps_records_queued_until_space_comes_back(tmp_path):
    disk = FlakyDisk()
    wal = Wal(tmp_path / "wal", 1 << 20, disk)
    wal.start()
    disk.full.set()
    ticket = wal.append(Record(PUSH, {"fid": 0, "version": 1}, b"x" * 1000))
    with pytest.raises(WalError) as e:
        wal.wait(ticket, 0.5)
    assert e.value.disk_full and wal.failure is not None
    disk.full.clear()  # space again: the queued record is written by the next retry
    wal.wait(ticket, TIMEOUT)
    assert wal.failure is None
    wal.close()
    assert [bytes(r.payload) for r in Wal(tmp_path / "wal", 1 << 20).replay()] == [b"x" * 1000]


class NoNewFiles(Disk):
    """Creating a file fails with ENOSPC while `full` is set; writing to open ones works."""

    def __init__(self) -> None:
        self.full = threading.Event()

    def open(self, path: Path) -> int:
        if self.full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().open(path)


def test_a_segment_that_cannot_be_created_stops_neither_the_writer_nor_a_seal(tmp_path):
    disk = NoNewFiles()
    wal = Wal(tmp_path / "wal", 1000, disk)  # a rotation after every record of 1000 bytes
    wal.start()
    disk.full.set()  # the rotation after the next record cannot create the next segment
    wal.wait(wal.append(Record(PUSH, {"fid": 0, "version": 1}, b"a" * 1000)), TIMEOUT)
    assert wal.seal(5.0) == 1  # sealing needs no new file
    ticket = wal.append(Record(PUSH, {"fid": 0, "version": 1}, b"b" * 1000))
    with pytest.raises(WalError) as e:
        wal.wait(ticket, 0.5)
    assert e.value.disk_full and "No space left" in (wal.failure or "")
    disk.full.clear()  # the writer is still there: the retry writes it
    wal.wait(ticket, TIMEOUT)
    assert wal.failure is None
    wal.close()
    assert [bytes(r.payload)[:1] for r in Wal(tmp_path / "wal", 1000).replay()] == [b"a", b"b"]


def test_segment_numbers_keep_growing_after_every_segment_is_released(tmp_path):
    wal = Wal(tmp_path / "wal", 1000)  # a rotation after every record of 1000 bytes
    wal.start()
    wal.wait(wal.append(Record(PUSH, {"fid": 0, "version": 1}, b"a" * 1000)), TIMEOUT)
    sealed = wal.seal(TIMEOUT)
    assert wal.release(sealed, {0: 1}) >= 1 and not list_segments(tmp_path / "wal")
    wal.wait(wal.append(Record(PUSH, {"fid": 0, "version": 2}, b"b" * 10)), TIMEOUT)
    wal.close()
    numbers = [n for n, _ in list_segments(tmp_path / "wal")]
    assert numbers and min(numbers) > sealed  # replay order is number order


def _spares(directory: Path) -> list[Path]:
    return sorted(directory.glob("spare-*.log"))


def test_a_released_segments_file_is_written_over_and_its_old_records_never_come_back(tmp_path):
    """Released segments' files are kept as spares (at most as many as a release let go) and
    the next segments are written over them from their start: what the old segment held past
    the new one's end fails the new number's checksums, after a restart too."""
    directory = tmp_path / "wal"
    wal = Wal(directory, 4000)  # a rotation once a segment holds 4000 bytes
    wal.start()
    for i in range(3):  # one segment each
        wal.wait(wal.append(Record(PUSH, {"fid": 0, "version": 1, "i": i}, b"o" * 5000)), TIMEOUT)
    old = {path.stat().st_ino: path.stat().st_size for _, path in list_segments(directory)}
    assert wal.release(wal.seal(TIMEOUT), {0: 1}) == 3
    assert not list_segments(directory) and len(_spares(directory)) == 3
    wal.wait(wal.append(Record(PUSH, {"fid": 0, "version": 2}, b"n" * 10)), TIMEOUT)
    ((_, segment),) = list_segments(directory)
    assert segment.stat().st_ino in old  # a spare, written over from its start
    assert segment.stat().st_size == old[segment.stat().st_ino] > 5000  # its old bytes remain
    assert len(_spares(directory)) == 2
    wal.close()

    again = Wal(directory, 4000)
    assert [(r.meta, bytes(r.payload)) for r in again.replay()] == [
        ({"fid": 0, "version": 2}, b"n" * 10)
    ]
    again.start()  # the spares of the run before are written over too
    again.wait(again.append(Record(PUSH, {"fid": 0, "version": 3}, b"m" * 10)), TIMEOUT)
    assert len(_spares(directory)) == 1
    sealed = again.seal(TIMEOUT)
    assert again.release(sealed, {0: 3}) == 2  # spares beyond the two it let go are deleted
    assert len(_spares(directory)) == 2
    again.close()
    assert list(Wal(directory, 4000).replay()) == []


def test_a_reused_file_whose_first_record_never_became_durable_holds_nothing(tmp_path):
    """A spare renamed to the next segment, and the power cut before its SEGMENT record reached
    the disk: the file still starts with the old segment's, which names another number."""
    directory = tmp_path / "wal"
    wal = Wal(directory, 1 << 20)
    wal.start()
    wal.wait(wal.append(Record(PUSH, {"fid": 0, "version": 1}, b"a" * 100)), TIMEOUT)
    wal.close()
    ((number, path),) = list_segments(directory)
    stale = directory / f"wal-{number + 1:010d}.log"
    stale.write_bytes(path.read_bytes())
    assert list(read_segment(stale)) == []
    assert [bytes(r.payload) for r in Wal(directory, 1 << 20).replay()] == [b"a" * 100]


def _older_format(record: Record) -> bytes:
    """A record as the log wrote it before segments began with SEGMENT records: no number in
    its checksum."""
    meta = json.dumps(record.meta, separators=(",", ":")).encode()
    body_head = struct.pack("<I", len(meta)) + meta
    crc = zlib.crc32(body_head, zlib.crc32(bytes([record.kind]), zlib.crc32(record.payload)))
    length = len(body_head) + len(record.payload)
    return struct.pack("<IIB", length, crc, record.kind) + body_head + bytes(record.payload)


def test_segments_of_the_older_format_are_replayed_and_deleted_not_reused(tmp_path):
    directory = tmp_path / "wal"
    directory.mkdir()
    path = directory / "wal-0000000001.log"
    path.write_bytes(
        _older_format(Record(PUSH, {"fid": 0, "version": 1}, b"x" * 50))
        + _older_format(Record(ROUND, {"fid": 0, "version": 1}))
    )
    wal = Wal(directory, 1 << 20)
    assert [(r.kind, bytes(r.payload)) for r in wal.replay()] == [(PUSH, b"x" * 50), (ROUND, b"")]
    wal.start()
    wal.wait(wal.append(Record(ROUND, {"fid": 0, "version": 2})), TIMEOUT)
    assert wal.release(wal.seal(TIMEOUT), {0: 2}) == 2
    assert not path.exists() and len(_spares(directory)) == 1  # only the new segment's file
    wal.close()


class CountingDisk(Disk):
    """Counts bytes written and fsyncs; fails the next `fail_fsyncs` fsyncs with EIO; an fsync
    waits while `gate` is clear (`in_fsync` is set once one has started)."""

    def __init__(self) -> None:
        self.written = 0
        self.fsyncs = 0
        self.fail_fsyncs = 0
        self.cv = threading.Condition()
        self.gate = threading.Event()
        self.gate.set()
        self.in_fsync = threading.Event()

    def write(self, fd: int, data: bytes | memoryview) -> int:
        n = super().write(fd, data)
        with self.cv:
            self.written += n
            self.cv.notify_all()
        return n

    def wait_written(self, more_than: int) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: self.written > more_than, TIMEOUT)

    def fsync(self, fd: int) -> None:
        self.in_fsync.set()
        assert self.gate.wait(TIMEOUT)
        if self.fail_fsyncs:
            self.fail_fsyncs -= 1
            raise OSError(errno.EIO, "Input/output error")
        self.fsyncs += 1
        super().fsync(fd)


def _parts(wal: Wal, disk: CountingDisk, count: int) -> tuple[int, list[int]]:
    """`count` parts of one stream, each appended once the previous one is written."""
    stream, tickets = wal.stream(), []
    for i in range(count):
        before = disk.written
        tickets.append(wal.append(Record(PART, {"stream": stream, "at": i * 1000}, b"p" * 1000)))
        disk.wait_written(before)
    return stream, tickets


def test_a_streams_parts_are_written_as_they_land_and_fsynced_by_the_record_ending_them(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(wal_module, "IDLE_SYNC_S", 60.0)  # no idle fsync within the test
    disk = CountingDisk()
    wal = Wal(tmp_path / "wal", 1 << 20, disk)
    wal.start()
    stream, tickets = _parts(wal, disk, 5)
    assert disk.fsyncs == 0 and not any(wal.is_durable(t) for t in tickets)
    wal.wait(wal.append(Record(PUSH, {"fid": 0, "version": 1, "stream": stream})), TIMEOUT)
    assert disk.fsyncs == 1 and all(wal.is_durable(t) for t in tickets)
    wal.close()
    assert [r.kind for r in Wal(tmp_path / "wal", 1 << 20).replay()] == [PART] * 5 + [PUSH]


def test_parts_nothing_follows_are_fsynced_once_the_writer_is_idle(tmp_path):
    disk = CountingDisk()
    wal = Wal(tmp_path / "wal", 1 << 20, disk)
    wal.start()
    _, tickets = _parts(wal, disk, 2)  # a push that stalls after two parts
    wal.wait(tickets[-1], TIMEOUT)
    assert disk.fsyncs >= 1 and wal.seal(TIMEOUT) > 0  # a checkpoint can seal meanwhile
    wal.close()


def test_a_failed_fsync_writes_the_unsynced_parts_again_once(tmp_path, monkeypatch):
    monkeypatch.setattr(wal_module, "IDLE_SYNC_S", 60.0)
    monkeypatch.setattr(wal_module, "RETRY_S", 0.01)
    disk = CountingDisk()
    wal = Wal(tmp_path / "wal", 1 << 20, disk)
    wal.start()
    stream, _ = _parts(wal, disk, 3)
    disk.fail_fsyncs = 1  # the PUSH's fsync fails: the file is cut back to before the parts
    wal.wait(wal.append(Record(PUSH, {"fid": 0, "version": 1, "stream": stream})), TIMEOUT)
    # the bytes cut and written again are counted once, as the disk holds them
    on_disk = sum(path.stat().st_size for _, path in list_segments(tmp_path / "wal"))
    assert wal.written_bytes == wal.disk_bytes() == on_disk < disk.written
    wal.close()
    replayed = Wal(tmp_path / "wal", 1 << 20)
    again = list(replayed.replay())
    assert replayed.written_bytes == replayed.disk_bytes() == on_disk
    assert [r.kind for r in again] == [PART] * 3 + [PUSH]
    assert [r.meta["at"] for r in again[:3]] == [0, 1000, 2000]
    assert all(bytes(r.payload) == b"p" * 1000 for r in again[:3])


def _held_fsync_and_a_record_written_meanwhile(wal: Wal, disk: CountingDisk) -> tuple[int, int]:
    """A record whose fsync is held, and a second one appended meanwhile and written."""
    disk.gate.clear()
    first = wal.append(Record(PUSH, {"fid": 0, "version": 1}, b"a" * 1000))
    assert disk.in_fsync.wait(TIMEOUT)
    before = disk.written
    second = wal.append(Record(PUSH, {"fid": 0, "version": 1}, b"b" * 1000))
    disk.wait_written(before)  # the writer is not held by the fsync
    assert not wal.is_durable(first) and not wal.is_durable(second)
    return first, second


def test_a_record_appended_during_an_fsync_is_written_before_it_ends(tmp_path):
    """The syncer fsyncs while the writer goes on writing: a push whose record arrives during
    another's fsync waits for the rest of that fsync and one more, not for a write after it."""
    disk = CountingDisk()
    wal = Wal(tmp_path / "wal", 1 << 20, disk)
    wal.start()
    first, second = _held_fsync_and_a_record_written_meanwhile(wal, disk)
    disk.gate.set()
    wal.wait(second, TIMEOUT)
    assert wal.is_durable(first) and disk.fsyncs == 2  # the second came after the first began
    wal.close()
    assert [bytes(r.payload)[:1] for r in Wal(tmp_path / "wal", 1 << 20).replay()] == [b"a", b"b"]


class HeldForget(Disk):
    """Dropping a range's pages waits while `gate` is clear (`in_forget` is set once it has
    started)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.in_forget = threading.Event()

    def forget(self, fd: int, offset: int, length: int) -> None:
        self.in_forget.set()
        assert self.gate.wait(TIMEOUT)
        super().forget(fd, offset, length)


def test_a_record_is_durable_before_its_pages_are_dropped_and_a_seal_waits_for_the_drop(
    tmp_path,
):
    """Dropping fsynced pages from the cache is housekeeping: a push's acknowledgement waits
    for its fsync, never for the drop; closing the segment (a seal) waits for both, so no file
    is closed under it."""
    disk = HeldForget()
    wal = Wal(tmp_path / "wal", 1 << 20, disk)
    wal.start()
    ticket = wal.append(Record(PUSH, {"fid": 0, "version": 1}, b"a" * 1000))
    assert disk.in_forget.wait(TIMEOUT)
    wal.wait(ticket, TIMEOUT)  # durable while the drop is held
    sealed: list[int] = []
    sealer = threading.Thread(target=lambda: sealed.append(wal.seal(TIMEOUT)))
    sealer.start()
    sealer.join(0.2)
    assert sealer.is_alive() and not sealed  # the seal waits for the drop
    disk.gate.set()
    sealer.join(TIMEOUT)
    assert sealed and sealed[0] >= 1
    wal.close()
    assert [bytes(r.payload)[:1] for r in Wal(tmp_path / "wal", 1 << 20).replay()] == [b"a"]


def test_an_fsync_failing_after_later_records_were_written_writes_them_all_again_once(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(wal_module, "RETRY_S", 0.01)
    disk = CountingDisk()
    wal = Wal(tmp_path / "wal", 1 << 20, disk)
    wal.start()
    disk.fail_fsyncs = 1
    first, second = _held_fsync_and_a_record_written_meanwhile(wal, disk)
    disk.gate.set()  # the held fsync fails: the file is cut back to before both and written again
    wal.wait(second, TIMEOUT)
    assert wal.is_durable(first) and wal.failure is None
    wal.close()
    assert [bytes(r.payload)[:1] for r in Wal(tmp_path / "wal", 1 << 20).replay()] == [b"a", b"b"]


def test_a_streams_parts_keep_their_segments_until_its_push_whose_version_they_then_carry(
    tmp_path,
):
    """A push logged as it arrives: its parts may span segments, written before anyone knows
    which round it goes into. No checkpoint may release them while the stream is open, and once
    its PUSH record names the round, they are kept until a checkpoint holds that round, after a
    restart too."""
    wal = Wal(tmp_path / "wal", 1000)  # a rotation after every batch of 1000 bytes or more
    wal.start()
    stream = wal.stream()
    for i in range(3):  # one batch, so one segment, each
        wal.wait(
            wal.append(Record(PART, {"stream": stream, "at": i * 1000}, bytes([i]) * 1000)), TIMEOUT
        )
    assert len(list_segments(tmp_path / "wal")) >= 3
    assert wal.release(wal.seal(TIMEOUT), {0: 9}) == 0  # open: whatever the checkpoint holds
    wal.wait(wal.append(Record(PUSH, {"fid": 0, "version": 2, "stream": stream})), TIMEOUT)
    sealed = wal.seal(TIMEOUT)
    assert wal.release(sealed, {0: 1}) == 0  # its round 2 is in no checkpoint yet
    wal.close()

    again = Wal(tmp_path / "wal", 1000)
    records = list(again.replay())
    assert [r.kind for r in records] == [PART, PART, PART, PUSH]
    assert b"".join(bytes(r.payload) for r in records[:3]) == b"".join(
        bytes([i]) * 1000 for i in range(3)
    )
    assert again.stream() > stream  # stream ids never repeat in one log
    assert again.release(sealed, {0: 1}) == 0
    assert again.release(sealed, {0: 2}) >= 3 and not list_segments(tmp_path / "wal")


def test_an_abandoned_streams_parts_free_their_segments_and_a_dead_runs_open_stream_too(
    tmp_path,
):
    wal = Wal(tmp_path / "wal", 1000)
    wal.start()
    refused, cut_off = wal.stream(), wal.stream()
    wal.append(Record(PART, {"stream": refused, "at": 0}, b"r" * 1000))
    wal.append(Record(ABANDON, {"stream": refused}))
    wal.wait(wal.append(Record(PART, {"stream": cut_off, "at": 0}, b"c" * 1000)), TIMEOUT)
    sealed = wal.seal(TIMEOUT)
    assert wal.release(sealed, {}) == 0  # `cut_off` is still open
    wal.close()  # as a kill would leave it: `cut_off` never ends
    again = Wal(tmp_path / "wal", 1000)
    assert len(list(again.replay())) == 3
    assert not again.segments.streams  # nothing can end `cut_off` now
    assert again.release(sealed, {}) >= 1 and not list_segments(tmp_path / "wal")


class GatedDisk(Disk):
    """Writes wait while `shut` is set: the log's writer falls behind on demand."""

    def __init__(self) -> None:
        self.open_ = threading.Event()
        self.open_.set()

    def write(self, fd: int, data: bytes | memoryview) -> int:
        assert self.open_.wait(TIMEOUT)
        return super().write(fd, data)


def test_a_refused_pushs_buffer_is_not_reused_while_its_parts_wait_to_be_written(
    tmp_path, monkeypatch
):
    """A push's bytes are logged as they arrive, from its receive buffer. Refused after its last
    byte (here: a NaN), its parts may still be queued: were its buffer handed to the next push
    meanwhile, the log would write that push's bytes under the refused one's checksums, and a
    replay would cut the log there, the next push with it, acknowledged as it was."""
    monkeypatch.setattr(journal_module, "PART_BYTES", 1)  # a part per chunk, as 2 MiB ones are
    disk = GatedDisk()
    state = tmp_path / "s"
    cfg = SynchronizerConfig(port=0, metrics_port=-1, state_dir=state, quorum=1, grace="none")
    srv = start(cfg, Metrics(), disk=disk)
    try:
        c = Client(srv.address, SPEC, "l0")
        c.join()
        c.init([torch.zeros(f.numel) for f in SPEC.fragments])
        assert c.push(0, torch.ones(N0)).outcome == pb.PUSH_ACCEPTED
        assert c.pull(0, min_version=1, wait_s=TIMEOUT)[0] == 1  # its buffer back in the pool
        disk.open_.clear()
        h, buf = c.header(0, torch.ones(N0), pb.CODEC_FP32, base=1)
        buf.view(torch.float32)[-1] = float("nan")
        with pytest.raises(grpc.RpcError) as e:
            c.stub.PushFragment(push_messages(h, buf), timeout=TIMEOUT, metadata=c.md)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        wal = srv.synchronizer.journal.wal
        assert wal is not None
        before, parts = wal.appended, -(-buf.numel() // 512)  # its chunks, 512 bytes each
        second: dict[str, pb.PushReply] = {}
        pushing = threading.Thread(
            target=lambda: second.update(r=c.push(0, torch.full((N0,), 2.0), base=1))
        )
        pushing.start()  # received whole (into the refused push's buffer, were it reused)
        poll(lambda: wal.appended >= before + parts, TIMEOUT, "the second push's parts")
        disk.open_.set()
        pushing.join(TIMEOUT)
        assert second["r"].outcome == pb.PUSH_ACCEPTED
        # The log as it stands (a kill now would leave this) replays the acknowledged push.
        logged = [r for _, path in list_segments(state / "wal") for r in read_segment(path)]
        pushes = [r.meta for r in logged if r.kind == PUSH]
        assert [(m["seq"], m["version"]) for m in pushes] == [(1, 1), (c.seq, 2)]
    finally:
        disk.open_.set()
        stop(srv, 1.0)


def test_a_push_in_tiny_chunks_is_logged_in_parts_of_part_bytes(tmp_path, monkeypatch):
    """A part per chunk would cost a learner sending tiny chunks a record header per chunk."""
    monkeypatch.setattr(journal_module, "PART_BYTES", 1000)
    cfg = SynchronizerConfig(port=0, metrics_port=-1, state_dir=tmp_path / "s", quorum=1)
    srv = start(cfg, Metrics())
    try:
        c = Client(srv.address, SPEC, "l0")
        c.join()
        c.init([torch.zeros(f.numel) for f in SPEC.fragments])
        assert c.push(0, torch.ones(N0)).outcome == pb.PUSH_ACCEPTED  # 512-byte chunks
        logged = [
            r for _, path in list_segments(tmp_path / "s" / "wal") for r in read_segment(path)
        ]
    finally:
        stop(srv, 1.0)
    (push,) = [r for r in logged if r.kind == PUSH]
    parts = [r for r in logged if r.kind == PART and r.meta["stream"] == push.meta["stream"]]
    sizes = [len(r.payload) for r in parts]
    assert sum(sizes) == N0 * 4 and len(sizes) >= 2
    assert all(1000 <= n < 1000 + 512 for n in sizes[:-1]) and 0 < sizes[-1] < 1000 + 512
    assert [r.meta["at"] for r in parts] == [sum(sizes[:i]) for i in range(len(sizes))]


# The Synchronizer over the log -------------------------------------------------------------


SYNCHRONIZER = [sys.executable, "-m", "synchronizer"]


def log_only_flags(quorum: int) -> tuple[str, ...]:
    """`serve` flags for the kill tests: rounds close at `quorum` pushes with no grace, and no
    checkpoint but the first, so everything after init is only in the log."""
    return ("--quorum", str(quorum), "--grace", "none", "--outer", "nesterov") + (
        "--checkpoint-interval-s",
        "0",
    )


def _pull_all(c: Client) -> dict[int, tuple[int, torch.Tensor]]:
    return {f: c.pull(f) for f in range(len(SPEC.fragments))}


def test_kill_9_loses_nothing_acknowledged_and_serves_every_version_again(tmp_path):
    """Quorum 2 of 2 learners: rounds close only when both pushed, so the last round is open
    (one acknowledged push in it) when the Synchronizer is killed."""
    state, ready = tmp_path / "state", tmp_path / "ready.json"
    command, flags = SYNCHRONIZER, log_only_flags(quorum=2)
    proc, info = serve_process(command, state, ready, *flags)
    try:
        a, b = Client(info["address"], SPEC, "a"), Client(info["address"], SPEC, "b")
        a.join()
        b.join()
        g = torch.Generator().manual_seed(0)
        a.init([torch.randn(f.numel, generator=g) for f in SPEC.fragments])
        served: dict[tuple[int, int], torch.Tensor] = {}
        for r in range(3):
            for c in (a, b):
                for f, frag in enumerate(SPEC.fragments):
                    delta = torch.randn(frag.numel, generator=g) * 0.1
                    assert c.push(f, delta, base=r).outcome == pb.PUSH_ACCEPTED
            for f in range(len(SPEC.fragments)):
                version, params = a.pull(f, min_version=r + 1, wait_s=TIMEOUT)
                served[(f, version)] = params
        open_push = a.push(0, torch.ones(N0), base=3)  # acknowledged; its round stays open
        assert open_push.outcome == pb.PUSH_ACCEPTED and open_push.round_version == 4
        proc.send_signal(signal.SIGKILL)  # no final checkpoint: only the log and the init one
        proc.wait(TIMEOUT)
    finally:
        proc.kill()
    proc, again = serve_process(command, state, ready, *flags)
    try:
        assert again["epoch"] == info["epoch"]  # the same history of versions
        a2, b2 = Client(again["address"], SPEC, "a"), Client(again["address"], SPEC, "b")
        a2.session, b2.session = a.session, b.session
        assert a2.join(a.learner_id).server_epoch == info["epoch"]
        b2.join(b.learner_id)
        a2.seq, b2.seq = a.seq, b.seq
        for (f, version), params in served.items():
            now = a2.pull(f)
            assert now[0] == 3 and (version < 3 or torch.equal(now[1], params))
        # The acknowledged push is in its round: a retry is a duplicate, and b's push closes it.
        retry = a2.push(0, torch.ones(N0), base=3, seq=a.seq)
        assert retry.outcome == pb.PUSH_DUPLICATE
        assert b2.push(0, torch.zeros(N0), base=3).outcome == pb.PUSH_ACCEPTED
        version, _ = a2.pull(0, min_version=4, wait_s=TIMEOUT)
        assert version == 4
    finally:
        stop_serving(proc, TIMEOUT)


class Killed(BaseException):
    """What SIGKILL does to a replay: it stops where it is, and nothing handles it."""


def _files(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_a_kill_during_replay_changes_nothing_on_disk_and_the_next_start_serves_it_all(
    tmp_path, monkeypatch
):
    """Replay only reads: killed part-way through (here after a few records of each segment),
    the state directory is byte for byte what it was, and the next start replays it all."""
    state, ready = tmp_path / "state", tmp_path / "ready.json"
    command, flags = SYNCHRONIZER, log_only_flags(quorum=1)
    proc, info = serve_process(command, state, ready, *flags)
    try:
        a = Client(info["address"], SPEC, "a")
        a.join()
        g = torch.Generator().manual_seed(1)
        a.init([torch.randn(f.numel, generator=g) for f in SPEC.fragments])
        served: dict[int, tuple[int, torch.Tensor]] = {}
        for r in range(3):
            for f, frag in enumerate(SPEC.fragments):
                delta = torch.randn(frag.numel, generator=g) * 0.1
                assert a.push(f, delta, base=r).outcome == pb.PUSH_ACCEPTED
                served[f] = a.pull(f, min_version=r + 1, wait_s=TIMEOUT)
        proc.send_signal(signal.SIGKILL)  # only the init checkpoint and the log
        proc.wait(TIMEOUT)
    finally:
        proc.kill()
    before = _files(state)
    assert any(name.startswith("wal/") for name in before)
    intact = wal_module.read_segment

    def killed_part_way(path: Path):
        for i, record in enumerate(intact(path)):
            if i == 4:
                raise Killed
            yield record

    monkeypatch.setattr(wal_module, "read_segment", killed_part_way)
    cfg = SynchronizerConfig(
        port=0, metrics_port=-1, state_dir=state, quorum=1, grace="none", outer="nesterov"
    )
    with pytest.raises(Killed):
        start(cfg, Metrics())
    assert _files(state) == before
    monkeypatch.undo()
    proc, again = serve_process(command, state, ready, *flags)
    try:
        assert again["epoch"] == info["epoch"]
        b = Client(again["address"], SPEC, "b")
        b.join()
        for f, (version, params) in served.items():
            now = b.pull(f)
            assert now[0] == version == 3 and torch.equal(now[1], params)
    finally:
        stop_serving(proc, TIMEOUT)


def test_a_failing_log_refuses_pushes_keeps_serving_pulls_and_recovers(tmp_path):
    disk = FlakyDisk()
    cfg = SynchronizerConfig(
        port=0, metrics_port=-1, state_dir=tmp_path / "s", quorum=1, grace="none", wal_wait_s=0.5
    )
    metrics = Metrics()
    srv = start(cfg, metrics, disk=disk)
    try:
        c = Client(srv.address, SPEC, "l0")
        c.join()
        c.init([torch.zeros(f.numel) for f in SPEC.fragments])
        assert c.push(0, torch.ones(N0)).outcome == pb.PUSH_ACCEPTED
        assert c.pull(0, min_version=1, wait_s=TIMEOUT)[0] == 1  # its round applied
        disk.full.set()
        with pytest.raises(grpc.RpcError) as e:  # admitted, but not durable: not acknowledged
            c.push(0, torch.ones(N0), base=1)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        unacknowledged = c.seq
        assert metrics.registry.get_sample_value("diloco_wal_failing") == 1.0
        assert "write-ahead log failing" in c.status().unhealthy
        with pytest.raises(grpc.RpcError) as e:  # refused up front now: nothing admitted
            c.push(0, torch.ones(N0), base=1)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "write-ahead log" in (e.value.details() or "")
        assert c.pull(1)[0] == 0  # pulls are served meanwhile
        disk.full.clear()  # space again: the queued record is written, the retry answered

        def retried() -> pb.PushReply | None:
            try:
                return c.push(0, torch.ones(N0), base=1, seq=unacknowledged)
            except grpc.RpcError:
                return None

        reply = poll(retried, TIMEOUT, "the log to be writable again")
        assert reply.outcome == pb.PUSH_DUPLICATE  # it was in its round all along, once
        assert c.pull(0, min_version=2, wait_s=TIMEOUT)[0] == 2
        assert c.status().unhealthy == ""
        assert metrics.registry.get_sample_value("diloco_wal_failing") == 0.0
    finally:
        stop(srv, 1.0)


@pytest.mark.parametrize("wal", [True, False], ids=["wal", "no-wal"])
def test_the_epoch_survives_a_restart_only_with_the_log(make_server, wal):
    srv = make_server(quorum=1, grace="none", wal=wal)
    c = Client(srv.address, SPEC, "l0")
    epoch = c.join().server_epoch
    c.init([torch.zeros(f.numel) for f in SPEC.fragments])
    srv.server.stop(0).wait()
    srv.synchronizer.close()
    again = make_server(quorum=1, grace="none", wal=wal)
    c2 = Client(again.address, SPEC, "l0")
    c2.session = c.session
    assert (c2.join(c.learner_id).server_epoch == epoch) is wal
    assert (srv.synchronizer.cfg.state_dir / "wal").is_dir() is wal


@pytest.mark.parametrize(
    "changed",
    [
        {"outer": "delayed_nesterov"},
        {"outer_lr": 0.5},
        {"compute_threads": 2},
        {"merge": "radial", "anchor": "base"},
        {"round_share": "full"},
        {"outer_warmup": 5},
    ],
    ids=["outer", "outer_lr", "compute_threads", "merge", "round_share", "outer_warmup"],
)
def test_a_restart_under_other_outer_step_arithmetic_starts_a_new_epoch(make_server, changed):
    """Logged rounds replayed under another outer optimizer (a new default after an upgrade
    included) would serve known versions with other contents: learners must re-pull."""
    settings = {"quorum": 1, "grace": "none", "outer": "nesterov"}
    srv = make_server(**settings)
    c = Client(srv.address, SPEC, "l0")
    epoch = c.join().server_epoch
    c.init([torch.zeros(f.numel) for f in SPEC.fragments])
    assert c.push(0, torch.ones(N0)).outcome == pb.PUSH_ACCEPTED
    srv.server.stop(0).wait()
    srv.synchronizer.close()
    again = make_server(**(settings | changed))
    c2 = Client(again.address, SPEC, "l0")
    c2.session = c.session
    assert c2.join(c.learner_id).server_epoch != epoch
    assert again.synchronizer.model.fragments[0].version >= 1  # the acknowledged push was not lost


def test_learners_alive_at_a_checkpoint_come_back_alive_for_one_lease_and_the_others_dead():
    # A restart is not the learners' doing: those alive keep their sessions (a round waiting
    # for every live learner still waits for them), and one that never calls lapses as usual.
    before = Registry(lease_s=60, max_learners=8, forget_after_s=60)
    alive, _, _ = before.join("alive")
    dead, _, _ = before.join("dead")
    gone, _, _ = before.join("gone")
    dead.lease_deadline = 0.0  # lapsed
    before.reap()
    before.leave(gone.learner_id)
    after = Registry(lease_s=0.2, max_learners=8, forget_after_s=60)
    after.restore(before.snapshot())
    states = {r.name: r.state for r in after.learners.values()}
    assert states == {"alive": "alive", "dead": "dead"}
    back = after.learners[alive.learner_id]
    assert (back.session_hash, back.spec_hash) == (alive.session_hash, alive.spec_hash)
    assert after.live_ids() == {alive.learner_id}
    assert poll(lambda: after.reap() == [back], 10, "an absent learner to lapse after one lease")
    # One that joined after the checkpoint (a JOIN record in the log) was alive a moment ago.
    joined = after.joined_record({"learner_id": "0123456789ab", "name": "late"})
    assert joined.state == "alive" and after.live_ids() == {"0123456789ab"}
