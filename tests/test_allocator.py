"""Freed buffers kept for reuse (`synchronizer.allocator`): glibc's thresholds fixed by `serve`."""

import json
import subprocess
import sys

import pytest

from synchronizer import allocator

# Three buffers of 24 MiB written and freed, five times over, with malloc itself (as gRPC's and
# Python's buffers are): the page faults of each time, as a JSON list.
_ROUNDS = """
import ctypes, json, resource, sys
from synchronizer import allocator
if sys.argv[1] == "keep":
    allocator.keep_freed_buffers({})
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n, faults = 24 << 20, []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [libc.malloc(n) for _ in range(3)]
    for p in buffers:
        ctypes.memset(p, 1, n)
    for p in buffers:
        libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


def _faults(mode: str) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(not allocator.GLIBC, reason="the thresholds are glibc's")
def test_freed_buffers_are_written_again_without_page_faults_once_kept():
    pages = 3 * (24 << 20) // 4096
    kept, plain = _faults("keep"), _faults("plain")
    # the first time maps the pages, whatever the settings
    assert kept[0] >= pages * 0.9 and plain[0] >= pages * 0.9
    # glibc's own thresholds hand the freed top of the heap back each time: fresh pages again
    assert all(f >= pages * 0.5 for f in plain[1:]), plain
    assert all(f < pages * 0.05 for f in kept[1:]), kept


@pytest.mark.parametrize(
    "environ",
    [
        {"MALLOC_TRIM_THRESHOLD_": "131072"},
        {"MALLOC_MMAP_THRESHOLD_": "131072"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"},
    ],
)
def test_thresholds_the_environment_sets_stand(environ):
    assert allocator.keep_freed_buffers(environ) == (
        "malloc thresholds left as the environment sets them"
    )


@pytest.mark.skipif(not allocator.GLIBC, reason="the thresholds are glibc's")
def test_other_glibc_tunables_do_not_keep_the_thresholds_from_being_set():
    said = subprocess.run(
        [
            sys.executable,
            "-c",
            "from synchronizer import allocator; "
            "print(allocator.keep_freed_buffers({'GLIBC_TUNABLES': 'glibc.cpu.x86_ibt=on'}))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert said.stdout.startswith("freed buffers up to 32 MiB kept for reuse"), said
