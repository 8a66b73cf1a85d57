"""TLS, mutual TLS and bearer tokens, with certificates made by the test (the `pki` fixture, openssl)."""

from __future__ import annotations

import grpc
import pytest

from protos import diloco_pb2 as pb
from protos import diloco_pb2_grpc as pb_grpc
from tests.helpers import SPEC_FOR_TESTS as SPEC


def _join(channel: grpc.Channel, metadata: tuple = ()) -> pb.JoinReply:
    return pb_grpc.SynchronizerStub(channel).Join(
        pb.JoinRequest(spec=SPEC.to_proto()), timeout=5, metadata=metadata
    )


def test_tls_server_accepts_clients_that_trust_its_ca_and_refuses_plaintext(make_server, pki):
    srv = make_server(tls_cert=pki / "server.pem", tls_key=pki / "server.key")
    creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())
    assert _join(grpc.secure_channel(srv.address, creds)).learner_id
    with pytest.raises(grpc.RpcError) as err:
        _join(grpc.insecure_channel(srv.address))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate_signed_by_the_ca(make_server, pki):
    srv = make_server(
        tls_cert=pki / "server.pem", tls_key=pki / "server.key", tls_client_ca=pki / "ca.pem"
    )
    ca = (pki / "ca.pem").read_bytes()
    with pytest.raises(grpc.RpcError) as err:
        _join(grpc.secure_channel(srv.address, grpc.ssl_channel_credentials(root_certificates=ca)))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=(pki / "client.key").read_bytes(),
        certificate_chain=(pki / "client.pem").read_bytes(),
    )
    assert _join(grpc.secure_channel(srv.address, creds)).learner_id


def test_admin_rpc_needs_the_admin_token_and_refuses_a_learner_token(make_server):
    srv = make_server(auth_token="learner-secret", admin_token="admin-secret")
    stub = pb_grpc.SynchronizerStub(grpc.insecure_channel(srv.address))
    with pytest.raises(grpc.RpcError) as err:
        stub.Status(
            pb.StatusRequest(), timeout=5, metadata=(("authorization", "Bearer learner-secret"),)
        )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as err:
        stub.Status(pb.StatusRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stub.Status(
        pb.StatusRequest(), timeout=5, metadata=(("authorization", "Bearer admin-secret"),)
    ).server_epoch
    assert _join(
        grpc.insecure_channel(srv.address), (("authorization", "Bearer learner-secret"),)
    ).learner_id
