"""Every malformed or hostile request gets its precise status code, is counted, and changes nothing."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch

from protos import diloco_pb2 as pb
from protos import framing
from protos.spec import TensorInfo, plan_fragments
from synchronizer.server import RunningServer
from tests.helpers import Client, push_messages, small_spec, wait_until

SPEC = small_spec()


@pytest.fixture
def ready(make_server) -> tuple[RunningServer, Client]:
    srv = make_server(quorum=1, grace="none", lease_s=30.0)
    c = Client(srv.address, SPEC, "victim")
    c.join()
    g = torch.Generator().manual_seed(0)
    c.init([torch.randn(f.numel, generator=g) for f in SPEC.fragments])
    return srv, c


def _state(srv: RunningServer) -> list[tuple[int, torch.Tensor, dict[str, torch.Tensor]]]:
    state = []
    for f in srv.synchronizer.model.fragments:
        assert f.model.params is not None
        state.append(
            (
                f.version,
                f.model.params.clone(),
                {k: v.clone() for k, v in f.model.outer.state_dict().items()},
            )
        )
    return state


def _rejections(srv: RunningServer, code: str) -> float:
    total = 0.0
    for metric in srv.synchronizer.metrics.registry.collect():
        if metric.name == "diloco_rejected_requests":
            total += sum(
                s.value
                for s in metric.samples
                if s.name.endswith("_total") and s.labels["code"] == code
            )
    return total


def _expect(
    srv: RunningServer, code: grpc.StatusCode, call: Callable[[], object], words: str
) -> None:
    before, rejected = _state(srv), _rejections(srv, code.name)
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    assert words in err.value.details()
    # the global model is bit-for-bit unchanged, and the refusal is counted
    for (v0, p0, s0), (v1, p1, s1) in zip(before, _state(srv), strict=True):
        assert v0 == v1 and torch.equal(p0, p1) and all(torch.equal(s0[k], s1[k]) for k in s0)
    assert _rejections(srv, code.name) == rejected + 1


def _raw_push(c: Client, header: pb.PushHeader, chunks: Iterator[pb.Chunk]) -> pb.PushReply:
    def msgs() -> Iterator[pb.PushRequest]:
        yield pb.PushRequest(header=header)
        for ch in chunks:
            yield pb.PushRequest(chunk=ch)

    return c.stub.PushFragment(msgs(), timeout=10)


def _delta(fragment: int = 0, value: float = 0.1) -> torch.Tensor:
    return torch.full((SPEC.fragments[fragment].numel,), value)


def test_unknown_learner_is_not_found(ready):
    srv, c = ready
    c.learner_id = "nobody"
    _expect(srv, grpc.StatusCode.NOT_FOUND, lambda: c.push(0, _delta()), "not joined")


def test_expired_lease_is_failed_precondition_until_rejoin(make_server):
    srv = make_server(
        quorum=1, grace="none", lease_s=1.0
    )  # long enough to join and init on a busy machine
    c = Client(srv.address, SPEC)
    c.join()
    c.init([torch.zeros(f.numel) for f in SPEC.fragments])
    assert wait_until(lambda: srv.synchronizer.registry.counts()["dead"] == 1)
    _expect(srv, grpc.StatusCode.FAILED_PRECONDITION, lambda: c.push(0, _delta()), "lease")
    c.join(c.learner_id)  # coming back under the same id works
    assert c.push(0, _delta()).outcome == pb.PUSH_ACCEPTED


def test_wrong_spec_hash_is_failed_precondition(ready):
    srv, c = ready
    h, buf = c.header(0, _delta(), pb.CODEC_FP32, 0)
    h.spec_hash = "0" * 64
    _expect(
        srv,
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: c.stub.PushFragment(push_messages(h, buf), timeout=10),
        "spec hash",
    )


def test_join_with_a_different_model_is_refused_with_what_differs(ready):
    srv, _ = ready
    other = plan_fragments(
        [
            TensorInfo("layer0.weight", (301,)),
            TensorInfo("layer1.weight", (257,)),
            TensorInfo("layer2.weight", (100,)),
            TensorInfo("layer3.weight", (40,)),
        ],
        2,
    )
    _expect(
        srv,
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: Client(srv.address, other).join(),
        "layer0.weight",
    )


def test_malformed_spec_is_invalid_argument(ready):
    srv, c = ready
    bad = SPEC.to_proto()
    bad.fragments[0].numel += 1
    _expect(
        srv,
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: c.stub.Join(pb.JoinRequest(spec=bad), timeout=10),
        "numel",
    )


def test_second_initialiser_gets_already_exists(ready):
    srv, _ = ready
    late = Client(srv.address, SPEC, "late")
    assert not late.join().needs_init
    _expect(
        srv,
        grpc.StatusCode.ALREADY_EXISTS,
        lambda: late.init([torch.ones(f.numel) for f in SPEC.fragments]),
        "already initialised",
    )


def test_unknown_fragment_is_not_found(ready):
    srv, c = ready
    h, buf = c.header(0, _delta(), pb.CODEC_FP32, 0)
    h.fragment_id = 7
    _expect(
        srv,
        grpc.StatusCode.NOT_FOUND,
        lambda: c.stub.PushFragment(push_messages(h, buf), timeout=10),
        "fragment 7",
    )


def test_unknown_codec_is_invalid_argument(ready):
    srv, c = ready
    h, buf = c.header(0, _delta(), pb.CODEC_INT8, 0)
    h.payload.codec = 42
    _expect(
        srv,
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: c.stub.PushFragment(push_messages(h, buf), timeout=10),
        "codec",
    )


def test_pull_in_a_codec_not_served_is_invalid_argument_naming_those_served(ready):
    srv, c = ready
    _expect(
        srv,
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: c.pull(0, codec_id=pb.CODEC_INT4),
        "pulls are served as fp32, bf16, int8",
    )


def test_wrong_element_count_is_invalid_argument(ready):
    srv, c = ready
    _expect(
        srv,
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: c.push(0, torch.zeros(SPEC.fragments[0].numel - 1)),
        "elements",
    )


def test_out_of_order_chunks_are_invalid_argument(ready):
    srv, c = ready
    h, buf = c.header(0, _delta(), pb.CODEC_FP32, 0)
    chunks = list(framing.iter_chunks(buf, 256))
    chunks[0], chunks[1] = chunks[1], chunks[0]
    _expect(
        srv, grpc.StatusCode.INVALID_ARGUMENT, lambda: _raw_push(c, h, iter(chunks)), "in order"
    )


def test_missing_chunks_are_invalid_argument(ready):
    srv, c = ready
    h, buf = c.header(0, _delta(), pb.CODEC_FP32, 0)
    chunks = list(framing.iter_chunks(buf, 256))[:-1]
    _expect(
        srv, grpc.StatusCode.INVALID_ARGUMENT, lambda: _raw_push(c, h, iter(chunks)), "stream ended"
    )


def test_oversized_stream_is_resource_exhausted(ready):
    srv, c = ready
    h, buf = c.header(0, _delta(), pb.CODEC_FP32, 0)
    chunks = list(framing.iter_chunks(buf, 256)) + [pb.Chunk(offset=buf.numel(), data=b"x" * 64)]
    _expect(
        srv, grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: _raw_push(c, h, iter(chunks)), "runs past"
    )


@pytest.mark.parametrize(
    ("codec_id", "dtype", "bad"),
    [(pb.CODEC_FP32, torch.float32, float("nan")), (pb.CODEC_BF16, torch.bfloat16, -math.inf)],
)
def test_nan_after_decoding_is_invalid_argument(ready, codec_id, dtype, bad):
    # values are checked in the pass that takes their norm (the native kernels'), as in torch's
    srv, c = ready
    d = _delta()
    h, _ = c.header(0, d, codec_id, 0)
    d[-5] = bad
    raw = d.to(dtype).view(torch.uint8).clone()
    _expect(
        srv,
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: _raw_push(c, h, framing.iter_chunks(raw, 256)),
        "NaN or Inf",
    )


def test_inf_scale_is_invalid_argument(ready):
    srv, c = ready
    h, buf = c.header(0, _delta(), pb.CODEC_INT8, 0)
    numel = SPEC.fragments[0].numel
    buf[numel : numel + 4] = torch.tensor([float("inf")]).view(
        torch.uint8
    )  # first block's fp32 scale
    _expect(
        srv,
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: c.stub.PushFragment(push_messages(h, buf), timeout=10),
        "scale",
    )


def test_version_from_the_future_is_failed_precondition(ready):
    srv, c = ready
    _expect(
        srv, grpc.StatusCode.FAILED_PRECONDITION, lambda: c.push(0, _delta(), base=5), "re-pull"
    )


def test_push_before_init_is_failed_precondition(make_server):
    srv = make_server()
    c = Client(srv.address, SPEC)
    c.join()
    with pytest.raises(grpc.RpcError) as err:
        c.push(0, _delta())
    assert (
        err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "InitModel" in err.value.details()
    )


def test_duplicate_push_changes_nothing_and_says_so(ready):
    srv, c = ready
    assert c.push(0, _delta(), seq=3).outcome == pb.PUSH_ACCEPTED
    c.pull(0, min_version=1, wait_s=10)
    before = _state(srv)
    assert c.push(0, _delta(value=9.0), seq=3).outcome == pb.PUSH_DUPLICATE
    for (v0, p0, _), (v1, p1, _) in zip(before, _state(srv), strict=True):
        assert v0 == v1 and torch.equal(p0, p1)


def test_zero_steps_is_invalid_argument(ready):
    srv, c = ready
    _expect(
        srv,
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: c.push(0, _delta(), steps=0),
        "at least one step",
    )


def test_too_many_learners_is_resource_exhausted(make_server):
    srv = make_server(max_learners=1)
    Client(srv.address, SPEC).join()
    with pytest.raises(grpc.RpcError) as err:
        Client(srv.address, SPEC).join()
    assert (
        err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        and "max_learners" in err.value.details()
    )


def test_missing_bearer_token_is_unauthenticated_but_health_stays_open(make_server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    srv = make_server(auth_token="s3cret")
    with pytest.raises(grpc.RpcError) as err:
        Client(srv.address, SPEC).join()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        Client(srv.address, SPEC, metadata=[("authorization", "Bearer wrong")]).join()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ok = Client(srv.address, SPEC, metadata=[("authorization", "Bearer s3cret")])
    assert ok.join().needs_init
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(srv.address))
    assert (
        health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        == health_pb2.HealthCheckResponse.SERVING
    )


def test_pushes_of_different_fragments_may_arrive_out_of_seq_order(ready):
    srv, c = ready
    assert c.push(1, _delta(1), seq=5).outcome == pb.PUSH_ACCEPTED
    assert c.push(0, _delta(0), seq=4).outcome == pb.PUSH_ACCEPTED  # new, though below 5
    assert c.push(0, _delta(0), seq=4).outcome == pb.PUSH_DUPLICATE
