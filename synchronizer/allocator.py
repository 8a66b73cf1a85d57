"""Freed buffers kept for reuse: glibc's malloc told not to hand them back to the kernel.

A Synchronizer allocates and frees buffers of megabytes all the time: the bytes gRPC receives,
receive buffers the payload budget could not pool, encoded links and pull replies. glibc maps a
buffer above its mmap threshold (dynamic, at most 32 MiB) fresh and unmaps it when freed, and
returns the free top of a heap to the kernel past its trim threshold (twice the mmap threshold);
the next buffer of that size is then fresh pages, each one a page fault that zeroes 4 KiB before
the first byte is written: over a million in an 8 s `bench.ingest` cell at 100M parameters
(docs/performance.md, "Freed buffers kept for reuse").

`keep_freed_buffers` fixes both thresholds (which also ends glibc's dynamic adjustment): buffers
up to `MMAP_THRESHOLD` come from malloc's heaps, and a heap's free top is kept up to
`TRIM_THRESHOLD`. Resident memory then stays near its peak after a burst instead of falling back;
the buffers it holds are the ones the next pushes take. It is done by the `serve` command, once
per process, never by the library on a process that embeds a Synchronizer; where the environment
already sets either threshold (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, or
`GLIBC_TUNABLES` naming `glibc.malloc.`) the environment's settings stand, and neither is set
here: that is how an operator chooses other values.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping

MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit: buffers above it are always mapped fresh
TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
ENV_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
GLIBC = platform.libc_ver()[0] == "glibc"  # the thresholds are glibc's


def keep_freed_buffers(environ: Mapping[str, str] = os.environ) -> str:
    """Sets glibc's mmap and trim thresholds for this process (see the module's docstring);
    says what it did, in words for the log."""
    if any(name in environ for name in ENV_SETTINGS) or "glibc.malloc." in environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return "malloc thresholds left as the environment sets them"
    if not GLIBC:
        return "malloc thresholds left as they are (not glibc)"
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return "malloc thresholds left as they are (no mallopt)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    ):
        return "malloc thresholds left as they are (mallopt refused them)"
    return (
        f"freed buffers up to {MMAP_THRESHOLD >> 20} MiB kept for reuse "
        f"(malloc mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold "
        f"{TRIM_THRESHOLD >> 20} MiB)"
    )
