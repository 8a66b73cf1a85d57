"""A bare test client for the Synchronizer: raw RPCs, no retries, so tests see every status."""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from protos import codec, framing, layout
from protos import diloco_pb2 as pb
from protos import diloco_pb2_grpc as pb_grpc
from protos.initmodel import init_model_requests
from protos.spec import ModelSpec, TensorInfo, plan_fragments
from synchronizer.disk import Disk
from synchronizer.wire import RawChunk

TIMEOUT = 20.0


def small_spec(sizes: Sequence[int] = (300, 257, 100, 40), fragments: int = 2) -> ModelSpec:
    return plan_fragments(
        [TensorInfo(f"layer{i}.weight", (n,)) for i, n in enumerate(sizes)], fragments
    )


def push_messages(
    header: pb.PushHeader, buf: torch.Tensor, chunk_bytes: int = 512
) -> Iterator[pb.PushRequest]:
    yield pb.PushRequest(header=header)
    for chunk in framing.iter_chunks(buf, chunk_bytes):
        yield pb.PushRequest(chunk=chunk)


def pulled(replies: Iterator[pb.PullReply | RawChunk]) -> tuple[int, torch.Tensor]:
    """The version and the FP32 values of a full pull's replies."""
    first = next(replies)
    assert isinstance(first, pb.PullReply)
    header = first.header
    asm = framing.Assembler(header.payload)
    for r in replies:
        asm.add_data(r.chunk.offset, r.chunk.data)
    out = torch.empty(header.payload.numel, dtype=torch.float32)
    return header.version, codec.decode(asm.finish(), header.payload, out)


def push_header(
    learner_id: str,
    session: str,
    spec: ModelSpec,
    fragment: int,
    delta: torch.Tensor,
    codec_id: int,
    base: int,
    seq: int,
    tokens: int = 100,
    steps: int = 10,
    compute_s: float = 1.0,
) -> tuple[pb.PushHeader, torch.Tensor]:
    """A push's header and its encoded payload."""
    h = pb.PushHeader(
        learner_id=learner_id,
        session=session,
        seq=seq,
        spec_hash=spec.spec_hash,
        fragment_id=fragment,
        base_version=base,
        tokens=tokens,
        steps=steps,
        compute_s=compute_s,
        payload=layout.make_header(codec_id, delta.numel()),
    )
    return h, codec.encode(delta, codec_id)


