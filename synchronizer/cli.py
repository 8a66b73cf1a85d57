"""`diloco-synchronizer`: serve the Synchronizer, initialise its model from a file, show status.

    diloco-synchronizer serve [--config FILE] [--host H --port P --metrics-port M --state-dir DIR ...]
    diloco-synchronizer init FILE [--synchronizer HOST:PORT[,HOST:PORT...]] [--fragments N] [connection flags]
    diloco-synchronizer status [--synchronizer HOST:PORT[,HOST:PORT...]] [--json] [connection flags]

Every `serve` option can also come from the config file (TOML/YAML) or a `DILOCO_<OPTION>`
environment variable; flags win over the environment, which wins over the file. `init` and
`status` reach a running Synchronizer as a learner does (`RemoteConfig`: `--tls-ca` for TLS,
`--tls-cert`/`--tls-key` for mutual TLS, `--auth-token` for the learner RPCs `init` makes,
`--admin-token` for `status`), each also from its `DILOCO_<OPTION>` variable. `status` prints a
table, or with `--json` the object `status_json` documents; given every shard of a sharded
Synchronizer (`--synchronizer a:50051,b:50051`), one view of them all (`shards_json`), where a
shard that does not answer is shown as down. A bad setting, an unreadable file, a Synchronizer
that refuses, or one that cannot be reached (every shard, for a list) prints one line and exits 2.

This module parses the line and dispatches; each subcommand lives in its own module
(`cli_serve`, `cli_init`, `cli_status`), and what `init` and `status` share in `cli_remote`.
"""

from __future__ import annotations

import argparse
import sys

import grpc

from protos.cli import Parser
from protos.configload import ConfigError, load
from synchronizer import cli_init, cli_serve, cli_status
from synchronizer.cli_remote import RemoteConfig, RemoteError, rpc_error_text


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="diloco-synchronizer",
        description="The Synchronizer of Decoupled DiLoCo: merges learners' outer gradients into a global model and serves it back.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    cli_serve.add_parser(sub)
    cli_init.add_parser(sub)
    cli_status.add_parser(sub)
    return parser


def _remote(args: argparse.Namespace) -> int:
    """`init` or `status`; a failed RPC is one line naming the address, the code and what to do."""
    cfg = load(RemoteConfig, None, vars(args))
    try:
        return cli_init.run(args, cfg) if args.command == "init" else cli_status.run(args, cfg)
    except grpc.RpcError as e:
        address, error = cfg.synchronizer, e
    except RemoteError as e:
        address, error = e.address, e.error
    print(
        f"diloco-synchronizer: {args.command} at {address}: {rpc_error_text(error)}",
        file=sys.stderr,
    )
    return 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return cli_serve.run(args) if args.command == "serve" else _remote(args)
    except ConfigError as e:
        print(f"diloco-synchronizer: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"diloco-synchronizer: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
