"""Chunk framing of the wire: how payload bytes travel as ``Chunk`` messages and are reassembled.

Owns the default chunk size, the split of an encoded payload (a 1-D uint8 CPU tensor) into
in-order ``Chunk`` messages (``iter_chunks``), their reassembly into one preallocated buffer with
every offset and size checked (``Assembler``), and the crc32 that proves two sides hold the same
FP32 parameters (``checksum``). It knows nothing of what the bytes mean: ``protos.codec`` owns
the quantization, ``protos.layout`` the ``PayloadHeader``. Every failure raises ``CodecError``.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from protos import diloco_pb2 as pb
from protos.layout import CodecError

CHUNK_BYTES = 2 * 1024 * 1024  # default wire chunk size


def iter_chunks(buf: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.Chunk]:
    """Yield ``buf`` (a CPU uint8 tensor) as in-order ``Chunk`` messages of at most
    ``chunk_bytes`` bytes; an empty ``buf`` yields nothing.

    Each chunk's bytes are copied when it is yielded: do not overwrite ``buf`` before the
    generator is exhausted.
    """
    if chunk_bytes <= 0:
        raise CodecError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.device.type != "cpu":
        raise CodecError(
            f"iter_chunks takes a 1-D uint8 CPU tensor (copy with .cpu() first), got {buf.dtype} "
            f"of shape {tuple(buf.shape)} on {buf.device}"
        )
    buf = buf.contiguous()
    base, total = buf.data_ptr(), buf.numel()
    for offset in range(0, total, chunk_bytes):
        # One copy, straight from the tensor's memory into the bytes the message holds
        # (``buf`` stays alive, so the pointer is valid; no numpy needed).
        data = ctypes.string_at(base + offset, min(chunk_bytes, total - offset))
        yield pb.Chunk(offset=offset, data=data)


class Assembler:
    """Receives one payload's chunks, in order, into a single preallocated uint8 CPU tensor.

    The buffer (``header.total_bytes``) is allocated up front: validate the header first and
    pass ``max_bytes`` wherever the header comes from the network.
    """

    def __init__(
        self,
        header: pb.PayloadHeader,
        max_bytes: int | None = None,
        buffer: torch.Tensor | None = None,
    ) -> None:
        """``buffer``: a uint8 CPU tensor of ``total_bytes`` to fill instead of a fresh one
        (receivers reuse buffers: fresh large allocations cost page faults on every push)."""
        self.total_bytes = int(header.total_bytes)
        if max_bytes is not None and self.total_bytes > max_bytes:
            raise CodecError(
                f"payload of {self.total_bytes} bytes exceeds the limit of {max_bytes} bytes"
            )
        self.received = 0
        if buffer is not None and (
            buffer.dtype != torch.uint8
            or buffer.numel() != self.total_bytes
            or buffer.device.type != "cpu"
            or not buffer.is_contiguous()
        ):
            raise CodecError(
                f"Assembler buffer must be a contiguous CPU uint8 tensor of {self.total_bytes} bytes"
            )
        self._buf = (
            buffer if buffer is not None else torch.empty(self.total_bytes, dtype=torch.uint8)
        )

    def add(self, chunk: pb.Chunk) -> None:
        self.add_data(chunk.offset, chunk.data)  # read the field once: each read copies it

    def add_data(self, offset: int, data: bytes, start: int = 0, size: int | None = None) -> None:
        """The bytes of one chunk at ``offset`` (``add`` without the message): ``data``, or its
        ``size`` bytes from ``start`` (copied from there, not sliced first)."""
        n = len(data) - start if size is None else size
        if start < 0 or n < 0 or start + n > len(data):
            raise CodecError(f"{n} bytes from {start} are not within a chunk of {len(data)} bytes")
        if n == 0:
            raise CodecError(f"empty chunk at offset {offset}")
        if offset != self.received:
            raise CodecError(
                f"chunk at offset {offset} arrived, expected offset {self.received}: "
                "chunks must arrive in order"
            )
        if self.received + n > self.total_bytes:
            raise CodecError(
                f"chunk of {n} bytes at offset {offset} overflows the payload of "
                f"{self.total_bytes} bytes"
            )
        # The one copy: from the message's bytes straight into the preallocated buffer, in bounds
        # as checked above (as fast as torch.frombuffer + slice assignment, without its warning
        # about read-only buffers).
        src = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value  # data's own buffer
        assert src is not None
        ctypes.memmove(self._buf.data_ptr() + self.received, src + start, n)
        self.received += n

    @property
    def complete(self) -> bool:
        return self.received == self.total_bytes

    def finish(self) -> torch.Tensor:
        """The whole payload; ``CodecError`` if bytes are missing."""
        if not self.complete:
            raise CodecError(f"stream ended after {self.received} of {self.total_bytes} bytes")
        return self._buf


def checksum(x: torch.Tensor, crc32: Callable[[Any], int] = zlib.crc32) -> int:
    """crc32 of a flat FP32 tensor's bytes (never 0, so 0 can mean "no checksum").

    Both sides compute it over the canonical parameters of a version to prove that applying a
    chain of delta updates reproduced them exactly. CUDA tensors are copied to the host first.
    `crc32`: zlib's, or one that gives the same numbers faster (the Synchronizer's native one).
    """
    x = x.detach().to("cpu", torch.float32).contiguous()
    if x.numel() == 0:
        return 1
    return crc32(x.view(torch.uint8).numpy()) or 1
