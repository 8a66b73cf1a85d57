"""`diloco-learner`: train the example (or your model) as one learner, or run the whole job locally.

    diloco-learner train [--synchronizer HOST:PORT] [--steps S] [--data DIR] [--model pkg.mod:fn] ...
    diloco-learner train --no-sync ...        the same loop without syncing (overhead baseline)
    diloco-learner local [--learners N] [--steps S] [--out DIR]   Synchronizer + N learners here
    diloco-learner local --shards 2 ...       the same with the Synchronizer split into 2 shards

`python -m demo` is the same command. `train` takes every Learner setting as a flag, from `--config FILE` (TOML/YAML) or from
`DILOCO_<SETTING>` environment variables (flags win over the environment, which wins over the
file). Bad input prints one line saying what is wrong and exits 2; never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

from demo.example.data import DataError
from demo.train import EXAMPLE_SYNC_DEFAULTS, TrainOptions, load_factory, train
from learner.client import ShardMismatch
from learner.config import LearnerConfig
from protos.channel import parse_addresses
from protos.configload import ConfigError, add_flags, from_env, load, read_file


class UsageError(ValueError):
    """Bad command-line input: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag prints one line (and where to look), not the whole usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value

    return parse


def _float_at_least(lo: float, exclusive: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < lo or (exclusive and value == lo) or value != value:
            raise argparse.ArgumentTypeError(
                f"must be {'>' if exclusive else '>='} {lo:g}, got {text}"
            )
        return value

    return parse


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


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "model and data (the bundled byte-level GPT on the Python stdlib sources)"
    )
    g.add_argument(
        "--model",
        metavar="PKG.MODULE:FACTORY",
        help="train your own model instead: FACTORY(learner_index, learners) returns (model, batch_fn[, eval_fn]); see demo/train.py",
    )
    g.add_argument(
        "--data",
        metavar="DIR",
        help="directory of text files to train on instead of the Python standard library's sources",
    )
    g.add_argument(
        "--max-bytes",
        type=_int_at_least(1024),
        default=4 << 20,
        help="training bytes each learner reads from its shard (default: %(default)s)",
    )
    g.add_argument(
        "--n-layer",
        type=_int_at_least(1),
        default=2,
        help="transformer blocks (default: %(default)s)",
    )
    g.add_argument(
        "--d-model", type=_int_at_least(1), default=64, help="model width (default: %(default)s)"
    )
    g.add_argument(
        "--n-head",
        type=_int_at_least(1),
        default=2,
        help="attention heads; must divide --d-model (default: %(default)s)",
    )
    g.add_argument(
        "--context",
        type=_int_at_least(1),
        default=128,
        help="context length in bytes (default: %(default)s)",
    )
    g.add_argument(
        "--batch-size",
        type=_int_at_least(1),
        default=16,
        help="sequences per inner step (default: %(default)s)",
    )
    g.add_argument(
        "--seed",
        type=_int_at_least(0),
        default=0,
        help="model initialisation (the same on every learner) and data order (default: %(default)s)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="diloco-learner",
        description="Learners of Decoupled DiLoCo: train locally, sync parameter fragments with a Synchronizer now and then.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser(
        "train",
        help="train as one learner against a Synchronizer",
        description="Join a Synchronizer and train the bundled example (or --model) as one learner; "
        "logs step, loss, tokens/s and sync state, and writes a JSON result with --out.",
    )
    g = t.add_argument_group("training")
    g.add_argument(
        "--steps",
        type=_int_at_least(0),
        default=1000,
        help="inner steps; 0 only evaluates the served global model (default: %(default)s)",
    )
    g.add_argument(
        "--start-step",
        type=_int_at_least(0),
        default=0,
        help="resume the schedule at this step (a restarted learner) (default: %(default)s)",
    )
    g.add_argument(
        "--lr",
        type=_float_at_least(0, exclusive=True),
        default=8e-3,
        help="peak AdamW learning rate (default: %(default)s)",
    )
    g.add_argument(
        "--warmup-steps",
        type=_int_at_least(0),
        default=50,
        help="linear warm-up steps (default: %(default)s)",
    )
    g.add_argument(
        "--min-lr-ratio",
        type=_float_at_least(0),
        default=0.1,
        help="cosine decay ends at this fraction of --lr (default: %(default)s)",
    )
    g.add_argument(
        "--weight-decay",
        type=_float_at_least(0),
        default=0.1,
        help="AdamW weight decay on matrices (default: %(default)s)",
    )
    g.add_argument(
        "--clip",
        type=_float_at_least(0),
        default=1.0,
        help="gradient norm clip; 0 disables (default: %(default)s)",
    )
    g.add_argument(
        "--learner-index",
        type=_int_at_least(0),
        default=0,
        help="this learner's data shard, 0..learners-1 (default: %(default)s)",
    )
    g.add_argument(
        "--learners",
        type=_int_at_least(1),
        default=1,
        help="number of data shards (default: %(default)s)",
    )
    g.add_argument(
        "--slow",
        type=_float_at_least(1),
        default=1.0,
        metavar="F",
        help="simulate a slow learner: sleep (F-1) x step time after each step (default: %(default)s)",
    )
    g.add_argument(
        "--wait-for-learners",
        type=_int_at_least(0),
        default=0,
        metavar="N",
        help="before the first step, wait until N learners have joined (start a run together) (default: %(default)s)",
    )
    g.add_argument(
        "--no-sync",
        action="store_true",
        help="train alone: the same loop without a Learner (the overhead baseline)",
    )
    g.add_argument(
        "--log-every",
        type=_int_at_least(1),
        default=25,
        help="steps between progress lines (default: %(default)s)",
    )
    g.add_argument(
        "--eval-windows",
        type=_int_at_least(1),
        default=256,
        help="held-out windows the eval loss averages over (default: %(default)s)",
    )
    g.add_argument(
        "--threads",
        type=_int_at_least(0),
        default=0,
        help="torch CPU threads; 0 = torch's default (default: %(default)s)",
    )
    g.add_argument(
        "--out",
        metavar="PATH",
        help="write the JSON result here (rewritten at every progress line)",
    )
    g.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    _add_model_flags(t)
    s = t.add_argument_group("learner settings (also from --config FILE or DILOCO_* variables)")
    s.add_argument("--config", help="TOML or YAML file with learner settings")
    add_flags(s, LearnerConfig)

    loc = sub.add_parser(
        "local",
        help="run a Synchronizer and N learners on this machine (the demo)",
        description="Start a Synchronizer and N learner processes on this host, make one learner slow and "
        "kill and restart another, show live progress, and write OUT/summary.json and OUT/summary.png. "
        "With --shards S the Synchronizer is S processes (diloco-synchronizer serve --shards S "
        "--shard-index i, each with its own port and state directory), each serving its share "
        "of the fragments; every learner is given all S addresses.",
    )
    loc.add_argument(
        "--learners",
        type=_int_at_least(1),
        default=4,
        help="learner processes (default: %(default)s)",
    )
    loc.add_argument(
        "--shards",
        type=_int_at_least(1),
        default=1,
        help="Synchronizer processes sharing the fragments (at most --fragments); 1 = one unsharded Synchronizer (default: %(default)s)",
    )
    loc.add_argument(
        "--steps",
        type=_int_at_least(1),
        default=1000,
        help="inner steps per learner; the slow one takes steps/slow-factor (default: %(default)s)",
    )
    loc.add_argument(
        "--out",
        type=Path,
        default=Path("runs/local"),
        help="directory for summary.json, summary.png, per-learner results and logs (default: %(default)s)",
    )
    loc.add_argument(
        "--slow-learner",
        type=int,
        help="index of the slow learner; -1 for none (default: 1 when there are 2 or more learners)",
    )
    loc.add_argument(
        "--slow-factor",
        type=_float_at_least(1),
        default=3.0,
        help="how many times slower it runs (default: %(default)s)",
    )
    loc.add_argument(
        "--kill-learner",
        type=int,
        help="index of the learner killed mid-run and restarted; -1 for none (default: 2 when there are 3 or more learners)",
    )
    loc.add_argument(
        "--kill-at",
        type=_float_at_least(0),
        default=0.4,
        help="kill it after this fraction of its steps (default: %(default)s)",
    )
    loc.add_argument(
        "--restart-after-s",
        type=_float_at_least(0),
        default=5.0,
        help="restart it this long after the kill (default: %(default)s)",
    )
    loc.add_argument(
        "--quorum",
        type=_int_at_least(0),
        default=2,
        help="Synchronizer: contributions before a round may close; 0 = every live learner (default: %(default)s)",
    )
    loc.add_argument(
        "--grace",
        choices=("adaptive", "fixed", "none"),
        default="adaptive",
        help="Synchronizer: grace window after the quorum (default: %(default)s)",
    )
    loc.add_argument(
        "--lease-s",
        type=_float_at_least(0, exclusive=True),
        default=3.0,
        help="Synchronizer: a learner silent this long is dead (default: %(default)s)",
    )
    loc.add_argument(
        "--sync-every",
        type=_int_at_least(1),
        default=25,
        help="H: inner steps between syncs of a fragment (default: %(default)s)",
    )
    loc.add_argument(
        "--fragments",
        type=_int_at_least(1),
        default=4,
        help="P: fragments of the model (default: %(default)s)",
    )
    loc.add_argument(
        "--codec",
        default="int4",
        help="push codec: fp32, bf16, int8, int4, fp4 (default: %(default)s)",
    )
    loc.add_argument(
        "--data", metavar="DIR", help="directory of text files instead of the Python stdlib sources"
    )
    loc.add_argument(
        "--seed",
        type=_int_at_least(0),
        default=0,
        help="model initialisation and data order (default: %(default)s)",
    )
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
    loc.add_argument(
        "--live",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="redraw progress in place (default: when stdout is a terminal)",
    )
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
        env = from_env(LearnerConfig)
        for key, value in EXAMPLE_SYNC_DEFAULTS.items():
            if flags.get(key) is None and key not in file_values and key not in env:
                flags[key] = value
        sync = load(LearnerConfig, args.config, flags)
        check_address(sync.synchronizer)
    if args.start_step > args.steps:
        raise UsageError(f"--start-step {args.start_step} is beyond --steps {args.steps}")
    if args.learner_index >= args.learners:
        raise UsageError(
            f"--learner-index {args.learner_index} must be below --learners {args.learners}"
        )
    if args.d_model % args.n_head:
        raise UsageError(f"--d-model {args.d_model} must be divisible by --n-head {args.n_head}")
    if args.out and not Path(args.out).parent.is_dir():
        raise UsageError(f"--out {args.out}: directory {Path(args.out).parent} does not exist")
    name = (sync.name if sync else "") or args.name or f"learner{args.learner_index}"
    options = TrainOptions(
        steps=args.steps,
        start_step=args.start_step,
        model=args.model,
        data=args.data,
        max_bytes=args.max_bytes,
        n_layer=args.n_layer,
        d_model=args.d_model,
        n_head=args.n_head,
        block=args.context,
        batch_size=args.batch_size,
        seed=args.seed,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay,
        clip=args.clip,
        sync=sync,
        name=name,
        learner_index=args.learner_index,
        learners=args.learners,
        slow=args.slow,
        wait_for_learners=args.wait_for_learners,
        log_every=args.log_every,
        eval_windows=args.eval_windows,
        threads=args.threads,
        out=args.out,
    )
    train(options)
    return 0


