"""tests/tools.py: a test whose external tool is missing is skipped with the tool's name, or fails
under DILOCO_REQUIRE_TOOLS=1; and tests/test_deploy.py on a machine without those tools."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import tools
from tests.helpers import REPO

ABSENT = "diloco-no-such-tool"
EXTERNAL = ("promtool", "prometheus", "docker-compose", "kubectl", "dockerd", "debootstrap")


def test_a_missing_tool_skips_the_test_naming_the_tool_and_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(tools.REQUIRE, raising=False)
    with pytest.raises(pytest.skip.Exception, match=f"`{ABSENT}` is not installed: apt it"):
        tools.tool(ABSENT, "apt it")
    monkeypatch.setenv(tools.REQUIRE, "0")
    with pytest.raises(pytest.skip.Exception, match=ABSENT):
        tools.tool(ABSENT, "apt it")


def test_a_missing_tool_fails_the_test_when_tools_are_required(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(tools.REQUIRE, "1")
    with pytest.raises(
        pytest.fail.Exception, match=f"`{ABSENT}` is not installed.*REQUIRE_TOOLS=1"
    ):
        tools.tool(ABSENT, "apt it")


def test_a_present_tool_is_its_path_whether_or_not_tools_are_required(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for required in ("", "1"):
        monkeypatch.setenv(tools.REQUIRE, required)
        assert Path(tools.tool("sh", "apt it")).name == "sh"


def test_a_require_tools_value_other_than_0_or_1_fails_saying_what_it_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(tools.REQUIRE, "yes")
    with pytest.raises(pytest.fail.Exception, match="set it to 1 .* or 0"):
        tools.tool("sh", "apt it")


def path_without(names: tuple[str, ...], into: Path) -> str:
    """A PATH of one directory that links every command on this PATH but `names`."""
    into.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        if not Path(folder).is_dir():
            continue
        for cmd in Path(folder).iterdir():
            link = into / cmd.name
            if cmd.name in names or link.exists() or not os.access(cmd, os.X_OK):
                continue
            link.symlink_to(cmd)
    return str(into)


def run_deploy_tests(path: str, require: str) -> subprocess.CompletedProcess[str]:
    """The deploy tests that drive promtool, Prometheus, docker-compose and kubectl, run as a
    user would, with `path` as PATH and DILOCO_REQUIRE_TOOLS=`require`."""
    env = {**os.environ, "PATH": path, tools.REQUIRE: require}
    selected = (
        "promtool or docker_compose_v1 or compose_host_variant or kustomize"
        " or real_prometheus_scrapes"
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-rsfE", "-p", "no:cacheprovider", "-k", selected]
    return subprocess.run(
        [*cmd, "tests/test_deploy.py"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deploy_tests_skip_naming_each_missing_tool_and_fail_when_tools_are_required(
    tmp_path: Path,
) -> None:
    # the venv's own bin/ is searched too (hadolint comes from the dev extra): these are not in it
    assert not any((Path(sys.executable).parent / name).exists() for name in EXTERNAL)
    path = path_without(EXTERNAL, tmp_path / "bin")
    skipped = run_deploy_tests(path, "0")
    out = skipped.stdout + skipped.stderr
    assert skipped.returncode == 0, out[-4000:]
    assert " passed" not in out and " failed" not in out, out[-4000:]
    for name in ("promtool", "prometheus", "docker-compose", "kubectl"):
        assert "SKIPPED" in out and f"`{name}` is not installed" in out, (name, out[-4000:])
    assert "deploy/ci/install-tools.sh" in out

    failed = run_deploy_tests(path, "1")
    out = failed.stdout + failed.stderr
    assert failed.returncode == 1, out[-4000:]
    assert " skipped" not in out and " passed" not in out, out[-4000:]
    for name in ("promtool", "prometheus", "docker-compose", "kubectl"):
        assert f"`{name}` is not installed" in out, (name, out[-4000:])
