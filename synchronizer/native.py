"""The outer step's native kernels: `native.c`, built on first use by the machine's C compiler.

torch runs an outer step as a chain of element-wise operations, each a pass over memory: the
decode of a push is a dozen, the INT8 update chain another dozen (`docs/performance.md`). The
kernels in `native.c` do each of those in one pass: every held push of a round decoded and
weighted into its sums together (`accumulate`), the sums divided into the merged delta while its
range is taken (`merge`), and the Nesterov step, the INT8 encoding of the update with its
residual, and the parameters' add, block by block (`chain_int8`). Pushes are INT8 or INT4 codes
or BF16 or FP32 values (`Push`). Where a round is still all held pushes when its step comes,
`step_int8` does all of it in one pass, each block of the merged delta made in cache and
stepped at once, with the same numbers and no FP32 sums.
`native.c` also holds zlib's crc32 by carry-less folding, which `synchronizer.crc` calls.

They are optional: nothing but a C compiler is needed (no torch headers, no build step at
install; `synchronizer.native_build` builds and loads them), the shared object is cached per
source, compiler and machine, and where none can be built the Synchronizer runs the torch path
(`--kernels auto`, the default) or refuses to start (`--kernels native`). The kernels' numbers
are their own (no fused multiply-add, each product rounded before its add): the same on every
machine, but not always torch's to the last bit, so the kernel in use is one of the log's replay
settings. Tensors must be contiguous CPU tensors; the GIL is released while a kernel runs
(ctypes does so for every foreign call).

An outer step's kernels (`step_int8`, `chain_int8`) take `threads`: a fragment of at least
`SPLIT_MIN_ELEMS` (16M) elements per thread is cut into that many ranges of whole blocks, each
run by one thread at once (the calling thread takes the first). Every block is computed alone,
so the numbers are the same for any count: it is not a replay setting. One core's memory
bandwidth is what holds a step (`docs/performance.md`); two cores give it nearly twice that.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

# Building and loading are native_build's; these names are the kernels' interface too.
from synchronizer.native_build import CACHE_ENV as CACHE_ENV
from synchronizer.native_build import KERNELS as KERNELS
from synchronizer.native_build import SOURCE as SOURCE
from synchronizer.native_build import NativeUnavailable as NativeUnavailable
from synchronizer.native_build import available as available
from synchronizer.native_build import load as load
from synchronizer.native_build import resolve as resolve

RUN_ELEMS = 4096  # native.c's RUN: the largest block `step_int8` takes
MAX_THREADS = 64  # threads one kernel call may split across
AUTO_THREADS = 4  # the most `kernel_threads(0)` takes: memory bandwidth stops growing by then
# Elements per thread below which a step is not split: such a step takes a few ms alone, which
# learners syncing every few seconds cannot see, and its second core is taken from receiving
# pushes (intake of 6.25M-element INT4 pushes fell 12% so: docs/performance.md).
SPLIT_MIN_ELEMS = 1 << 24
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()

# What a push is to the kernels that add pushes (native.c's PUSH_ kinds): (data, kind, scales).
# INT8 codes (uint8, one per element) and INT4 codes (two per byte, low nibble first, code + 8)
# come with FP32 scales, one per block, the push's weight folded in; BF16 and FP32 values with
# one FP32 weight.
INT8, INT4, BF16, FP32 = 0, 1, 2, 3
Push = tuple[torch.Tensor, int, torch.Tensor]
_DATA = {  # each kind's data: dtype, elements per item
    INT8: (torch.uint8, 1),
    INT4: (torch.uint8, 2),
    BF16: (torch.bfloat16, 1),
    FP32: (torch.float32, 1),
}


def kernel_threads(setting: int) -> int:
    """The threads an outer step's kernels split across under the `kernel_threads` setting: the
    setting, or for 0 the cores this process may run on, at most AUTO_THREADS."""
    if not 0 <= setting <= MAX_THREADS:
        raise ValueError(f"kernel_threads must be in [0, {MAX_THREADS}], got {setting}")
    if setting:
        return setting
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, AUTO_THREADS))


def ranges(n: int, block_size: int, threads: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges covering [0, n) in order, one per thread, none more than 2 x block_size
    longer than another: every start a multiple of 2 x block_size (whole blocks, and whole
    bytes of 4-bit codes), SPLIT_MIN_ELEMS elements each on average; one range where a split
    is not worth it."""
    step = 2 * block_size
    units = -(-n // step)
    k = max(1, min(threads, n // SPLIT_MIN_ELEMS, units))
    bounds = [min(n, (units * i // k) * step) for i in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _split(part: Callable[[int, int], bool], n: int, block_size: int, threads: int) -> bool:
    """`part(lo, hi)` over `ranges(n, block_size, threads)`, at once; True if every one was."""
    return _in_parallel(
        [functools.partial(part, lo, hi) for lo, hi in ranges(n, block_size, threads)]
    )


def _in_parallel(calls: list[Callable[[], bool]]) -> bool:
    """Runs the calls at once, the first on this thread; True if every one returned True."""
    global _pool
    if len(calls) == 1:
        return calls[0]()
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_THREADS - 1, thread_name_prefix="native-kernel")
        pool = _pool
    futures = [pool.submit(call) for call in calls[1:]]
    ok = calls[0]()
    return all([f.result() for f in futures]) and ok


def _ptr(t: torch.Tensor) -> int:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("native kernels take contiguous CPU tensors")
    return t.data_ptr()


def _check_f32(name: str, t: torch.Tensor, numel: int) -> None:
    if t.dtype != torch.float32 or t.numel() < numel:
        raise ValueError(f"{name} must be FP32 of at least {numel} elements")


def accumulate(
    pushes: list[Push], n: int, block_size: int, out: torch.Tensor, overwrite: bool
) -> None:
    """out (=|+=) the sum, in order, of each push's values times their scale over [0, n)
    (`Push`; codes have `block_size`)."""
    lib = load().lib
    _check_f32("out", out, n)
    data, kinds, scales = _pushes(pushes, n, block_size)
    lib.diloco_accumulate(
        len(pushes), data, kinds, scales, n, block_size, _ptr(out), int(overwrite)
    )


def _pushes(pushes: list[Push], n: int, block_size: int):
    """The kernels' arrays of pushes' data, kinds and scales (each push checked)."""
    k = len(pushes)
    data = (ctypes.c_void_p * k)()
    scales = (ctypes.c_void_p * k)()
    kinds = (ctypes.c_int * k)()
    blocks = -(-n // block_size)
    for i, (d, kind, s) in enumerate(pushes):
        dtype, per_byte = _DATA[kind]
        if d.dtype != dtype or d.numel() < -(-n // per_byte):
            raise ValueError(f"push {i} must be {dtype} covering every element")
        _check_f32("scales", s, 1 if kind in (BF16, FP32) else blocks)
        data[i], scales[i], kinds[i] = _ptr(d), _ptr(s), kind
    return data, kinds, scales


def _cut(push: Push, lo: int, block_size: int) -> Push:
    """A push from element `lo` on (a multiple of 2 x block_size)."""
    d, kind, s = push
    if kind in (BF16, FP32):
        return d[lo:], kind, s
    return d[lo // 2 :] if kind == INT4 else d[lo:], kind, s[lo // block_size :]


def absmax(values: torch.Tensor) -> float:
    """The greatest |x| of contiguous BF16 or FP32 values (Inf or NaN where one is not
    finite), in one pass on their bits."""
    return _absmax(values, None)


def absmax_and_norm(values: torch.Tensor) -> tuple[float, float]:
    """(`absmax`, the L2 norm) of contiguous BF16 or FP32 values, in one pass: the squares
    summed in double precision, so the norm of finite values is finite."""
    squares = ctypes.c_double()
    largest = _absmax(values, squares)
    return largest, math.sqrt(squares.value) if math.isfinite(largest) else math.inf


def _absmax(values: torch.Tensor, squares: ctypes.c_double | None) -> float:
    if values.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError("absmax takes BF16 or FP32 values")
    lib = load().lib
    bf16 = int(values.dtype == torch.bfloat16)
    out = ctypes.byref(squares) if squares is not None else None
    return float(lib.diloco_absmax(_ptr(values), bf16, values.numel(), out))


def merge(sums: torch.Tensor, total: float) -> float:
    """sums /= total in place; returns the greatest |merged value| (Inf or NaN where one is
    not finite)."""
    _check_f32("sums", sums, sums.numel())
    return float(load().lib.diloco_merge(_ptr(sums), sums.numel(), total))


def chain_int8(
    params: torch.Tensor,
    momentum: torch.Tensor | None,
    grad: torch.Tensor,
    residual: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    factor: float,
    mu: float,
    nu: float | None = None,
    threads: int = 1,
) -> bool:
    """One outer step through the INT8 update chain (`native.c`, `diloco_chain_int8`);
    Nesterov with `momentum` (decayed by `mu`, looked ahead by `nu`: mu's unless the step is a
    partial one), SGD without; split across `threads` (`ranges`). False if the update was not
    finite."""
    _check_f32("grad", grad, params.numel())

    def part(lo: int, hi: int) -> bool:
        scratch = torch.empty(block_size)
        chain = _chain(
            (lo, hi), params, momentum, residual, codes, scales, block_size, factor, mu, nu, scratch
        )
        return load().lib.diloco_chain_int8(_ptr(grad[lo:hi]), *chain) == 0

    return _split(part, params.numel(), block_size, threads)


def step_int8(
    pushes: list[Push],
    summed: int,
    total: float,
    params: torch.Tensor,
    momentum: torch.Tensor | None,
    residual: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    factor: float,
    mu: float,
    nu: float | None = None,
    threads: int = 1,
) -> bool:
    """A round's whole outer step from its pushes (`Push`; `native.c`, `diloco_step_int8`):
    the same numbers as `accumulate` of the first `summed` pushes (the first written), `merge`
    by `total`, `accumulate` of the rest added, then `chain_int8`, with no FP32 sums in memory;
    split across `threads` (`ranges`). Pushes of codes have the chain's `block_size` (at most
    4096); the caller has shown the merged delta appliable (nothing here checks its range). False if
    the update was not finite."""
    if not 1 <= summed <= len(pushes):
        raise ValueError(f"summed must be in [1, {len(pushes)}], got {summed}")
    if not 0 < block_size <= RUN_ELEMS:
        raise ValueError(f"block_size must be in [1, {RUN_ELEMS}], got {block_size}")

    def part(lo: int, hi: int) -> bool:
        scratch = torch.empty(2 * block_size)
        chain = _chain(
            (lo, hi), params, momentum, residual, codes, scales, block_size, factor, mu, nu, scratch
        )
        cut = [_cut(push, lo, block_size) for push in pushes]
        arrays = _pushes(cut, hi - lo, block_size)
        return load().lib.diloco_step_int8(len(pushes), summed, *arrays, total, *chain) == 0

    return _split(part, params.numel(), block_size, threads)


def _chain(
    span: tuple[int, int],
    params: torch.Tensor,
    momentum: torch.Tensor | None,
    residual: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    factor: float,
    mu: float,
    nu: float | None,
    scratch: torch.Tensor,
) -> tuple[Any, ...]:
    """The arguments both chain kernels end with, over elements [lo, hi) of `span` (lo a
    multiple of block_size), checked (`scratch`: the caller's, alive until the call returns)."""
    lo, hi = span
    params, residual, codes = params[lo:hi], residual[lo:hi], codes[lo:hi]
    momentum = None if momentum is None else momentum[lo:hi]
    scales = scales[lo // block_size :]
    n = params.numel()
    _check_f32("params", params, n)
    if momentum is not None:
        _check_f32("momentum", momentum, n)
    if residual.dtype not in (torch.bfloat16, torch.float32) or residual.numel() < n:
        raise ValueError("residual must be BF16 or FP32 covering every element")
    if codes.dtype != torch.uint8 or codes.numel() < n:
        raise ValueError("codes must be uint8 of at least n bytes")
    _check_f32("scales", scales, -(-n // block_size))
    return (
        _ptr(params),
        _ptr(momentum) if momentum is not None else None,
        _ptr(residual),
        int(residual.dtype == torch.bfloat16),
        _ptr(codes),
        _ptr(scales),
        n,
        block_size,
        factor,
        int(momentum is not None),
        mu,
        mu if nu is None else nu,
        _ptr(scratch),
    )
