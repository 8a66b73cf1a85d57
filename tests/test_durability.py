"""Nothing acknowledged is lost: broken streams apply nothing, checkpoints are atomic and skip damage,
and a power cut at any moment loses nothing acknowledged (`tests/powercut.py`)."""

from __future__ import annotations

import errno
import json
import logging
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from bench import durability as durability_bench
from protos import diloco_pb2 as pb
from protos import framing
from protos.spec import TensorInfo, plan_fragments
from synchronizer import checkpoint
from synchronizer.config import SynchronizerConfig
from synchronizer.core import Synchronizer
from synchronizer.disk import Disk
from synchronizer.errors import Code, Rejected
from synchronizer.journal import EPOCH_FILE, load_epoch
from synchronizer.metrics import Metrics
from tests import powercut
from tests.core_helpers import CoreClient
from tests.helpers import TIMEOUT, Client, small_spec, wait_until

SPEC = small_spec(fragments=1)


def test_learner_dying_mid_stream_leaves_nothing_half_applied(make_server, caplog):
    caplog.set_level(logging.WARNING, logger="synchronizer.service")
    srv = make_server(quorum=1, grace="none")
    c = Client(srv.address, SPEC)
    c.join()
    c.init([torch.zeros(SPEC.fragments[0].numel)])
    h, buf = c.header(0, torch.full((SPEC.fragments[0].numel,), 0.25), pb.CODEC_FP32, 0, seq=1)
    chunks = list(framing.iter_chunks(buf, 256))
    half_sent, never = threading.Event(), threading.Event()

    def dying() -> Iterator[pb.PushRequest]:
        yield pb.PushRequest(header=h)
        yield pb.PushRequest(chunk=chunks[0])
        half_sent.set()
        never.wait(30)  # the process "dies" here: the call is cancelled below

    future = c.stub.PushFragment.future(dying(), timeout=30)
    assert half_sent.wait(30)
    # The client has sent them; cancel only once the server's handler holds the stream (on a
    # busy machine a call cancelled before it is dispatched never reaches the handler at all).
    streams_open = srv.synchronizer.metrics.streams_open
    assert wait_until(lambda: streams_open._value.get() == 1, TIMEOUT)
    future.cancel()
    assert future.cancelled() or future.exception() is not None
    cancelled = srv.synchronizer.metrics.rpcs.labels("PushFragment", "CANCELLED")
    deadline = time.monotonic() + 30
    while cancelled._value.get() < 1 and time.monotonic() < deadline:  # the handler sees it soon
        time.sleep(0.01)
    # Only now may the request generator end: ending it earlier can half-close the stream
    # before the cancellation reaches the server, which then sees a push cut short instead.
    never.set()
    assert cancelled._value.get() == 1
    # An expected event: one warning line, no error with a traceback.
    records = [r for r in caplog.records if r.name == "synchronizer.service"]
    assert not [r for r in records if r.levelno >= logging.ERROR]
    assert [r.levelno for r in records if "went away" in r.getMessage()] == [logging.WARNING]
    frag = srv.synchronizer.model.fragments[0]
    assert (
        frag.admission.round is None
        and frag.version == 0
        and torch.equal(frag.model.params, torch.zeros(frag.numel))
    )
    retry = c.push(
        0, torch.full((SPEC.fragments[0].numel,), 0.25), seq=1
    )  # same seq: not a duplicate
    assert retry.outcome == pb.PUSH_ACCEPTED


def test_damaged_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path):
    checkpoint.save(tmp_path, {"x": torch.ones(3)}, {"n": 1}, keep=3)
    newest = checkpoint.save(tmp_path, {"x": torch.full((3,), 2.0)}, {"n": 2}, keep=3)
    newest.write_bytes(newest.read_bytes()[:20])  # torn by a crash that bypassed the rename
    latest = checkpoint.load_latest(tmp_path)
    assert latest is not None
    tensors, meta, path = latest
    assert meta == {"n": 1} and torch.equal(tensors["x"], torch.ones(3)) and path != newest


