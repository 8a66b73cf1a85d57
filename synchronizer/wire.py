"""PushFragment's and PullFragment's chunk messages without copies of their bytes.

A 2 MiB chunk parsed as `pb.PushRequest` is copied twice before it reaches the push buffer:
into the message, and again on every read of `chunk.data`. `parse_push_request` reads the
protobuf wire format of the one common shape, a PushRequest holding only `chunk` (offset and
data), and returns a `RawChunk` that points into the bytes gRPC received; the Assembler copies
them once, into the push buffer. Any other shape (the header, unknown or repeated fields,
anything malformed) goes through the real parser, so the service sees the same messages and
the same errors as without this module.

The other way, a PullReply holding a chunk was copied four times on its way out (the tensor's
bytes into the Chunk, the Chunk into the reply, the reply into its serialization, and that into
gRPC). `pull_chunks` writes each such reply's wire format at once, the chunk's bytes copied
once from the tensor, as a `RawChunk` that reads as the message in process and that
`serialize_pull_reply` hands to gRPC as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from protos import diloco_pb2 as pb
from protos import framing

_CHUNK_TAG = 0x12  # PushRequest.chunk and PullReply.chunk: field 2, length-delimited
_OFFSET_TAG = 0x08  # Chunk.offset: field 1, varint
_DATA_TAG = 0x12  # Chunk.data: field 2, length-delimited


@dataclass(frozen=True)
class RawChunk:
    """A message holding one chunk (a PushRequest received, or a PullReply to send), kept as its
    serialized bytes `source`, the chunk's `size` bytes at `start` in them; in process it reads
    as the message (`WhichOneof`, `chunk.offset`, `chunk.data`)."""

    offset: int
    source: bytes
    start: int
    size: int

    def WhichOneof(self, name: str) -> str:  # noqa: N802 - the protobuf message's method name
        return "chunk"

    @property
    def chunk(self) -> RawChunk:
        return self

    @property
    def data(self) -> bytes:
        return self.source[self.start : self.start + self.size]


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


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def pull_chunks(buf: torch.Tensor, chunk_bytes: int = framing.CHUNK_BYTES) -> Iterator[RawChunk]:
    """`buf` (1-D uint8, CPU) as the PullReplies of its chunks (`framing.iter_chunks`'s
    offsets and sizes), each serialized once. Do not overwrite `buf` before they are sent."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.device.type != "cpu":
        raise ValueError(f"pull_chunks takes a 1-D uint8 CPU tensor, got {buf.dtype}")
    view = buf.contiguous().numpy().data  # a memoryview of the tensor's bytes
    for offset in range(0, buf.numel(), chunk_bytes):
        size = min(chunk_bytes, buf.numel() - offset)
        data_head = bytes([_DATA_TAG]) + _encode_varint(size)
        field = (bytes([_OFFSET_TAG]) + _encode_varint(offset) if offset else b"") + data_head
        head = bytes([_CHUNK_TAG]) + _encode_varint(len(field) + size) + field
        yield RawChunk(offset, b"".join((head, view[offset : offset + size])), len(head), size)


def serialize_pull_reply(reply: pb.PullReply | RawChunk) -> bytes:
    """PullFragment's response serializer: a `RawChunk` as it is, any other reply by protobuf."""
    if isinstance(reply, RawChunk):
        return reply.source
    return reply.SerializeToString()
