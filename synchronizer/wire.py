"""Reading PushFragment's chunk messages without copying their bytes.

A 2 MiB chunk parsed as `pb.PushRequest` is copied twice before it reaches the push buffer:
into the message, and again on every read of `chunk.data`. `parse_push_request` reads the
protobuf wire format of the one common shape, a PushRequest holding only `chunk` (offset and
data), and returns a `RawChunk` that points into the bytes gRPC received; the Assembler copies
them once, into the push buffer. Any other shape (the header, unknown or repeated fields,
anything malformed) goes through the real parser, so the service sees the same messages and
the same errors as without this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos import diloco_pb2 as pb

_CHUNK_TAG = 0x12  # PushRequest.chunk: field 2, length-delimited
_OFFSET_TAG = 0x08  # Chunk.offset: field 1, varint
_DATA_TAG = 0x12  # Chunk.data: field 2, length-delimited


@dataclass(frozen=True)
class RawChunk:
    """A chunk whose `size` bytes start at `start` in `source` (the received message)."""

    offset: int
    source: bytes
    start: int
    size: int

    def WhichOneof(self, name: str) -> str:  # noqa: N802 - the protobuf message's method name
        return "chunk"

    @property
    def chunk(self) -> RawChunk:
        return self


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """(value, next position); ValueError if it runs past the end or beyond 64 bits."""
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _chunk(raw: bytes) -> RawChunk | None:
    """The RawChunk of a chunk-only PushRequest, or None for any other shape."""
    if not raw or raw[0] != _CHUNK_TAG:
        return None
    length, pos = _varint(raw, 1)
    if pos + length != len(raw):  # the chunk must be the whole message
        return None
    offset, data = 0, None
    while pos < len(raw):
        tag = raw[pos]
        if tag == _OFFSET_TAG and data is None:
            offset, pos = _varint(raw, pos + 1)
        elif tag == _DATA_TAG and data is None:
            size, pos = _varint(raw, pos + 1)
            if pos + size > len(raw):
                return None
            data, pos = (pos, size), pos + size
        else:
            return None
    if data is None:
        return None
    return RawChunk(offset, raw, data[0], data[1])


def parse_push_request(raw: bytes) -> pb.PushRequest | RawChunk:
    """Deserializer for PushFragment's request stream: a `RawChunk` for a chunk-only message,
    otherwise the parsed `pb.PushRequest`."""
    try:
        chunk = _chunk(raw)
    except ValueError:
        chunk = None
    return chunk if chunk is not None else pb.PushRequest.FromString(raw)
