"""Loading one pydantic config model from a file, the environment and command-line flags.

Every program (Synchronizer, learner, operator commands) configures itself the same way, so the
loader lives beside the wire as the one other piece they share. Precedence, lowest first: field
defaults, a TOML or YAML file, environment variables, flags. Flags are generated from the model's
fields, so `--help` lists every option with its description and default, in the model's groups.

Each program reads its own variables: a model names its prefix in the class variable
`env_prefix` (`DILOCO_SYNC_`, `DILOCO_LEARNER_`, `DILOCO_CTL_`), and a field's variable is the
prefix and the field's name in capitals, less a leading repetition of the prefix's last word
(`learner_id` under `DILOCO_LEARNER_` is `DILOCO_LEARNER_ID`). `env_name` is that rule. An
unprefixed `DILOCO_<FIELD>` (what every program read before) and a prefixed variable that names no
setting are reported as a warning naming the variable to set instead; neither is read.

A field marked secret (`json_schema_extra={"secret": True}`) also takes a file: `--FIELD-file`,
`<VAR>_FILE` or the key `FIELD_file`, whose content (less its trailing newline) is the value, so
that a token never has to be on a command line. Errors come back as one line that names the field
and where its value came from (`ConfigError`), never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI (a dependency only there)
    import tomli as tomllib

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
LEGACY_PREFIX = "DILOCO_"  # what every program read before each had its own prefix
# Each program's own: the service, the learner, the operator commands (init, status)
PROGRAM_PREFIXES = ("DILOCO_SYNC_", "DILOCO_LEARNER_", "DILOCO_CTL_")
FILE_SUFFIX = "_file"


class ConfigError(ValueError):
    """A configuration problem, phrased for the person who wrote the config."""


def env_prefix(model: type[BaseModel]) -> str:
    """The model's variable prefix (its `env_prefix` class variable); TypeError without one."""
    prefix = getattr(model, "env_prefix", None)
    if not isinstance(prefix, str) or not prefix.endswith("_"):
        raise TypeError(f"{model.__name__} names no env_prefix ending in '_'")
    return prefix


def program_env(prefix: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment to start the program reading `prefix` with: every variable but the
    other programs' settings (a launcher of several programs hands each only its own)."""
    env = os.environ if environ is None else environ
    others = tuple(p for p in PROGRAM_PREFIXES if p != prefix)
    return {k: v for k, v in env.items() if not k.startswith(others)}


def env_name(prefix: str, field: str) -> str:
    """The variable of `field` under `prefix`: DILOCO_SYNC_QUORUM, DILOCO_LEARNER_ID."""
    word = prefix.rstrip("_").rsplit("_", 1)[-1].lower()
    if field.startswith(word + "_"):
        field = field[len(word) + 1 :]
    return prefix + field.upper()


def flag_name(field: str) -> str:
    """The flag users type for a field: --kebab-case."""
    return "--" + field.replace("_", "-")


def secrets(model: type[BaseModel]) -> list[str]:
    """The fields that hold a secret (each also read from a file)."""
    return [
        name
        for name, f in model.model_fields.items()
        if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("secret")
    ]


def variables(model: type[BaseModel]) -> dict[str, str]:
    """Every variable the model reads: {variable: setting}, a secret's file form included."""
    prefix = env_prefix(model)
    out = {env_name(prefix, name): name for name in model.model_fields}
    out.update({env_name(prefix, name) + "_FILE": name + FILE_SUFFIX for name in secrets(model)})
    return out


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
    """The settings the model's variables give (values left as strings; a secret's file form
    under `FIELD_file`). Warns of legacy `DILOCO_<FIELD>` variables and of prefixed ones that
    name no setting, saying what to set instead."""
    env = os.environ if environ is None else environ
    names = variables(model)
    out = {names[key]: env[key] for key in names if key in env}
    prefix = env_prefix(model)
    for name in model.model_fields:
        legacy = LEGACY_PREFIX + name.upper()
        if legacy in env and legacy not in names:
            logger.warning(
                "%s is not read any more: set %s (each program has its own prefix, %s...)",
                legacy,
                env_name(prefix, name),
                prefix,
            )
    for key in sorted(env):
        if key.startswith(prefix) and key not in names:
            logger.warning("%s names no setting here and is not read (see --help)", key)
    return out


def flag_type(annotation: Any) -> tuple[Any, bool]:
    """(argparse type, is_bool) for a field annotation; Optional[X] counts as X."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and args:
        annotation = args[0]
    if annotation is bool:
        return None, True
    if typing.get_origin(annotation) is typing.Literal:
        return str, False
    return (annotation if annotation in (int, float) else str), False


def plain(value: Any) -> str:
    """A default as a user would type it: on/off, a path as text, none, no quotes or reprs."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def kebab_text(text: str, fields: Iterable[str]) -> str:
    """`text` with every field name it mentions written as the flag users type."""
    names = sorted((f for f in fields if "_" in f), key=len, reverse=True)
    if not names:
        return text
    pattern = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, names)) + r")(?!\w)")
    return pattern.sub(lambda m: flag_name(m.group(1)), text)


