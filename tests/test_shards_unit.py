"""The learner against a sharded Synchronizer, no server: `ShardedClient` over in-memory fake
shards (joins, routing, init, heartbeats, epochs), the push/pull engine with one shard down or
restarted, and the `synchronizer`/`shards` settings."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from pydantic import ValidationError

from learner.addresses import client_for, shard_addresses
from learner.client import ShardMismatch, SyncClient
from learner.config import LearnerConfig
from learner.session import Clock, Push
from learner.shards import ShardedClient
from learner.sync import SyncEngine
from protos import diloco_pb2 as pb
from protos.spec import shard_owners
from tests.fakes import (
    DEADLINE_S,
    FAST,
    SIZES,
    SPEC,
    FakeShard,
    arrival,
    job,
)

OWNERS = shard_owners(SPEC, 2)  # [0, 1, 1]
ON_0 = [p for p, s in enumerate(OWNERS) if s == 0]
ON_1 = [p for p, s in enumerate(OWNERS) if s == 1]


@pytest.fixture
def shards() -> tuple[FakeShard, FakeShard]:
    return FakeShard(0), FakeShard(1)


@pytest.fixture
def engines() -> Iterator[Any]:
    """Makes engines over a ShardedClient of the given shards, connected and started; stops them."""
    made: list[SyncEngine] = []

    def make(*shards: FakeShard, **settings: Any) -> SyncEngine:
        cfg = LearnerConfig(**{**FAST, **settings})
        engine = SyncEngine(
            ShardedClient(shards),
            cfg,
            SPEC,
            "test",
            Clock(),
            global_params=lambda: [torch.zeros(n) for n in SIZES],
            pin=False,
        )
        made.append(engine)
        engine.connect(DEADLINE_S, lambda: [torch.zeros(n) for n in SIZES])
        engine.start()
        return engine

    yield make
    for engine in made:
        engine.stop(timeout_s=DEADLINE_S, close_channel=True)
        assert not [t.name for t in engine.threads if t.is_alive()]


# Joining ------------------------------------------------------------------------------------


def test_a_sharded_join_joins_every_shard_under_one_id_in_shard_order_and_merges_the_replies(
    shards,
):
    a, b = shards
    b.versions = [0, 4, 7]
    client = ShardedClient([b, a])  # addresses in any order
    reply = client.join("l0", SPEC)
    assert client.shards == [a, b]
    assert [j[0] for j in b.joins + a.joins] == [
        "",
        "learner-1",
    ]  # the first one asked gives the id
    assert a.joins[0][2:] == b.joins[0][2:] == (2, OWNERS)
    assert reply.learner_id == a.learner_id == b.learner_id == client.learner_id == "learner-1"
    assert reply.server_epoch == "epoch-0,epoch-1"
    assert [(fv.fragment_id, fv.version) for fv in reply.versions] == [(0, 0), (1, 4), (2, 7)]
    assert client.session == "s0-learner-1,s1-learner-1"
    assert [client.shard_of(p) for p in range(len(SIZES))] == OWNERS


def test_pushes_and_pulls_go_to_the_fragments_owner_with_the_composite_epoch(shards):
    a, b = shards
    client = ShardedClient([a, b])
    client.join("l0", SPEC)
    for p in range(len(SIZES)):
        client.push(
            Push(p, p + 1, 0, 10, 1, 0.1, torch.zeros(8, dtype=torch.uint8), pb.PayloadHeader())
        )
        version, epoch, _ = client.pull(p, 0, 0.0, pb.CODEC_FP32)
        assert (version, epoch) == (1, "epoch-0,epoch-1")
    assert [c[0] for c in a.calls_of("push")] == ON_0
    assert [c[0] for c in b.calls_of("push")] == ON_1
    b.restart("epoch-1b")
    assert client.pull(ON_1[0], 0, 0.0, pb.CODEC_FP32)[1] == "epoch-0,epoch-1b"
    assert client.pull(ON_0[0], 0, 0.0, pb.CODEC_FP32)[1] == "epoch-0,epoch-1"


def test_shards_that_are_not_each_index_once_are_refused_naming_them():
    client = ShardedClient([FakeShard(0), FakeShard(0)])
    with pytest.raises(
        ShardMismatch,
        match=r"needs shards 0\.\.1 once each, but fake:0 is shard 0, fake:0 is shard 0",
    ):
        client.join("l0", SPEC)


def test_a_shard_that_owns_other_fragments_than_the_learner_computed_is_refused():
    client = ShardedClient([FakeShard(0, owned=[0, 1]), FakeShard(1)])
    with pytest.raises(
        ShardMismatch, match=r"owns fragments \[0, 1\], this learner computed \[0\]"
    ):
        client.join("l0", SPEC)


def test_more_shards_than_fragments_is_a_shard_mismatch():
    client = ShardedClient([FakeShard(i, shards=4) for i in range(4)])
    with pytest.raises(ShardMismatch, match="at most as many shards as fragments"):
        client.join("l0", SPEC)


def test_a_restarted_learner_gives_back_every_shards_session_in_shard_order(shards):
    a, b = shards
    first = ShardedClient([a, b])
    first.join("l0", SPEC)
    again = ShardedClient([b, a])  # the addresses in another order this time
    again.learner_id, again.session = first.learner_id, first.session
    again.join("l0", SPEC, again.learner_id)
    assert a.joins[-1][:2] == ("learner-1", "s0-learner-1")
    assert b.joins[-1][:2] == ("learner-1", "s1-learner-1")
    with pytest.raises(ShardMismatch, match="holds 1 session"):
        again.session = "just-one"


def test_a_rejoin_carries_on_without_a_shard_out_of_reach_and_keeps_its_epoch(shards):
    a, b = shards
    client = ShardedClient([a, b])
    client.join("l0", SPEC)
    b.down = True
    reply = client.join("l0", SPEC, client.learner_id)
    assert reply.server_epoch == "epoch-0,epoch-1" and len(a.joins) == 2
    c, d = FakeShard(0), FakeShard(1)
    d.down = True
    with pytest.raises(grpc.RpcError):  # a first join needs every shard
        ShardedClient([c, d]).join("l0", SPEC)


# The model ----------------------------------------------------------------------------------


def test_init_model_sends_each_shard_only_its_own_fragments(shards):
    a, b = shards
    a.needs_init = b.needs_init = True
    client = ShardedClient([a, b])
    assert client.join("l0", SPEC).needs_init
    params = [torch.full((n,), 9.0 + p) for p, n in enumerate(SIZES)]
    reply = client.init_model(params)
    assert a.inits == [ON_0] and b.inits == [ON_1]
    assert [fv.fragment_id for fv in reply.versions] == [0, 1, 2]
    assert torch.equal(b.params[ON_1[0]], params[ON_1[0]])


def test_init_model_uploads_to_every_shard_at_once(shards):
    """Each upload keeps only its own shard's lease: one after another, a large model's first
    upload and checkpoint outlast the next shard's lease before its turn."""
    a, b = shards
    a.needs_init = b.needs_init = True
    client = ShardedClient([a, b])
    client.join("l0", SPEC)
    both = threading.Barrier(2, timeout=DEADLINE_S)  # broken (BrokenBarrierError) if one at a time
    for shard in (a, b):
        upload = shard.init_model

        def meeting(fragments, fragment_ids=None, upload=upload):  # type: ignore[no-untyped-def]
            both.wait()
            return upload(fragments, fragment_ids)

        shard.init_model = meeting  # type: ignore[method-assign]
    reply = client.init_model([torch.zeros(n) for n in SIZES])
    assert [fv.fragment_id for fv in reply.versions] == [0, 1, 2]
    assert a.inits == [ON_0] and b.inits == [ON_1]


