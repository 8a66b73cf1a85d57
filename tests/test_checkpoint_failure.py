"""A checkpoint that cannot be written is loud: an ERROR record, a metric, Status, stop's result."""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Any, NoReturn

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import diloco_pb2 as pb
from synchronizer import checkpoint
from synchronizer.server import stop
from tests.helpers import TIMEOUT, Client, small_spec

SPEC = small_spec(fragments=1)


def _full_disk(*args: Any, **kwargs: Any) -> NoReturn:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_checkpoint_that_cannot_be_written_is_loud_and_the_service_keeps_serving(
    make_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    srv = make_server(state_dir=state, checkpoint_interval_s=0, quorum=1, grace="none")
    c = Client(srv.address, SPEC, "l0")
    c.join()
    c.init([torch.zeros(SPEC.fragments[0].numel)])  # the first checkpoint is written
    assert [n for n, _ in checkpoint.list_checkpoints(state)] == [1]
    caplog.set_level(logging.ERROR, logger="synchronizer")

    monkeypatch.setattr(checkpoint.Writer, "add", _full_disk)
    assert c.push(0, torch.full((SPEC.fragments[0].numel,), 0.1)).outcome == pb.PUSH_ACCEPTED
    core = srv.synchronizer
    assert not core.save_checkpoint()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("No space left on device" in m and "ckpt-0000000001" in m for m in errors), errors
    assert core.metrics.registry.get_sample_value("diloco_checkpoint_failures_total") == 1.0
    assert "checkpoints failing" in c.status().unhealthy
    assert sorted(p.name for p in state.iterdir() if "ckpt" in p.name) == [
        "ckpt-0000000001.safetensors"
    ]  # no half-written file
    # Still serving: health SERVING, the round merged, pulls answered.
    with grpc.insecure_channel(srv.address) as ch:
        assert (
            health_pb2_grpc.HealthStub(ch)
            .Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            .status
            == health_pb2.HealthCheckResponse.SERVING
        )
    assert c.pull(0, min_version=1, wait_s=TIMEOUT)[0] == 1

    monkeypatch.undo()  # the disk has room again: the next checkpoint clears the alarm
    assert core.save_checkpoint() and c.status().unhealthy == ""

    # SIGTERM with the disk full again: the write-ahead log holds what the final checkpoint could
    # not, so the exit is clean (status 0) and the log says which versions only the WAL holds.
    monkeypatch.setattr(checkpoint.Writer, "add", _full_disk)
    assert c.push(0, torch.full((SPEC.fragments[0].numel,), 0.1)).outcome == pb.PUSH_ACCEPTED
    assert c.pull(0, min_version=2, wait_s=TIMEOUT)[0] == 2
    caplog.clear()
    assert stop(srv, 1.0) is True
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(
        "without its final checkpoint" in m
        and "fragment 0 version 2 " in m
        and "the write-ahead log holds them" in m
        for m in errors
    ), errors
    monkeypatch.undo()
    again = make_server(state_dir=state, checkpoint_interval_s=0, quorum=1, grace="none")
    assert again.synchronizer.model.fragments[0].version == 2  # checkpoint 1 + the log's round


def test_without_a_write_ahead_log_a_failed_final_checkpoint_says_which_versions_are_lost(
    make_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    srv = make_server(state_dir=state, checkpoint_interval_s=0, quorum=1, grace="none", wal=False)
    c = Client(srv.address, SPEC, "l0")
    c.join()
    c.init([torch.zeros(SPEC.fragments[0].numel)])
    monkeypatch.setattr(checkpoint.Writer, "add", _full_disk)
    for v in (1, 2):
        assert c.push(0, torch.full((SPEC.fragments[0].numel,), 0.1)).outcome == pb.PUSH_ACCEPTED
        assert c.pull(0, min_version=v, wait_s=TIMEOUT)[0] == v
    caplog.set_level(logging.ERROR, logger="synchronizer")
    assert stop(srv, 1.0) is False  # what SIGTERM runs: exit status 1, one ERROR line, no traceback
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(
        "without its final checkpoint" in m
        and "No space left on device" in m
        and "fragment 0 versions 1-2" in m
        and "are lost" in m
        for m in errors
    ), errors
