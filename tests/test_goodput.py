"""Goodput accounting: every token a learner reports lands in exactly one bucket."""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from tests.helpers import Client, small_spec, wait_until

SPEC = small_spec(sizes=(300, 100), fragments=2)


def _buckets(srv) -> dict[str, float]:
    reg = srv.synchronizer.metrics.registry
    out = {
        b: reg.get_sample_value("diloco_tokens_total", {"bucket": b})
        for b in ("merged", "discarded", "lost")
    }
    out["in_flight"] = reg.get_sample_value("diloco_tokens_in_flight")
    return out


def test_tokens_move_from_in_flight_to_merged_discarded_and_lost(make_server):
    srv = make_server(
        quorum=1, grace="none", lease_s=2.0, max_staleness=0
    )  # no lapse before the last push, even on a busy machine
    share = [f.numel / SPEC.numel for f in SPEC.fragments]
    a, b = Client(srv.address, SPEC, "a"), Client(srv.address, SPEC, "b")
    a.join()
    b.join()
    a.init([torch.zeros(f.numel) for f in SPEC.fragments])
    a.heartbeat(steps=20, tokens=2000, compute_s=4.0)
    assert _buckets(srv)["in_flight"] == pytest.approx(2000)
    a.push(0, torch.ones(SPEC.fragments[0].numel), tokens=1000, steps=10)  # merged at once (K=1)
    a.pull(0, min_version=1, wait_s=10)
    b.heartbeat(steps=10, tokens=1000, compute_s=2.0)
    dropped = b.push(
        0, torch.ones(SPEC.fragments[0].numel), base=0, tokens=1000, steps=10
    )  # stale: dropped
    assert dropped.staleness == 1
    got = _buckets(srv)
    assert got["merged"] == pytest.approx(1000 * share[0])
    assert got["discarded"] == pytest.approx(1000 * share[0])
    assert got["in_flight"] == pytest.approx(3000 - 2000 * share[0])
    # Both leases lapse: what they reported but never pushed is lost.
    assert wait_until(lambda: srv.synchronizer.registry.counts()["dead"] == 2, timeout_s=30)
    got = _buckets(srv)
    assert got["lost"] == pytest.approx(3000 - 2000 * share[0])
    assert got["in_flight"] == pytest.approx(0)
    assert sum(got.values()) == pytest.approx(3000)
    capacity = srv.synchronizer.metrics.registry.get_sample_value(
        "diloco_learner_capacity_seconds_total"
    )
    assert capacity > 0


def test_reflection_lists_the_service(make_server):
    srv = make_server()
    db = ProtoReflectionDescriptorDatabase(grpc.insecure_channel(srv.address))
    assert "diloco.v1.Synchronizer" in db.get_services()
