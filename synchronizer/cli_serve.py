"""`diloco-synchronizer serve`: run the service until SIGTERM/SIGINT, then checkpoint and exit.

Every `SynchronizerConfig` field is a flag (and a `DILOCO_SYNC_<FIELD>` variable, and a key of
the `--config` file), listed by group in `--help`; `--ready-file` tells scripts and launchers the
ports once it is serving. Serving beyond loopback with neither a token nor TLS is allowed (a
trusted network) but said at start, as a warning.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
from pathlib import Path
from typing import Any

from protos.cli import LOG_FORMATS, setup_logging
from protos.configload import ConfigError, add_flags, env_name, load
from synchronizer import allocator, native
from synchronizer.config import SynchronizerConfig
from synchronizer.server import RunningServer, serve

logger = logging.getLogger(__name__)


def add_parser(sub: Any) -> None:
    """The `serve` subcommand and its flags."""
    s = sub.add_parser(
        "serve",
        help="run the service until SIGTERM",
        usage="%(prog)s [--config FILE] [--ready-file PATH] [options]",
        description="Run the Synchronizer service until SIGTERM/SIGINT (then checkpoint and exit 0).",
    )
    s.add_argument(
        "--config",
        metavar="FILE",
        help="TOML or YAML file with settings (flags and DILOCO_SYNC_* variables override it)",
    )
    s.add_argument(
        "--ready-file",
        metavar="PATH",
        help="once serving, write the bound ports as JSON to this path (for scripts and launchers)",
    )
    add_flags(s, SynchronizerConfig)


def loopback(host: str) -> bool:
    """Whether `host` is reachable only from this machine (127.0.0.0/8, ::1, localhost)."""
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def open_to_all(cfg: SynchronizerConfig) -> str | None:
    """What to warn of when the service listens beyond loopback with no token and no TLS."""
    if loopback(cfg.host) or cfg.auth_token is not None or cfg.tls_cert is not None:
        return None
    return (
        f"serving on {cfg.host} with neither --auth-token-file nor TLS (--tls-cert): anyone "
        "who can reach this port can join, push into the model and read it; fine on a trusted "
        "network only (docs/security.md)"
    )


def run(args: argparse.Namespace) -> int:
    """Serves until stopped: 0 after a clean shutdown, 1 when the service failed."""
    # warnings about the settings themselves come while loading them: in the format asked for
    fmt = args.log_format or os.environ.get(env_name(SynchronizerConfig.env_prefix, "log_format"))
    setup_logging("INFO", fmt if fmt in LOG_FORMATS else "text")
    cfg = load(SynchronizerConfig, args.config, vars(args))
    setup_logging(cfg.log_level, cfg.log_format)
    try:
        uses_native = native.resolve(cfg.kernels)
    except native.NativeUnavailable as e:
        raise ConfigError(f"kernels native: {e}; use kernels auto or torch") from None
    if warning := open_to_all(cfg):
        logger.warning(warning)
    malloc = allocator.keep_freed_buffers()  # before the model's buffers; said once serving

    def ready(running: RunningServer) -> None:
        # said once serving: a start refused by its checks stays the one line that says why
        logger.info("outer step kernels: %s", "native" if uses_native else "torch")
        logger.info("%s", malloc)
        if args.ready_file:
            tmp = Path(args.ready_file + ".tmp")
            tmp.write_text(
                json.dumps(
                    {
                        "address": running.address,
                        "port": running.port,
                        "metrics_port": running.metrics_port,
                        "epoch": running.synchronizer.epoch,
                    }
                )
            )
            tmp.replace(args.ready_file)

    return 0 if serve(cfg, on_ready=ready) else 1
