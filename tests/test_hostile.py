"""A learner holding the shared token cannot act as another, starve the service, pin its
counters or decide the served model; each test is one case of the hostile-learner review
(docs/security.md), against a real server on port 0.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import diloco_pb2 as pb
from tests.helpers import TIMEOUT, Client, small_spec, wait_until

SPEC = small_spec(fragments=1)
N = SPEC.fragments[0].numel


def _code(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_a_learner_cannot_act_under_another_learners_id(make_server):
    srv = make_server(quorum=1, grace="none")
    victim, attacker = Client(srv.address, SPEC, "victim"), Client(srv.address, SPEC, "attacker")
    victim.join()
    victim.init([torch.zeros(N)])
    attacker.join()
    assert victim.session and attacker.session and victim.session != attacker.session
    own_id = attacker.learner_id
    attacker.learner_id = victim.learner_id  # its own session, the victim's id

    before = victim.status()
    for call in (
        attacker.heartbeat,
        lambda: attacker.push(0, torch.ones(N), seq=10**9),
        lambda: attacker.pull(0),
        attacker.leave,
    ):
        assert _code(call) == grpc.StatusCode.PERMISSION_DENIED
    attacker.session = ""  # no session at all
    assert _code(attacker.heartbeat) == grpc.StatusCode.PERMISSION_DENIED
    assert _code(lambda: attacker.join(victim.learner_id)) == grpc.StatusCode.PERMISSION_DENIED

    # Nothing of the victim changed: still alive, its seq numbers not burned, its push applies.
    after = victim.status()
    assert [(x.learner_id, x.state) for x in after.learners] == [
        (x.learner_id, x.state) for x in before.learners
    ]
    assert victim.push(0, torch.ones(N), seq=1).outcome == pb.PUSH_ACCEPTED
    again = victim.join(victim.learner_id)  # a re-join with its own session keeps the session
    assert again.session == victim.session
    attacker.learner_id, attacker.session = own_id, ""
    assert _code(lambda: attacker.join(own_id)) == grpc.StatusCode.PERMISSION_DENIED


def test_sessions_survive_a_restart_from_the_checkpoint(make_server):
    srv = make_server(quorum=1, grace="none")
    c = Client(srv.address, SPEC, "l0")
    c.join()
    c.init([torch.zeros(N)])
    srv.server.stop(0).wait()
    srv.synchronizer.close()
    srv = make_server(quorum=1, grace="none")
    back = Client(srv.address, SPEC, "l0")
    back.session = "0" * 32
    with pytest.raises(grpc.RpcError) as e:
        back.join(c.learner_id)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    back.session = c.session
    reply = back.join(c.learner_id)
    assert reply.learner_id == c.learner_id and reply.session == c.session
    assert back.heartbeat().server_epoch == reply.server_epoch
    back.close()
    c.close()


# Resources: idle streams, waiting pulls, one learner's share --------------------------------


def _health_answers(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _sample(srv, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    return srv.synchronizer.metrics.registry.get_sample_value(name, labels) or 0.0


def test_push_streams_without_a_header_hold_no_slot_and_are_cut(make_server):
    srv = make_server(quorum=1, grace="none", max_concurrent_streams=4)
    c = Client(srv.address, SPEC, "honest")
    c.join()
    c.init([torch.zeros(N)])
    hold = threading.Event()

    def silent() -> Iterator[pb.PushRequest]:  # opens the stream, sends nothing
        hold.wait(TIMEOUT)
        yield from ()

    try:
        idle = [c.stub.PushFragment.future(silent(), timeout=TIMEOUT) for _ in range(4)]
        gate = srv.synchronizer.streams.first_messages
        assert wait_until(lambda: gate.held() == 4)
        assert _sample(srv, "diloco_streams_open") == 0  # no transfer slot before a header
        assert c.push(0, torch.ones(N)).outcome == pb.PUSH_ACCEPTED
        assert _health_answers(srv.address)
        for f in idle:  # never identified: cut after IDENTIFY_S
            assert _code(f.result) == grpc.StatusCode.CANCELLED
        assert _sample(srv, "diloco_streams_cut_total", kind="unidentified") == 4
        assert gate.held() == 0
    finally:
        hold.set()


def test_a_push_that_stalls_after_its_header_is_cut_and_one_learner_cannot_take_every_slot(
    make_server, caplog
):
    srv = make_server(quorum=1, grace="none", max_concurrent_streams=8, stream_idle_s=1.0)
    hog, honest = Client(srv.address, SPEC, "hog"), Client(srv.address, SPEC, "honest")
    hog.join()
    honest.join()
    hog.init([torch.zeros(N)])
    hold = threading.Event()

    def stalled() -> Iterator[pb.PushRequest]:  # a header, then nothing
        h, _ = hog.header(0, torch.ones(N), pb.CODEC_FP32, 0)
        yield pb.PushRequest(header=h)
        hold.wait(TIMEOUT)

    try:
        limit = len(SPEC.fragments) + 2  # the automatic per-learner limit
        held = [hog.stub.PushFragment.future(stalled(), timeout=TIMEOUT) for _ in range(limit)]
        streams = srv.synchronizer.streams
        assert wait_until(lambda: streams.per_learner.get(hog.learner_id) == limit)
        refused = hog.stub.PushFragment.future(stalled(), timeout=TIMEOUT)
        with pytest.raises(grpc.RpcError) as e:
            refused.result()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_streams_per_learner" in (e.value.details() or "")
        assert honest.push(0, torch.ones(N)).outcome == pb.PUSH_ACCEPTED  # slots are left
        for f in held:
            assert _code(f.result) == grpc.StatusCode.CANCELLED
        assert hog.push(0, torch.ones(N)).outcome == pb.PUSH_ACCEPTED  # its slots came back
        # A cut stream is expected: a warning line, never a traceback from gRPC's own logger
        assert not [r for r in caplog.records if r.exc_info], [
            r.getMessage() for r in caplog.records if r.exc_info
        ]
    finally:
        hold.set()


def test_waiting_pulls_hold_no_transfer_slot_and_end_when_their_client_cancels(make_server):
    srv = make_server(
        quorum=1, grace="none", max_concurrent_streams=2, max_waiting_pulls=2, max_pull_wait_s=60
    )
    a, b, c = (Client(srv.address, SPEC, n) for n in ("a", "b", "c"))
    for x in (a, b, c):
        x.join()
    a.init([torch.zeros(N)])

    def waiting_pull(x: Client):  # type: ignore[no-untyped-def]
        request = pb.PullRequest(
            learner_id=x.learner_id, session=x.session, min_version=100, wait_s=60
        )
        return x.stub.PullFragment(request, timeout=TIMEOUT)

    calls = [waiting_pull(a), waiting_pull(b)]
    ended: list[grpc.StatusCode] = []

    def drain(call) -> None:  # type: ignore[no-untyped-def]
        ended.append(_code(lambda: list(call)))

    waiting = [threading.Thread(target=drain, args=(call,), daemon=True) for call in calls]
    for t in waiting:
        t.start()  # the server answers nothing until version 100 or the client cancels
    assert wait_until(lambda: _sample(srv, "diloco_pulls_waiting") == 2)
    # Every waiting slot taken: a pull is answered at once with the version there is.
    assert c.pull(0, min_version=100, wait_s=60)[0] == 0
    # Transfers and the reserved workers are untouched by the waiting pulls.
    assert c.push(0, torch.ones(N)).outcome == pb.PUSH_ACCEPTED
    assert _health_answers(srv.address)
    for call in calls:
        call.cancel()
    assert wait_until(lambda: _sample(srv, "diloco_pulls_waiting") == 0, timeout_s=5.0)
    for t in waiting:
        t.join(TIMEOUT)
    assert ended == [grpc.StatusCode.CANCELLED] * 2


def test_a_waiting_pull_that_ends_during_an_outer_step_stalls_no_other_call(make_server):
    # gRPC runs a call's end callbacks on its one polling thread. Waking the pulls that wait
    # there took the fragment's lock, which an outer step holds for its whole length (seconds
    # at 1B parameters), so every call on the server stalled until the step ended.
    srv = make_server(quorum=1, grace="none", max_pull_wait_s=60)
    a = Client(srv.address, SPEC, "a")
    a.join()
    a.init([torch.zeros(N)])
    request = pb.PullRequest(learner_id=a.learner_id, session=a.session, min_version=100, wait_s=60)
    call = a.stub.PullFragment(request, timeout=TIMEOUT)
    ended: list[grpc.StatusCode] = []
    drain = threading.Thread(target=lambda: ended.append(_code(lambda: list(call))), daemon=True)
    drain.start()
    assert wait_until(lambda: _sample(srv, "diloco_pulls_waiting") == 1)
    fragment = srv.synchronizer.model.fragments[0].model
    with fragment.cv:  # as an outer step holds it
        call.cancel()
        drain.join(TIMEOUT)
        assert ended == [grpc.StatusCode.CANCELLED]
        assert _health_answers(srv.address)
    assert wait_until(lambda: _sample(srv, "diloco_pulls_waiting") == 0, timeout_s=5.0)


# Counters -----------------------------------------------------------------------------------


def test_counters_no_learner_could_reach_are_refused_and_change_nothing(make_server):
    srv = make_server(quorum=1, grace="none")
    c = Client(srv.address, SPEC, "l0")
    c.join()
    c.init([torch.zeros(N)])
    c.heartbeat(steps=10, tokens=1000, compute_s=1.0)
    counters = pb.LearnerCounters(steps=10, tokens=1000, compute_s=1.0, blocked_s=1e300)
    request = pb.HeartbeatRequest(learner_id=c.learner_id, session=c.session, counters=counters)
    assert _code(lambda: c.stub.Heartbeat(request, timeout=TIMEOUT)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert _code(lambda: c.heartbeat(step_time_s=1e300)) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: c.heartbeat(tokens=2**62)) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: c.push(0, torch.ones(N), tokens=2**62)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert _sample(srv, "diloco_learner_blocked_seconds_total") == 0.0
    (learner,) = c.status().learners
    assert learner.counters.tokens == 1000 and learner.counters.blocked_s == 0.0
    c.heartbeat(steps=20, tokens=2000, compute_s=2.0)  # sane counters go on counting
    assert c.status().learners[0].counters.tokens == 2000


# The served model ---------------------------------------------------------------------------


def test_only_a_successful_initialisation_decides_the_served_model(make_server):
    srv = make_server(quorum=1, grace="none", max_model_params=1 << 30)
    bogus_spec = small_spec(sizes=(4,), fragments=1)
    bogus = Client(srv.address, bogus_spec, "bogus")
    bogus.join()  # no InitModel
    huge = Client(srv.address, small_spec(sizes=(1 << 28,), fragments=1), "big")
    huge.join()  # within the limit, and nothing is allocated for it
    assert srv.synchronizer.model.fragments == [] and not srv.synchronizer.model.initialized
    over = Client(srv.address, small_spec(sizes=(1 << 40,), fragments=1), "over")
    with pytest.raises(grpc.RpcError) as e:
        over.join()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_params" in (e.value.details() or "")

    real = Client(srv.address, SPEC, "real")
    assert real.join().needs_init
    real.init([torch.zeros(N)])
    assert srv.synchronizer.model.spec is not None
    assert srv.synchronizer.model.spec.spec_hash == SPEC.spec_hash
    assert real.pull(0)[0] == 0
    # The learners that joined with other specs are told so and serve as nothing.
    for other in (bogus, huge):
        assert _code(lambda other=other: other.pull(0)) == grpc.StatusCode.FAILED_PRECONDITION
        assert _code(other.join) == grpc.StatusCode.FAILED_PRECONDITION


def test_a_spec_beyond_max_spec_bytes_is_refused(make_server):
    srv = make_server(max_spec_bytes=4096)
    names = small_spec(sizes=tuple(range(1, 300)), fragments=1)
    with pytest.raises(grpc.RpcError) as e:
        Client(srv.address, names, "many").join()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_spec_bytes" in (e.value.details() or "")
    assert Client(srv.address, SPEC, "ok").join().needs_init