class Client:
    def __init__(
        self,
        address: str,
        spec: ModelSpec,
        name: str = "test",
        metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.SynchronizerStub(self.channel)
        self.spec = spec
        self.name = name
        self.md = list(metadata)
        self.learner_id = ""
        self.session = ""
        self.seq = 0

    def close(self) -> None:
        self.channel.close()

    def join(self, learner_id: str = "", evaluator: bool = False) -> pb.JoinReply:
        reply = self.stub.Join(
            pb.JoinRequest(
                learner_name=self.name,
                spec=self.spec.to_proto(),
                learner_id=learner_id,
                session=self.session if learner_id else "",
                evaluator=evaluator,
            ),
            timeout=TIMEOUT,
            metadata=self.md,
        )
        self.learner_id, self.session = reply.learner_id, reply.session
        self.seq = reply.next_seq - 1
        return reply

    def init(self, flats: Sequence[torch.Tensor]) -> pb.InitModelReply:
        messages = init_model_requests(
            self.learner_id, self.session, self.spec.spec_hash, flats, chunk_bytes=1000
        )
        return self.stub.InitModel(messages, timeout=TIMEOUT, metadata=self.md)

    def header(
        self,
        fragment: int,
        delta: torch.Tensor,
        codec_id: int,
        base: int,
        seq: int | None = None,
        tokens: int = 100,
        steps: int = 10,
    ) -> tuple[pb.PushHeader, torch.Tensor]:
        if seq is None:
            self.seq += 1
            seq = self.seq
        return push_header(
            self.learner_id,
            self.session,
            self.spec,
            fragment,
            delta,
            codec_id,
            base,
            seq,
            tokens,
            steps,
        )

    def push(
        self,
        fragment: int,
        delta: torch.Tensor,
        codec_id: int = pb.CODEC_FP32,
        base: int = 0,
        seq: int | None = None,
        tokens: int = 100,
        steps: int = 10,
    ) -> pb.PushReply:
        h, buf = self.header(fragment, delta, codec_id, base, seq, tokens, steps)
        return self.stub.PushFragment(push_messages(h, buf), timeout=TIMEOUT, metadata=self.md)

    def pull(
        self,
        fragment: int,
        min_version: int = 0,
        wait_s: float = 0.0,
        codec_id: pb.Codec = pb.CODEC_FP32,
    ) -> tuple[int, torch.Tensor]:
        replies = self.stub.PullFragment(
            pb.PullRequest(
                learner_id=self.learner_id,
                session=self.session,
                fragment_id=fragment,
                min_version=min_version,
                wait_s=wait_s,
                codec=codec_id,
            ),
            timeout=TIMEOUT,
            metadata=self.md,
        )
        return pulled(replies)

    def heartbeat(
        self,
        steps: int = 0,
        tokens: int = 0,
        compute_s: float = 0.0,
        step_time_s: float = 0.0,
        overlap_steps: int = 0,
        pushes_done: bool = False,
    ) -> pb.HeartbeatReply:
        counters = pb.LearnerCounters(steps=steps, tokens=tokens, compute_s=compute_s)
        request = pb.HeartbeatRequest(
            learner_id=self.learner_id,
            session=self.session,
            counters=counters,
            step_time_s=step_time_s,
            overlap_steps=overlap_steps,
            pushes_done=pushes_done,
        )
        return self.stub.Heartbeat(request, timeout=TIMEOUT, metadata=self.md)

    def leave(self) -> None:
        self.stub.Leave(
            pb.LeaveRequest(learner_id=self.learner_id, session=self.session),
            timeout=TIMEOUT,
            metadata=self.md,
        )

    def status(self) -> pb.StatusReply:
        return self.stub.Status(pb.StatusRequest(), timeout=TIMEOUT, metadata=self.md)

    def report_eval(
        self, eval_loss: float, versions: dict[int, int] | None = None, eval_set: str = ""
    ) -> pb.EvalReply:
        request = pb.EvalReport(
            learner_id=self.learner_id,
            session=self.session,
            versions=[
                pb.FragmentVersion(fragment_id=f, version=v) for f, v in (versions or {}).items()
            ],
            eval_loss=eval_loss,
            eval_set=eval_set,
        )
        return self.stub.ReportEval(request, timeout=TIMEOUT, metadata=self.md)


SPEC_FOR_TESTS = small_spec()


def wait_until(
    predicate: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.05
) -> bool:
    """Polls a condition owned by another thread or process (leases lapse on the server's clock)."""
    stop = threading.Event()
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        stop.wait(interval_s)
    return True


def serve_process(
    command: Sequence[str],
    state_dir: Path,
    ready: Path,
    *flags: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, dict]:
    """Starts `command` (e.g. `python -m synchronizer`) `serve` on free ports with stdout piped,
    waits for its ready file and returns the process and the file's content (address, ports,
    epoch); AssertionError with the output if it exits or is not ready within 120 s."""
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [
            *command,
            "serve",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--state-dir",
            str(state_dir),
            "--ready-file",
            str(ready),
            *flags,
        ],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the Synchronizer did not start: {proc.communicate()[0]}")
        time.sleep(0.05)  # waiting on another process's file: no event to await
    return proc, json.loads(ready.read_text())


def poll(fn: Callable[[], Any], deadline_s: float, what: str, every_s: float = 0.25) -> Any:
    """fn() until it returns something truthy, or fail after deadline_s saying what never came."""
    end = time.monotonic() + deadline_s
    last: Any = None
    while time.monotonic() < end:
        try:
            last = fn()
        except (OSError, urllib.error.URLError) as e:
            last = e
        else:
            if last:
                return last
        time.sleep(every_s)
    pytest.fail(f"{what} within {deadline_s:.0f}s (last: {last!r})")


REPO = Path(__file__).resolve().parents[1]


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children first met first), read from /proc: the
    Synchronizers and learners a benchmark starts each get a session of their own, out of reach
    of a signal to its process group."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_serving(proc: subprocess.Popen, timeout_s: float = 60) -> str:
    """Stops a process from `serve_process` as its operator would (SIGTERM) and returns its
    output, read while it stops (a pipe left unread can hold a process that writes). One that has
    not exited within `timeout_s` is killed, so none is left to load the rest of the suite, and
    the test fails with its output."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(
            f"the Synchronizer had not stopped {timeout_s} s after SIGTERM; killed: {out[-3000:]}"
        ) from None
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (found before any dies, so none is reparented
    out of sight first)."""
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def run_smoke(name: str, out: Path, *extra: str, timeout_s: float = 230) -> dict[str, Any]:
    """Runs `python -m bench.NAME --smoke --json OUT` as a user would; asserts it exits 0 and
    returns the JSON it wrote. Past `timeout_s` it fails, killing the benchmark and every process
    it started, so none is left to load the rest of the suite."""
    proc = subprocess.Popen(
        [sys.executable, "-m", f"bench.{name}", "--smoke", "--json", str(out), *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"bench.{name} --smoke ran past {timeout_s:.0f} s\n{stdout[-3000:]}{stderr[-3000:]}"
        )
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return json.loads(out.read_text())


def resident_fraction(path: Path) -> float:
    """The share of a file's pages in the page cache (mincore over a mapping of it)."""
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as m:
        vec = (ctypes.c_ubyte * pages)()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        rc = libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec)
        del addr  # the mapping may close only once nothing points into it
        if rc != 0:
            pytest.skip(f"mincore failed: {os.strerror(ctypes.get_errno())}")
        return sum(v & 1 for v in vec) / pages


class KeepsPages(Disk):
    """The real filesystem, but nothing written is dropped from the page cache."""

    def forget(self, fd: int, offset: int, length: int) -> None:
        pass
