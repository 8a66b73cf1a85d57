"""`diloco-synchronizer` as operators use it: real processes, SIGTERM, clear config errors; `init`
and `status` against a Synchronizer with mutual TLS and tokens, the status table and its JSON;
`status` over every shard of a sharded Synchronizer, one of them down."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import save_file

from learner.client import SyncClient
from protos import diloco_pb2 as pb
from protos.spec import TensorInfo, plan_fragments
from synchronizer import allocator
from synchronizer.cli import main
from synchronizer.cli_status import shards_json, shards_table
from tests.helpers import Client, serve_process, small_spec, stop_serving


def _start(
    tmp_path: Path, *flags: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, dict]:
    return serve_process(
        [sys.executable, "-m", "synchronizer"],
        tmp_path / "state",
        tmp_path / "ready.json",
        *flags,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_serve_with_defaults_reports_serving_and_exits_zero_on_sigterm(tmp_path):
    proc, info = _start(tmp_path)
    try:
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(info["address"]))
        assert (
            stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    finally:
        out = stop_serving(proc)
    assert proc.returncode == 0, out
    assert f"serving gRPC on 127.0.0.1:{info['port']}" in out


def _signal_a_thread_other_than_main(pid: int, sig: int) -> None:
    """What the kernel may do with `kill PID`: hand the signal to any thread of the process that
    does not block it (here gRPC's or torch's), not to its main thread."""
    tgkill = getattr(ctypes.CDLL(None, use_errno=True), "tgkill", None)
    if tgkill is None:
        pytest.skip("this libc has no tgkill")
    others = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert others, "the Synchronizer runs threads besides its main one"
    assert tgkill(pid, others[-1], sig) == 0, os.strerror(ctypes.get_errno())


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_caught_by_another_thread_still_stops_it_cleanly(tmp_path, sig):
    """The main thread used to wait on an Event that only a Python-level handler set, and Python
    runs handlers in the main thread only when it executes bytecode: a signal the kernel gave to
    a gRPC thread left the Synchronizer serving until SIGKILL, without its final checkpoint."""
    proc, info = _start(tmp_path)
    try:
        _signal_a_thread_other_than_main(proc.pid, sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert f"{sig.name}: shutting down" in out and "Synchronizer stopped" in out


@pytest.mark.slow
def test_init_from_file_then_sigterm_checkpoint_then_restart_serves_it(tmp_path):
    weights = {"a.weight": torch.randn(10, 3), "b.bias": torch.randn(7)}
    save_file(weights, str(tmp_path / "init.safetensors"))
    proc, info = _start(tmp_path, "--checkpoint-interval-s", "0")
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "synchronizer",
                "init",
                str(tmp_path / "init.safetensors"),
                "--synchronizer",
                info["address"],
                "--fragments",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        again = subprocess.run(
            [
                sys.executable,
                "-m",
                "synchronizer",
                "init",
                str(tmp_path / "init.safetensors"),
                "--synchronizer",
                info["address"],
                "--fragments",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert again.returncode == 4 and "already initialised" in again.stderr  # refused
    finally:
        stop_serving(proc)
    assert proc.returncode == 0
    proc, info = _start(tmp_path)
    try:
        spec = plan_fragments([TensorInfo(n, tuple(t.shape)) for n, t in weights.items()], 2)
        c = Client(info["address"], spec)
        assert not c.join().needs_init
        flat = {
            f.fragment_id: torch.cat([weights[t.name].reshape(-1) for t in f.tensors])
            for f in spec.fragments
        }
        for fid, expected in flat.items():
            assert torch.equal(c.pull(fid)[1], expected)
    finally:
        stop_serving(proc)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        (["--quorum", "-1"], {}, "invalid setting quorum"),
        ([], {"DILOCO_SYNC_OUTER": "adam"}, "invalid setting outer (from DILOCO_SYNC_OUTER)"),
        (["--update-history", "4"], {}, "needs update_history"),
        ([], {"DILOCO_SYNC_QUORUM": "abc"}, "invalid setting quorum (from DILOCO_SYNC_QUORUM)"),
        ([], {"DILOCO_SYNC_AUTH_TOKEN_FILE": "/nonexistent"}, "cannot read auth_token_file"),
        (["--config", "/nonexistent.toml"], {}, "cannot read config file"),
    ],
)
def test_bad_config_is_one_line_naming_the_field(tmp_path, args, env, words):
    out = subprocess.run(
        [sys.executable, "-m", "synchronizer", "serve", "--state-dir", str(tmp_path), *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert words in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("stored", [False, True], ids=["no-model", "stored-model"])
def test_start_that_cannot_fit_memory_limit_bytes_is_one_line_and_exit_2(tmp_path, stored):
    """Too small for the process alone, or for the model the state directory holds."""
    from synchronizer import memory
    from synchronizer.config import SynchronizerConfig
    from synchronizer.metrics import Metrics
    from synchronizer.server import serving

    state = tmp_path / "state"
    limit = 1000
    if stored:
        spec = plan_fragments([TensorInfo(n, tuple(t.shape)) for n, t in WEIGHTS.items()], 2)
        cfg = SynchronizerConfig(port=0, metrics_port=-1, state_dir=state, shutdown_grace_s=1.0)
        with serving(cfg, Metrics()) as srv:
            c = Client(srv.address, spec)
            c.join()
            c.init([torch.zeros(f.numel) for f in spec.fragments])
            c.close()
        limit = memory.project(cfg, spec)["total"] - 1
    out = subprocess.run(
        [sys.executable, "-m", "synchronizer", "serve", "--state-dir", str(state)]
        + ["--port", "0", "--metrics-port", "-1", "--memory-limit-bytes", str(limit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "refusing to start" in out.stderr and f"memory_limit_bytes={limit:,}" in out.stderr
    assert ("parameters in 2 fragments" in out.stderr) == stored
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_config_file_is_overridden_by_environment_and_flags(tmp_path):
    from protos.configload import load
    from synchronizer.config import SynchronizerConfig

    (tmp_path / "c.toml").write_text("quorum = 3\nouter_lr = 0.5\nlease_s = 4.0\n")
    cfg = load(
        SynchronizerConfig,
        tmp_path / "c.toml",
        {"lease_s": 6.0},
        {"DILOCO_SYNC_OUTER_LR": "0.9", "DILOCO_SYNC_LEASE_S": "5"},
    )
    assert (cfg.quorum, cfg.outer_lr, cfg.lease_s) == (3, 0.9, 6.0)


@pytest.mark.slow
def test_help_explains_every_option():
    out = subprocess.run(
        [sys.executable, "-m", "synchronizer", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    from synchronizer.config import SynchronizerConfig

    for name in SynchronizerConfig.model_fields:
        assert "--" + name.replace("_", "-") in out.stdout
    assert "--memory-limit-bytes" in out.stdout and "diloco_memory_projected_bytes" in out.stdout


@pytest.mark.slow
def test_both_programs_print_their_version():
    from protos.version import version

    for module, prog in (("synchronizer", "diloco-synchronizer"), ("demo", "diloco-learner")):
        out = subprocess.run(
            [sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"{prog} {version()}"


@pytest.mark.slow
def test_serve_logs_json_lines_and_warns_of_an_open_port_and_of_legacy_variables(tmp_path):
    proc, info = _start(
        tmp_path, "--host", "0.0.0.0", "--log-format", "json", env={"DILOCO_MERGE": "radial"}
    )
    out = stop_serving(proc)
    assert proc.returncode == 0, out
    records = [json.loads(line) for line in out.splitlines()]  # every line is one object
    assert all(set(r) >= {"time", "level", "logger", "message"} for r in records), records
    warnings = {r["logger"]: r["message"] for r in records if r["level"] == "WARNING"}
    assert "set DILOCO_SYNC_MERGE" in warnings["protos.configload"]
    assert (
        "serving on 0.0.0.0 with neither --auth-token-file nor TLS"
        in (warnings["synchronizer.cli_serve"])
    )
    assert any(f"serving gRPC on 0.0.0.0:{info['port']}" in r["message"] for r in records)
    if allocator.GLIBC:  # the allocator's thresholds set, and said so
        assert any("freed buffers up to 32 MiB kept" in r["message"] for r in records), records


def _tiny_train(*flags: str) -> list[str]:
    """`diloco-learner train` of a very small example model, with `flags`."""
    return [
        "train",
        "--steps",
        "1",
        "--n-layer",
        "1",
        "--d-model",
        "8",
        "--n-head",
        "1",
        "--context",
        "16",
        "--max-bytes",
        "4096",
        "--eval-windows",
        "2",
        "--batch-size",
        "2",
        *flags,
    ]


@pytest.mark.slow
def test_a_learner_that_cannot_join_exits_3_with_one_line_and_logs_json(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "demo",
            *_tiny_train(
                "--synchronizer",
                f"127.0.0.1:{_free_port()}",
                "--join-timeout-s",
                "2",
                "--retry-initial-s",
                "0.2",
                "--log-format",
                "json",
            ),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.startswith("diloco-learner: cannot join: could not join the Synchronizer")
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert any(r["logger"] == "learner.session" and r["level"] == "INFO" for r in records)


def test_a_learner_the_synchronizer_refuses_exits_4_with_one_line(make_server, tmp_path, capsys):
    from demo.cli import main as learner_main

    srv = make_server(auth_token=LEARNER_TOKEN)
    (tmp_path / "token").write_text("not-the-token\n")
    rc = learner_main(
        _tiny_train("--synchronizer", srv.address, "--auth-token-file", str(tmp_path / "token"))
    )
    err = capsys.readouterr().err
    assert rc == 4, err
    assert err.startswith("diloco-learner: refused: the Synchronizer at ")
    assert "refused the credentials" in err and len(err.strip().splitlines()) == 1


# init and status through TLS and tokens, in-process ----------------------------------------------

LEARNER_TOKEN, ADMIN_TOKEN = "learner-secret", "admin-secret"
WEIGHTS = {
    "a.weight": torch.randn(10, 3, generator=torch.Generator().manual_seed(0)),
    "b.bias": torch.ones(7),
}


@pytest.fixture
def secured(make_server, pki: Path):
    """A Synchronizer that wants a client certificate signed by the CA and bearer tokens, and the
    flags that reach it."""
    srv = make_server(
        tls_cert=pki / "server.pem",
        tls_key=pki / "server.key",
        tls_client_ca=pki / "ca.pem",
        auth_token=LEARNER_TOKEN,
        admin_token=ADMIN_TOKEN,
    )
    flags = [
        "--synchronizer",
        srv.address,
        "--tls-ca",
        str(pki / "ca.pem"),
        "--tls-cert",
        str(pki / "client.pem"),
        "--tls-key",
        str(pki / "client.key"),
    ]
    return srv, flags


def _learner(address: str, pki: Path, name: str, counters: pb.LearnerCounters) -> SyncClient:
    """A learner over mutual TLS that joined and reported its counters."""
    client = SyncClient(
        address,
        auth_token=LEARNER_TOKEN,
        tls_ca=pki / "ca.pem",
        tls_cert=pki / "client.pem",
        tls_key=pki / "client.key",
        rpc_timeout_s=10,
    )
    client.join(
        name, plan_fragments([TensorInfo(n, tuple(t.shape)) for n, t in WEIGHTS.items()], 2)
    )
    client.heartbeat(counters)
    return client


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_init_and_status_json_reach_a_mutual_tls_server_with_learner_and_admin_tokens(
    secured, pki, tmp_path, capsys, monkeypatch
):
    srv, flags = secured
    save_file(WEIGHTS, str(tmp_path / "init.safetensors"))
    (tmp_path / "token").write_text(LEARNER_TOKEN + "\n")  # as `echo TOKEN > FILE` writes it
    rc, out, err = _run(
        capsys,
        "init",
        str(tmp_path / "init.safetensors"),
        "--fragments",
        "2",
        *flags,
        "--auth-token-file",
        str(tmp_path / "token"),
    )
    assert rc == 0, err
    assert "initialised 37 parameters in 2 fragments" in out
    client = _learner(
        srv.address,
        pki,
        "l0",
        pb.LearnerCounters(steps=30, tokens=3840, compute_s=3.0, blocked_s=1.0),
    )
    try:
        monkeypatch.setenv(
            "DILOCO_CTL_ADMIN_TOKEN", ADMIN_TOKEN
        )  # the token from the environment, as serve's settings
        rc, out, err = _run(capsys, "status", *flags, "--json")
    finally:
        client.close()
    assert rc == 0, err
    status = json.loads(out)
    assert set(status) == {
        "server_epoch",
        "initialized",
        "spec_hash",
        "outer_steps",
        "shards",
        "shard_index",
        "fragments",
        "learners",
        "totals",
        "goodput",
        "model_fraction",
        "loop_goodput",
        "unhealthy",
    }
    assert 0.0 <= status["goodput"] <= 1.0 and status["unhealthy"] is None
    assert status["shards"] == 1 and status["shard_index"] == 0  # unsharded
    assert (
        status["initialized"] and status["server_epoch"] and status["spec_hash"] == client.spec_hash
    )
    assert status["fragments"] == [
        {"fragment_id": 0, "version": 0},
        {"fragment_id": 1, "version": 0},
    ]
    learners = {x["name"]: x for x in status["learners"]}
    assert learners["init"]["state"] == "left"  # init joins, uploads and leaves
    assert learners["l0"] == {
        "learner_id": client.learner_id,
        "name": "l0",
        "state": "alive",
        "steps": 30,
        "tokens": 3840,
        "compute_s": 3.0,
        "blocked_s": 1.0,
        "evaluator": False,
    }
    assert status["totals"] == {
        "learners": {"alive": 1, "dead": 0, "left": 1},
        "steps": 30,
        "tokens": 3840,
        "compute_s": 3.0,
        "blocked_s": 1.0,
    }
    assert status["loop_goodput"] == pytest.approx(0.75)


def test_status_table_shows_versions_learners_with_their_state_and_goodput(secured, pki, capsys):
    srv, flags = secured
    first = _learner(
        srv.address,
        pki,
        "first",
        pb.LearnerCounters(steps=1200, tokens=153600, compute_s=9.0, blocked_s=1.0),
    )
    second = _learner(
        srv.address,
        pki,
        "second",
        pb.LearnerCounters(steps=10, tokens=1280, compute_s=1.0, blocked_s=0.0),
    )
    first.init_model([torch.zeros(30), torch.zeros(7)])  # the first learner seeds the model
    second.leave(pb.LearnerCounters(steps=10, tokens=1280, compute_s=1.0, blocked_s=0.0))
    try:
        rc, out, err = _run(capsys, "status", *flags, "--admin-token", ADMIN_TOKEN)
    finally:
        first.close()
        second.close()
    assert rc == 0, err
    lines = out.splitlines()
    assert (
        lines[0].startswith("Synchronizer epoch ")
        and f"spec {first.spec_hash[:12]}" in lines[0]
        and "0 outer steps" in lines[0]
    )
    assert lines[2].split() == ["fragment", "version"] and [x.split() for x in lines[3:5]] == [
        ["0", "0"],
        ["1", "0"],
    ]
    header = next(x for x in lines if x.startswith("learner "))
    assert header.split() == [
        "learner",
        "id",
        "state",
        "steps",
        "tokens",
        "compute_s",
        "blocked_s",
        "loop",
        "goodput",
    ]
    row = {x.split()[0]: x.split() for x in lines if x.startswith(("first ", "second "))}
    assert row["first"] == [
        "first",
        first.learner_id,
        "alive",
        "1,200",
        "153,600",
        "9.0",
        "1.0",
        "90.0%",
    ]
    assert row["second"] == [
        "second",
        second.learner_id,
        "left",
        "10",
        "1,280",
        "1.0",
        "0.0",
        "100.0%",
    ]
    assert "learners: 1 alive, 0 dead, 1 left; 1,210 steps, 154,880 tokens" in out
    assert (
        "loop goodput: 90.9% of the learners' time in inner steps" in out
        and "diloco_goodput_ratio" in out
    )


def test_status_of_an_empty_synchronizer_says_it_is_not_initialised(make_server, capsys):
    srv = make_server()
    rc, out, err = _run(capsys, "status", "--synchronizer", srv.address)
    assert rc == 0, err
    assert (
        "not initialised yet" in out
        and "no learners" in out
        and "no inner steps reported yet" in out
    )
    assert "goodput: none yet (no learner has joined" in out and "0.0%" not in out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("conn", "argv", "words", "code"),
    [
        ("mtls", ["status", "--admin-token", "wrong-secret"], "UNAUTHENTICATED", 4),
        (
            "mtls",
            ["status", "--auth-token", LEARNER_TOKEN],
            "PERMISSION_DENIED: this RPC needs the admin token",
            4,
        ),
        ("address", ["status", "--admin-token", ADMIN_TOKEN], "UNAVAILABLE", 3),
        (
            "mtls",
            ["status", "--tls-ca", "/nonexistent/ca.pem"],
            "cannot read tls_ca /nonexistent/ca.pem",
            2,
        ),
        ("mtls", ["status", "--tls-ca", "{weights}"], "is not a PEM file", 2),
        (
            "ca",
            ["status", "--tls-cert", "client.pem"],
            "tls_cert and tls_key must be given together",
            2,
        ),
        ("mtls", ["status", "--synchronizer", "localhost"], "invalid setting synchronizer", 2),
        (
            "mtls",
            ["status", "--synchronizer", "127.0.0.1:50051,localhost"],
            "invalid setting synchronizer",
            2,
        ),
        (
            "mtls",
            ["init", "{weights}", "--synchronizer", "127.0.0.1:{free},127.0.0.1:{free}"],
            "UNAVAILABLE",
            3,
        ),
        ("mtls", ["status", "--synchronizer", "127.0.0.1:{free}"], "UNAVAILABLE", 3),
        ("mtls", ["status", "--timeout-s", "0"], "--timeout-s: must be > 0", 2),
        (
            "mtls",
            ["init", "/nonexistent.safetensors"],
            "cannot read /nonexistent.safetensors as safetensors",
            2,
        ),
        ("mtls", ["init", "{weights}", "--fragments", "0"], "--fragments: must be > 0", 2),
    ],
    ids=[
        "wrong-token",
        "learner-token-for-status",
        "plaintext-to-tls",
        "missing-ca",
        "ca-not-pem",
        "cert-without-key",
        "bad-address",
        "bad-address-in-list",
        "init-to-a-list",
        "nothing-listening",
        "bad-timeout",
        "unreadable-file",
        "zero-fragments",
    ],
)
def test_bad_input_unreachable_or_refusing_server_is_one_line_and_its_exit_code(
    secured, tmp_path, capsys, conn, argv, words, code
):
    """2: bad input; 3: nothing answered; 4: the Synchronizer refused (docs/configuration.md)."""
    _, flags = secured
    flags = {"mtls": flags, "ca": flags[:4], "address": flags[:2]}[conn]
    save_file(WEIGHTS, str(tmp_path / "w.safetensors"))
    argv = [a.format(free=_free_port(), weights=tmp_path / "w.safetensors") for a in argv]
    rc: int | str | None
    try:
        rc = main([argv[0], *flags, *argv[1:]])  # the case's own flags come last and win
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == code, err
    assert words in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


# status over the shards of a sharded Synchronizer ------------------------------------------------


def test_status_over_shards_shows_each_shard_and_one_that_does_not_answer_as_down(
    make_server, tmp_path, capsys
):
    """Two in-process Synchronizers (unsharded here: each serves the whole model, so the view
    flags them as two answers of shard 0) and an address where nothing listens, in that order."""
    spec = small_spec()
    servers = [make_server(state_dir=tmp_path / f"shard-{i}") for i in range(2)]
    learners = []
    for srv in servers:
        learner = Client(srv.address, spec, "l0")
        learner.join()
        learner.init([torch.zeros(f.numel) for f in spec.fragments])
        learners.append(learner)
    dead = f"127.0.0.1:{_free_port()}"
    addresses = [servers[0].address, dead, servers[1].address]
    capsys.readouterr()  # the servers' own start-up lines, logged here in-process
    try:
        rc, out, err = _run(capsys, "status", "--synchronizer", ",".join(addresses), "--json")
        rc_table, table, err_table = _run(capsys, "status", "--synchronizer", ",".join(addresses))
    finally:
        for learner in learners:
            learner.close()
    assert rc == 0 and rc_table == 0 and not err and not err_table, err + err_table
    view = json.loads(out)
    assert set(view) == {"shards", "totals", "problems"}
    shards = view["shards"]
    assert [(x["address"], x["up"]) for x in shards] == [
        (addresses[0], True),
        (dead, False),
        (addresses[2], True),
    ]
    assert shards[1]["error"].startswith("UNAVAILABLE: ") and set(shards[1]) == {
        "address",
        "up",
        "error",
    }
    for shard in (shards[0], shards[2]):
        assert shard["error"] is None and shard["initialized"] and shard["unhealthy"] is None
        assert shard["spec_hash"] == spec.spec_hash
        assert shard["fragments"] == [
            {"fragment_id": 0, "version": 0},
            {"fragment_id": 1, "version": 0},
        ]
        assert [(x["name"], x["state"]) for x in shard["learners"]] == [("l0", "alive")]
    assert shards[0]["server_epoch"] != shards[2]["server_epoch"]
    assert view["totals"] == {
        "shards": 3,
        "up": 2,
        "down": 1,
        "fragments": 4,
        "outer_steps": 0,
        "goodput": shards[0]["goodput"] + shards[2]["goodput"],  # unsharded: fraction 1
        "learners": {"alive": 1, "dead": 0, "left": 0},
    }
    assert view["problems"] == [
        f"shard index 0 answers at 2 addresses: {addresses[0]}, {addresses[2]}",
        f"{addresses[0]}, {addresses[2]}: shards 1, but 3 addresses were given",
    ]
    lines = table.splitlines()
    assert lines[0] == "shards: 3 given, 2 up, 1 down; 4 fragments, 0 outer steps"
    assert f"PROBLEM: shard index 0 answers at 2 addresses: {addresses[0]}, {addresses[2]}" in lines
    for address in addresses:
        body = lines[lines.index(address) + 1]
        if address == dead:
            assert body.startswith("  DOWN: UNAVAILABLE: ")
        else:
            assert body.startswith("  Synchronizer epoch ") and "0 outer steps" in body


def test_status_over_shards_totals_their_parts_and_names_what_does_not_add_up():
    """The view of a real two-shard layout (Status replies as shards send them): each lists its
    own fragments, goodputs weigh by the share of the model each serves, learners are counted
    once; then three mistakes."""

    def reply(index: int, fragments: dict[int, int], spec: str = "a" * 64, shards: int = 2):
        return pb.StatusReply(
            server_epoch=f"epoch-{index}",
            initialized=True,
            spec_hash=spec,
            versions=[pb.FragmentVersion(fragment_id=f, version=v) for f, v in fragments.items()],
            outer_steps=sum(fragments.values()),
            goodput=0.25 * (index + 1),
            model_fraction=(0.6, 0.4)[index],
            shards=shards,
            shard_index=index,
            learners=[
                pb.LearnerStatus(learner_id=f"{index}-{i}", name=f"l{i}", state="alive")
                for i in range(2)
            ],
        )

    view = shards_json([("s0:50051", reply(0, {0: 5, 2: 4})), ("s1:50051", reply(1, {1: 5, 3: 3}))])
    assert view["problems"] == []
    assert view["totals"] == {
        "shards": 2,
        "up": 2,
        "down": 0,
        "fragments": 4,
        "outer_steps": 17,
        "goodput": pytest.approx(0.25 * 0.6 + 0.5 * 0.4),
        "learners": {"alive": 2, "dead": 0, "left": 0},
    }
    assert [(x["shard_index"], x["shards"]) for x in view["shards"]] == [(0, 2), (1, 2)]
    table = shards_table(view)
    assert (
        "goodput: 35.0% of learner capacity merged (each shard's for its part of the model)"
        in table
    )
    assert (
        "  Synchronizer shard 1 of 2, epoch epoch-1: initialised, spec aaaaaaaaaaaa, 8 outer steps"
        in table.splitlines()
    )

    wrong = shards_json(
        [
            ("s0:50051", reply(0, {0: 5}, shards=3)),
            ("s1:50051", reply(0, {1: 5}, spec="b" * 64)),
        ]
    )
    assert wrong["problems"] == [
        "the shards hold different model specs (aaaaaaaaaaaa, bbbbbbbbbbbb)",
        "shard index 0 answers at 2 addresses: s0:50051, s1:50051",
        "s0:50051: shards 3, but 2 addresses were given",
    ]


def test_status_exits_3_when_no_shard_answers_and_4_when_one_refuses(make_server, tmp_path, capsys):
    down = [f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"]
    rc, out, err = _run(capsys, "status", "--synchronizer", ",".join(down), "--timeout-s", "5")
    assert rc == 3
    assert err.strip() == (
        "diloco-synchronizer: status: none of the 2 shards answered (is a Synchronizer serving "
        "there, with TLS exactly when --tls-ca is given?)"
    )
    assert out.count("  DOWN: ") == out.count("  DOWN: UNAVAILABLE: ") == 2

    open_ = make_server(state_dir=tmp_path / "open")
    locked = make_server(state_dir=tmp_path / "locked", admin_token=ADMIN_TOKEN)
    capsys.readouterr()  # the servers' own start-up lines, logged here in-process
    addresses = f"{open_.address},{locked.address}"
    rc, out, err = _run(capsys, "status", "--synchronizer", addresses, "--admin-token", "wrong")
    assert rc == 4 and not out
    assert err.startswith(f"diloco-synchronizer: status at {locked.address}: UNAUTHENTICATED: ")
    assert len(err.strip().splitlines()) == 1
