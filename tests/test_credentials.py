"""Per-learner credentials: a learner id is bound at Join to the credential it joined under, and
one credential holds no more learners, streams or share of a round however many times it joins
(against a real server on port 0 with a tokens file)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from protos import diloco_pb2 as pb
from protos import diloco_pb2_grpc as pb_grpc
from protos.configload import ConfigError, load
from synchronizer.config import SynchronizerConfig
from tests.helpers import TIMEOUT, Client, small_spec, wait_until

SPEC = small_spec(fragments=1)
N = SPEC.fragments[0].numel
GREEDY, HONEST = "greedy-token-0123456789", "honest-token-0123456789"


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "learner-tokens"
    path.write_text(f"# name token\ngreedy {GREEDY}\n\nhonest {HONEST}\n")
    return path


def _code(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


@pytest.mark.parametrize(
    "text, words",
    [
        ("alice short\n", ["line 1", "at least 16"]),
        (f"alice {GREEDY}\nalice {HONEST}\n", ["line 2", "'alice' appears twice"]),
        (f"alice {GREEDY}\nbob {GREEDY}\n", ["line 2", "same token as 'alice'"]),
        (f"alice {GREEDY} extra\n", ["line 1", "'NAME TOKEN'"]),
        ("# nothing\n", ["holds no"]),
    ],
)
def test_a_bad_tokens_file_is_a_configuration_error_naming_the_line(tmp_path, text, words):
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(SynchronizerConfig, None, {"learner_tokens_file": str(path)}, {})
    for word in words:
        assert word in str(e.value)


def test_one_credential_holds_one_learners_share_of_a_round_however_many_times_it_joins(
    make_server, tokens_file
):
    srv = make_server(learner_tokens_file=tokens_file, quorum=2, grace="none")
    greedy = [Client(srv.address, SPEC, f"greedy-{i}", _bearer(GREEDY)) for i in range(4)]
    honest = Client(srv.address, SPEC, "honest", _bearer(HONEST))
    greedy[0].join()
    for extra in greedy[1:]:  # max_learners_per_credential 1: joining again buys nothing
        with pytest.raises(grpc.RpcError) as e:
            extra.join()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_learners_per_credential" in (e.value.details() or "")
    honest.join()
    assert _code(Client(srv.address, SPEC, "anon").join) == grpc.StatusCode.UNAUTHENTICATED
    g = greedy[0]
    g.init([torch.zeros(N)])

    # An id is bound to its credential: the greedy credential cannot act as the honest learner,
    # not even with its session.
    thief = Client(srv.address, SPEC, "thief", _bearer(GREEDY))
    thief.learner_id, thief.session = honest.learner_id, honest.session
    for call in (lambda: thief.push(0, torch.ones(N), seq=1), lambda: thief.pull(0)):
        assert _code(call) == grpc.StatusCode.PERMISSION_DENIED
    assert _code(lambda: thief.join(honest.learner_id)) == grpc.StatusCode.PERMISSION_DENIED

    # One contribution per credential per round: a second push of the greedy credential into
    # the open round takes no weight and does not make up the quorum of 2 by itself.
    first = g.push(0, torch.ones(N))
    assert first.outcome == pb.PUSH_ACCEPTED and first.round_version == 1
    second = g.push(0, torch.full((N,), 100.0), tokens=10**6)
    assert second.outcome == pb.PUSH_DROPPED_STALE and "one contribution per credential" in (
        second.message
    )
    assert g.pull(0)[0] == 0  # the round is still open: greedy alone is no quorum
    fair = honest.push(0, -torch.ones(N))
    assert fair.outcome == pb.PUSH_ACCEPTED and fair.round_version == 1
    assert fair.weight == pytest.approx(first.weight)  # equal shares of round 1
    version, params = honest.pull(0, min_version=1, wait_s=TIMEOUT)
    assert version == 1
    assert torch.allclose(params, torch.zeros(N))  # +1 and -1 at equal weight: nothing moved

    learners = {x.name: x.credential for x in g.status().learners}
    assert learners == {"greedy-0": "greedy", "honest": "honest"}
    live = srv.synchronizer.metrics.registry.get_sample_value  # set by the housekeeping tick
    for name in ("greedy", "honest"):
        assert wait_until(lambda: live("diloco_credential_learners", {"credential": name}) == 1)  # noqa: B023


def test_a_credential_cannot_gather_streams_through_learners_it_lets_lapse(
    make_server, tokens_file
):
    srv = make_server(learner_tokens_file=tokens_file, quorum=1, grace="none", lease_s=1.0)
    first = Client(srv.address, SPEC, "greedy-a", _bearer(GREEDY))
    first.join()
    first.init([torch.zeros(N)])
    hold = threading.Event()

    def stalled(x: Client) -> Iterator[pb.PushRequest]:  # a header, then nothing
        h, _ = x.header(0, torch.ones(N), pb.CODEC_FP32, 0)
        yield pb.PushRequest(header=h)
        hold.wait(TIMEOUT)

    try:
        limit = len(SPEC.fragments) + 2  # the automatic per-learner limit
        held = [
            first.stub.PushFragment.future(stalled(first), timeout=TIMEOUT, metadata=first.md)
            for _ in range(limit)
        ]
        streams = srv.synchronizer.streams
        assert wait_until(lambda: streams.per_credential.get("greedy") == limit)
        # Its stalled streams do not renew its lease: it lapses, and the credential may join
        # another learner, but not open more streams than one learner may.
        again = Client(srv.address, SPEC, "greedy-b", _bearer(GREEDY))

        def joined() -> bool:
            try:
                again.join()
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return False
            return True

        assert wait_until(joined, timeout_s=TIMEOUT)
        refused = again.stub.PushFragment.future(stalled(again), timeout=TIMEOUT, metadata=again.md)
        with pytest.raises(grpc.RpcError) as e:
            refused.result()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "credential 'greedy'" in (e.value.details() or "")
        honest = Client(srv.address, SPEC, "honest", _bearer(HONEST))
        honest.join()
        assert honest.push(0, torch.ones(N)).outcome == pb.PUSH_ACCEPTED  # its own share
    finally:
        hold.set()
    for f in held:
        f.cancel()


def test_client_certificates_name_the_credential_under_mutual_tls(make_server, pki):
    srv = make_server(
        tls_cert=pki / "server.pem",
        tls_key=pki / "server.key",
        tls_client_ca=pki / "ca.pem",
        client_cert_credentials=True,
    )
    creds = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes(),
        certificate_chain=(pki / "client.pem").read_bytes(),
    )
    clients = []
    for name in ("first", "second"):
        c = Client(srv.address, SPEC, name)
        c.channel = grpc.secure_channel(srv.address, creds)
        c.stub = pb_grpc.SynchronizerStub(c.channel)
        clients.append(c)
    clients[0].join()
    assert _code(clients[1].join) == grpc.StatusCode.RESOURCE_EXHAUSTED  # the same certificate
    (learner,) = clients[0].status().learners
    assert learner.credential == "client"  # the certificate's common name
