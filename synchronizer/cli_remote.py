"""How `diloco-synchronizer init` and `status` reach a running Synchronizer, and report a refusal.

`RemoteConfig` holds the connection settings (the learner's of the same names: the address, or
every shard's, TLS and the tokens), loaded like any config from `DILOCO_CTL_<FIELD>` variables
and flags;
`connect` opens a stub on it. A failed RPC is reported as one line, its code, the first line of
its details and what to do (`rpc_error_text`); `RemoteError` carries one from one address of
several up to `synchronizer.cli`, which prints it.
"""

from __future__ import annotations

from typing import ClassVar

import grpc
from pydantic import ConfigDict, Field, field_validator

from protos import diloco_pb2_grpc as pb_grpc
from protos.channel import ClientTLS, open_channel, parse_addresses
from protos.configload import ConfigError


class RemoteConfig(ClientTLS):
    """How `init` and `status` reach a running Synchronizer (the learner's settings of the same names)."""

    model_config = ConfigDict(extra="forbid")
    env_prefix: ClassVar[str] = "DILOCO_CTL_"
    help_groups: ClassVar[dict[str, str]] = {
        "connection": "synchronizer",
        "security": "auth_token admin_token tls_ca tls_cert tls_key tls_server_name",
    }

    synchronizer: str = Field(
        default="127.0.0.1:50051",
        description="host:port of the Synchronizer's gRPC endpoint; for a sharded one every shard's, comma-separated, in any order (init uploads each shard its fragments; status shows them all)",
        json_schema_extra={"metavar": "HOST:PORT[,...]"},
    )
    auth_token: str | None = Field(
        default=None,
        description="Learner bearer token: init joins and uploads as a learner (status falls back to it)",
        json_schema_extra={"secret": True},
    )
    admin_token: str | None = Field(
        default=None,
        description="Admin bearer token: status needs it when the Synchronizer has one (init may use it too)",
        json_schema_extra={"secret": True},
    )

    @field_validator("synchronizer")
    @classmethod
    def _host_port(cls, v: str) -> str:
        try:
            parse_addresses(v)
        except ValueError as e:
            raise ValueError(
                f"must be host:port with a port in 1..65535 (e.g. 127.0.0.1:50051), or several comma-separated: {e}"
            ) from None
        return v

    @property
    def addresses(self) -> list[str]:
        """Every address `synchronizer` names (one per shard of a sharded Synchronizer)."""
        return parse_addresses(self.synchronizer)


def connect(cfg: RemoteConfig, address: str | None = None) -> pb_grpc.SynchronizerStub:
    """A stub on `address` (else `cfg.synchronizer`) with `cfg`'s TLS; ConfigError for bad TLS files."""
    try:
        channel = open_channel(
            address or cfg.synchronizer,
            tls_ca=cfg.tls_ca,
            tls_cert=cfg.tls_cert,
            tls_key=cfg.tls_key,
            tls_server_name=cfg.tls_server_name,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return pb_grpc.SynchronizerStub(channel)


HINTS = {
    grpc.StatusCode.UNAVAILABLE: "is a Synchronizer serving there, with TLS exactly when --tls-ca is given?",
    grpc.StatusCode.UNAUTHENTICATED: "give its token with --auth-token-file or --admin-token-file (or DILOCO_CTL_AUTH_TOKEN / DILOCO_CTL_ADMIN_TOKEN)",
    grpc.StatusCode.PERMISSION_DENIED: "status needs the admin token: --admin-token-file or DILOCO_CTL_ADMIN_TOKEN",
    grpc.StatusCode.DEADLINE_EXCEEDED: "no answer within --timeout-s; raise it or check the network",
}
DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # no shard there to ask


def rpc_error_text(e: grpc.RpcError) -> str:
    """A failed RPC as every command reports it: code, the first line of its details, a hint."""
    code: grpc.StatusCode = e.code()  # type: ignore[attr-defined]
    details = ((e.details() or "").splitlines() or [""])[0]  # type: ignore[attr-defined]
    hint = f" ({HINTS[code]})" if code in HINTS else ""
    return f"{code.name}: {details}{hint}"


class Unanswered(Exception):
    """No shard of several answered: the command could reach none of them."""


class RemoteError(Exception):
    """A refused RPC to one of several addresses, reported as any other failed RPC is."""

    def __init__(self, address: str, error: grpc.RpcError) -> None:
        super().__init__(f"{address}: {rpc_error_text(error)}")
        self.address = address
        self.error = error
