"""Streams nobody has claimed hold no slot an identified learner needs: a client that opens
calls and never sends their first message (no header, so no learner id) is held in a bounded
pool per peer and in all, cut at its deadline or by newer calls, and honest pushes, pulls,
heartbeats and health checks are answered throughout, against a real server on port 0.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos import diloco_pb2 as pb
from synchronizer.server import SERVICE_NAME
from synchronizer.streams import IDENTIFY_S
from tests.helpers import TIMEOUT, Client, pulled, push_messages, small_spec, wait_until

SPEC = small_spec(fragments=1)
N = SPEC.fragments[0].numel
ANSWER_S = 3.0  # an honest call must be answered within this, attack or not
IDENTIFY_HOLD_S = IDENTIFY_S + 1.0  # past the first-message deadline
SILENT_METHODS = ("PushFragment", "PullFragment", "Join", "Heartbeat")


class SilentStreams:
    """Keeps `count` calls open over `connections` connections of its own that never send a
    request message (a push without its header, a pull or join without its request),
    reopening each as soon as the server ends it, until stopped or `max_opens` calls were
    made."""

    def __init__(
        self,
        address: str,
        count: int,
        connections: int,
        max_opens: int,
        methods: tuple[str, ...] = SILENT_METHODS,
    ) -> None:
        # Connections of its own, as another client's would be (the channels of one process
        # share one connection unless told not to).
        self.channels = [
            grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(connections)
        ]
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.ended: Counter[str] = Counter()  # status codes of the calls the server ended
        self.opens = 0
        self.max_opens = max_opens
        self.live: set[Any] = set()
        self.threads = [
            threading.Thread(
                target=self._hold,
                args=(self.channels[i % connections], methods[i % len(methods)]),
                daemon=True,
            )
            for i in range(count)
        ]

    def _silent(self) -> Iterator[bytes]:
        self.stop.wait(TIMEOUT)
        yield from ()

    def _hold(self, channel: grpc.Channel, method: str) -> None:
        open_call = channel.stream_stream(f"/{SERVICE_NAME}/{method}")
        while not self.stop.is_set():
            with self.lock:
                if self.opens >= self.max_opens:
                    return
                self.opens += 1
            call = open_call(self._silent(), timeout=TIMEOUT)
            with self.lock:
                self.live.add(call)
            try:
                for _ in call:
                    pass
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            with self.lock:
                self.live.discard(call)
                if not self.stop.is_set():
                    self.ended[code] += 1

    def __enter__(self) -> SilentStreams:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        with self.lock:
            live = list(self.live)
        for call in live:
            call.cancel()
        for t in self.threads:
            t.join(TIMEOUT)
        for channel in self.channels:
            channel.close()


def _honest_rounds(srv: Any, pusher: Client, puller: Client, hold_s: float) -> int:
    """Pushes, pulls, heartbeats and health checks for `hold_s`, each with a deadline of
    ANSWER_S (a slower answer fails the test); returns how many rounds of the four ran."""
    rounds = 0
    deadline = time.monotonic() + hold_s
    with grpc.insecure_channel(srv.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            request = pb.PullRequest(learner_id=puller.learner_id, session=puller.session)
            version, _ = pulled(puller.stub.PullFragment(request, timeout=ANSWER_S))
            h, buf = pusher.header(0, torch.ones(N), pb.CODEC_FP32, base=version)
            reply = pusher.stub.PushFragment(push_messages(h, buf), timeout=ANSWER_S)
            assert reply.outcome == pb.PUSH_ACCEPTED
            beat = pb.HeartbeatRequest(learner_id=puller.learner_id, session=puller.session)
            assert puller.stub.Heartbeat(beat, timeout=ANSWER_S).server_epoch
            probe = health.Check(health_pb2.HealthCheckRequest(), timeout=ANSWER_S)
            assert probe.status == health_pb2.HealthCheckResponse.SERVING
            rounds += 1
    return rounds


PUSHES = ("PushFragment",)
UNARY = ("Join", "Heartbeat", "PullFragment")  # a request gRPC would read on a worker first


@pytest.mark.parametrize(
    "silent, connections, methods, hold_s, settings",
    [
        # As many silent pushes as there are transfer slots (32), which the server now holds
        # (16 per connection, 32 in all): held until the first-message deadline, reopened.
        (32, 2, PUSHES, IDENTIFY_HOLD_S, {}),
        # More than it holds: each new one displaces the oldest of the fullest connection.
        (48, 3, SILENT_METHODS, 2.0, {}),
        (8, 1, PUSHES, IDENTIFY_HOLD_S, {"max_concurrent_streams": 8}),
        # More requestless unary calls than the gRPC workers of the default settings before
        # calls waited for their first message in a bounded place (32 + 64 + 8).
        (200, 8, UNARY, 2.0, {}),
    ],
    ids=["32-pushes", "48-mixed", "8-pushes-of-8-slots", "200-unary"],
)
def test_silent_streams_take_no_slot_and_honest_learners_are_answered_throughout(
    make_server, silent, connections, methods, hold_s, settings
):
    srv = make_server(quorum=1, grace="none", **settings)
    pusher, puller = Client(srv.address, SPEC, "pusher"), Client(srv.address, SPEC, "puller")
    pusher.join()
    puller.join()
    pusher.init([torch.zeros(N)])
    sample = srv.synchronizer.metrics.registry.get_sample_value
    gate = srv.synchronizer.streams.first_messages
    held = min(silent, srv.synchronizer.cfg.max_unidentified_streams)
    with SilentStreams(srv.address, silent, connections, 50 * silent, methods) as flood:
        assert wait_until(lambda: gate.held() == held, timeout_s=TIMEOUT)
        assert sample("diloco_streams_open") == 0  # none holds a transfer slot
        rounds = _honest_rounds(srv, pusher, puller, hold_s)
        assert gate.held() <= held
        ended = dict(flood.ended)
    assert rounds >= 1
    # Ended by the server: cut (CANCELLED), or refused by gRPC on a connection that opens
    # streams faster than they end (UNAVAILABLE, its own connection only).
    assert set(ended) <= {"CANCELLED", "UNAVAILABLE"}
    assert ended["CANCELLED"] >= held  # each cut at least once: at the deadline, or displaced
    assert sample("diloco_streams_cut_total", {"kind": "unidentified"}) >= ended["CANCELLED"]
    assert wait_until(lambda: gate.held() == 0)


def test_health_watches_pass_the_first_message_gate_and_hold_no_worker(make_server):
    # Watch answers through a callback and holds no worker while it waits for changes; read
    # through the first-message gate it must stay so: more watches than workers, all answered,
    # health checks still answered, and every watch told of a change.
    srv = make_server(max_concurrent_streams=2, max_waiting_pulls=2)
    watches_n = srv.synchronizer.cfg.max_workers + 16
    channels = [
        grpc.insecure_channel(srv.address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(4)
    ]
    try:
        stubs = [health_pb2_grpc.HealthStub(ch) for ch in channels]
        watches = [
            stubs[i % 4].Watch(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            for i in range(watches_n)
        ]
        serving = health_pb2.HealthCheckResponse.SERVING
        assert [next(w).status for w in watches] == [serving] * watches_n
        probe = stubs[0].Check(health_pb2.HealthCheckRequest(), timeout=ANSWER_S)
        assert probe.status == serving
        srv.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        changed = [next(w).status for w in watches]
        assert changed == [health_pb2.HealthCheckResponse.NOT_SERVING] * watches_n
        for w in watches:
            w.cancel()
    finally:
        for ch in channels:
            ch.close()


def test_a_status_set_while_watches_close_leaves_the_server_answering(make_server):
    # gRPC runs a closing watch's callback on its one polling thread; a status sent to the
    # watchers while that callback waited for the sender's lock stopped the server for good
    # (grpcio-health-checking's servicer did this every time here): nothing answered, and
    # shutdown never returned.
    srv = make_server()
    channel = grpc.insecure_channel(srv.address)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        watches = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=TIMEOUT) for _ in range(64)]
        assert {next(w).status for w in watches} == {health_pb2.HealthCheckResponse.SERVING}
        done = threading.Event()

        def flip() -> None:
            statuses = (
                health_pb2.HealthCheckResponse.NOT_SERVING,
                health_pb2.HealthCheckResponse.SERVING,
            )
            i = 0
            while not done.is_set():
                srv.health.set("", statuses[i % 2])
                i += 1

        flipper = threading.Thread(target=flip, daemon=True)
        flipper.start()
        for w in watches:
            w.cancel()
        assert wait_until(lambda: srv.health.watching("") == 0, TIMEOUT), "closed watches stay"
        done.set()
        flipper.join(ANSWER_S)
        assert not flipper.is_alive(), "a status set never returned"
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=ANSWER_S).status in (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
    finally:
        channel.close()


def test_open_reflection_streams_are_bounded_like_silent_calls(make_server):
    # Reflection needs no token and answers as long as its stream stays open: streams that ask
    # once and stay open hold their place for their whole life, so they are bounded and
    # displaced like calls that never send a first message, and never take every worker.
    srv = make_server(max_concurrent_streams=2, max_waiting_pulls=2)
    cfg = srv.synchronizer.cfg
    channels = [
        grpc.insecure_channel(srv.address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(4)
    ]
    hold = threading.Event()

    def ask_once() -> Iterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        hold.wait(TIMEOUT)

    try:
        stubs = [reflection_pb2_grpc.ServerReflectionStub(ch) for ch in channels]
        streams = [
            stubs[i % 4].ServerReflectionInfo(ask_once(), timeout=TIMEOUT)
            for i in range(cfg.max_workers)  # as many as there are workers
        ]
        answered = 0
        for s in streams:
            try:
                answered += next(s).HasField("list_services_response")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.CANCELLED  # displaced by a newer one
        assert answered >= cfg.max_unidentified_streams
        gate = srv.synchronizer.streams.first_messages
        assert gate.held() <= cfg.max_unidentified_streams
        with grpc.insecure_channel(srv.address) as ch:
            probe = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=ANSWER_S
            )
        assert probe.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        hold.set()
        for ch in channels:
            ch.close()
