"""Hostile or broken learners cannot take the model or the service down.

A finite, validated push whose round cannot be applied is refused and the model stays healthy:
INT8 codes of 127 with a scale of 2.6e36 pass every wire check (127 * 2.6e36 is finite) but
would overflow Nesterov's momentum (an all-zero payload claiming 2^64 - 1 tokens, which made the
round's weighted sum NaN, is now refused at the door: tests/test_hostile.py). Such a round is
refused before it touches any state: the version
advances by an empty update, the parameters and outer state stay as they were, the fragment
keeps serving, and the next honest round applies as usual. Names and ids are bounded. (Learners
that are gone hold neither a slot nor a record forever, and a stalled InitModel upload cannot
block initialisation for good: tests/test_core.py, on the core's clock.)
"""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import diloco_pb2 as pb
from protos import layout
from synchronizer.records import MAX_ID_CHARS, MAX_NAME_CHARS
from tests.helpers import TIMEOUT, Client, push_messages, small_spec

SPEC = small_spec(fragments=1)
N = SPEC.fragments[0].numel


def _huge_scale_int8() -> tuple[pb.PayloadHeader, torch.Tensor]:
    header = layout.make_header(pb.CODEC_INT8, N)
    blocks = -(-N // layout.DEFAULT_BLOCK_SIZE)
    codes = torch.full((N,), 127, dtype=torch.int8).view(torch.uint8)
    scales = torch.full((blocks,), 2.6e36, dtype=torch.float32).view(torch.uint8)
    return header, torch.cat([codes, scales])


@pytest.mark.parametrize("update_history", [16, 0], ids=["update-chain", "exact-fp32"])
@pytest.mark.parametrize("attack, tokens", [(_huge_scale_int8, 100)], ids=["int8-scale-2.6e36"])
def test_a_round_that_would_overflow_is_refused_and_the_fragment_stays_healthy(
    make_server, update_history, attack, tokens
):
    srv = make_server(
        quorum=1, grace="none", anchor="base", update_history=update_history, outer="nesterov"
    )
    c = Client(srv.address, SPEC, "l0")
    c.join()
    init = torch.linspace(-1, 1, N)
    c.init([init])
    frag = srv.synchronizer.model.fragments[0]
    outer_before = {k: v.clone() for k, v in frag.model.outer.state_dict().items()}

    header, buf = attack()
    c.seq += 1
    push = pb.PushHeader(
        learner_id=c.learner_id,
        session=c.session,
        seq=c.seq,
        spec_hash=SPEC.spec_hash,
        fragment_id=0,
        base_version=0,
        tokens=tokens,
        steps=1,
        compute_s=1.0,
        payload=header,
    )
    assert (
        c.stub.PushFragment(push_messages(push, buf), timeout=TIMEOUT).outcome == pb.PUSH_ACCEPTED
    )

    version, served = c.pull(0, min_version=1, wait_s=TIMEOUT)
    assert version == 1 and torch.equal(served, init)  # skipped: an empty update
    assert all(torch.equal(v, outer_before[k]) for k, v in frag.model.outer.state_dict().items())
    assert frag.model.failure is None and c.status().unhealthy == ""
    with grpc.insecure_channel(srv.address) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=TIMEOUT
        )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    metrics = srv.synchronizer.metrics.registry
    assert metrics.get_sample_value("diloco_rounds_refused_total") == 1.0
    assert metrics.get_sample_value("diloco_outer_steps_total") == 0.0

    # The next honest round applies as usual, on top of the unchanged parameters.
    delta = torch.full((N,), 0.01)
    assert c.push(0, delta, base=1).outcome == pb.PUSH_ACCEPTED
    version, served = c.pull(0, min_version=2, wait_s=TIMEOUT)
    assert version == 2 and torch.isfinite(served).all()
    assert not torch.equal(served, init)
    assert metrics.get_sample_value("diloco_outer_steps_total") == 1.0


def test_oversized_names_and_ids_are_refused_and_nothing_is_stored(make_server):
    srv = make_server()
    c = Client(srv.address, SPEC, "x" * (MAX_NAME_CHARS + 1))
    with pytest.raises(grpc.RpcError) as e:
        c.join()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "learner_name" in (
        e.value.details() or ""
    )
    with pytest.raises(grpc.RpcError) as e:
        c.stub.Join(
            pb.JoinRequest(learner_name="ok", spec=SPEC.to_proto(), learner_id="i" * (1 << 20)),
            timeout=TIMEOUT,
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(e.value.details() or "") < 200
    with pytest.raises(grpc.RpcError) as e:
        c.stub.Heartbeat(pb.HeartbeatRequest(learner_id="i" * (MAX_ID_CHARS + 1)), timeout=TIMEOUT)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert srv.synchronizer.registry.learners == {}
