"""Transfers longer than a lease keep their learner alive while their bytes flow.

A learner busy uploading the initial model, pushing or pulling sends no heartbeat of its own
(the first learner heartbeats only once the model exists), so every chunk a stream moves renews
its lease; a stream that stalls does not, and its learner dies as any silent one does. A learner
that joins while another uploads the model waits for it (one INFO line) and starts once it exists.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

import grpc
import pytest
import torch
from torch import nn

from learner import Learner
from learner.fragments import FragmentPlan
from protos import diloco_pb2 as pb
from protos.initmodel import init_model_requests
from tests.helpers import TIMEOUT, Client, push_messages, small_spec, wait_until

T = TypeVar("T")

LEASE_S = 0.6
GAP_S = 0.1  # between the messages of a throttled stream: six per lease
SPEC = small_spec()  # two fragments of 340 and 357 parameters
CHUNK = 100  # bytes: about 14 chunks per fragment


def throttled(messages: Iterable[T], gap_s: float = GAP_S) -> Iterator[T]:
    """`messages`, one every `gap_s`: a slow link, as seen by the server."""
    pace = threading.Event()
    for m in messages:
        pace.wait(gap_s)
        yield m


def lapsed(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "lease lapsed" in r.getMessage()]


def params() -> list[torch.Tensor]:
    return [torch.randn(f.numel) for f in SPEC.fragments]


def test_an_initmodel_upload_longer_than_several_leases_keeps_the_uploaders_lease(
    make_server, caplog
):
    srv = make_server(lease_s=LEASE_S)
    c = Client(srv.address, SPEC, "uploader")
    assert c.join().needs_init
    flats = params()
    messages = list(init_model_requests(c.learner_id, c.session, SPEC.spec_hash, flats, CHUNK))
    assert len(messages) * GAP_S > 4 * LEASE_S
    c.stub.InitModel(throttled(messages), timeout=TIMEOUT)
    assert lapsed(caplog) == []
    assert srv.synchronizer.registry.learners[c.learner_id].state == "alive"
    c.heartbeat()  # the first heartbeat after the upload is taken: the lease held throughout
    assert torch.equal(c.pull(1)[1], flats[1])


def test_a_first_checkpoint_longer_than_several_leases_keeps_the_uploaders_lease(
    make_server, caplog, monkeypatch
):
    # At 1B parameters the checkpoint InitModel writes before it answers takes longer than a
    # lease: that is the server's time, and the learner waiting for the reply must not die.
    srv = make_server(lease_s=LEASE_S)
    core = srv.synchronizer
    original = core.save_checkpoint
    reaped = threading.Event()

    def slow_checkpoint() -> None:
        # Slow enough that the reaper has run past several leases meanwhile.
        reaped.wait(4 * LEASE_S)
        core.registry.reap()
        original()

    monkeypatch.setattr(core, "save_checkpoint", slow_checkpoint)
    c = Client(srv.address, SPEC, "uploader")
    c.join()
    c.init(params())
    assert lapsed(caplog) == []
    assert core.registry.learners[c.learner_id].state == "alive"
    c.heartbeat()


def test_a_push_longer_than_several_leases_keeps_the_pushers_lease(make_server, caplog):
    srv = make_server(lease_s=LEASE_S, quorum=1, grace="none")
    c = Client(srv.address, SPEC, "pusher")
    c.join()
    c.init(params())
    c.heartbeat()
    h, buf = c.header(0, torch.full((SPEC.fragments[0].numel,), 0.01), pb.CODEC_FP32, base=0)
    messages = list(push_messages(h, buf, CHUNK))
    assert len(messages) * GAP_S > 2 * LEASE_S
    reply = c.stub.PushFragment(throttled(messages), timeout=TIMEOUT)
    assert reply.outcome == pb.PUSH_ACCEPTED
    assert lapsed(caplog) == []
    c.heartbeat()


def test_a_pull_read_slowly_keeps_the_pullers_lease(make_server, caplog):
    # One fragment of three 2 MiB chunks, read by the caller one message at a time, as gRPC
    # does when the client reads no faster than its link: header, chunks, end.
    spec = small_spec((1_400_000,), fragments=1)
    srv = make_server(lease_s=LEASE_S)
    c = Client(srv.address, spec, "puller")
    c.join()
    c.init([torch.randn(spec.fragments[0].numel)])
    c.heartbeat()
    stream = srv.synchronizer.pull(
        pb.PullRequest(learner_id=c.learner_id, session=c.session, fragment_id=0)
    )
    moved = list(throttled(stream, gap_s=LEASE_S / 2))
    assert len(moved) == 4
    assert lapsed(caplog) == []
    c.heartbeat()


def test_a_stalled_push_does_not_keep_the_lease(make_server):
    srv = make_server(lease_s=LEASE_S, quorum=1, grace="none")
    c = Client(srv.address, SPEC, "staller")
    c.join()
    c.init(params())
    c.heartbeat()
    h, buf = c.header(0, torch.full((SPEC.fragments[0].numel,), 0.01), pb.CODEC_FP32, base=0)
    messages = list(push_messages(h, buf, CHUNK))
    rec = srv.synchronizer.registry.learners[c.learner_id]

    def stalling() -> Iterator[pb.PushRequest]:
        yield from messages[:3]
        assert wait_until(lambda: rec.state == "dead", TIMEOUT)  # stalled past its lease
        yield from messages[3:]

    c.stub.PushFragment(stalling(), timeout=TIMEOUT)
    with pytest.raises(grpc.RpcError) as e:
        c.heartbeat()
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_learner_joining_during_the_upload_waits_once_and_starts_when_the_model_exists(
    make_server, caplog
):
    caplog.set_level(logging.INFO)
    srv = make_server(lease_s=LEASE_S)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    spec = FragmentPlan(model, 2).spec
    first = Client(srv.address, spec, "first")
    first.join()
    uploaded = [torch.randn(f.numel) for f in spec.fragments]
    messages = list(
        init_model_requests(first.learner_id, first.session, spec.spec_hash, uploaded, CHUNK)
    )
    release = threading.Event()

    def upload() -> Iterator[pb.InitModelRequest]:
        yield from messages[:3]  # under way: the model is not there yet
        release.wait(TIMEOUT)
        yield from messages[3:]

    uploader = threading.Thread(target=lambda: first.stub.InitModel(upload(), timeout=TIMEOUT))
    uploader.start()
    assert wait_until(lambda: srv.synchronizer.initializer.claim is not None, TIMEOUT)
    joined: list[Learner] = []
    second = threading.Thread(
        target=lambda: joined.append(
            Learner(
                model,
                None,
                synchronizer=srv.address,
                fragments=2,
                retry_initial_s=0.05,
                retry_max_s=0.5,
                join_timeout_s=TIMEOUT,
            )
        )
    )
    second.start()

    def refusals() -> int:  # the second learner's InitModel attempts, one per wait
        return sum("InitModel refused (ALREADY_EXISTS)" in r.getMessage() for r in caplog.records)

    assert wait_until(lambda: refusals() >= 2, TIMEOUT)  # it has waited a while, and again
    assert not joined
    release.set()
    uploader.join(TIMEOUT)
    second.join(TIMEOUT)
    assert joined, "the second learner did not start once the model existed"
    try:
        plan = FragmentPlan(model, 2)
        for p, params in enumerate(uploaded):
            assert torch.equal(plan.gather(p, "cpu"), params)
        lines = [r for r in caplog.records if r.name.startswith("learner.")]
        waiting = [r for r in lines if "waiting for the model" in r.getMessage()]
        assert [r.levelno for r in waiting] == [logging.INFO]
        assert not [r for r in lines if "retrying" in r.getMessage()]
        assert not [r for r in lines if r.levelno >= logging.WARNING]
    finally:
        joined[0].close()
