"""A failed outer step fails its fragment loudly: health, waiters, pushes, metrics, shutdown."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import diloco_pb2 as pb
from synchronizer import checkpoint
from synchronizer.server import SERVICE_NAME
from tests.helpers import TIMEOUT, Client, small_spec, wait_until

SPEC = small_spec(fragments=2)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=TIMEOUT
        ).status


@pytest.mark.parametrize("update_history", [16, 0], ids=["update-chain", "exact-fp32"])
def test_failed_outer_step_fails_its_fragment_loudly_and_shutdown_finishes(
    make_server, tmp_path, update_history
):
    srv = make_server(
        quorum=1,
        grace="none",
        anchor="base",
        update_history=update_history,
        checkpoint_interval_s=0,
        state_dir=tmp_path / "state",
    )
    a, b = Client(srv.address, SPEC, "a"), Client(srv.address, SPEC, "b")
    a.join()
    b.join()
    a.init([torch.zeros(f.numel) for f in SPEC.fragments])
    broken = srv.synchronizer.model.fragments[0].model.outer

    def explode(*args: object) -> float:
        raise RuntimeError("injected fault")

    broken.begin = explode  # type: ignore[method-assign]  # every outer step starts there

    # A pull already waiting for the version the failing step would make.
    waiting: dict[str, grpc.RpcError] = {}
    started = threading.Event()

    def wait_for_version_1() -> None:
        started.set()
        try:
            b.pull(0, min_version=1, wait_s=60)
        except grpc.RpcError as e:
            waiting["error"] = e

    waiter = threading.Thread(target=wait_for_version_1)
    waiter.start()
    assert started.wait(TIMEOUT)

    # Acknowledged (received and validated), then its outer step raises.
    assert a.push(0, torch.full((SPEC.fragments[0].numel,), 0.1)).outcome == pb.PUSH_ACCEPTED
    assert wait_until(
        lambda: _health(srv.address) == health_pb2.HealthCheckResponse.NOT_SERVING, TIMEOUT
    )
    assert "injected fault" in (srv.synchronizer.unhealthy or "")
    assert "fragment 0" in a.status().unhealthy and "injected fault" in a.status().unhealthy

    # The waiter is answered with an error, long before its 60 s wait.
    waiter.join(TIMEOUT)
    assert not waiter.is_alive()
    assert waiting["error"].code() == grpc.StatusCode.UNAVAILABLE
    assert "fragment 0 failed" in (waiting["error"].details() or "")

    # Nothing more is taken or served for the failed fragment; the other one keeps working.
    with pytest.raises(grpc.RpcError) as push_error:
        a.push(0, torch.full((SPEC.fragments[0].numel,), 0.1), base=0)
    assert push_error.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as pull_error:
        b.pull(0)
    assert pull_error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert a.push(1, torch.full((SPEC.fragments[1].numel,), 0.1)).outcome == pb.PUSH_ACCEPTED
    assert b.pull(1, min_version=1, wait_s=TIMEOUT)[0] == 1

    metrics = srv.synchronizer.metrics.registry
    assert metrics.get_sample_value("diloco_fragments_failed") == 1.0

    # Shutdown merges what it can and finishes, and writes no checkpoint of the failed state:
    # the newest one is still the initial model.
    srv.synchronizer.close()
    found = checkpoint.load_latest(tmp_path / "state")
    assert found is not None
    assert [f["version"] for f in found[1]["fragments"]] == [0, 0]
