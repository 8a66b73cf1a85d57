"""The write-ahead log's segments: what each one holds, and which of them a checkpoint covers.

`synchronizer.wal` writes records into numbered segment files; this module keeps their
bookkeeping. A segment notes the highest version each of its records names per fragment (a
push's round, a round's version), its size, whether it is sealed (no record will be written to
it again) and the push streams with parts in it that have not ended yet. A stream's parts may
sit in several segments, and its PUSH record names the round they went into: that version is
noted on every segment holding the parts, so none of them is released before a checkpoint holds
the round. A stream still open keeps its segments: its push may yet be acknowledged, into a
round no checkpoint holds.

`Segments` takes no lock of its own: the log calls it under its lock, or before its threads
start (replay).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from synchronizer.walformat import ABANDON, PART, PUSH, Record


@dataclass
class Segment:
    number: int
    path: Path
    # fragment id -> the highest version a record of this segment names (a push's round, a
    # round's version): the segment is covered once a checkpoint holds every one of them.
    versions: dict[int, int] = field(default_factory=dict)
    sealed: bool = False
    size: int = 0  # bytes on disk
    # its file may be written over by a later segment once released: it starts with a SEGMENT
    # record (`synchronizer.walformat`), as every segment this version writes does
    reusable: bool = True
    # streams with parts here and no PUSH or ABANDON yet: the segment is kept while any is open
    open_streams: set[int] = field(default_factory=set)

    def note(self, record: Record) -> None:
        fid = record.meta.get("fid")
        if fid is not None:
            v = int(record.meta["version"])
            self.versions[fid] = max(self.versions.get(fid, 0), v)


class Segments:
    """The log's segments, oldest first, and the streams whose parts they hold."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.kept: list[Segment] = []  # on disk, oldest first
        self.last_number = 0  # the highest segment number replayed or opened
        self.next_stream = 1  # above every stream id on disk once replayed
        # stream id -> the segments holding its parts
        self.streams: dict[int, list[Segment]] = {}

    @property
    def current(self) -> Segment:
        """The newest segment: the one being written, or the last sealed one."""
        return self.kept[-1]

    def add(
        self, number: int, path: Path, sealed: bool = False, size: int = 0, reusable: bool = True
    ) -> Segment:
        seg = Segment(number, path, sealed=sealed, size=size, reusable=reusable)
        self.kept.append(seg)
        self.last_number = max(self.last_number, number)
        return seg

    def next_path(self) -> tuple[int, Path]:
        """The number and path of the next segment. Numbers only grow, even once every segment
        is released: replay goes in their order."""
        number = self.last_number + 1
        return number, self.directory / f"wal-{number:010d}.log"

    def new_stream(self) -> int:
        """A fresh stream id for a push's PART records."""
        self.next_stream += 1
        return self.next_stream - 1

    def noted(self, seg: Segment, record: Record, replayed: bool = False) -> None:
        """What a record written to (or replayed from) `seg` tells the segments: the versions
        it names, noted on the segments of its stream's parts too, and which streams are open.
        A stream left open by an earlier run can never finish: replayed parts open nothing."""
        seg.note(record)
        stream = record.meta.get("stream")
        if stream is None:
            return
        self.next_stream = max(self.next_stream, int(stream) + 1)
        if record.kind == PART:
            held = self.streams.setdefault(stream, [])
            if not held or held[-1] is not seg:
                held.append(seg)
            if not replayed:
                seg.open_streams.add(stream)
        elif record.kind in (PUSH, ABANDON):
            for s in self.streams.pop(stream, []):
                s.open_streams.discard(stream)
                if record.kind == PUSH:
                    s.note(record)

    def replayed(self) -> None:
        """Replay is over: the streams it left open were cut off by the end of a run."""
        self.streams.clear()

    def last_sealed(self) -> int:
        """The number of the newest sealed segment, 0 when none is."""
        sealed = [s.number for s in self.kept if s.sealed]
        return sealed[-1] if sealed else 0

    def bytes(self) -> int:
        """The bytes of every segment kept on disk."""
        return sum(s.size for s in self.kept)

    def covered(self, upto_segment: int, versions: dict[int, int]) -> list[Segment]:
        """Takes out and returns the sealed segments up to `upto_segment` that a checkpoint
        holding `versions` (fragment id -> version) covers, with no stream open in them."""
        gone = [
            s
            for s in self.kept
            if s.sealed
            and s.number <= upto_segment
            and not s.open_streams
            and all(v <= versions.get(fid, -1) for fid, v in s.versions.items())
        ]
        for s in gone:
            self.kept.remove(s)
        return gone