def test_init_model_refused_by_one_shard_still_initialises_the_other_then_says_already_exists(
    shards,
):
    a, b = shards
    a.needs_init = b.needs_init = True
    client = ShardedClient([a, b])
    client.join("l0", SPEC)
    a.needs_init = False  # another learner got there first
    with pytest.raises(grpc.RpcError) as e:
        client.init_model([torch.zeros(n) for n in SIZES])
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert b.inits == [ON_1] and not b.needs_init


def test_a_new_learner_uploads_to_an_empty_shard_and_pulls_the_others_fragments(shards, engines):
    a, b = shards
    b.needs_init = True  # shard 1 lost its state; shard 0 serves its fragments
    a.params[0] = torch.full((SIZES[0],), 5.0)
    engine = engines(a, b)
    assert b.inits == [ON_1] and a.inits == []
    held = engine.held[0]  # shard 0's fragment: pulled, not this learner's own
    assert held is not None and torch.equal(held[2], a.params[0])


# Heartbeats ---------------------------------------------------------------------------------


def test_a_heartbeat_goes_on_while_one_shard_is_down_and_keeps_its_epoch(shards, caplog):
    a, b = shards
    client = ShardedClient([a, b])
    client.join("l0", SPEC)
    b.down = True
    for _ in range(3):
        reply = client.heartbeat(pb.LearnerCounters())
        assert reply.server_epoch == "epoch-0,epoch-1"
    assert len(b.calls_of("heartbeat")) == 3
    warnings = [r for r in caplog.records if "shard 1 at fake:1" in r.getMessage()]
    assert len(warnings) == 1  # rate-limited
    a.down = True
    with pytest.raises(grpc.RpcError):
        client.heartbeat(pb.LearnerCounters())


