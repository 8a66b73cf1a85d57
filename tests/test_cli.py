"""`diloco-synchronizer` as operators use it: real processes, SIGTERM, clear config errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import save_file

from protos.spec import TensorInfo, plan_fragments
from tests.helpers import Client


def _start(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, dict]:
    ready = tmp_path / "ready.json"
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "synchronizer", "serve", "--port", "0", "--metrics-port", "0", "--state-dir", str(tmp_path / "state"), "--ready-file", str(ready), *flags],
        env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"server did not start: {proc.communicate()[0]}")
        time.sleep(0.05)  # waiting on another process's file: no event to await
    return proc, json.loads(ready.read_text())


def test_serve_with_defaults_reports_serving_and_exits_zero_on_sigterm(tmp_path):
    proc, info = _start(tmp_path)
    try:
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(info["address"]))
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert f"serving gRPC on 127.0.0.1:{info['port']}" in out


def test_init_from_file_then_sigterm_checkpoint_then_restart_serves_it(tmp_path):
    weights = {"a.weight": torch.randn(10, 3), "b.bias": torch.randn(7)}
    save_file(weights, str(tmp_path / "init.safetensors"))
    proc, info = _start(tmp_path, "--checkpoint-interval-s", "0")
    try:
        out = subprocess.run([sys.executable, "-m", "synchronizer", "init", str(tmp_path / "init.safetensors"), "--synchronizer", info["address"], "--fragments", "2"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        again = subprocess.run([sys.executable, "-m", "synchronizer", "init", str(tmp_path / "init.safetensors"), "--synchronizer", info["address"], "--fragments", "2"], capture_output=True, text=True, timeout=60)
        assert again.returncode == 2 and "already initialised" in again.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0
    proc, info = _start(tmp_path)
    try:
        spec = plan_fragments([TensorInfo(n, tuple(t.shape)) for n, t in weights.items()], 2)
        c = Client(info["address"], spec)
        assert not c.join().needs_init
        flat = {f.fragment_id: torch.cat([weights[t.name].reshape(-1) for t in f.tensors]) for f in spec.fragments}
        for fid, expected in flat.items():
            assert torch.equal(c.pull(fid)[1], expected)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        (["--quorum", "-1"], {}, "invalid setting quorum"),
        ([], {"DILOCO_OUTER": "adam"}, "invalid setting outer"),
        (["--dynamic-local-updates"], {}, "needs inner_steps"),
        (["--config", "/nonexistent.toml"], {}, "cannot read config file"),
    ],
)
def test_bad_config_is_one_line_naming_the_field(tmp_path, args, env, words):
    out = subprocess.run([sys.executable, "-m", "synchronizer", "serve", "--state-dir", str(tmp_path), *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert words in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_config_file_is_overridden_by_environment_and_flags(tmp_path):
    from protos.configload import load
    from synchronizer.config import SynchronizerConfig

    (tmp_path / "c.toml").write_text("quorum = 3\nouter_lr = 0.5\nlease_s = 4.0\n")
    cfg = load(SynchronizerConfig, tmp_path / "c.toml", {"lease_s": 6.0}, {"DILOCO_OUTER_LR": "0.9", "DILOCO_LEASE_S": "5"})
    assert (cfg.quorum, cfg.outer_lr, cfg.lease_s) == (3, 0.9, 6.0)


def test_help_explains_every_option():
    out = subprocess.run([sys.executable, "-m", "synchronizer", "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    from synchronizer.config import SynchronizerConfig

    for name in SynchronizerConfig.model_fields:
        assert "--" + name.replace("_", "-") in out.stdout
