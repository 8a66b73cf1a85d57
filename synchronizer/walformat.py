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
- ROUND: a fragment's round closed into a version.

On disk: `wal/wal-NNNNNNNNNN.log` segments, each a sequence of records `<length u32><crc32 u32>
<kind u8><body>`, the body a JSON document (length-prefixed) followed by the payload bytes; the
checksum runs over the payload, then the kind and the JSON part (so the payload's part can be
computed by the pushing thread, outside the writer; a part's is computed by the writer). A
record whose length or checksum does not hold ends its segment (a torn tail: only a record that
was never acknowledged can be torn) and is cut off.
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

JOIN, PUSH, ROUND, PART, ABANDON = 1, 2, 3, 4, 5
KINDS = {JOIN: "join", PUSH: "push", ROUND: "round", PART: "part", ABANDON: "abandon"}
_HEAD = struct.Struct("<IIB")  # body length, crc32 of payload + kind + JSON part, kind
_META = struct.Struct("<I")  # JSON length, at the start of the body
NAME = re.compile(r"^wal-(\d{10})\.log$")


@dataclass
class Record:
    kind: int
    meta: dict[str, Any]
    payload: bytes | memoryview = b""
    # crc32 of the payload, when the caller computed it; else the writer does, as it encodes
    # the record (a push's parts: their receiving thread only appends them)
    payload_crc: int | None = None


def encode(record: Record) -> list[bytes | memoryview]:
    meta = json.dumps(record.meta, separators=(",", ":")).encode()
    body_head = _META.pack(len(meta)) + meta
    payload_crc = record.payload_crc
    if payload_crc is None:
        payload_crc = crc32(record.payload)
    crc = zlib.crc32(body_head, zlib.crc32(bytes([record.kind]), payload_crc))
    length = len(body_head) + len(record.payload)
    return [_HEAD.pack(length, crc, record.kind) + body_head, record.payload]


def list_segments(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := NAME.match(p.name))]
    return sorted(found)


def read_segment(path: Path) -> Iterator[Record]:
    """The records of one segment up to its first torn or damaged one."""
    return records_of(path.read_bytes())


def records_of(data: bytes) -> Iterator[Record]:
    """The records of a segment's bytes up to the first torn or damaged one."""
    view = memoryview(data)
    at = 0
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
        if zlib.crc32(head, zlib.crc32(bytes([kind]), crc32(payload))) != crc:
            return
        try:
            meta = json.loads(bytes(body[_META.size : _META.size + meta_len]))
        except ValueError:
            return
        yield Record(kind, meta, payload)
        at = end
