"""Where the Synchronizer is: the `synchronizer` setting turned into the transport a `Learner` uses.

`shard_addresses` gives one address per shard (the comma-separated list as given, or one name
that resolves to several addresses, such as a Kubernetes headless Service), and `client_for`
builds the transport: a `learner.client.SyncClient` for one shard, exactly as unsharded, a
`learner.shards.ShardedClient` over one per shard for more.
"""

from __future__ import annotations

import socket
import time

from learner.client import ShardMismatch, SyncClient, backoff_s
from learner.config import LearnerConfig
from learner.shards import ShardedClient


def shard_addresses(cfg: LearnerConfig, timeout_s: float = 0.0) -> list[str]:
    """One address per shard from `cfg.synchronizer`: the comma-separated list as given, or,
    with shards > 1 and one address, every address its name resolves to (a Kubernetes headless
    Service), resolving again for up to timeout_s while fewer shards are ready than needed.
    ShardMismatch when the count is not `cfg.shards`; OSError when the name does not resolve."""
    given = [a.strip() for a in cfg.synchronizer.split(",")]
    if len(given) > 1 or cfg.shards <= 1:
        return given
    host, _, port = given[0].rpartition(":")
    deadline = time.monotonic() + timeout_s
    failures = 0
    while True:
        found = resolve(host.strip("[]"), int(port))
        if len(found) >= cfg.shards or time.monotonic() >= deadline:
            break
        time.sleep(backoff_s(failures, cfg.retry_initial_s, cfg.retry_max_s))
        failures += 1
    if len(found) != cfg.shards:
        raise ShardMismatch(
            f"synchronizer {given[0]!r} resolves to {len(found)} address(es) "
            f"({', '.join(found) or 'none'}), but shards={cfg.shards} needs one per shard"
        )
    return found


def resolve(host: str, port: int) -> list[str]:
    """host:port for every distinct address `host` resolves to, in the resolver's order."""
    out: list[str] = []
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        ip = str(sockaddr[0])
        address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if address not in out:
            out.append(address)
    return out


def client_for(cfg: LearnerConfig) -> SyncClient | ShardedClient:
    """The learner's transport: a `SyncClient` to the one Synchronizer, or a `ShardedClient`
    over one per shard (resolving a shared name waits up to join_timeout_s for every shard)."""
    addresses = shard_addresses(cfg, cfg.join_timeout_s)
    clients = [
        SyncClient(
            address,
            rpc_timeout_s=cfg.rpc_timeout_s,
            attempts=cfg.rpc_attempts,
            retry_initial_s=cfg.retry_initial_s,
            retry_max_s=cfg.retry_max_s,
            auth_token=cfg.auth_token,
            tls_ca=cfg.tls_ca,
            tls_cert=cfg.tls_cert,
            tls_key=cfg.tls_key,
            tls_server_name=cfg.tls_server_name,
            chunk_bytes=cfg.chunk_bytes,
        )
        for address in addresses
    ]
    return clients[0] if len(clients) == 1 else ShardedClient(clients)
