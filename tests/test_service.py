"""The Synchronizer end to end over real gRPC on port 0: joins, init, pushes, pulls, restarts."""

from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from prometheus_client.parser import text_string_to_metric_families

from protos import codec, layout
from protos import diloco_pb2 as pb
from tests.helpers import Client, small_spec


def _init_model(address: str, spec, seed: int = 0) -> tuple[Client, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    flats = [torch.randn(f.numel, generator=g) for f in spec.fragments]
    c = Client(address, spec, "init")
    reply = c.join()
    assert reply.needs_init
    c.init(flats)
    return c, flats


def test_health_reports_serving_and_status_lists_fragments(make_server):
    srv = make_server()
    channel = grpc.insecure_channel(srv.address)
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "diloco.v1.Synchronizer"):
        assert (
            stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    spec = small_spec()
    c, _ = _init_model(srv.address, spec)
    status = c.status()
    assert status.initialized and status.spec_hash == spec.spec_hash
    assert [v.version for v in status.versions] == [0] * len(spec.fragments)


def test_pushes_from_several_threads_match_reference_outside_the_service(make_server):
    """Four learners push INT8 and INT4 deltas concurrently; K = 4, no grace: one round per step."""
    srv = make_server(
        quorum=0,
        grace="none",
        token_weight="uniform",
        anchor="base",
        update_history=0,
        outer="nesterov",
        outer_lr=0.7,
        outer_momentum=0.9,
    )
    spec = small_spec()
    init, flats = _init_model(srv.address, spec)
    init.leave()
    learners = [Client(srv.address, spec, f"l{i}") for i in range(4)]
    for c in learners:
        c.join()
    codecs = [pb.CODEC_INT8, pb.CODEC_INT4, pb.CODEC_INT8, pb.CODEC_INT4]
    rounds = 3
    g = torch.Generator().manual_seed(1)
    deltas = [
        [[torch.randn(f.numel, generator=g) * 0.01 for f in spec.fragments] for _ in learners]
        for _ in range(rounds)
    ]

    def run(i: int) -> None:
        c = learners[i]
        for r in range(rounds):
            for f in spec.fragments:
                reply = c.push(f.fragment_id, deltas[r][i][f.fragment_id], codecs[i], base=r)
                assert reply.outcome == pb.PUSH_ACCEPTED and reply.round_version == r + 1
            for f in spec.fragments:
                version, _ = c.pull(f.fragment_id, min_version=r + 1, wait_s=10)
                assert version == r + 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(learners))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # Reference: what the service should compute, from the same quantized deltas, with torch's SGD.
    for f in spec.fragments:
        p = torch.nn.Parameter(flats[f.fragment_id].clone())
        opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
        for r in range(rounds):
            decoded = []
            for i in range(len(learners)):
                d = deltas[r][i][f.fragment_id]
                decoded.append(
                    codec.decode(
                        codec.encode(d, codecs[i]),
                        layout.make_header(codecs[i], d.numel()),
                        torch.empty(d.numel()),
                    )
                )
            p.grad = torch.stack(decoded).mean(0)
            opt.step()
        version, served = learners[0].pull(f.fragment_id)
        assert version == rounds
        torch.testing.assert_close(served, p.detach(), rtol=1e-5, atol=1e-6)


def test_retried_push_with_same_seq_is_applied_once(make_server):
    srv = make_server(
        quorum=1, grace="none", anchor="base", outer="sgd", outer_lr=1.0, token_weight="uniform"
    )
    spec = small_spec()
    c, flats = _init_model(srv.address, spec)
    delta = torch.full((spec.fragments[0].numel,), 0.5)
    first = c.push(0, delta, seq=7)
    assert first.outcome == pb.PUSH_ACCEPTED
    _, after_first = c.pull(0, min_version=1, wait_s=10)
    again = c.push(0, delta, seq=7)
    assert again.outcome == pb.PUSH_DUPLICATE and again.round_version == first.round_version
    version, after_retry = c.pull(0)
    assert version == 1
    assert torch.equal(after_first, after_retry)
    torch.testing.assert_close(after_retry, flats[0] - 0.5)


