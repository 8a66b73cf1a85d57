"""Which of the write-ahead log's segments a checkpoint covers, without a disk or a thread."""

from __future__ import annotations

from pathlib import Path

from synchronizer.segments import Segments
from synchronizer.walformat import JOIN, PART, PUSH, ROUND, Record


def _segments(count: int, sealed: bool = True) -> tuple[Segments, list]:
    segments = Segments(Path("wal"))
    made = []
    for _ in range(count):
        number, path = segments.next_path()
        made.append(segments.add(number, path, sealed=sealed))
    return segments, made


def test_a_segment_naming_two_fragments_is_covered_only_once_both_are_held():
    segments, (seg,) = _segments(1)
    segments.noted(seg, Record(ROUND, {"fid": 0, "version": 3}))
    segments.noted(seg, Record(ROUND, {"fid": 1, "version": 5}))
    segments.noted(seg, Record(JOIN, {"name": "a"}))  # names no fragment: holds nothing back
    assert segments.covered(seg.number, {0: 9}) == []  # fragment 1 is in no checkpoint
    assert segments.covered(seg.number, {0: 9, 1: 4}) == []  # nor its version 5
    assert segments.covered(seg.number, {0: 3, 1: 5}) == [seg]
    assert segments.kept == [] and segments.bytes() == 0


def test_only_sealed_segments_up_to_the_checkpoints_are_covered_and_numbers_keep_growing():
    segments, (first, second) = _segments(2)
    assert segments.last_sealed() == second.number
    number, path = segments.next_path()
    open_one = segments.add(number, path, size=7)
    assert segments.covered(first.number, {}) == [first]  # `second` is past the checkpoint's
    assert segments.covered(open_one.number, {}) == [second]  # the open one is written to
    assert segments.kept == [open_one] and segments.bytes() == 7
    open_one.sealed = True
    assert segments.covered(open_one.number, {}) == [open_one]
    assert segments.next_path()[0] == open_one.number + 1  # never a released segment's number


def test_a_push_carries_its_round_to_every_segment_of_its_parts_but_not_further():
    segments, (a, b, c) = _segments(3)
    stream = segments.new_stream()
    segments.noted(a, Record(PART, {"stream": stream, "at": 0}))
    segments.noted(b, Record(PART, {"stream": stream, "at": 1}))
    assert segments.covered(c.number, {}) == [c]  # `a` and `b` hold the open stream
    segments.noted(b, Record(PUSH, {"fid": 2, "version": 8, "stream": stream}))
    assert a.versions == b.versions == {2: 8} and not a.open_streams and not b.open_streams
    assert segments.covered(b.number, {2: 7}) == []
    assert segments.covered(b.number, {2: 8}) == [a, b]


def test_replayed_parts_open_nothing_and_new_streams_start_above_them():
    segments, (seg,) = _segments(1)
    segments.noted(seg, Record(PART, {"stream": 41, "at": 0}), replayed=True)
    segments.replayed()
    assert not seg.open_streams and not segments.streams
    assert segments.new_stream() == 42
    assert segments.covered(seg.number, {}) == [seg]
