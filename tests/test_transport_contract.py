"""What the learner's `Transport` promises, checked alike against every implementation: a
`SyncClient` to a real in-process Synchronizer, a `ShardedClient` over two real shards (port 0,
real channels), and the in-memory `FakeClient` the engine and Learner tests run on. The fake
passing the same checks is what makes those tests worth trusting."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from learner.client import SyncClient
from learner.session import REJOIN_CODES, Push, Transport
from learner.shards import ShardedClient
from protos import codec, layout
from protos import diloco_pb2 as pb
from synchronizer.server import RunningServer
from tests.fakes import DEADLINE_S, SIZES, SPEC, FakeClient

# Rounds close on one push at once, and a push one outer step behind is stale.
SERVER = dict(quorum=1, grace="none", max_staleness=0, checkpoint_interval_s=0)
COUNTERS = pb.LearnerCounters(steps=1, tokens=1)


def _fake() -> FakeClient:
    fake = FakeClient()
    fake.needs_init, fake.max_staleness = True, 0  # a fresh Synchronizer, as SERVER
    return fake


@pytest.fixture(params=["grpc", "sharded", "fake"])
def transport(
    request: pytest.FixtureRequest, make_server: Callable[..., RunningServer], tmp_path: Path
) -> Iterator[Transport]:
    """A transport, not yet joined, to a Synchronizer that has no model yet."""
    t: Transport
    if request.param == "grpc":
        t = SyncClient(make_server(**SERVER).address)
    elif request.param == "sharded":
        shards = [
            make_server(**SERVER, shards=2, shard_index=i, state_dir=tmp_path / f"shard-{i}")
            for i in range(2)
        ]
        t = ShardedClient([SyncClient(s.address) for s in shards])
    else:
        t = _fake()
    yield t
    t.close()


def initial(p: int) -> torch.Tensor:
    return torch.arange(SIZES[p], dtype=torch.float32) / 10 + p


def joined(t: Transport) -> pb.JoinReply:
    """Joins and uploads the model `initial`; returns the Join's reply."""
    reply = t.join("contract", SPEC)
    t.init_model([initial(p) for p in range(len(SIZES))])
    return reply


def push(p: int, seq: int, base_version: int = 0) -> Push:
    delta = torch.full((SIZES[p],), 0.01)
    return Push(
        p,
        seq,
        base_version,
        tokens=16,
        steps=4,
        compute_s=0.1,
        encoded=codec.encode(delta, pb.CODEC_FP32),
        header=layout.make_header(pb.CODEC_FP32, SIZES[p]),
    )


def pull(
    t: Transport,
    p: int,
    min_version: int = 0,
    wait_s: float = 0.0,
    codec_id: int = pb.CODEC_FP32,
    have: tuple[int, torch.Tensor] | None = None,
) -> tuple[int, str, torch.Tensor]:
    return t.pull(p, min_version, wait_s, codec_id, out=torch.empty(SIZES[p]), have=have)