def _local(args: argparse.Namespace) -> int:
    from demo.local import LocalOptions, run

    check_data(args.data)
    if args.slow_learner is None:
        args.slow_learner = 1 if args.learners >= 2 else -1
    if args.kill_learner is None:
        args.kill_learner = 2 if args.learners >= 3 else -1
    for flag, index in (
        ("--slow-learner", args.slow_learner),
        ("--kill-learner", args.kill_learner),
    ):
        if not -1 <= index < args.learners:
            raise UsageError(
                f"{flag} {index} must be -1 (none) or a learner index below --learners {args.learners}"
            )
    if args.shards > args.fragments:
        raise UsageError(
            f"--shards {args.shards} is more than --fragments {args.fragments}: a shard would own no fragment"
        )
    if args.kill_at >= 1:
        raise UsageError(f"--kill-at must be a fraction below 1, got {args.kill_at}")
    load(LearnerConfig, None, {"codec": args.codec})  # ConfigError names the allowed codecs
    try:
        train_args, synchronizer_args = (
            shlex.split(args.train_args),
            shlex.split(args.synchronizer_args),
        )
    except ValueError as e:
        raise UsageError(f"--train-args/--synchronizer-args: {e}") from None
    options = LocalOptions(
        learners=args.learners,
        shards=args.shards,
        steps=args.steps,
        out=args.out,
        slow_learner=args.slow_learner,
        slow_factor=args.slow_factor,
        kill_learner=args.kill_learner,
        kill_at=args.kill_at,
        restart_after_s=args.restart_after_s,
        quorum=args.quorum,
        grace=args.grace,
        lease_s=args.lease_s,
        sync_every=args.sync_every,
        fragments=args.fragments,
        codec=args.codec,
        data=os.path.abspath(args.data) if args.data else None,
        seed=args.seed,
        train_args=train_args,
        synchronizer_args=synchronizer_args,
        plot=not args.no_plot,
        live=args.live,
    )
    run(options)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO"),
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
    )
    try:
        return _train(args) if args.command == "train" else _local(args)
    except (UsageError, ConfigError, DataError, ShardMismatch) as e:
        print(f"diloco-learner: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, TimeoutError, OSError) as e:
        print(f"diloco-learner: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("diloco-learner: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
