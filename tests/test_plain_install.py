"""The plain install (`pip install .`, no extras) is whole: it serves, checkpoints, stops with
SIGTERM (exit 0) and restores. The suite itself runs with the dev extras, which bring packages a
plain install lacks (numpy came only through matplotlib, and safetensors needs it to save)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from synchronizer import checkpoint
from tests.helpers import serve_process, stop_serving

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def plain_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("plain") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # --no-compile: byte-compiling every file of torch took a quarter of this setup (torch's
    # install: 116 s, 85 s without, on a 2-core machine); Python compiles what the commands
    # import when they import it.
    pip = [str(venv / "bin" / "pip"), "install", "-q", "--no-compile"]
    for step in (torch_install(), [str(REPO)]):
        out = subprocess.run([*pip, *step], capture_output=True, text=True, timeout=800)
        assert out.returncode == 0, (
            f"pip install failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    return venv


def torch_install() -> list[str]:
    """pip's arguments for torch as the README's Quick start gives them: TORCH_SPEC, from where
    TORCH_INDEX says (the CPU index unless set; set but empty, pip's own configuration)."""
    readme = (REPO / "README.md").read_text()
    spec = re.search(r'"\$\{TORCH_SPEC:-([^}]+)\}"', readme)
    index = re.search(r'\$\{TORCH_INDEX-"([^"]+)"\}', readme)
    assert spec and index, "the README's Quick start installs torch from TORCH_SPEC and TORCH_INDEX"
    return [
        *shlex.split(os.environ.get("TORCH_INDEX", index.group(1))),
        os.environ.get("TORCH_SPEC") or spec.group(1),
    ]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _serve(venv: Path, state: Path, cwd: Path) -> tuple[subprocess.Popen, dict]:
    command = [str(venv / "bin" / "diloco-synchronizer")]
    return serve_process(
        command,
        state,
        cwd / "ready.json",
        "--metrics-port",
        "-1",
        "--checkpoint-interval-s",
        "0",
        cwd=cwd,
        env=_env(),
    )


def _sigterm(proc: subprocess.Popen) -> tuple[int, str]:
    out = stop_serving(proc)
    return proc.returncode, out


def test_plain_install_serves_checkpoints_on_sigterm_and_restores(
    plain_venv: Path, tmp_path: Path
) -> None:
    weights = {"a.weight": torch.randn(10, 3), "b.bias": torch.randn(7)}
    save_file(weights, str(tmp_path / "init.safetensors"))
    state = tmp_path / "state"
    cli = str(plain_venv / "bin" / "diloco-synchronizer")

    proc, info = _serve(plain_venv, state, tmp_path)
    try:
        init = subprocess.run(
            [
                cli,
                "init",
                str(tmp_path / "init.safetensors"),
                "--synchronizer",
                info["address"],
                "--fragments",
                "2",
            ],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert init.returncode == 0, init.stderr
    finally:
        code, out = _sigterm(proc)
    assert code == 0, out
    assert "Traceback" not in out and " ERROR " not in out, out
    assert checkpoint.list_checkpoints(state), f"no checkpoint in {state}:\n{out}"

    proc, info = _serve(plain_venv, state, tmp_path)
    try:
        status = subprocess.run(
            [cli, "status", "--synchronizer", info["address"], "--json"],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        restored = json.loads(status.stdout)
        assert restored["initialized"] and [f["fragment_id"] for f in restored["fragments"]] == [
            0,
            1,
        ]
    finally:
        code, out = _sigterm(proc)
    assert code == 0, out
