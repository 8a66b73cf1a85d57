"""Settings as both programs load them: each program's own variables (no name read by two
programs), legacy and misspelt variables warned about, errors naming where a value came from,
secrets from files, `--help` grouped with plain defaults and the flags users type, the warning of a
service open beyond loopback, and a launcher handing each program only its own variables."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import typing

import pytest
from pydantic import BaseModel

from demo.cli import _parser as learner_parser
from demo.options import LocalOptions, TrainOptions
from demo.procs import rejoin_args
from demo.train import keep_session
from learner.config import LearnerConfig
from protos import layout
from protos.configload import (
    LEGACY_PREFIX,
    PROGRAM_PREFIXES,
    ConfigError,
    env_name,
    env_prefix,
    help_groups,
    load,
    program_env,
    secrets,
    variables,
)
from synchronizer.cli import _parser as synchronizer_parser
from synchronizer.cli_remote import RemoteConfig
from synchronizer.cli_serve import open_to_all
from synchronizer.config import SynchronizerConfig

PROGRAMS: dict[str, type[BaseModel]] = {
    "diloco-synchronizer serve": SynchronizerConfig,
    "diloco-learner train": LearnerConfig,
    "diloco-synchronizer init/status": RemoteConfig,
}


def test_no_environment_variable_is_read_by_two_programs():
    read_by: dict[str, str] = {}
    for program, model in PROGRAMS.items():
        assert env_prefix(model) in PROGRAM_PREFIXES
        names = variables(model)
        assert set(names.values()) >= set(model.model_fields)  # every setting has its variable
        for var in names:
            assert var not in read_by, f"{var} is read by {read_by.get(var)} and {program}"
            read_by[var] = program
    # A legacy name one program warns about is never a name another program reads
    for program, model in PROGRAMS.items():
        for field in model.model_fields:
            legacy = LEGACY_PREFIX + field.upper()
            assert read_by.get(legacy, program) == program, (legacy, read_by[legacy])
    # The example's own options are flags only: no variable of theirs could collide
    for options in (TrainOptions, LocalOptions):
        assert getattr(options, "env_prefix", None) is None
    assert variables(LearnerConfig)["DILOCO_LEARNER_ID"] == "learner_id"
    assert variables(LearnerConfig)["DILOCO_LEARNER_SESSION_FILE"] == "learner_session_file"
    assert env_name("DILOCO_SYNC_", "merge") != env_name("DILOCO_LEARNER_", "merge")


def test_settings_that_meant_different_things_now_reach_only_their_program():
    env = {
        "DILOCO_SYNC_MERGE": "radial",
        "DILOCO_SYNC_ANCHOR": "base",
        "DILOCO_LEARNER_MERGE": "rebase",
        "DILOCO_SYNC_METRICS_PORT": "9464",
        "DILOCO_LEARNER_METRICS_PORT": "-1",
    }
    service = load(SynchronizerConfig, environ=env)
    learner = load(LearnerConfig, environ=env)
    assert (service.merge, service.metrics_port) == ("radial", 9464)
    assert (learner.merge, learner.metrics_port) == ("rebase", -1)


def test_a_legacy_or_misspelt_variable_is_not_read_and_warns_naming_what_to_set(caplog):
    env = {"DILOCO_QUORUM": "3", "DILOCO_SYNC_QUORUMM": "4", "DILOCO_MERGE": "radial"}
    with caplog.at_level(logging.WARNING, logger="protos.configload"):
        cfg = load(SynchronizerConfig, environ=env)
    assert cfg.quorum == 1 and cfg.merge == "mean"  # neither was read
    warnings = [r.getMessage() for r in caplog.records]
    assert any("DILOCO_QUORUM" in w and "set DILOCO_SYNC_QUORUM" in w for w in warnings)
    assert any("DILOCO_MERGE" in w and "set DILOCO_SYNC_MERGE" in w for w in warnings)
    assert any(w.startswith("DILOCO_SYNC_QUORUMM names no setting") for w in warnings)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="protos.configload"):
        load(LearnerConfig, environ={"DILOCO_LEARNER_SESSION": "s", "DILOCO_SYNC_EVERY": "5"})
    warnings = [r.getMessage() for r in caplog.records]
    # the session's variable is the same in both schemes: not a legacy name
    assert warnings == [
        "DILOCO_SYNC_EVERY is not read any more: set DILOCO_LEARNER_SYNC_EVERY (each program "
        "has its own prefix, DILOCO_LEARNER_...)"
    ]


@pytest.mark.parametrize(
    ("config_file", "flags", "env", "words"),
    [
        (
            None,
            {},
            {"DILOCO_SYNC_QUORUM": "abc"},
            "invalid setting quorum (from DILOCO_SYNC_QUORUM)",
        ),
        (
            None,
            {"quorum": -1},
            {"DILOCO_SYNC_QUORUM": "2"},
            "invalid setting quorum (from --quorum)",
        ),
        ("quorum = -2\n", {}, {}, "invalid setting quorum (from config file "),
    ],
    ids=["variable", "flag-over-variable", "file"],
)
def test_a_bad_value_names_where_it_came_from(tmp_path, config_file, flags, env, words):
    path = None
    if config_file:
        path = tmp_path / "c.toml"
        path.write_text(config_file)
    with pytest.raises(ConfigError) as e:
        load(SynchronizerConfig, path, flags, env)
    assert words in str(e.value)


def test_every_token_and_session_takes_a_file_and_drops_its_trailing_newline(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret-with spaces\n")
    assert set(secrets(SynchronizerConfig)) == {"auth_token", "admin_token"}
    assert set(secrets(LearnerConfig)) == {"auth_token", "learner_session"}
    assert set(secrets(RemoteConfig)) == {"auth_token", "admin_token"}
    for model in PROGRAMS.values():
        for name in secrets(model):
            by_flag = load(model, flags={f"{name}_file": str(secret)}, environ={})
            by_env = load(model, environ={env_name(env_prefix(model), name) + "_FILE": str(secret)})
            assert getattr(by_flag, name) == getattr(by_env, name) == "s3cret-with spaces"
    config = tmp_path / "c.yaml"
    config.write_text(f"auth_token_file: {secret}\n")
    assert load(SynchronizerConfig, config, environ={}).auth_token == "s3cret-with spaces"
    # a higher layer's value replaces a lower layer's file, and the other way round
    assert load(SynchronizerConfig, config, {"auth_token": "flag"}, {}).auth_token == "flag"
    env = {"DILOCO_SYNC_AUTH_TOKEN": "env"}
    assert load(SynchronizerConfig, None, {"auth_token_file": str(secret)}, env).auth_token == (
        "s3cret-with spaces"
    )


@pytest.mark.parametrize(
    ("content", "flags", "words"),
    [
        (
            None,
            {"auth_token_file": "{dir}/missing"},
            "cannot read auth_token_file {dir}/missing (from --auth-token-file): No such file",
        ),
        (
            "\n",
            {"auth_token_file": "{dir}/secret"},
            "auth_token_file {dir}/secret (from --auth-token-file) is empty",
        ),
        (
            "x",
            {"auth_token_file": "{dir}", "auth_token": "y"},
            "auth_token is given twice (--auth-token and --auth-token-file)",
        ),
        (
            "x",
            {"auth_token_file": "{dir}"},
            "cannot read auth_token_file {dir} (from --auth-token-file)",
        ),
    ],
    ids=["missing", "empty", "twice", "a-directory"],
)
def test_a_bad_secret_file_is_one_clear_error_that_shows_no_secret(tmp_path, content, flags, words):
    if content is not None:
        (tmp_path / "secret").write_text(content)
    flags = {k: v.format(dir=tmp_path) for k, v in flags.items()}
    with pytest.raises(ConfigError) as e:
        load(SynchronizerConfig, None, flags, {})
    assert words.format(dir=tmp_path) in str(e.value)
    assert "\n" not in str(e.value) and "'y'" not in str(e.value)


def _help(parser_of, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parser_of().parse_args([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    ("program", "argv", "model", "groups"),
    [
        (
            synchronizer_parser,
            ["serve"],
            SynchronizerConfig,
            [
                "network",
                "rounds",
                "outer optimizer",
                "limits",
                "durability",
                "security",
                "observability",
            ],
        ),
        (
            learner_parser,
            ["train"],
            LearnerConfig,
            [
                "learner settings: network",
                "learner settings: security",
                "learner settings: observability",
            ],
        ),
        (synchronizer_parser, ["status"], RemoteConfig, ["connection", "security"]),
        (synchronizer_parser, ["init"], RemoteConfig, ["connection", "security"]),
    ],
    ids=["serve", "train", "status", "init"],
)
def test_help_is_grouped_with_plain_defaults_and_the_flags_users_type(
    capsys, program, argv, model, groups
):
    text = _help(program, argv, capsys)
    headings = re.findall(r"^(\S[^\n]*):$", text, flags=re.M)
    for group in groups:
        assert any(h.startswith(group) for h in headings), (group, headings)
    for title, names in help_groups(model):
        assert names, title
    assert not re.search(r"PosixPath|default:? ['\"\[]|default None|default True", text)
    snake = {name for name in model.model_fields if "_" in name}
    words = set(re.findall(r"(?<![\w.-])[a-z0-9]+(?:_[a-z0-9]+)+", text))
    assert not words & snake, words & snake  # settings are named by their flags
    for name in model.model_fields:
        assert "--" + name.replace("_", "-") in text
        assert env_name(env_prefix(model), name) in text.replace("\n", " ").replace(" ", "")
    for name in secrets(model):
        assert f"--{name.replace('_', '-')}-file" in text


def test_serve_help_shows_defaults_as_typed():
    help_text = synchronizer_parser().format_help()
    assert "--version" in help_text
    serve = _help_text(synchronizer_parser, "serve")
    assert "(default diloco-state;" in serve and "(default on;" in serve  # --state-dir, --wal
    assert "(default 0.7;" in serve  # --outer-lr, not 0.7000


def _help_text(parser_of, command: str) -> str:
    parser = parser_of()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[command].format_help()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("settings", "warns"),
    [
        ({"host": "0.0.0.0"}, True),
        ({"host": "[::]"}, True),
        ({"host": "sync.example.org"}, True),
        ({"host": "127.0.0.1"}, False),
        ({"host": "127.1.2.3"}, False),
        ({"host": "[::1]"}, False),
        ({"host": "localhost"}, False),
        ({"host": "0.0.0.0", "auth_token": "t"}, False),
        ({"host": "0.0.0.0", "tls_cert": "c.pem", "tls_key": "k.pem"}, False),
    ],
)
def test_serving_beyond_loopback_without_token_or_tls_is_warned_of(settings, warns):
    warning = open_to_all(SynchronizerConfig(**settings))
    assert (warning is not None) == warns
    if warning is not None:
        assert settings["host"] in warning and "--auth-token-file" in warning


def test_a_launcher_hands_each_program_only_its_own_variables():
    env = {
        "PATH": "/bin",
        "DILOCO_SYNC_QUORUM": "2",
        "DILOCO_LEARNER_MERGE": "rebase",
        "DILOCO_CTL_ADMIN_TOKEN": "a",
        "DILOCO_CHAOS": "full",  # not a program's setting: left alone
    }
    assert program_env("DILOCO_SYNC_", env) == {
        "PATH": "/bin",
        "DILOCO_SYNC_QUORUM": "2",
        "DILOCO_CHAOS": "full",
    }
    assert program_env("DILOCO_LEARNER_", env) == {
        "PATH": "/bin",
        "DILOCO_LEARNER_MERGE": "rebase",
        "DILOCO_CHAOS": "full",
    }


def test_a_learners_session_is_kept_in_a_0600_file_and_a_restart_reads_it_from_there(tmp_path):
    class Client:
        session = "the-session-secret"

    class Learner:
        client = Client()

    path = tmp_path / "learner-0.json.session"
    assert keep_session(str(path), Learner(), "") == "the-session-secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == "the-session-secret\n"
    Client.session = "after-a-rejoin"
    assert keep_session(str(path), Learner(), "the-session-secret") == "after-a-rejoin"
    assert path.read_text() == "after-a-rejoin\n"

    result = {"learner": {"learner_id": "L7"}, "session_file": str(path)}
    args = rejoin_args(result)
    assert args == ["--learner-id", "L7", "--learner-session-file", str(path)]
    assert not any("after-a-rejoin" in a for a in args)  # argv is public
    flags = vars(learner_parser().parse_args(["train", *args]))
    cfg = load(LearnerConfig, None, flags, {})
    assert (cfg.learner_id, cfg.learner_session) == ("L7", "after-a-rejoin")
    assert rejoin_args({"learner": {"learner_id": "L7"}}) == []  # no file: join anew
    assert "after-a-rejoin" not in json.dumps(result)
    assert os.environ.get("DILOCO_LEARNER_SESSION") is None


def test_the_learners_pull_codecs_are_those_the_synchronizer_serves():
    named = typing.get_args(LearnerConfig.model_fields["pull_codec"].annotation)
    assert set(named) == {layout.NAMES_BY_CODEC[c] for c in layout.PULL_CODECS}
