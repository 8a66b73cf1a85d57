"""Capacity settings are validated against each other, and the reserve they keep holds."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.configload import ConfigError, load
from synchronizer.config import MIN_MESSAGE_BYTES, RESERVED_WORKERS, SynchronizerConfig
from tests.helpers import TIMEOUT, Client, small_spec, wait_until

SPEC = small_spec(fragments=1)


def test_default_capacity_settings_keep_workers_for_unary_rpcs():
    cfg = SynchronizerConfig()
    assert cfg.max_workers == (
        cfg.max_concurrent_streams
        + cfg.max_waiting_pulls
        + cfg.max_unidentified_streams
        + RESERVED_WORKERS
    )


@pytest.mark.parametrize(
    "settings, words",
    [
        (
            {"max_workers": "32", "max_concurrent_streams": "64"},
            ["max_workers (32)", "max_concurrent_streams (64)"],
        ),
        (
            {"max_workers": "20", "max_concurrent_streams": "4", "max_waiting_pulls": "10"},
            ["max_workers (20)", "max_waiting_pulls (10)", "max_unidentified_streams (32)"],
        ),
        ({"max_message_bytes": str(MIN_MESSAGE_BYTES - 1)}, ["max_message_bytes"]),
    ],
)
def test_contradicting_capacity_settings_are_refused_naming_them(settings, words):
    with pytest.raises(ConfigError) as e:
        load(SynchronizerConfig, None, settings, {})
    for word in words:
        assert word in str(e.value)


def test_waiting_pulls_at_their_limit_leave_heartbeats_and_health_answering(make_server):
    waiting = 4
    srv = make_server(
        max_concurrent_streams=2,
        max_waiting_pulls=waiting,
        max_unidentified_streams=4,
        max_workers=2 + waiting + 4 + RESERVED_WORKERS,
        quorum=1,
        grace="none",
        max_pull_wait_s=60,
    )
    clients = [Client(srv.address, SPEC, f"waiter-{i}") for i in range(waiting + 1)]
    for c in clients:
        c.join()
    c = clients[-1]
    c.init([torch.zeros(SPEC.fragments[0].numel)])
    answered: list[int] = []

    def long_poll(x: Client) -> None:
        answered.append(x.pull(0, min_version=1, wait_s=60)[0])

    pollers = [threading.Thread(target=long_poll, args=(x,)) for x in clients[:waiting]]
    for t in pollers:
        t.start()
    registry = srv.synchronizer.metrics.registry
    assert wait_until(lambda: registry.get_sample_value("diloco_pulls_waiting") == waiting)
    assert c.pull(0, min_version=1, wait_s=60)[0] == 0  # no waiting slot: answered at once
    assert c.heartbeat(steps=1).server_epoch
    with grpc.insecure_channel(srv.address) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=TIMEOUT
        )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    # Shutting down answers them with the version there is, long before their 60 s.
    srv.synchronizer.close()
    for t in pollers:
        t.join(TIMEOUT)
    assert answered == [0] * waiting and not any(t.is_alive() for t in pollers)
