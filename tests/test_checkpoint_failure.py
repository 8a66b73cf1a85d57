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

    monkeypatch.setattr(checkpoint.Writer, "add", _full_disk)
    caplog.clear()
    assert stop(srv, 1.0) is False  # what SIGTERM runs: the exit status says it
    assert any(
        "without its final checkpoint" in r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR
    )
