"""The command-line parts both programs (`diloco-synchronizer`, `diloco-learner`) share.

`Parser` is argparse with one-line errors and `--version`. The exit codes (`OK`, `FAILED`,
`USAGE`, `UNREACHABLE`, `REFUSED`, `INTERRUPTED`) are the same for both programs and documented
in docs/configuration.md. `setup_logging` gives both the same log lines: time, level, logger and
message, as text or as one JSON object per line (`--log-format json`). `number(int, ge=0)` is a flag type that checks its
bound as the flag is read (`argument --steps: must be >= 0, got -5`). `add_option_flags` gives
fields of a pydantic options model their flags, taking each flag's default, bound, choices and
help from its field, so that each is written once. Settings loaded in layers (file <
environment < flags) take their flags from `protos.configload.add_flags` instead, and the address
rule behind every `--synchronizer` is `protos.channel.parse_addresses`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import typing
from collections.abc import Callable
from typing import Any, TextIO

from pydantic import BaseModel

from protos.configload import flag_type, metavar, plain
from protos.version import version

# Exit codes, the same for every command of both programs (docs/configuration.md)
OK = 0  # done; a server stopped by SIGTERM/SIGINT after a clean shutdown
FAILED = 1  # failed while running: the service failed, training raised, a file could not be written
USAGE = 2  # bad usage or configuration: a flag, a setting, a variable, a file named by one
UNREACHABLE = 3  # the Synchronizer could not be reached, or did not answer in time
REFUSED = (
    4  # the Synchronizer answered and refused: credentials, permission, the model, the request
)
INTERRUPTED = 130  # stopped by Ctrl-C before the end (a client command or a learner)
# A learner stopped by SIGTERM after writing its checkpoint (`train --resume`): not 0, so that a
# Kubernetes Job counts the pod as failed and starts it again, to resume where it stopped
TERMINATED = 143

LOG_FORMATS = ("text", "json")


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag prints one line (and where to look), not the whole usage."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_version(parser: argparse.ArgumentParser) -> None:
    """`--version`: the program's name and the installed package's version, exit 0."""
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {version()}", help="print the version"
    )


class JsonLines(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message (and the
    exception's traceback as `exception`, when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


class _Console(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler on sys.stdout or sys.stderr as they are when each record is written (so that a
    program run in-process, in tests, writes where its caller captures)."""

    def __init__(self, name: str) -> None:
        self.name_of_stream = name
        super().__init__()

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        stream: TextIO = getattr(sys, self.name_of_stream)
        return stream

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # always the current sys.stdout / sys.stderr


def setup_logging(level: str = "INFO", fmt: str = "text", stream: str = "stderr") -> None:
    """The root logger writes to sys.stderr (or sys.stdout) at `level`, as text lines
    (`time LEVEL logger: message`) or JSON lines; a second call replaces the first's handler
    and leaves any other handler alone."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Console)]:
        root.removeHandler(old)
    handler = _Console(stream)
    handler.setFormatter(
        JsonLines()
        if fmt == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root.addHandler(handler)
    root.setLevel(level)


def add_log_flags(parser: argparse._ActionsContainer, level: bool = True) -> None:
    """`--log-format` (and `--log-level` unless `level` is False) for a command whose logging
    is not a setting of its config model."""
    if level:
        parser.add_argument(
            "--log-level",
            default="INFO",
            choices=("DEBUG", "INFO", "WARNING", "ERROR"),
            help="least severe log lines shown (default: INFO)",
        )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="log lines as text (time, level, logger, message) or one JSON object per line "
        "with those keys (default: text)",
    )


def number(
    kind: type[int] | type[float], *, gt: float | None = None, ge: float | None = None
) -> Callable[[str], int | float]:
    """An argparse type: the text as `kind`, not NaN, and `> gt` or `>= ge` when given."""
    expected = "an integer" if kind is int else "a number"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value != value:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        if gt is not None and not value > gt:
            raise argparse.ArgumentTypeError(f"must be > {gt:g}, got {text}")
        if ge is not None and not value >= ge:
            raise argparse.ArgumentTypeError(f"must be >= {ge:g}, got {text}")
        return value

    return parse


def add_option_flags(
    parser: argparse._ActionsContainer, model: type[BaseModel], names: str
) -> None:
    """A flag for each field of `model` named in `names` (space-separated), in that order.

    The flag is `--field-name`, or the field's `json_schema_extra` "flag" (with "metavar" there
    for its placeholder); its default is the field's, shown in the help after the field's
    description unless it is None or "" (None, the flag left out, for a default that a factory
    computes from the other fields); a Literal gives the choices, `ge`/`gt` the bound that
    `number` checks, and `bool | None` a `--flag/--no-flag` pair.
    """
    for name in names.split():
        field = model.model_fields[name]
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        flag = str(extra.get("flag", "--" + name.replace("_", "-")))
        # A default computed from the other fields is left to the model: the flag's is None
        takes_data = field.default_factory_takes_validated_data
        default = None if takes_data else field.get_default(call_default_factory=True)
        help_text = field.description or ""
        kind, is_bool = flag_type(field.annotation)
        if is_bool:
            parser.add_argument(
                flag,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_text,
            )
            continue
        if default not in (None, ""):
            help_text += f" (default: {plain(default)})".replace("%", "%%")
        bounds = {
            key: getattr(m, key) for m in field.metadata for key in ("gt", "ge") if hasattr(m, key)
        }
        if kind in (int, float) and bounds:
            kind = number(kind, **bounds)
        choices = (
            typing.get_args(field.annotation)
            if typing.get_origin(field.annotation) is typing.Literal
            else None
        )
        parser.add_argument(
            flag,
            dest=name,
            type=kind,
            default=default,
            choices=choices,
            metavar=None
            if choices
            else str(extra.get("metavar", metavar(name, kind, field.annotation))),
            help=help_text,
        )
