"""PushFragment's copy-free chunk reader: the same messages as the protobuf parser, or its
errors; PullFragment's chunk replies serialized once: the bytes protobuf would send."""

from __future__ import annotations

import random

import pytest
import torch
from google.protobuf.message import DecodeError

from protos import diloco_pb2 as pb
from synchronizer.wire import (
    RawChunk,
    parse_push_request,
    pull_chunks,
    serialize_pull_reply,
)


def _chunk_bytes(raw: RawChunk) -> bytes:
    return raw.source[raw.start : raw.start + raw.size]


@pytest.mark.parametrize("offset", [0, 1, 300, 2**40])
@pytest.mark.parametrize("size", [1, 127, 128, 70_000])
def test_chunk_messages_are_read_in_place(offset, size):
    data = bytes(random.Random(size).randrange(256) for _ in range(size))
    raw = pb.PushRequest(chunk=pb.Chunk(offset=offset, data=data)).SerializeToString()
    got = parse_push_request(raw)
    assert isinstance(got, RawChunk)
    assert got.WhichOneof("kind") == "chunk" and got.chunk is got
    assert got.offset == offset and got.source is raw and _chunk_bytes(got) == data


def test_header_and_other_shapes_go_through_the_protobuf_parser():
    header = pb.PushRequest(header=pb.PushHeader(learner_id="a", seq=3))
    got = parse_push_request(header.SerializeToString())
    assert isinstance(got, pb.PushRequest) and got == header
    # An empty chunk (no data field), a chunk followed by another field, and an unknown field
    # inside the chunk are all legal protobuf: the real parser reads them.
    empty = pb.PushRequest(chunk=pb.Chunk(offset=5))
    assert parse_push_request(empty.SerializeToString()) == empty
    two = (
        pb.PushRequest(chunk=pb.Chunk(offset=1, data=b"xy")).SerializeToString()
        + pb.PushRequest(header=pb.PushHeader(seq=1)).SerializeToString()
    )
    assert parse_push_request(two) == pb.PushRequest.FromString(two)
    unknown = b"\x12\x06" + b"\x08\x01" + b"\x18\x07" + b"\x12\x00"  # field 3 inside the chunk
    assert parse_push_request(unknown) == pb.PushRequest.FromString(unknown)


def test_random_and_truncated_bytes_parse_as_protobuf_would():
    rng = random.Random(0)
    good = pb.PushRequest(chunk=pb.Chunk(offset=300, data=b"abcdef" * 20)).SerializeToString()
    samples = [good[:cut] for cut in range(len(good))]
    samples += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))) for _ in range(2000)]
    samples += [
        b"\x12" + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 20)))
        for _ in range(2000)
    ]
    for raw in samples:
        try:
            expected = pb.PushRequest.FromString(raw)
        except DecodeError:
            with pytest.raises(DecodeError):
                parse_push_request(raw)
            continue
        got = parse_push_request(raw)
        if isinstance(got, RawChunk):
            assert expected.WhichOneof("kind") == "chunk", raw
            assert (got.offset, _chunk_bytes(got)) == (
                expected.chunk.offset,
                expected.chunk.data,
            ), raw
        else:
            assert got == expected, raw


@pytest.mark.parametrize("nbytes, chunk_bytes", [(1, 4), (127, 64), (70_000, 1 << 14), (300, 300)])
def test_pull_chunks_are_the_bytes_protobuf_serializes_and_read_as_the_message(nbytes, chunk_bytes):
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    data = bytes(buf.numpy())
    chunks = list(pull_chunks(buf, chunk_bytes))
    offsets = list(range(0, nbytes, chunk_bytes))
    assert [c.offset for c in chunks] == offsets
    for c, offset in zip(chunks, offsets, strict=True):
        piece = data[offset : offset + chunk_bytes]
        expected = pb.PullReply(chunk=pb.Chunk(offset=offset, data=piece))
        assert serialize_pull_reply(c) == expected.SerializeToString()
        assert pb.PullReply.FromString(c.source) == expected
        assert c.WhichOneof("kind") == "chunk" and c.chunk.data == piece
    header = pb.PullReply(header=pb.PullHeader(version=3))
    assert serialize_pull_reply(header) == header.SerializeToString()
    assert all(isinstance(c, RawChunk) for c in chunks)
