"""How a client reaches the Synchronizer: the channel (insecure, TLS or mutual TLS) and the token.

Both the learner's client and the operator's commands (`diloco-synchronizer init`, `status`)
open their channel here, so TLS and bearer tokens behave the same for every caller: `tls_ca`
turns TLS on, `tls_cert` with `tls_key` adds a client certificate (mutual TLS),
`tls_server_name` checks the server's certificate against another name than the address's host,
and `bearer(token)` is the call metadata the server's token check reads. Messages up to
`MAX_MESSAGE_BYTES` pass both ways (chunks are at most 4 MiB; the rest is envelope).
`parse_addresses` is the one rule for what a Synchronizer address is, which the learner's
settings and both programs' `--synchronizer` flags check against.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc
from pydantic import BaseModel, Field, model_validator

MAX_MESSAGE_BYTES = 16 << 20


class ClientTLS(BaseModel):
    """The TLS settings of every client config (the learner's, the operator commands'), checked
    together: a client certificate needs its key, and both need the CA."""

    tls_ca: Path | None = Field(
        default=None,
        description="PEM CA bundle that signed the Synchronizer's certificate: connect with TLS",
    )
    tls_cert: Path | None = Field(
        default=None, description="PEM client certificate for mutual TLS (with tls_key)"
    )
    tls_key: Path | None = Field(default=None, description="PEM private key of tls_cert")
    tls_server_name: str | None = Field(
        default=None,
        description="Name to check the server certificate against when it differs from the address's host",
    )

    @model_validator(mode="after")
    def _tls_pairs(self) -> ClientTLS:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_cert is not None and self.tls_ca is None:
            raise ValueError("mutual TLS (tls_cert/tls_key) needs tls_ca to check the server")
        return self


def parse_addresses(text: str) -> list[str]:
    """The HOST:PORT addresses in `text`, comma-separated (one per shard of a sharded
    Synchronizer), stripped of spaces; ValueError saying which one is wrong and how.

    A host is a name, an IPv4 address or an IPv6 address in brackets (`[::1]:50051`); a port is
    1..65535. The message names the address, not the setting: callers put that in front.
    """
    addresses = [a.strip() for a in text.split(",")]
    for a in addresses:
        host, sep, port = a.rpartition(":")
        bracketed = host.startswith("[") and host.endswith("]")
        if not a:
            problem = "an empty address (a stray comma?)"
        elif not sep:
            problem = f"{a!r} has no port"
        elif not host.strip("[]"):
            problem = f"{a!r} has no host"
        elif not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
            problem = f"{a!r} has port {port!r}, not a number in 1..65535"
        elif host.startswith("[") != host.endswith("]"):
            problem = f"{a!r} opens or closes a bracket around its host without the other"
        elif ":" in host and not bracketed:
            problem = f"{a!r} has an IPv6 host without brackets (write [::1]:50051, say)"
        else:
            continue
        raise ValueError(problem)
    return addresses


def _read_pem(what: str, path: str | Path) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path} is not a PEM file (no '-----BEGIN' line)")
    return data


def open_channel(
    address: str,
    *,
    tls_ca: str | Path | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
    tls_server_name: str | None = None,
    options: Sequence[tuple[str, int | str]] = (),
) -> grpc.Channel:
    """A channel to `address` (HOST:PORT): TLS when `tls_ca` is given, else plaintext.

    ValueError, naming the file or the setting, for a certificate without its key (or the
    reverse), client certificates without a CA, or a PEM file that cannot be read.
    """
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert and tls_key must be given together")
    if tls_ca is None and tls_cert is not None:
        raise ValueError("mutual TLS (tls_cert/tls_key) needs tls_ca to check the server")
    opts = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        *options,
    ]
    if tls_ca is None:
        return grpc.insecure_channel(address, options=opts)
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read_pem("tls_ca", tls_ca),
        private_key=_read_pem("tls_key", tls_key) if tls_key is not None else None,
        certificate_chain=_read_pem("tls_cert", tls_cert) if tls_cert is not None else None,
    )
    if tls_server_name:
        opts.append(("grpc.ssl_target_name_override", tls_server_name))
    return grpc.secure_channel(address, creds, options=opts)


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()
