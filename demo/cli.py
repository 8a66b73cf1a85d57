"""`diloco-learner`: train the example (or your model) as one learner, or run the whole job locally.

    diloco-learner train [--synchronizer HOST:PORT] [--steps S] [--data DIR] [--model pkg.mod:fn] ...
    diloco-learner train --no-sync ...        the same loop without syncing (overhead baseline)
    diloco-learner local [--learners N] [--steps S] [--out DIR]   Synchronizer + N learners here
    diloco-learner local --shards 2 ...       the same with the Synchronizer split into 2 shards
    diloco-learner --version

`python -m demo` is the same command. `train` takes every Learner setting as a flag, from
`--config FILE` (TOML/YAML) or from `DILOCO_LEARNER_<SETTING>` environment variables (flags win
over the environment, which wins over the file); the example's own options are flags only. What
goes wrong is one line on stderr, never a traceback, and an exit code of `protos.cli`: 2 for bad
input, 3 when the Synchronizer cannot be reached within --join-timeout-s, 4 when it refuses
this learner, 1 when training fails, 143 when SIGTERM stopped it (after its checkpoint, with
--resume DIR). The flags' defaults, bounds and help come from
`TrainOptions` and `LocalOptions` (demo/options.py).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from demo.example.data import DataError
from demo.options import EXAMPLE_SYNC_DEFAULTS, LocalOptions, TrainOptions
from demo.train import Stopped, load_factory, train
from learner.client import ShardMismatch
from learner.config import LearnerConfig
from learner.session import JoinRefused, Unreachable
from protos.channel import parse_addresses
from protos.cli import (
    FAILED,
    INTERRUPTED,
    REFUSED,
    TERMINATED,
    UNREACHABLE,
    USAGE,
    Parser,
    add_log_flags,
    add_option_flags,
    add_version,
    setup_logging,
)
from protos.configload import ConfigError, add_flags, load, read_file, variables


class UsageError(ValueError):
    """Bad command-line input: reported as one line, exit code 2."""


# TrainOptions' flags by help group ("training" has --no-sync between the two halves)
TRAINING = "steps start_step lr warmup_steps min_lr_ratio weight_decay clip learner_index learners fsdp slow wait_for_learners"
REPORTING = "log_every eval_windows eval_only eval_every_s eval_reports threads out session_out resume save_every"
MODEL_AND_DATA = "model data max_bytes n_layer d_model n_head block batch_size seed"
# LocalOptions' flags before the hand-made ones (--train-args and the rest), then "live"
LOCAL = "learners island_size fsdp shards steps out slow_learner slow_factor kill_learner kill_at kill_rank restart_after_s quorum grace lease_s sync_every fragments codec data seed"


def check_address(addresses: str) -> str:
    """`--synchronizer` as `protos.channel.parse_addresses` takes it; UsageError otherwise."""
    try:
        parse_addresses(addresses)
    except ValueError as e:
        raise UsageError(
            "--synchronizer must be HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:50051), "
            f"or one per shard, comma-separated: {e}"
        ) from None
    return addresses


def check_data(path: str | None) -> str | None:
    if path is not None and not Path(path).is_dir():
        raise UsageError(f"--data {path}: no such directory (give a directory of text files)")
    return path


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="diloco-learner",
        description="Learners of Decoupled DiLoCo: train locally, sync parameter fragments with a Synchronizer now and then.",
    )
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    t = sub.add_parser(
        "train",
        help="train as one learner against a Synchronizer",
        usage="%(prog)s [--synchronizer HOST:PORT] [--steps N] [--config FILE] [options]",
        description="Join a Synchronizer and train the bundled example (or --model) as one learner; "
        "logs step, loss, tokens/s and sync state, and writes a JSON result with --out.",
    )
    g = t.add_argument_group("training")
    add_option_flags(g, TrainOptions, TRAINING)
    g.add_argument(
        "--no-sync",
        action="store_true",
        help="train alone: the same loop without a Learner (the overhead baseline)",
    )
    add_option_flags(g, TrainOptions, REPORTING)
    add_log_flags(g)
    add_option_flags(
        t.add_argument_group(
            "model and data (the bundled byte-level GPT on the Python stdlib sources)"
        ),
        TrainOptions,
        MODEL_AND_DATA,
    )
    t.add_argument_group(
        "learner settings (each also from --config FILE or a DILOCO_LEARNER_* variable)"
    ).add_argument("--config", metavar="FILE", help="TOML or YAML file with learner settings")
    add_flags(t, LearnerConfig, "learner settings: {group}")

    loc = sub.add_parser(
        "local",
        help="run a Synchronizer and N learners on this machine (the demo)",
        description="Start a Synchronizer and N learner processes on this host, make one learner slow and "
        "kill and restart another, show live progress, and write OUT/summary.json and OUT/summary.png. "
        "With --shards S the Synchronizer is S processes (diloco-synchronizer serve --shards S "
        "--shard-index i, each with its own port and state directory), each serving its share "
        "of the fragments; every learner is given all S addresses.",
    )
    add_option_flags(loc, LocalOptions, LOCAL)
    loc.add_argument(
        "--train-args",
        default="",
        metavar="'FLAGS'",
        help="extra flags for every `diloco-learner train`; write it with '=': --train-args='--lr 4e-3 --merge rebase'",
    )
    loc.add_argument(
        "--synchronizer-args",
        default="",
        metavar="'FLAGS'",
        help="extra flags for the Synchronizer (see diloco-synchronizer serve --help); write it with '=': --synchronizer-args='--outer sgd'",
    )
    loc.add_argument("--no-plot", action="store_true", help="skip summary.png")
    add_option_flags(loc, LocalOptions, "live")
    return parser


def _train(args: argparse.Namespace) -> int:
    check_data(args.data)
    if args.model:
        try:
            load_factory(args.model)
        except ValueError as e:
            raise UsageError(str(e)) from None
    sync = None
    if not args.no_sync:
        if args.synchronizer is not None:
            check_address(args.synchronizer)
        flags = vars(args).copy()
        file_values = read_file(args.config) if args.config else {}
        env = {setting for var, setting in variables(LearnerConfig).items() if var in os.environ}
        for key, value in EXAMPLE_SYNC_DEFAULTS.items():
            if flags.get(key) is None and key not in file_values and key not in env:
                flags[key] = value
        sync = load(LearnerConfig, args.config, flags)
    if args.eval_only and (args.no_sync or args.fsdp or args.resume):
        raise UsageError(
            "--eval-only evaluates the Synchronizer's model: not with --no-sync, --fsdp or --resume"
        )
    if args.start_step > args.steps:
        raise UsageError(f"--start-step {args.start_step} is beyond --steps {args.steps}")
    if args.learner_index >= args.learners:
        raise UsageError(
            f"--learner-index {args.learner_index} must be below --learners {args.learners}"
        )
    if args.d_model % args.n_head:
        raise UsageError(f"--d-model {args.d_model} must be divisible by --n-head {args.n_head}")
    if args.fsdp and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        raise UsageError(
            "--fsdp shards the model across a torchrun island: start it with torchrun "
            "--nproc-per-node 2 or more (or diloco-learner local --island-size N --fsdp)"
        )
    if args.fsdp and args.resume:
        raise UsageError("--resume is not supported with --fsdp yet")
    if args.out and not Path(args.out).parent.is_dir():
        raise UsageError(f"--out {args.out}: directory {Path(args.out).parent} does not exist")
    name = (sync.name if sync else "") or args.name or f"learner{args.learner_index}"
    flags = {key: getattr(args, key) for key in f"{TRAINING} {REPORTING} {MODEL_AND_DATA}".split()}
    train(TrainOptions(**flags, sync=sync, name=name))
    return 0


def _local(args: argparse.Namespace) -> int:
    from demo.local import run

    check_data(args.data)
    try:
        train_args, synchronizer_args = (
            shlex.split(args.train_args),
            shlex.split(args.synchronizer_args),
        )
    except ValueError as e:
        raise UsageError(f"--train-args/--synchronizer-args: {e}") from None
    given = {key: getattr(args, key) for key in f"{LOCAL} live".split()}
    o = LocalOptions(
        **{key: value for key, value in given.items() if value is not None},
        train_args=train_args,
        synchronizer_args=synchronizer_args,
        plot=not args.no_plot,
    )
    for flag, index in (("--slow-learner", o.slow_learner), ("--kill-learner", o.kill_learner)):
        if not -1 <= index < o.learners:
            raise UsageError(
                f"{flag} {index} must be -1 (none) or a learner index below --learners {o.learners}"
            )
    if o.shards > o.fragments:
        raise UsageError(
            f"--shards {o.shards} is more than --fragments {o.fragments}: a shard would own no fragment"
        )
    if o.kill_at >= 1:
        raise UsageError(f"--kill-at must be a fraction below 1, got {o.kill_at}")
    load(LearnerConfig, None, {"codec": o.codec})  # ConfigError names the allowed codecs
    if o.data:
        o.data = os.path.abspath(o.data)
    run(o)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging(getattr(args, "log_level", "INFO"), getattr(args, "log_format", "text"), "stdout")
    try:
        return _train(args) if args.command == "train" else _local(args)
    except (UsageError, ConfigError, DataError, ShardMismatch) as e:
        print(f"diloco-learner: error: {e}", file=sys.stderr)
        return USAGE
    except Unreachable as e:
        print(f"diloco-learner: cannot join: {e}", file=sys.stderr)
        return UNREACHABLE
    except JoinRefused as e:
        print(f"diloco-learner: refused: {e}", file=sys.stderr)
        return REFUSED
    except (ValueError, RuntimeError, TimeoutError, OSError) as e:
        print(f"diloco-learner: {type(e).__name__}: {e}", file=sys.stderr)
        return FAILED
    except KeyboardInterrupt:
        print("diloco-learner: interrupted", file=sys.stderr)
        return INTERRUPTED
    except Stopped as e:
        print(f"diloco-learner: {e}", file=sys.stderr)
        return TERMINATED


if __name__ == "__main__":
    sys.exit(main())
