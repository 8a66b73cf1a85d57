"""A tiny version of the bundled example, run as real processes on loopback: what the end-to-end
tests and the chaos benchmark start and watch.

- `TINY`: `python -m demo train` flags for a model and data small enough that a step takes
  milliseconds on one CPU thread;
- `start_learner`: one learner process writing its result file as it goes;
- `wait_until`, `finish_ok`: waiting on other processes (their files and RPCs: no event to await),
  failing with the end of every log;
- `status`, `versions`, `final_pull`: what the Synchronizer serves.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from demo.procs import Procs, read_json
from protos import diloco_pb2 as pb
from protos import diloco_pb2_grpc as pb_grpc

TINY = [
    "--n-layer",
    "1",
    "--d-model",
    "32",
    "--n-head",
    "2",
    "--context",
    "32",
    "--batch-size",
    "8",
    "--max-bytes",
    str(1 << 18),
    "--eval-windows",
    "64",
    "--threads",
    "1",
    "--lr",
    "1e-2",
    "--warmup-steps",
    "10",
    "--sync-every",
    "10",
    "--fragments",
    "2",
    "--log-every",
    "10",
    "--retry-max-s",
    "1",
]


class NotInTime(AssertionError):
    """A process did not get where it should within its time (the logs' ends attached)."""


def wait_until(
    cond: Callable[[], object], timeout_s: float, what: str, procs: Procs | None = None
) -> object:
    """cond() until it is truthy (polled: it reads other processes' files and RPCs)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise NotInTime(
                f"timed out after {timeout_s} s waiting for {what}\n"
                + (procs.tails() if procs else "")
            )
        time.sleep(0.1)


def start_learner(
    procs: Procs, address: str, index: int, learners: int, steps: int, *flags: str, run: int = 0
) -> tuple[subprocess.Popen, Path]:
    """`python -m demo train` of the tiny example as learner `index` of `learners`; returns the
    process and its result file (ROOT/l{index}.run{run}.json)."""
    out = procs.root / f"l{index}.run{run}.json"
    proc = procs.start(
        f"l{index}",
        [
            sys.executable,
            "-m",
            "demo",
            "train",
            "--synchronizer",
            address,
            "--name",
            f"l{index}",
            "--learner-index",
            str(index),
            "--learners",
            str(learners),
            "--steps",
            str(steps),
            "--out",
            str(out),
            *TINY,
            *flags,
        ],
    )
    return proc, out


def status(address: str) -> pb.StatusReply:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.SynchronizerStub(channel).Status(pb.StatusRequest(), timeout=10)


def versions(address: str) -> list[int]:
    return [v.version for v in status(address).versions]


def finish_ok(procs: Procs, proc: subprocess.Popen, out: Path, timeout_s: float = 90) -> dict:
    """The learner's result once it has exited 0 having finished; NotInTime otherwise."""
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise NotInTime(f"{out.name} did not finish in {timeout_s} s\n{procs.tails()}") from None
    result = read_json(out)
    if rc != 0 or not result.get("finished"):
        raise NotInTime(f"{out.name} exited with {rc}\n{procs.tails()}")
    return result


def final_pull(procs: Procs, address: str) -> dict:
    """A learner with zero steps: joins, adopts the served model, evaluates it, leaves."""
    proc, out = start_learner(procs, address, 0, 1, 0, "--name", "final-pull", run=99)
    return finish_ok(procs, proc, out, timeout_s=60)
