"""Building and loading `native.c`: the machine's C compiler, once per process, into a cache
named by the source, the flags and the machine (`load`); whether the kernels are here
(`available`) and whether the outer step runs them under `--kernels` (`resolve`). What the
kernels do and how they are called is `synchronizer.native`'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

KERNELS = ("auto", "native", "torch")
SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O3", "-fno-fast-math", "-ffp-contract=off", "-fPIC", "-shared", "-std=c99")
CACHE_ENV = "DILOCO_NATIVE_CACHE"  # where the built object is kept (default: the user's cache)
BUILD_TIMEOUT_S = 120.0

_lock = threading.Lock()
_built: dict[str, Kernels | str] = {}  # one build per process: the kernels, or why there are none

_i64 = ctypes.c_int64


class NativeUnavailable(RuntimeError):
    """The native kernels could not be built or loaded here; the message says why."""


@dataclass(frozen=True)
class Kernels:
    lib: ctypes.CDLL
    path: Path


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (found := shutil.which(name)):
            return found
    return None


def _cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "diloco-native"


def _build() -> Kernels:
    """The kernels from the cache, or built into it first. The object is named by the source,
    the flags and the machine's architecture (no compiler is needed to load one built before,
    e.g. into an image's cache at build time)."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join(FLAGS).encode(), platform.machine().encode()])
    ).hexdigest()[:16]
    candidates = [_cache_dir(), Path(tempfile.gettempdir()) / f"diloco-native-{os.getuid()}"]
    cc = _compiler()
    errors = []  # every place's reason: an object that cannot load must not hide behind the rest
    for directory in candidates:
        path = directory / f"diloco_native_{key}.so"
        if not path.exists():
            if cc is None:
                continue
            try:
                _compile(cc, path)
            except (NativeUnavailable, OSError, subprocess.SubprocessError) as e:
                errors.append(f"{path}: {e}")
                continue
        try:
            return Kernels(_declare(ctypes.CDLL(str(path))), path)
        except OSError as e:
            errors.append(f"{path}: {e}")
    if cc is None:
        errors.append(
            "no C compiler found (looked for $CC, cc, gcc and clang) and no object built "
            f"before in {' or '.join(str(d) for d in candidates)}"
        )
    raise NativeUnavailable("; ".join(errors))


def _compile(cc: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            raise NativeUnavailable(
                f"{cc} could not build {SOURCE.name}: {done.stderr.strip()[-500:]}"
            )
        # mkstemp makes the file private to its builder; a cache filled at image build time (as
        # root) is loaded by another user, so the object is readable as any built file would be
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o755 & ~umask)
        os.replace(tmp, path)  # whole or not at all, whoever builds at the same time
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp = ctypes.c_void_p
    f32, c_int = ctypes.c_float, ctypes.c_int
    pvp, pint = ctypes.POINTER(vp), ctypes.POINTER(c_int)
    # npush, data, kind, scales, n, bs, out, overwrite
    lib.diloco_accumulate.argtypes = [c_int, pvp, pint, pvp, _i64, _i64, vp, c_int]
    lib.diloco_accumulate.restype = None
    lib.diloco_absmax.argtypes = [vp, ctypes.c_int, _i64, ctypes.POINTER(ctypes.c_double)]
    lib.diloco_absmax.restype = ctypes.c_float
    lib.diloco_merge.argtypes = [vp, _i64, ctypes.c_float]
    lib.diloco_merge.restype = ctypes.c_float
    # the update chain's arguments, shared by the chain alone and by a whole round's step:
    # params, momentum, residual, residual_bf16, codes, scales, n, bs, factor, nesterov, mu,
    # nu, scratch
    chain: list[Any] = [vp, vp, vp, c_int, vp, vp, _i64, _i64, f32, c_int, f32, f32, vp]
    lib.diloco_chain_int8.argtypes = [vp, *chain]  # grad first
    lib.diloco_chain_int8.restype = c_int
    # npush, nsum, data, kind, scales, total, then the chain
    pushes: list[Any] = [c_int, c_int, pvp, pint, pvp, f32]
    lib.diloco_step_int8.argtypes = [*pushes, *chain]
    lib.diloco_step_int8.restype = c_int
    lib.diloco_crc32_fast.argtypes = []
    lib.diloco_crc32_fast.restype = ctypes.c_int
    lib.diloco_crc32.argtypes = [ctypes.c_uint32, vp, _i64]
    lib.diloco_crc32.restype = ctypes.c_uint32
    return lib


def load() -> Kernels:
    """The kernels, built on the first call of the process (NativeUnavailable with the reason
    where they cannot be; the same answer on every later call)."""
    with _lock:
        got = _built.get("kernels")
        if got is None:
            try:
                got = _build()
            except NativeUnavailable as e:
                got = str(e)
            _built["kernels"] = got
    if isinstance(got, str):
        raise NativeUnavailable(got)
    return got


def available() -> bool:
    """Whether the kernels are built here (`load` without raising), whatever `--kernels` says:
    for the work whose numbers do not depend on them (crc32, a received push's check)."""
    try:
        load()
    except NativeUnavailable:
        return False
    return True


def resolve(choice: str) -> bool:
    """Whether the outer step runs the native kernels under the `kernels` setting: `torch`
    never, `native` always (NativeUnavailable where they cannot be built), `auto` where they
    can (logging why not, once, where they cannot)."""
    if choice not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {choice!r}")
    if choice == "torch":
        return False
    try:
        load()
    except NativeUnavailable as e:
        if choice == "native":
            raise
        with _lock:
            if not _built.get("warned"):
                _built["warned"] = "yes"
                logger.warning("native kernels unavailable, the outer step runs torch's: %s", e)
        return False
    return True
