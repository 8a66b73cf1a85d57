"""zlib's crc32 (the same numbers) folded with carry-less multiplication by `native.c`, for the
write-ahead log and a version's parameter checksum, whatever `--kernels` says (its numbers are
zlib's): zlib's tables run at a third of its speed. zlib's own where the kernels do not build
or the CPU cannot fold.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch

from synchronizer import native

CRC_MIN_BYTES = 1 << 16  # smaller buffers go to zlib, whose per-call cost is lower


def crc32_folding() -> bool:
    """Whether `crc32` folds with carry-less multiplication here (the kernels build and the
    CPU has PCLMULQDQ); otherwise it is zlib's."""
    try:
        return bool(native.load().lib.diloco_crc32_fast())
    except native.NativeUnavailable:
        return False


def crc32(data: Any, value: int = 0) -> int:
    """zlib.crc32(data, value), the same number, computed by `native.c`'s folding where it can
    be (`crc32_folding`): several times zlib's speed over the megabytes of a logged push or a
    version's parameters. `data`: any contiguous buffer (bytes, memoryview, bytearray, a
    contiguous CPU tensor's bytes). The GIL is released while it runs, as zlib's is."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or not data.is_contiguous():
            raise ValueError("crc32 takes a contiguous CPU tensor")
        data = data.reshape(-1).view(torch.uint8).numpy()  # its bytes, no copy
    view = memoryview(data)
    if view.nbytes < CRC_MIN_BYTES or not view.c_contiguous or not crc32_folding():
        return zlib.crc32(view, value)
    address = np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data  # read-only too, no copy
    return int(native.load().lib.diloco_crc32(value, address, view.nbytes))
