"""Learners against the real Synchronizer in-process (real gRPC on port 0): what needs the server
(syncing to its parameters, restarts, outages, TLS, islands, its directives and grace). Learner's
own merge and overlap policy is tested against the fake in test_learner_policy.py."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from demo.tiny import status
from learner import Learner
from learner.client import SyncClient
from learner.fragments import FragmentPlan
from learner.session import Push
from protos import codec, layout
from protos import diloco_pb2 as pb
from synchronizer.config import SynchronizerConfig
from synchronizer.server import RunningServer, serving


def server_config(state_dir: Path, **overrides: Any) -> SynchronizerConfig:
    settings: dict[str, Any] = dict(
        port=0,
        metrics_port=-1,
        state_dir=state_dir,
        quorum=1,
        grace="none",
        shutdown_grace_s=0.5,
        checkpoint_interval_s=0,
    )
    settings.update(overrides)
    return SynchronizerConfig(**settings)


@contextlib.contextmanager
def running(cfg: SynchronizerConfig) -> Iterator[RunningServer]:
    with serving(cfg) as srv:
        yield srv


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def train(
    learner: Learner,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    seed: int,
    delay_s: float = 0.002,
) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g)
        loss = nn.functional.mse_loss(model(x), x[:, :4].sin())
        loss.backward()
        learner.step(tokens=16, loss=loss.item())
        opt.zero_grad()
        time.sleep(delay_s)  # stands in for real compute, so syncs overlap steps


def served(address: str, model: nn.Module, fragments: int, **client_kw: Any) -> list[torch.Tensor]:
    """Every fragment as the Synchronizer serves it now (FP32), via a separate client."""
    plan = FragmentPlan(model, fragments)
    client = SyncClient(address, **client_kw)
    try:
        client.join("observer", plan.spec)
        return [client.pull(p, numel=plan.numel(p))[2] for p in range(len(plan))]
    finally:
        client.close()


def local(model: nn.Module, fragments: int) -> list[torch.Tensor]:
    plan = FragmentPlan(model, fragments)
    return [plan.gather(p) for p in range(len(plan))]


def wait_until(cond: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_two_learners_sync_and_end_holding_exactly_the_served_parameters(tmp_path):
    with running(server_config(tmp_path)) as srv:
        results: dict[int, Any] = {}
        errors: list[BaseException] = []
        trained = threading.Barrier(2, timeout=60)
        flushed = threading.Barrier(2, timeout=60)

        def run(i: int) -> None:
            try:
                model = mlp(
                    seed=i
                )  # different initialisations: both must start from the global one
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                lrn = Learner(
                    model, opt, synchronizer=srv.address, sync_every=10, fragments=2, name=f"l{i}"
                )
                train(lrn, model, opt, 60, seed=100 + i)
                trained.wait()
                assert lrn.flush(timeout_s=30)
                flushed.wait()  # nobody pushes any more: the global model is final
                lrn.finish()
                results[i] = (model, lrn.stats)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)
                trained.abort()
                flushed.abort()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not errors, errors
        global_params = served(srv.address, results[0][0], 2)
        for model, stats in results.values():
            assert stats.step == 60 and stats.tokens == 960
            assert stats.pushes.get("accepted", 0) >= 2
            assert stats.merges >= 2 and stats.pulls >= 2
            assert all(v > 0 for v in stats.fragment_versions)
            assert stats.bytes_sent > 0 and stats.bytes_received > 0
            assert stats.sync_state == "closed"
            for mine, theirs in zip(local(model, 2), global_params, strict=True):
                assert torch.equal(mine, theirs)
        # both ended on the same, newest versions of every fragment
        status = SyncClient(srv.address)
        try:
            reply = status.status()
        finally:
            status.close()
        assert results[0][1].fragment_versions == results[1][1].fragment_versions
        assert reply.outer_steps == sum(results[0][1].fragment_versions)


def test_learner_keeps_training_without_raising_when_the_server_goes_away(tmp_path):
    cm = serving(server_config(tmp_path))
    srv = cm.__enter__()
    stopped = False
    try:
        model = mlp(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        lrn = Learner(
            model,
            opt,
            synchronizer=srv.address,
            sync_every=5,
            fragments=2,
            retry_initial_s=0.05,
            retry_max_s=0.2,
            rpc_timeout_s=2.0,
            pull_wait_s=0.5,
        )
        train(lrn, model, opt, 20, seed=1)
        assert wait_until(lambda: lrn.stats.pushes.get("accepted", 0) > 0)
        cm.__exit__(None, None, None)
        stopped = True
        before = {k: v.clone() for k, v in model.state_dict().items()}
        train(lrn, model, opt, 20, seed=2)  # must not raise
        assert wait_until(lambda: lrn.stats.errors > 0)
        stats = lrn.stats
        assert stats.step == 40 and stats.sync_state == "reconnecting"
        assert lrn.engine is not None and lrn.engine.in_flight() >= 1  # syncs due wait, unsent
        assert not torch.equal(before["0.weight"], model.state_dict()["0.weight"])  # still training
        t0 = time.monotonic()
        lrn.close()
        assert time.monotonic() - t0 < 10
    finally:
        if not stopped:
            cm.__exit__(None, None, None)


def test_learner_keeps_its_session_across_a_server_restart_and_syncs_on(tmp_path):
    # A learner alive at the restart comes back alive, its session and its versions valid: it
    # carries on without re-joining or re-pulling (a learner whose lease lapsed re-joins).
    cfg = server_config(tmp_path, lease_s=3.0)
    cm = serving(cfg)
    srv = cm.__enter__()
    port = srv.port
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    lrn = Learner(
        model,
        opt,
        synchronizer=srv.address,
        sync_every=5,
        fragments=2,
        merge="rebase",
        retry_initial_s=0.05,
        retry_max_s=0.3,
        rpc_timeout_s=2.0,
        pull_wait_s=0.5,
    )
    try:
        train(lrn, model, opt, 20, seed=1)
        assert lrn.flush(timeout_s=20)
        engine = lrn.engine
        assert engine is not None
        first_epoch, first_generation = engine.session.epoch, engine.session.generation
        cm.__exit__(None, None, None)  # final checkpoint; the restart restores it
        cm = serving(cfg.model_copy(update={"port": port}))
        srv = cm.__enter__()
        assert [x.state for x in srv.synchronizer.registry.learners.values()] == ["alive"]
        merges = lrn.stats.merges
        train(lrn, model, opt, 10, seed=2)
        assert lrn.flush(timeout_s=20) and lrn.stats.merges > merges
        assert engine.session.epoch == first_epoch  # the log kept the history of versions
        assert engine.session.generation == first_generation  # no re-join was needed
        merges = lrn.stats.merges
        train(lrn, model, opt, 20, seed=3)
        assert lrn.flush(timeout_s=20)
        assert lrn.stats.merges > merges
        lrn.finish()
        for mine, theirs in zip(local(model, 2), served(srv.address, model, 2), strict=True):
            assert torch.equal(mine, theirs)
    finally:
        lrn.close()
        cm.__exit__(None, None, None)


def test_delta_pull_rebuilds_the_served_parameters_exactly_at_a_fraction_of_the_bytes(tmp_path):
    with running(server_config(tmp_path)) as srv:
        plan = FragmentPlan(nn.Linear(64, 64), 1)
        n = plan.numel(0)
        client = SyncClient(srv.address)
        try:
            assert client.join("t", plan.spec).needs_init
            client.init_model([plan.gather(0)])
            v0, _, p0 = client.pull(0, numel=n)
            delta = torch.randn(n) * 0.01
            reply = client.push(
                Push(
                    0,
                    1,
                    v0,
                    10,
                    1,
                    0.0,
                    codec.encode(delta, pb.CODEC_FP32),
                    layout.make_header(pb.CODEC_FP32, n),
                )
            )
            assert reply.outcome == pb.PUSH_ACCEPTED
            before = client.bytes_received
            v1, _, from_delta = client.pull(0, reply.round_version, 5.0, numel=n, have=(v0, p0))
            delta_bytes, before = client.bytes_received - before, client.bytes_received
            v1_full, _, full = client.pull(0, numel=n)
            full_bytes = client.bytes_received - before
            assert v1 == v1_full == 1
            assert torch.equal(from_delta, full)
            assert delta_bytes < 0.35 * full_bytes  # one INT8 update instead of FP32 parameters
            # a wrong starting point is caught by the checksum: the pull falls back to a full one
            _, _, fallback = client.pull(0, numel=n, have=(v0, p0 + 1e-3))
            assert torch.equal(fallback, full)
        finally:
            client.close()


def test_a_learner_with_int8_pulls_trains_from_int8_rounded_parameters_at_a_third_of_the_bytes(
    tmp_path,
):
    # delta_pulls off, pull_codec int8: every pull after the first is the whole fragment in
    # INT8 blocks, not held as an exact base; a forced exact pull is still FP32.
    with running(server_config(tmp_path)) as srv:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 512), nn.Tanh(), nn.Linear(512, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        lrn = Learner(
            model,
            opt,
            synchronizer=srv.address,
            sync_every=5,
            fragments=2,
            delta_pulls=False,
            pull_codec="int8",
        )
        try:
            train(lrn, model, opt, 20, seed=1)
            assert lrn.flush(timeout_s=30) and lrn.stats.merges >= 2
            engine = lrn.engine
            assert engine is not None
            want = served(srv.address, model, 2)[0]
            before = lrn.stats.bytes_received
            version, _, got = engine.pull(0)
            int8_bytes, before = lrn.stats.bytes_received - before, lrn.stats.bytes_received
            assert version > 0 and engine.held[0] is None
            header = layout.make_header(pb.CODEC_INT8, want.numel())
            rounded = codec.decode(codec.encode(want, pb.CODEC_INT8), header, want.clone())
            assert torch.equal(got, rounded) and not torch.equal(got, want)
            _, _, exact = engine.pull(0, exact=True)
            fp32_bytes = lrn.stats.bytes_received - before
            assert torch.equal(exact, want)
            assert int8_bytes < 0.35 * fp32_bytes  # about 1 byte per parameter against 4
        finally:
            lrn.close()


def test_a_learner_built_as_the_initial_model_joins_without_pulling_it_and_others_pull(tmp_path):
    def model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 8))

    with running(server_config(tmp_path)) as srv:
        kw: dict[str, Any] = dict(synchronizer=srv.address, sync_every=10, fragments=2)
        first = Learner(model(0), None, name="first", **kw)  # uploads the initial model
        whole = 4 * sum(p.numel() for p in model(0).parameters())  # its FP32 bytes
        try:
            joined: dict[int, tuple[int, list[torch.Tensor]]] = {}
            for seed in (0, 1):  # built as the initial model; built from another seed
                m = model(seed)
                lrn = Learner(m, None, name=f"seed{seed}", **kw)
                joined[seed] = (lrn.stats.bytes_received, local(m, 2))
                lrn.close()
            initial = local(model(0), 2)
            for seed in (0, 1):  # both start from the global model, bit for bit
                assert all(torch.equal(a, b) for a, b in zip(joined[seed][1], initial, strict=True))
            # its own parameters matched version 0's checksum: no parameters were sent
            assert joined[0][0] < 0.01 * whole
            assert joined[1][0] > whole  # the other's did not: pulled whole
        finally:
            first.close()


def test_dynamic_local_updates_without_an_h_shorten_only_the_slow_learners_own(tmp_path):
    with running(server_config(tmp_path, dynamic_local_updates=True)) as srv:
        models = [mlp(0), mlp(0)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
        fast, slow = (
            Learner(
                m,
                o,
                synchronizer=srv.address,
                sync_every=50,
                fragments=2,
                heartbeat_interval_s=0.05,
            )
            for m, o in zip(models, opts, strict=True)
        )
        try:
            # Enough steps for the step-time averages to forget the first (join and init) step.
            train(fast, models[0], opts[0], 40, seed=0, delay_s=0.0)
            train(slow, models[1], opts[1], 40, seed=1, delay_s=0.05)  # over 10x slower
            session = slow.engine.session if slow.engine else None
            assert session is not None
            assert wait_until(lambda: session.inner_steps_scale > 0)
            train(fast, models[0], opts[0], 1, seed=0, delay_s=0.0)
            train(slow, models[1], opts[1], 1, seed=1, delay_s=0.05)
            assert fast.stats.sync_every == 50  # the fastest keeps its own H
            assert 1 <= slow.stats.sync_every < 50 * 0.8
        finally:
            fast.close()
            slow.close()


def test_restarted_learner_comes_back_under_its_id_and_serves_metrics(tmp_path):
    import urllib.request

    with running(server_config(tmp_path)) as srv:
        model = mlp(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        first = Learner(
            model,
            opt,
            synchronizer=srv.address,
            sync_every=2,
            fragments=2,
            strict_overlap=True,
            overlap_steps=0,
        )
        train(first, model, opt, 4, seed=0)
        assert first.client is not None
        old_id, old_session = first.learner_id, first.client.session
        first.close()  # as if killed: no Leave
        model = mlp(1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        again = Learner(
            model,
            opt,
            synchronizer=srv.address,
            sync_every=2,
            fragments=2,
            learner_id=old_id,
            learner_session=old_session,
            strict_overlap=True,
            overlap_steps=0,
            metrics_port=0,
        )
        try:
            assert again.learner_id == old_id
            train(again, model, opt, 4, seed=1)
            pushes = again.stats.pushes
            assert pushes == {"accepted": 4}  # seqs continued after the first run's: no duplicates
            assert again.metrics_port
            text = (
                urllib.request.urlopen(f"http://127.0.0.1:{again.metrics_port}/metrics", timeout=5)
                .read()
                .decode()
            )
            assert "diloco_learner_steps_total 4.0" in text
        finally:
            again.close()


def test_a_learner_the_synchronizer_forgot_comes_back_under_its_id_and_session(tmp_path):
    """Silent past its lease and then forget_after_s (a partition), a learner is no longer
    listed (NOT_FOUND) but its record is kept: it re-joins as itself, its push replies with it,
    not as a new learner."""
    # Dead 0.5 s after its last call, listed "left" 2 s later and dropped 2 s after that; its
    # heartbeat comes 3.5 s apart, in between.
    with running(server_config(tmp_path, lease_s=0.5, forget_after_s=2.0)) as srv:
        model = mlp(0)
        learner = Learner(
            model,
            torch.optim.SGD(model.parameters(), lr=0.05),
            synchronizer=srv.address,
            sync_every=1000,
            fragments=1,
            heartbeat_interval_s=3.5,
        )
        try:
            assert learner.client is not None
            me = (learner.learner_id, learner.client.session)

            def listed() -> dict[str, str]:
                return {r.learner_id: r.state for r in status(srv.address).learners}

            assert wait_until(lambda: listed().get(me[0]) == "left", 10)
            assert wait_until(lambda: listed().get(me[0]) == "alive", 10)
            assert (learner.learner_id, learner.client.session) == me
            assert list(listed()) == [me[0]]
        finally:
            learner.close()


def test_constructor_raises_clearly_on_a_different_model_bad_token_or_no_server(tmp_path):
    with running(server_config(tmp_path, auth_token="s3cret")) as srv:
        model = mlp(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with Learner(
            model, opt, synchronizer=srv.address, sync_every=2, fragments=2, auth_token="s3cret"
        ) as lrn:
            train(lrn, model, opt, 4, seed=0)
        assert lrn.stats.pushes.get("accepted", 0) >= 1
        with pytest.raises(PermissionError):
            Learner(mlp(1), None, synchronizer=srv.address, fragments=2, auth_token="wrong")
        other = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        with pytest.raises(ValueError, match="refused this model"):
            Learner(other, None, synchronizer=srv.address, fragments=2, auth_token="s3cret")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    with pytest.raises(TimeoutError):
        Learner(
            mlp(0),
            None,
            synchronizer=f"127.0.0.1:{free_port}",
            join_timeout_s=0.5,
            retry_initial_s=0.05,
        )


def _certificates(d: Path) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who in ("server", "client"):
        run("req", *ec, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={who}")
        run(
            "x509",
            "-req",
            "-in",
            f"{who}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{who}.pem",
            "-days",
            "1",
            "-extfile",
            "san.ext",
        )


@pytest.mark.skipif(
    shutil.which("openssl") is None, reason="needs the openssl command to make certificates"
)
def test_learner_trains_over_mutual_tls_and_is_refused_without_a_client_certificate(tmp_path):
    _certificates(tmp_path)
    cfg = server_config(
        tmp_path / "state",
        tls_cert=tmp_path / "server.pem",
        tls_key=tmp_path / "server.key",
        tls_client_ca=tmp_path / "ca.pem",
    )
    with running(cfg) as srv:
        model = mlp(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        tls = dict(
            tls_ca=tmp_path / "ca.pem",
            tls_cert=tmp_path / "client.pem",
            tls_key=tmp_path / "client.key",
        )
        with Learner(model, opt, synchronizer=srv.address, sync_every=2, fragments=2, **tls) as lrn:
            train(lrn, model, opt, 4, seed=0)
        assert lrn.stats.pushes.get("accepted", 0) >= 1 and lrn.stats.errors == 0
        with pytest.raises(TimeoutError):
            Learner(
                mlp(0),
                None,
                synchronizer=srv.address,
                fragments=2,
                tls_ca=tmp_path / "ca.pem",
                join_timeout_s=0.5,
                retry_initial_s=0.05,
            )


def merged_tokens(srv: RunningServer) -> float:
    """The tokens the Synchronizer merged, over every fragment (each push counts its tokens in
    proportion to its fragment's share of the model). Read while it serves: a round's tokens
    are counted before its version can be pulled, so a learner that finished finds its work
    counted."""
    registry = srv.synchronizer.metrics.registry
    return registry.get_sample_value("diloco_tokens_total", {"bucket": "merged"}) or 0.0


def test_every_step_a_learner_trained_is_merged_by_the_end_of_its_run(tmp_path):
    # H = 4, P = 2: fragment 1's pushes fall at steps 2, 6, 10, so steps 11 and 12 are in none
    # unless finish() pushes them.
    with running(server_config(tmp_path)) as srv:
        model = mlp(seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        lrn = Learner(model, opt, synchronizer=srv.address, sync_every=4, fragments=2)
        train(lrn, model, opt, 12, seed=0)
        lrn.finish()
        assert torch.equal(torch.cat(local(model, 2)), torch.cat(served(srv.address, mlp(0), 2)))
        assert merged_tokens(srv) == pytest.approx(12 * 16)


def _island_rank(rank: int, world: int, init_file: str, address: str, out_dir: str) -> None:
    """One rank of a 2-process gloo island: DDP-style averaged gradients, a Learner on every rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = mlp(seed=rank)  # ranks start different: the Learner makes them identical
        # inner_optimizer=None: the loop applies its own SGD update before step()
        lrn = Learner(
            model, None, synchronizer=address, sync_every=4, fragments=2, name=f"rank{rank}"
        )
        g = torch.Generator().manual_seed(rank)
        for _ in range(12):
            x = torch.randn(16, 8, generator=g)
            nn.functional.mse_loss(model(x), x[:, :4].sin()).backward()
            with torch.no_grad():
                for p in model.parameters():  # what DDP does: average the gradients
                    assert p.grad is not None
                    dist.all_reduce(p.grad)
                    p.sub_(0.05 * p.grad / world)
                    p.grad = None
            lrn.step(tokens=16)
        lrn.finish()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        torch.save(
            {"flat": flat, "merges": lrn.stats.merges, "leader": lrn.client is not None},
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def island_of_two(tmp_path: Path, rank: Callable[..., None]) -> Iterator[RunningServer]:
    """A Synchronizer, once `rank(rank, world, init_file, address, out_dir)` has run as both
    ranks of a 2-process gloo island against it."""
    import torch.multiprocessing as mp

    with running(server_config(tmp_path / "state")) as srv:
        args = (2, str(tmp_path / "init"), srv.address, str(tmp_path))
        mp.spawn(rank, args=args, nprocs=2, join=True)
        yield srv


@pytest.mark.slow  # spawns two gloo processes
def test_torchrun_island_rank0_syncs_and_every_rank_ends_identical(tmp_path):
    with island_of_two(tmp_path, _island_rank) as srv:
        ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
        global_flat = torch.cat(served(srv.address, mlp(0), 2))
        merged = merged_tokens(srv)
        status = SyncClient(srv.address)
        try:
            learners = status.status().learners
        finally:
            status.close()
    assert ranks[0]["leader"] and not ranks[1]["leader"]
    assert ranks[0]["merges"] > 0
    plan = FragmentPlan(mlp(0), 2)
    # model order -> fragment order
    names = [n for n, _ in mlp(0).named_parameters()]
    sizes = [p.numel() for p in mlp(0).parameters()]
    by_name = dict(zip(names, torch.split(ranks[0]["flat"], sizes), strict=True))
    in_fragment_order = torch.cat([by_name[t.name] for f in plan.fragments for t in f.tensors])
    assert torch.equal(ranks[0]["flat"], ranks[1]["flat"])
    assert torch.equal(in_fragment_order, global_flat)
    assert [lr.name for lr in learners if lr.name.startswith("rank")] == [
        "rank0"
    ]  # only rank 0 joined
    assert merged == pytest.approx(12 * 16 * 2)  # every step of both ranks, the last ones too


def _fsdp_rank(rank: int, world: int, init_file: str, address: str, out_dir: str) -> None:
    """One rank of a 2-process gloo island sharding the model with FSDP2."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = mlp(seed=0)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        lrn = Learner(model, opt, synchronizer=address, sync_every=4, fragments=2)
        g = torch.Generator().manual_seed(rank)
        for _ in range(12):
            x = torch.randn(16, 8, generator=g)
            nn.functional.mse_loss(model(x), x[:, :4].sin()).backward()
            lrn.step(tokens=16)
            opt.zero_grad()
        lrn.finish()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # spawns two gloo processes
def test_a_sharded_island_pushes_its_last_steps_when_it_finishes(tmp_path):
    # H = 4, P = 2: fragment 1's pushes fall at steps 2, 6, 10; steps 11 and 12 reach the
    # Synchronizer only in finish()'s final push, every rank its slice under one seq.
    with island_of_two(tmp_path, _fsdp_rank) as srv:
        assert merged_tokens(srv) == pytest.approx(12 * 16 * 2)


@pytest.mark.parametrize("strict", [False, True])
def test_heartbeats_tell_the_synchronizer_when_a_fragment_is_needed_back(tmp_path, strict):
    # The adaptive grace is sized by tau: a learner reports its H, or its strict-overlap bound.
    with running(server_config(tmp_path, grace="adaptive")) as srv:
        model = mlp(seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        lrn = Learner(
            model,
            opt,
            synchronizer=srv.address,
            sync_every=40,
            fragments=2,
            heartbeat_interval_s=0.05,
            strict_overlap=strict,
            overlap_steps=3,
        )
        try:
            assert wait_until(
                lambda: srv.synchronizer.grace.overlap_steps != 0
            )  # the first heartbeat
            assert srv.synchronizer.grace.overlap_steps == (3 if strict else 40)
        finally:
            lrn.finish()


def test_waiting_for_learners_counts_one_that_already_finished(tmp_path):
    from demo.train import wait_for_learners

    with running(server_config(tmp_path)) as srv:
        early = Learner(
            mlp(0),
            torch.optim.SGD(mlp(0).parameters(), lr=0.01),
            synchronizer=srv.address,
            sync_every=5,
            name="early",
        )
        early.finish()  # a short run that ended before the other looked
        model = mlp(1)
        late = Learner(
            model,
            torch.optim.SGD(model.parameters(), lr=0.01),
            synchronizer=srv.address,
            sync_every=5,
            name="late",
        )
        try:
            wait_for_learners(late, 2, timeout_s=30)
            with pytest.raises(TimeoutError, match="only 2 of 3"):
                wait_for_learners(late, 3, timeout_s=0.5)
        finally:
            late.finish()
