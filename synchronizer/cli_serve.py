"""`diloco-synchronizer serve`: run the service until SIGTERM/SIGINT, then checkpoint and exit.

Every `SynchronizerConfig` field is a flag (and a `DILOCO_<FIELD>` variable, and a key of the
`--config` file); `--ready-file` tells scripts and launchers the ports once it is serving.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from protos.configload import add_flags, load
from synchronizer.config import SynchronizerConfig
from synchronizer.server import RunningServer, serve


def add_parser(sub: Any) -> None:
    """The `serve` subcommand and its flags."""
    s = sub.add_parser(
        "serve",
        help="run the service until SIGTERM",
        description="Run the Synchronizer service until SIGTERM/SIGINT (then checkpoint and exit 0).",
    )
    s.add_argument(
        "--config",
        help="TOML or YAML file with settings (flags and DILOCO_* variables override it)",
    )
    s.add_argument(
        "--ready-file",
        help="once serving, write the bound ports as JSON to this path (for scripts and launchers)",
    )
    add_flags(s, SynchronizerConfig)


def run(args: argparse.Namespace) -> int:
    """Serves until stopped: 0 after a clean shutdown, 1 when the service failed."""
    cfg = load(SynchronizerConfig, args.config, vars(args))
    logging.basicConfig(
        level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    def ready(running: RunningServer) -> None:
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