def test_only_the_last_checkpoints_are_kept_and_no_temporaries_remain(tmp_path):
    for i in range(5):
        checkpoint.save(tmp_path, {"x": torch.full((2,), float(i))}, {"n": i}, keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ckpt-0000000004.safetensors", "ckpt-0000000005.safetensors"]


def test_shutdown_merges_acknowledged_contributions_before_the_final_checkpoint(
    make_server, tmp_path
):
    state = tmp_path / "s"
    srv = make_server(
        quorum=2,
        grace="fixed",
        grace_max_s=60.0,
        state_dir=state,
        outer="sgd",
        outer_lr=1.0,
        anchor="base",
    )
    a, b = Client(srv.address, SPEC, "a"), Client(srv.address, SPEC, "b")
    a.join()
    b.join()
    a.init([torch.zeros(SPEC.fragments[0].numel)])
    assert (
        a.push(0, torch.ones(SPEC.fragments[0].numel)).outcome == pb.PUSH_ACCEPTED
    )  # round waits for K=2
    srv.server.stop(0).wait()
    srv.synchronizer.close()
    again = make_server(state_dir=state, outer="sgd")
    c = Client(again.address, SPEC)
    c.join()
    version, params = c.pull(0)
    assert version == 1 and torch.equal(params, -torch.ones(SPEC.fragments[0].numel))


def test_unreachable_state_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    try:
        checkpoint.save(blocker / "state", {"x": torch.ones(1)}, {}, keep=1)
    except OSError as e:
        assert "file" in str(e)
    else:
        raise AssertionError("expected OSError")


def test_restart_with_another_outer_optimizer_keeps_parameters_and_starts_fresh_state(
    make_server, tmp_path
):
    state = tmp_path / "s"
    srv = make_server(quorum=1, grace="none", state_dir=state, outer="nesterov")
    c = Client(srv.address, SPEC)
    c.join()
    c.init([torch.zeros(SPEC.fragments[0].numel)])
    c.push(0, torch.ones(SPEC.fragments[0].numel))
    _, before = c.pull(0, min_version=1, wait_s=10)
    srv.server.stop(0).wait()
    srv.synchronizer.close()
    again = make_server(state_dir=state, outer="sgd")
    c2 = Client(again.address, SPEC)
    c2.join()
    assert torch.equal(c2.pull(0)[1], before)


def test_a_pull_cancelled_mid_stream_is_counted_and_not_logged_as_a_failure(make_server, caplog):
    numel = 1 << 22  # 16 MiB as FP32: more than gRPC's flow-control windows hold
    spec = plan_fragments([TensorInfo("w", (numel,))], 1)
    srv = make_server()
    c = Client(srv.address, spec, "l0")
    c.join()
    c.init([torch.zeros(numel)])
    caplog.set_level(logging.WARNING, logger="synchronizer")
    replies = c.stub.PullFragment(
        pb.PullRequest(learner_id=c.learner_id, session=c.session, fragment_id=0),
        timeout=TIMEOUT,
        metadata=c.md,
    )
    assert next(replies).WhichOneof("kind") == "header"
    replies.cancel()
    cancelled = srv.synchronizer.metrics.rpcs.labels("PullFragment", "CANCELLED")
    assert wait_until(lambda: cancelled._value.get() == 1, TIMEOUT)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# Power cuts ---------------------------------------------------------------------------------


def test_a_power_cut_keeps_only_what_was_fsynced_files_and_names_alike(tmp_path):
    disk = powercut.RecordingDisk(tmp_path)
    disk.make_dirs(tmp_path / "d")
    fd = disk.open(tmp_path / "d" / "kept")
    disk.fsync_dir(tmp_path / "d")
    disk.write_all(fd, b"synced")
    disk.fsync(fd)
    disk.write_all(fd, b" and not")
    unnamed = disk.create(tmp_path / "d" / "unnamed")  # its name never made durable
    disk.write_all(unnamed, b"x")
    disk.fsync(unnamed)
    disk.replace(tmp_path / "d" / "kept", tmp_path / "d" / "renamed")  # not durable either
    after, _ = disk.cut(random.Random(0), "drop")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["kept"]
    assert (tmp_path / "d" / "kept").read_bytes() == b"synced"
    fd = after.open(tmp_path / "d" / "kept")  # the next boot's disk goes on from there
    after.write_all(fd, b" again")
    after.cut(random.Random(0), "torn")
    assert b"synced again".startswith((tmp_path / "d" / "kept").read_bytes())
    assert (tmp_path / "d" / "kept").read_bytes().startswith(b"synced")


def test_a_new_epoch_is_durable_before_it_is_served(tmp_path):
    disk = powercut.RecordingDisk(tmp_path)
    cfg = SynchronizerConfig(state_dir=tmp_path / "state", wal=True)
    epoch = load_epoch(cfg, False, disk)
    disk.cut(random.Random(0), "drop")  # the power goes the moment it is chosen
    assert json.loads((tmp_path / "state" / EPOCH_FILE).read_text())["epoch"] == epoch


def test_a_log_written_by_code_of_another_arithmetic_is_served_under_a_new_epoch(tmp_path):
    cfg = SynchronizerConfig(state_dir=tmp_path / "state", wal=True)
    epoch = load_epoch(cfg, False)
    assert load_epoch(cfg, True) == epoch  # same code, same settings: the history goes on
    path = tmp_path / "state" / EPOCH_FILE
    stored = json.loads(path.read_text())
    del stored["settings"]["arithmetic"]  # as the code before ARITHMETIC_REVISION 2 wrote it
    path.write_text(json.dumps(stored))
    assert load_epoch(cfg, True) != epoch


def test_a_join_answered_before_the_first_checkpoint_survives_a_power_cut(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    disk = powercut.RecordingDisk(state)
    cfg = SynchronizerConfig(state_dir=state, wal=True, checkpoint_interval_s=0)
    core = Synchronizer(cfg, Metrics(CollectorRegistry()), disk=disk).start(housekeeping=False)
    joined = core.join(pb.JoinRequest(learner_name="a", spec=SPEC.to_proto()))
    disk.power_off()  # before any checkpoint: the Join is only in the log
    core.journal.close()
    disk, _ = disk.cut(random.Random(0), "drop")
    again = Synchronizer(cfg, Metrics(CollectorRegistry()), disk=disk).start(housekeeping=False)
    back = again.join(
        pb.JoinRequest(
            learner_name="a",
            spec=SPEC.to_proto(),
            learner_id=joined.learner_id,
            session=joined.session,
        )
    )
    assert (back.learner_id, back.session) == (joined.learner_id, joined.session)
    again.close()


def test_power_cuts_lose_nothing_acknowledged_and_serve_no_version_twice(tmp_path):
    # Cuts during group commits, checkpoints, log rotations and releases of old segments, each
    # dropping or tearing what was not fsynced; `tests/powercut.py` says what is checked.
    report = powercut.run_cuts(tmp_path, cuts=30, seed=1, chain=15)
    assert not report.violations, report.summary()
    assert report.cuts == 30 and report.acked > 100 and report.duplicates >= report.acked
    assert report.versions_checked > 20
    assert {"commit", "checkpoint", "rotation", "release"} <= set(report.by_group), report.by_group


class NoCheckpoints(Disk):
    """Checkpoint files cannot be created while `full` is set (a full disk)."""

    def __init__(self) -> None:
        self.full = True

    def create(self, path: Path) -> int:
        if self.full and path.name.startswith(".tmp-ckpt-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().create(path)


def test_a_model_whose_first_checkpoint_fails_is_refused_and_not_served(tmp_path):
    disk = NoCheckpoints()
    cfg = SynchronizerConfig(state_dir=tmp_path / "state", wal=True, checkpoint_interval_s=0)
    core = Synchronizer(cfg, Metrics(CollectorRegistry()), disk=disk).start(housekeeping=False)
    c = CoreClient(core, SPEC)
    c.join()
    with pytest.raises(Rejected) as e:  # served, a crash would take it back
        c.init([torch.zeros(SPEC.fragments[0].numel)])
    assert e.value.code == Code.UNAVAILABLE and "retry InitModel" in e.value.message
    assert not core.status().initialized
    with pytest.raises(Rejected):
        c.push(0, torch.ones(SPEC.fragments[0].numel))
    disk.full = False
    c.init([torch.zeros(SPEC.fragments[0].numel)])  # the retry, once the disk has room
    assert core.status().initialized and checkpoint.list_checkpoints(cfg.state_dir)
    core.close()


def test_the_power_cut_benchmark_mode_reports_what_it_checked_and_refuses_nonsense(
    tmp_path, capsys
):
    out = tmp_path / "cuts.json"
    result = durability_bench.main(["--power-cuts", "2", "--seed", "3", "--json", str(out)])
    assert result["power_cuts"] == 2 and result["violations"] == []
    assert json.loads(out.read_text())["pushes_acknowledged"] == result["pushes_acknowledged"]
    assert "power cuts: 2" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        durability_bench.main(["--power-cuts", "0"])
    assert e.value.code == 2 and "--power-cuts must be at least 1" in capsys.readouterr().err