def refused(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


# Joining and the model -----------------------------------------------------------------------


def test_a_first_join_gives_an_id_a_session_an_epoch_and_a_lease_and_asks_for_the_model(
    transport,
):
    reply = transport.join("contract", SPEC)
    assert reply.learner_id and reply.learner_id == transport.learner_id
    assert transport.session and reply.server_epoch and reply.lease_s > 0
    assert reply.needs_init and reply.next_seq == 1
    assert {transport.shard_of(p) for p in range(len(SIZES))} <= {0, 1}


def test_a_pull_before_the_model_exists_is_refused_failed_precondition(transport):
    transport.join("contract", SPEC)
    assert refused(lambda: pull(transport, 0)) == grpc.StatusCode.FAILED_PRECONDITION


def test_the_model_is_uploaded_once_and_served_exactly_as_uploaded(transport):
    epoch = transport.join("contract", SPEC).server_epoch
    reply = transport.init_model([initial(p) for p in range(len(SIZES))])
    assert [(v.fragment_id, v.version) for v in reply.versions] == [(p, 0) for p in range(3)]
    assert (
        refused(lambda: transport.init_model([initial(p) for p in range(len(SIZES))]))
        == grpc.StatusCode.ALREADY_EXISTS
    )
    for p in range(len(SIZES)):
        out = torch.empty(SIZES[p])
        version, served_epoch, params = transport.pull(p, 0, 0.0, pb.CODEC_FP32, out=out)
        assert (version, served_epoch) == (0, epoch)
        assert params is out and torch.equal(params, initial(p))


# Pushes -------------------------------------------------------------------------------------


def test_an_accepted_push_names_its_round_and_a_pull_waits_for_that_version(transport):
    joined(transport)
    for p in range(len(SIZES)):  # every fragment, so every shard
        reply = transport.push(push(p, seq=p + 1))
        assert (reply.outcome, reply.round_version) == (pb.PUSH_ACCEPTED, 1)
        version, _, params = pull(transport, p, min_version=1, wait_s=DEADLINE_S)
        assert version == 1 and not torch.equal(params, initial(p))


def test_a_repeated_seq_is_answered_as_a_duplicate_of_its_round_and_not_applied_again(transport):
    joined(transport)
    first = transport.push(push(1, seq=1))
    _, _, after_first = pull(transport, 1, min_version=1, wait_s=DEADLINE_S)
    again = transport.push(push(1, seq=1))
    assert (again.outcome, again.round_version) == (pb.PUSH_DUPLICATE, first.round_version)
    version, _, params = pull(transport, 1)
    assert version == 1 and torch.equal(params, after_first)


def test_a_push_staler_than_the_bound_is_dropped_and_says_the_current_version(transport):
    joined(transport)
    assert transport.push(push(0, seq=1)).outcome == pb.PUSH_ACCEPTED
    _, _, current = pull(transport, 0, min_version=1, wait_s=DEADLINE_S)
    stale = transport.push(push(0, seq=2, base_version=0))  # one outer step behind
    assert (stale.outcome, stale.current_version) == (pb.PUSH_DROPPED_STALE, 1)
    version, _, params = pull(transport, 0)
    assert version == 1 and torch.equal(params, current)


@pytest.mark.parametrize(
    ("seq", "base_version", "code"),
    [(1, 5, grpc.StatusCode.FAILED_PRECONDITION), (0, 0, grpc.StatusCode.INVALID_ARGUMENT)],
    ids=["base-version-ahead", "seq-zero"],
)
def test_a_push_that_cannot_be_judged_is_refused_with_a_status(transport, seq, base_version, code):
    joined(transport)
    assert refused(lambda: transport.push(push(2, seq, base_version))) == code


# Pulls ---------------------------------------------------------------------------------------


def test_a_delta_pull_a_bf16_pull_and_an_int8_pull_give_what_the_full_pull_gives(transport):
    joined(transport)
    _, _, v0 = pull(transport, 0)
    transport.push(push(0, seq=1))
    version, _, full = pull(transport, 0, min_version=1, wait_s=DEADLINE_S)
    delta_version, _, from_delta = pull(transport, 0, have=(0, v0.clone()))
    assert delta_version == version == 1 and torch.equal(from_delta, full)
    _, _, bf16 = pull(transport, 0, codec_id=pb.CODEC_BF16)
    assert torch.equal(bf16, full.bfloat16().float())
    _, _, int8 = pull(transport, 0, codec_id=pb.CODEC_INT8)
    header = layout.make_header(pb.CODEC_INT8, full.numel())
    assert torch.equal(int8, codec.decode(codec.encode(full, pb.CODEC_INT8), header, full.clone()))
    assert not torch.equal(int8, full)  # rounded: these values are not all INT8 codes


def test_a_pull_for_a_version_not_reached_answers_the_current_one_after_wait_s(transport):
    joined(transport)
    t0 = time.monotonic()
    version, _, params = pull(transport, 1, min_version=5, wait_s=0.2)
    assert version == 0 and torch.equal(params, initial(1))
    assert time.monotonic() - t0 < DEADLINE_S


# Lease, re-join, leave -----------------------------------------------------------------------


def test_a_heartbeat_renews_the_lease_and_reports_the_epoch(transport):
    epoch = joined(transport).server_epoch
    reply = transport.heartbeat(COUNTERS, step_time_s=0.1, overlap_steps=3)
    assert reply.server_epoch == epoch and reply.lease_s > 0


def test_a_rejoin_under_the_same_id_keeps_it_and_numbers_pushes_after_the_last(transport):
    first = joined(transport)
    assert transport.push(push(1, seq=1)).outcome == pb.PUSH_ACCEPTED
    again = transport.join("contract", SPEC, transport.learner_id)
    assert (again.learner_id, again.server_epoch) == (first.learner_id, first.server_epoch)
    assert again.next_seq == 2 and not again.needs_init
    assert sorted(v.fragment_id for v in again.versions) == [0, 1, 2]


def test_after_leave_the_learner_is_unknown_and_a_join_makes_it_a_new_one(transport):
    first = joined(transport)
    transport.leave(COUNTERS)
    code = refused(lambda: transport.heartbeat(COUNTERS))
    assert code == grpc.StatusCode.NOT_FOUND and code in REJOIN_CODES
    assert transport.join("contract", SPEC).learner_id != first.learner_id