def test_restart_from_checkpoint_resumes_versions_parameters_and_optimizer_state(
    make_server, tmp_path
):
    state = tmp_path / "restart"
    cfg = dict(quorum=1, grace="none", state_dir=state, outer="nesterov", anchor="current")
    srv = make_server(**cfg)
    spec = small_spec()
    c, _ = _init_model(srv.address, spec)
    g = torch.Generator().manual_seed(3)
    for r in range(3):
        c.push(0, torch.randn(spec.fragments[0].numel, generator=g) * 0.1, base=r)
        c.pull(0, min_version=r + 1, wait_s=10)
    _, before = c.pull(0)
    epoch = c.join(c.learner_id).server_epoch
    srv.server.stop(0).wait()
    srv.synchronizer.close()  # what SIGTERM does: merge what is open, checkpoint
    again = make_server(**cfg)
    c2 = Client(again.address, spec, "again")
    c2.session = c.session  # the session survives the restart
    joined = c2.join(c.learner_id)
    assert joined.server_epoch == epoch and not joined.needs_init  # the same history
    assert [v.version for v in joined.versions] == [3, 0]
    assert joined.next_seq == c.seq + 1  # duplicate detection survives the restart
    version, after = c2.pull(0)
    assert version == 3 and torch.equal(before, after)
    # The optimizer state came back too: the next step equals one on the uninterrupted server.
    d = torch.randn(spec.fragments[0].numel, generator=g) * 0.1
    c2.push(0, d, base=3)
    v4, restored_next = c2.pull(0, min_version=4, wait_s=10)
    frag = again.synchronizer.model.fragments[0]
    assert v4 == 4 and torch.equal(restored_next, frag.model.params)


def test_metrics_endpoint_parses_and_holds_the_series(make_server):
    srv = make_server(metrics_port=0, quorum=1, grace="none")
    spec = small_spec()
    c, _ = _init_model(srv.address, spec)
    c.heartbeat(steps=10, tokens=1000, compute_s=2.0, step_time_s=0.2)
    c.push(0, torch.zeros(spec.fragments[0].numel) + 0.01, pb.CODEC_INT8)
    c.pull(0, min_version=1, wait_s=10)
    with pytest.raises(grpc.RpcError):
        c.push(9, torch.zeros(3))
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5)
        .read()
        .decode()
    )
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "diloco_learners",
        "diloco_pushes",
        "diloco_rejected_requests",
        "diloco_tokens",
        "diloco_compute_seconds",
        "diloco_push_staleness",
        "diloco_round_contributors",
        "diloco_round_wait_seconds",
        "diloco_round_apply_seconds",
        "diloco_received_bytes",
        "diloco_sent_bytes",
        "diloco_outer_steps",
        "diloco_fragment_version",
        "diloco_rpcs",
        "diloco_goodput_ratio",
        "diloco_learner_capacity_seconds",
        "diloco_tokens_in_flight",
    ):
        assert name in families, name
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    assert samples[("diloco_pushes_total", (("outcome", "accepted"),))] == 1
    assert samples[("diloco_outer_steps_total", ())] == 1
    assert samples[("diloco_received_bytes_total", (("codec", "int8"),))] > 0
    assert (
        samples[
            (
                "diloco_rejected_requests_total",
                (("code", "NOT_FOUND"), ("reason", "unknown_fragment")),
            )
        ]
        == 1
    )
    assert samples[("diloco_rpcs_total", (("code", "OK"), ("method", "PushFragment")))] == 1
    assert samples[("diloco_fragment_version", (("fragment", "0"),))] == 1


def test_servicer_serves_every_rpc_of_the_proto_and_nothing_else():
    from synchronizer.core import Synchronizer
    from synchronizer.service import SynchronizerService

    core = Synchronizer.__new__(Synchronizer)  # the table only names the core's bound methods
    core.metrics = None  # type: ignore[assignment]
    handlers = SynchronizerService(core).handlers()
    assert set(handlers) == set(pb.DESCRIPTOR.services_by_name["Synchronizer"].methods_by_name)


def test_reflection_lists_the_service(make_server):
    srv = make_server()
    db = ProtoReflectionDescriptorDatabase(grpc.insecure_channel(srv.address))
    assert "diloco.v1.Synchronizer" in db.get_services()