def test_a_heartbeat_refused_by_one_shard_fails_so_that_the_session_rejoins(shards):
    a, b = shards
    client = ShardedClient([a, b])
    client.join("l0", SPEC)
    b.fail_next("heartbeat", grpc.StatusCode.FAILED_PRECONDITION)
    with pytest.raises(grpc.RpcError) as e:
        client.heartbeat(pb.LearnerCounters())
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


# The engine: a shard down or restarted stalls only its own fragments ------------------------


def test_a_shard_down_holds_back_only_its_own_fragments_pushes(shards, engines):
    a, b = shards
    engine = engines(a, b)
    b.down = True
    stalled, free = job(ON_1[0]), job(ON_0[0])
    assert engine.submit(stalled)
    b.wait_for_call("push")  # its sender keeps retrying...
    assert engine.submit(free)  # ...and shard 0's sender goes on
    got = arrival(engine)
    assert got.fragment == ON_0[0] and got.job is free and got.version == 1
    assert engine.in_flight() == 1  # its push, still queued
    b.down = False  # back, its epoch kept: the stalled push goes through
    got = arrival(engine)
    assert got.fragment == ON_1[0] and got.job is stalled and got.version == 1
    assert engine.session.generation == 0 and len(b.joins) == 1


def test_a_shard_restarted_with_a_new_epoch_repulls_only_its_fragments(shards, engines):
    a, b = shards
    a.close_rounds = False
    engine = engines(a, b, heartbeat_interval_s=0.01)
    awaited = job(ON_0[0])
    assert engine.submit(awaited)
    a.wait_for_call("pull", len(ON_0) + 1)  # waiting for the round of its push
    b.restart("epoch-1b")  # shard 1 lost everything
    got = {arrival(engine).fragment: None for _ in ON_1}
    assert sorted(got) == ON_1
    assert engine.session.epoch == "epoch-0,epoch-1b" and engine.session.generation == 1
    assert engine.busy(ON_0[0])  # shard 0's push is still awaited, not forgotten
    a.close_round(ON_0[0])
    back = arrival(engine)
    assert back.fragment == ON_0[0] and back.job is awaited and back.version == 1


def test_a_shard_restarted_with_its_epoch_kept_changes_nothing(shards, engines):
    a, b = shards
    engine = engines(a, b, heartbeat_interval_s=0.01)
    b.down = True
    a.wait_for_call("heartbeat", 5)
    b.down = False
    b.wait_for_call("heartbeat", len(b.calls_of("heartbeat")) + 3)
    assert engine.session.generation == 0 and len(a.joins) == len(b.joins) == 1
    assert engine.in_flight() == 0


# Configuration -------------------------------------------------------------------------------


def test_the_synchronizer_setting_takes_one_address_per_shard():
    cfg = LearnerConfig(synchronizer="a:1, b:2")
    assert shard_addresses(cfg) == ["a:1", "b:2"]
    assert LearnerConfig(synchronizer="a:1,b:2", shards=2).shards == 2
    with pytest.raises(ValidationError, match="shards=3 but synchronizer lists 2 addresses"):
        LearnerConfig(synchronizer="a:1,b:2", shards=3)
    with pytest.raises(ValidationError, match="lists an address twice"):
        LearnerConfig(synchronizer="a:1,a:1")
    with pytest.raises(ValidationError, match="must be host:port"):
        LearnerConfig(synchronizer="a:1,b")


def test_one_name_resolves_to_every_shard(monkeypatch):
    def getaddrinfo(host: str, port: int, *args: Any, **kw: Any) -> list[Any]:
        assert (host, port) == ("sync.ns.svc", 50051)
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.2", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.2", port)),
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::3", port, 0, 0)),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    cfg = LearnerConfig(synchronizer="sync.ns.svc:50051", shards=3)
    assert shard_addresses(cfg) == ["10.0.0.2:50051", "10.0.0.1:50051", "[fd00::3]:50051"]
    with pytest.raises(
        ShardMismatch, match=r"resolves to 3 address\(es\).*shards=2 needs one per shard"
    ):
        shard_addresses(LearnerConfig(synchronizer="sync.ns.svc:50051", shards=2))


def test_one_shard_is_the_plain_client_and_several_the_sharded_one():
    one = client_for(LearnerConfig(synchronizer="127.0.0.1:1"))
    two = client_for(LearnerConfig(synchronizer="127.0.0.1:1,127.0.0.1:2"))
    try:
        assert isinstance(one, SyncClient)
        assert isinstance(two, ShardedClient) and two.address == "127.0.0.1:1,127.0.0.1:2"
    finally:
        one.close()
        two.close()