def help_groups(model: type[BaseModel]) -> list[tuple[str, list[str]]]:
    """The model's `help_groups` ({title: "field field ..."}) as (title, fields), every field in
    exactly one; one untitled group of all fields when the model names none. ValueError if a
    field is left out or named twice."""
    groups = getattr(model, "help_groups", None)
    if not groups:
        return [("", list(model.model_fields))]
    out = [(title, names.split()) for title, names in groups.items()]
    listed = [name for _, names in out for name in names]
    missing = set(model.model_fields) - set(listed)
    if missing or len(listed) != len(set(listed)) or set(listed) - set(model.model_fields):
        raise ValueError(
            f"{model.__name__}.help_groups must name every field once (missing: {sorted(missing)})"
        )
    return out


def add_flags(
    parser: argparse.ArgumentParser, model: type[BaseModel], title: str = "{group}"
) -> None:
    """One --flag per field (and --FIELD-file per secret) in the model's help groups, default
    None so that only flags given on the line override. `title` makes each group's heading."""
    prefix = env_prefix(model)
    for group_title, names in help_groups(model):
        group = (
            parser.add_argument_group(title.format(group=group_title)) if group_title else parser
        )
        for name in names:
            _add_flag(group, model, name, prefix)


def _add_flag(
    group: argparse._ActionsContainer, model: type[BaseModel], name: str, prefix: str
) -> None:
    field = model.model_fields[name]
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    kind, is_bool = flag_type(field.annotation)
    secret = name in secrets(model)
    choices = (
        typing.get_args(field.annotation)
        if typing.get_origin(field.annotation) is typing.Literal
        else None
    )
    description = kebab_text(field.description or "", model.model_fields)
    default = "" if secret or field.default in (None, "") else f"default {plain(field.default)}; "
    help_text = f"{description} ({default}env {env_name(prefix, name)})".replace("%", "%%")
    if is_bool:
        group.add_argument(
            flag_name(name),
            dest=name,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=help_text,
        )
        return
    group.add_argument(
        flag_name(name),
        dest=name,
        type=kind,
        default=None,
        choices=choices,
        metavar=None
        if choices
        else str(extra.get("metavar", metavar(name, kind, field.annotation))),
        help=help_text,
    )
    if secret:
        group.add_argument(
            flag_name(name + FILE_SUFFIX),
            dest=name + FILE_SUFFIX,
            default=None,
            metavar="PATH",
            help=f"read {flag_name(name)} from this file (its trailing newline dropped), which "
            f"keeps it off the command line (env {env_name(prefix, name)}_FILE)",
        )


def metavar(name: str, kind: Any, annotation: Any) -> str:
    """A flag's placeholder in one word, what kind of value it wants (unless the field's
    `json_schema_extra` names one as "metavar")."""
    if name.endswith("_s"):
        return "SECONDS"
    if name.endswith("_bytes"):
        return "BYTES"
    if Path in typing.get_args(annotation) or annotation is Path:
        return "PATH"
    if kind is int:
        return "N"
    if kind is float:
        return "X"
    return name.rsplit("_", 1)[-1].upper()


def _read_secret(path: Any, name: str, source: str) -> str:
    """The secret in the file at `path`, less its trailing newline; ConfigError if unreadable
    or empty."""
    where = f"{name}{FILE_SUFFIX} {path} (from {source})"
    try:
        text = Path(str(path)).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read {where}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"cannot read {where}: not text") from None
    value = text.rstrip("\r\n")
    if not value:
        raise ConfigError(f"{where} is empty")
    return value


def load(
    model: type[M],
    config_file: str | Path | None = None,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> M:
    """Builds the model from file < environment < flags; ConfigError names the bad field and
    where its value came from (the flag, the variable or the file)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    secret_names = set(secrets(model))
    known = set(model.model_fields) | {name + FILE_SUFFIX for name in secret_names}

    def layer(given: Mapping[str, Any], source: Callable[[str], str]) -> None:
        for name in secret_names:  # a secret or its file replaces both from the layers below
            if name in given and name + FILE_SUFFIX in given:
                raise ConfigError(
                    f"{name} is given twice ({source(name)} and {source(name + FILE_SUFFIX)}): give one"
                )
            if name in given or name + FILE_SUFFIX in given:
                values.pop(name, None)
                values.pop(name + FILE_SUFFIX, None)
        values.update(given)
        sources.update({key: source(key) for key in given})

    if config_file:
        layer(read_file(config_file), lambda key: f"config file {config_file}")
    env_names = {setting: var for var, setting in variables(model).items()}
    layer(from_env(model, environ), lambda key: env_names[key])
    layer({k: v for k, v in (flags or {}).items() if v is not None and k in known}, flag_name)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown setting {unknown[0]!r}; see --help for the list of settings")
    for name in secret_names:
        file_key = name + FILE_SUFFIX
        if file_key in values:
            values[name] = _read_secret(values.pop(file_key), name, sources[file_key])
            sources[name] = sources.pop(file_key)
    try:
        return model.model_validate(values)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "config"
        source = f" (from {sources[field]})" if field in sources else ""
        secret = field in secret_names
        got = (
            f" (got {err['input']!r})"
            if "input" in err and not isinstance(err["input"], dict) and not secret
            else ""
        )
        raise ConfigError(f"invalid setting {field}{source}: {err['msg']}{got}") from None
