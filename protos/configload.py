"""Loading one pydantic config model from a file, the environment and command-line flags.

Both processes (Synchronizer and learner) configure themselves the same way, so the loader lives
beside the wire as the one other piece they share. Precedence, lowest first: field defaults, a
TOML or YAML file, `DILOCO_<FIELD>` environment variables, flags. Flags are generated from the
model's fields, so `--help` lists every option with its description and default. Errors come back
as one line that names the field (`ConfigError`), never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI (a dependency only there)
    import tomli as tomllib

M = TypeVar("M", bound=BaseModel)
ENV_PREFIX = "DILOCO_"


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who wrote the config."""


def read_file(path: str | Path) -> dict[str, Any]:
    """Reads a .toml, .yaml/.yml or .json file into a dict; ConfigError if it cannot."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror}") from None
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(text)
        elif p.suffix in (".yaml", ".yml", ".json"):
            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"config file {p} must end in .toml, .yaml, .yml or .json")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"config file {p} is not valid: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a table of settings at the top level")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def from_env(model: type[BaseModel], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The DILOCO_<FIELD> variables that name a field of the model (values left as strings)."""
    env = os.environ if environ is None else environ
    out = {}
    for name in model.model_fields:
        key = ENV_PREFIX + name.upper()
        if key in env:
            out[name] = env[key]
    return out


def flag_type(annotation: Any) -> tuple[Any, bool]:
    """(argparse type, is_bool) for a field annotation; Optional[X] counts as X."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, __import__("types").UnionType) and args:
        annotation = args[0]
    if annotation is bool:
        return None, True
    if typing.get_origin(annotation) is typing.Literal:
        return str, False
    return (annotation if annotation in (int, float) else str), False


def add_flags(parser: argparse._ActionsContainer, model: type[BaseModel]) -> None:
    """One --flag per field, default None so that only flags given on the line override."""
    for name, field in model.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind, is_bool = flag_type(field.annotation)
        default = field.default
        choices = (
            typing.get_args(field.annotation)
            if typing.get_origin(field.annotation) is typing.Literal
            else None
        )
        help_text = (
            f"{field.description or ''} (default: {default!r}; env {ENV_PREFIX}{name.upper()})"
        )
        if is_bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(
                flag,
                dest=name,
                type=kind,
                default=None,
                choices=choices,
                metavar=name.upper() if not choices else None,
                help=help_text,
            )


def load(
    model: type[M],
    config_file: str | Path | None = None,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> M:
    """Builds the model from file < environment < flags; ConfigError names the bad field."""
    values: dict[str, Any] = {}
    if config_file:
        values.update(read_file(config_file))
    values.update(from_env(model, environ))
    values.update(
        {k: v for k, v in (flags or {}).items() if v is not None and k in model.model_fields}
    )
    unknown = sorted(set(values) - set(model.model_fields))
    if unknown:
        raise ConfigError(f"unknown setting {unknown[0]!r}; see --help for the list of settings")
    try:
        return model.model_validate(values)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "config"
        got = (
            f" (got {err['input']!r})"
            if "input" in err and not isinstance(err["input"], dict)
            else ""
        )
        raise ConfigError(f"invalid setting {field}: {err['msg']}{got}") from None
