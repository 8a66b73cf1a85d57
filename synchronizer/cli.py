"""`diloco-synchronizer`: serve the Synchronizer, initialise its model from a file, show status.

    diloco-synchronizer serve [--config FILE] [--host H --port P --metrics-port M --state-dir DIR ...]
    diloco-synchronizer init FILE [--synchronizer HOST:PORT[,HOST:PORT...]] [--fragments N] [connection flags]
    diloco-synchronizer status [--synchronizer HOST:PORT[,HOST:PORT...]] [--json] [connection flags]

    diloco-synchronizer --version

Every `serve` option can also come from the config file (TOML/YAML) or a `DILOCO_SYNC_<OPTION>`
environment variable; flags win over the environment, which wins over the file. `init` and
`status` reach a running Synchronizer as a learner does (`RemoteConfig`: `--tls-ca` for TLS,
`--tls-cert`/`--tls-key` for mutual TLS, `--auth-token-file` for the learner RPCs `init` makes,
`--admin-token-file` for `status`), each also from its `DILOCO_CTL_<OPTION>` variable. `status`
prints a table, or with `--json` the object `status_json` documents; given every shard of a
sharded Synchronizer (`--synchronizer a:50051,b:50051`), one view of them all (`shards_json`),
where a shard that does not answer is shown as down. Whatever goes wrong is one line on stderr
and an exit code of `protos.cli`: 2 for a bad flag, setting or file, 3 when the Synchronizer
cannot be reached (every shard, for a list), 4 when it refuses, 1 when serving fails.

This module parses the line and dispatches; each subcommand lives in its own module
(`cli_serve`, `cli_init`, `cli_status`), and what `init` and `status` share in `cli_remote`.
"""

from __future__ import annotations

import argparse
import sys

import grpc

from protos.cli import (
    FAILED,
    INTERRUPTED,
    REFUSED,
    UNREACHABLE,
    USAGE,
    Parser,
    add_version,
    setup_logging,
)
from protos.configload import ConfigError, load
from synchronizer import cli_init, cli_serve, cli_status
from synchronizer.cli_remote import DOWN, RemoteConfig, RemoteError, Unanswered, rpc_error_text


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="diloco-synchronizer",
        description="The Synchronizer of Decoupled DiLoCo: merges learners' outer gradients into a global model and serves it back.",
    )
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    cli_serve.add_parser(sub)
    cli_init.add_parser(sub)
    cli_status.add_parser(sub)
    return parser


def _remote(args: argparse.Namespace) -> int:
    """`init` or `status`; a failed RPC is one line naming the address, the code and what to do,
    and exits UNREACHABLE when nothing answered, REFUSED when the Synchronizer refused."""
    setup_logging("WARNING", args.log_format)
    cfg = load(RemoteConfig, None, vars(args))
    try:
        return cli_init.run(args, cfg) if args.command == "init" else cli_status.run(args, cfg)
    except grpc.RpcError as e:
        address, error = cfg.synchronizer, e
    except RemoteError as e:
        address, error = e.address, e.error
    except Unanswered as e:
        print(f"diloco-synchronizer: {args.command}: {e}", file=sys.stderr)
        return UNREACHABLE
    print(
        f"diloco-synchronizer: {args.command} at {address}: {rpc_error_text(error)}",
        file=sys.stderr,
    )
    return UNREACHABLE if error.code() in DOWN else REFUSED  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return cli_serve.run(args) if args.command == "serve" else _remote(args)
    except ConfigError as e:
        print(f"diloco-synchronizer: {e}", file=sys.stderr)
        return USAGE
    except cli_init.AlreadyInitialised as e:
        print(f"diloco-synchronizer: {e}", file=sys.stderr)
        return REFUSED
    except OSError as e:
        print(f"diloco-synchronizer: {e}", file=sys.stderr)
        return FAILED
    except KeyboardInterrupt:
        print("diloco-synchronizer: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
