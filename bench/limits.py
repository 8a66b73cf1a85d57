"""The machine's own limits, measured in the run whose figures are ratios against them: one core's
memory bandwidth over an outer step's sizes (a copy and a triad pass), the sequential write
bandwidth with fdatasync of the directory a Synchronizer keeps its state in, and the bytes each
outer optimizer's arithmetic must move. A figure whose baseline could not be measured is None,
with the reason under `missing` (`combine` gathers them, `shown` prints either).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from synchronizer.disk import Disk

# Bytes one outer step's arithmetic must move per parameter, FP32: the passes it cannot avoid.
OUTER_BYTES_PER_PARAM = {
    "sgd": 12,  # read parameters and the merged delta, write parameters
    "nesterov": 20,  # read parameters, momentum and the merged delta; write parameters, momentum
    # per arrival: read parameters, the merged delta and the period's sum; write parameters and
    # the sum (the momentum's read and write every N-th arrival are not counted)
    "delayed_nesterov": 20,
}


def combine(*parts: dict[str, Any]) -> dict[str, Any]:
    """The figures of `parts` in one dict, their `missing` reasons merged."""
    out: dict[str, Any] = {}
    missing: dict[str, str] = {}
    for part in parts:
        missing |= part.get("missing", {})
        out |= {k: v for k, v in part.items() if k != "missing"}
    return out | {"missing": missing}


def shown(result: dict[str, Any], key: str, spec: str = ".3f") -> str:
    """`key`'s figure formatted, or "missing: why"."""
    value = result.get(key)
    if value is None:
        return f"missing: {result.get('missing', {}).get(key, 'not measured')}"
    return format(value, spec)


def _best_s(run: Callable[[], Any], repeats: int) -> float:
    run()  # first touch: page faults and cache state are not the pass being timed
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def memory_bandwidth(numel: int, repeats: int = 5) -> dict[str, Any]:
    """One core's memory bandwidth over `numel` FP32 elements (the outer step's size), best of
    `repeats` after a first untimed pass, torch on one thread: `mem_bw_copy_GBps` from
    `dst.copy_(src)` (8 bytes moved per element) and `mem_bw_triad_GBps` from `a = b + s * c`
    (12 bytes), as STREAM counts them."""
    if numel < 1:
        why = f"no elements to pass over (numel {numel})"
        return {
            "mem_bw_numel": numel,
            "mem_bw_copy_GBps": None,
            "mem_bw_triad_GBps": None,
            "missing": {"mem_bw_copy_GBps": why, "mem_bw_triad_GBps": why},
        }
    a, b, c = torch.empty(numel), torch.full((numel,), 1.0), torch.full((numel,), 2.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        copy_s = _best_s(lambda: a.copy_(b), repeats)
        triad_s = _best_s(lambda: torch.add(b, c, alpha=3.0, out=a), repeats)
    finally:
        torch.set_num_threads(threads)
    return {
        "mem_bw_numel": numel,
        "mem_bw_copy_GBps": 8 * numel / copy_s / 1e9,
        "mem_bw_triad_GBps": 12 * numel / triad_s / 1e9,
    }


def outer_step_figures(
    outer: str, numel: int, step_s: float, triad_GBps: float | None
) -> dict[str, Any]:
    """An outer step of `step_s` seconds over `numel` parameters against one core's triad
    bandwidth: `apply_bw_ratio` = the bytes its arithmetic must move per second over that
    bandwidth (1: as fast as torch's one-thread triad moves memory, which a fused native step
    may pass), and `bytes_per_param_moved` = the bytes of memory traffic per parameter its time
    is worth at that bandwidth (beside `outer_bytes_per_param`, the arithmetic's own)."""
    need = OUTER_BYTES_PER_PARAM[outer]
    out: dict[str, Any] = {"outer": outer, "outer_bytes_per_param": need}
    why = ""
    if triad_GBps is None:
        why = "the triad bandwidth was not measured"
    elif step_s <= 0:
        why = f"no outer step was timed (outer step {step_s} s)"
    if why:
        keys = ("apply_bw_ratio", "bytes_per_param_moved")
        return out | dict.fromkeys(keys) | {"missing": dict.fromkeys(keys, why)}
    assert triad_GBps is not None
    return out | {
        "apply_bw_ratio": need * numel / step_s / (triad_GBps * 1e9),
        "bytes_per_param_moved": step_s * triad_GBps * 1e9 / numel,
    }


def disk_write_bandwidth(
    directory: Path, total_bytes: int = 128 << 20, block_bytes: int = 4 << 20
) -> dict[str, Any]:
    """Sequential write bandwidth with fdatasync of the file system under `directory`, written
    as the write-ahead log writes: `total_bytes` in blocks of `block_bytes` appended to a new
    file there with os.write, each block fdatasync'd and then its pages dropped from the page
    cache (`Disk.forget`), all timed together; the file is deleted after. Without the drop this
    would time the page cache taking fresh pages as much as the disk: on this machine's
    virtual disk, `dd bs=4M count=64 conv=fdatasync` read anywhere from 125 to 1,218 MB/s, as
    the pages it wrote into were reused or fresh, against 1.1 GB/s with each block dropped.
    `disk_write_MBps`, or missing with the error that stopped it."""
    out: dict[str, Any] = {"disk_dir": str(directory), "disk_write_bytes": total_bytes}
    if getattr(os, "fdatasync", None) is None:
        return out | {
            "disk_write_MBps": None,
            "missing": {"disk_write_MBps": "os.fdatasync is not available on this platform"},
        }
    disk = Disk()
    block = memoryview(os.urandom(block_bytes))
    try:
        fd, name = tempfile.mkstemp(prefix="disk-bandwidth-", dir=directory)
        try:
            written, t0 = 0, time.perf_counter()
            while written < total_bytes:
                n = disk.write(fd, block[: total_bytes - written])
                disk.fsync(fd)
                disk.forget(fd, written, n)
                written += n
            seconds = time.perf_counter() - t0
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as e:
        why = f"writing {total_bytes >> 20} MiB to {directory} failed: {e}"
        return out | {"disk_write_MBps": None, "missing": {"disk_write_MBps": why}}
    return out | {"disk_write_MBps": written / seconds / 1e6}
