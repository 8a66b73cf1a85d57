"""The write-ahead log's records on disk: their kinds, how one is encoded, and how a segment's
bytes are read back (`synchronizer.wal` appends them and makes them durable).

Records, appended in the order the Synchronizer decided them:

- JOIN: a learner record (id, name, session hash, when it first joined);
- PUSH: an accepted push as received (its payload still encoded, so the log costs what the wire
  costs) with everything its judgement decided: learner, seq, base version, counts, the weight
  it was merged with and the version of the round it went into. Its payload is either in the
  record or, for a push logged as it arrived, in the PART records of its stream (`"stream"` in
  its JSON);
- PART: the next bytes of a push still arriving (`{"stream", "at"}`), appended chunk by chunk
  so the disk writes them while the rest is received: one learner's push is then durable soon
  after its last byte, not a whole payload's write later;
- ABANDON: a stream whose push was refused or broke off: its parts are never read;
- ROUND: a fragment's round closed into a version;
- SEGMENT: the first record of every segment, naming its number (`{"segment": N}`).

On disk: `wal/wal-NNNNNNNNNN.log` segments, each a sequence of records `<length u32><crc32 u32>
<kind u8><body>`, the body a JSON document (length-prefixed) followed by the payload bytes; the
checksum runs over the payload, then the kind, the segment's number (8 bytes, little-endian)
and the JSON part (so the payload's part can be computed by the pushing thread, outside the
writer; a part's is computed by the writer). A record whose length or checksum does not hold
ends its segment (a torn tail: only a record that was never acknowledged can be torn) and is cut
off.

The number in every checksum is what lets the log reuse a released segment's file for a new
segment (`synchronizer.wal`: overwriting blocks already written costs the disk less than
appending fresh ones): whatever the old segment left past the new one's end fails the new
number's checksum, and a file whose SEGMENT record names another number (its first write never
made durable) holds nothing. Segments written before SEGMENT records existed have none and no
number in their checksums; they are read as they were written, and never reused.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from synchronizer.crc import crc32

JOIN, PUSH, ROUND, PART, ABANDON, SEGMENT = 1, 2, 3, 4, 5, 6
KINDS = {
    JOIN: "join",
    PUSH: "push",
    ROUND: "round",
    PART: "part",
    ABANDON: "abandon",
    SEGMENT: "segment",
}
_HEAD = struct.Struct("<IIB")  # body length, crc32 of payload + kind + number + JSON, kind
_META = struct.Struct("<I")  # JSON length, at the start of the body
_NUMBER = struct.Struct("<Q")  # the segment's number, in every checksum but the oldest format's
NAME = re.compile(r"^wal-(\d{10})\.log$")


@dataclass
class Record:
    kind: int
    meta: dict[str, Any]
    payload: bytes | memoryview = b""
    # crc32 of the payload, when the caller computed it; else the writer does, as it encodes
    # the record (a push's parts: their receiving thread only appends them)
    payload_crc: int | None = None


def _salt(kind: int, number: int | None) -> bytes:
    """What follows the payload in a record's checksum: its kind, then its segment's number
    (None: the format before SEGMENT records, without it)."""
    return bytes([kind]) if number is None else bytes([kind]) + _NUMBER.pack(number)


def encode(record: Record, number: int) -> list[bytes | memoryview]:
    """A record's bytes for segment `number`."""
    meta = json.dumps(record.meta, separators=(",", ":")).encode()
    body_head = _META.pack(len(meta)) + meta
    payload_crc = record.payload_crc
    if payload_crc is None:
        payload_crc = crc32(record.payload)
    crc = zlib.crc32(body_head, zlib.crc32(_salt(record.kind, number), payload_crc))
    length = len(body_head) + len(record.payload)
    return [_HEAD.pack(length, crc, record.kind) + body_head, record.payload]


def header(number: int) -> bytes:
    """The SEGMENT record that starts segment `number`."""
    return b"".join(bytes(b) for b in encode(Record(SEGMENT, {"segment": number}), number))


def list_segments(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := NAME.match(p.name))]
    return sorted(found)


def read_segment(path: Path) -> Iterator[Record]:
    """The records of one segment up to its first torn or damaged one (its SEGMENT record not
    among them)."""
    match = NAME.match(path.name)
    return records_of(path.read_bytes(), int(match.group(1)) if match else None)


def numbered(data: bytes) -> int | None:
    """The number a segment's SEGMENT record names, None when it starts with none (the older
    format, or nothing intact)."""
    head = next(_records(data, 0, None, first_only=True), None)
    return int(head.meta["segment"]) if head is not None and head.kind == SEGMENT else None


def records_of(data: bytes, number: int | None = None) -> Iterator[Record]:
    """The records of a segment's bytes up to the first torn or damaged one, without its
    SEGMENT record. `number` is the segment's (its file name's): a SEGMENT record naming
    another means a reused file whose new start never became durable, so nothing in it is
    this segment's (None: whichever it names)."""
    named = numbered(data)
    if named is None:
        return _records(data, 0, None)  # the older format, or nothing
    if number is not None and named != number:
        return iter(())
    return _records(data, _HEAD.size + _HEAD.unpack_from(data, 0)[0], named)


def _meta(body: memoryview, meta_len: int) -> dict[str, Any] | None:
    try:
        meta = json.loads(bytes(body[_META.size : _META.size + meta_len]))
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def _records(
    data: bytes, at: int, number: int | None, first_only: bool = False
) -> Iterator[Record]:
    """The intact records from `at` on (`first_only`: at most one; the record at 0 is checked
    as a SEGMENT record with the number it names, when it is one)."""
    view = memoryview(data)
    while at + _HEAD.size <= len(data):
        length, crc, kind = _HEAD.unpack_from(data, at)
        end = at + _HEAD.size + length
        if kind not in KINDS or end > len(data) or length < _META.size:
            return
        body = view[at + _HEAD.size : end]
        (meta_len,) = _META.unpack_from(body, 0)
        if _META.size + meta_len > length:
            return
        head, payload = body[: _META.size + meta_len], body[_META.size + meta_len :]
        meta = None
        if first_only and kind == SEGMENT:  # checked with the number it names
            meta = _meta(body, meta_len)
            if meta is None or not isinstance(meta.get("segment"), int):
                return
            number = meta["segment"]
        if zlib.crc32(head, zlib.crc32(_salt(kind, number), crc32(payload))) != crc:
            return
        if meta is None:
            meta = _meta(body, meta_len)
            if meta is None:
                return
        yield Record(kind, meta, payload)
        if first_only:
            return
        at = end
