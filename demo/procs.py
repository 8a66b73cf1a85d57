"""Child processes of a job on this host: the one-machine demo, the benchmarks and the end-to-end tests.

- `Procs`: the processes a job started, each in its own process group (so whatever a child starts
  is signalled with it) and logging to `ROOT/logs/NAME.log`; `stop_all` ends them all, however
  the job ends.
- `start_synchronizer`: `python -m synchronizer serve` on port 0 (or a given port), waiting for
  its ready file (`ROOT/NAME.ready.json`: address, port, metrics port, epoch).
- `read_json`: a result or ready file that another process rewrites as it goes.
- `scrape` and `metric`: the Synchronizer's Prometheus samples.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, dict[tuple, float]]


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; empty while the file is missing or half written."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def scrape(metrics_url: str) -> Samples:
    """Prometheus text from `metrics_url` as {sample name: {sorted label items: value}}."""
    with urllib.request.urlopen(metrics_url, timeout=2) as r:
        text = r.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def metric(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when it is not there (yet)."""
    return samples.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


class Procs:
    """The processes a job started under `root`, each in its own process group."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen] = []
        (root / "logs").mkdir(parents=True, exist_ok=True)

    def log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def start(
        self, name: str, cmd: Sequence[str], env: Mapping[str, str] | None = None
    ) -> subprocess.Popen:
        """Starts `cmd` in a new session, stdout and stderr appended to `log(name)`; `env` adds
        to this process's environment (for secrets, which argv would show to every local user)."""
        with open(self.log(name), "ab") as f:
            p = subprocess.Popen(
                list(cmd),
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **env} if env else None,
            )
        self.procs.append(p)
        return p

    def tails(self, chars: int = 2000) -> str:
        """The end of every log, for a failure message."""
        return "\n".join(
            f"--- {p.name} ---\n{p.read_text(errors='replace')[-chars:]}"
            for p in sorted((self.root / "logs").glob("*.log"))
        )

    @staticmethod
    def signal(p: subprocess.Popen, sig: int) -> None:
        """Signals p's whole process group (whatever p started goes too)."""
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass

    @classmethod
    def kill(cls, p: subprocess.Popen) -> None:
        cls.signal(p, signal.SIGCONT)  # a stopped (SIGSTOP) group must run again to end
        cls.signal(p, signal.SIGKILL)
        p.wait()

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM to every group (the Synchronizer checkpoints and exits), up to `grace_s` to
        end, then SIGKILL whatever is left; `grace_s` 0 kills at once."""
        if grace_s > 0:
            for p in self.procs:
                if p.poll() is None:
                    self.signal(p, signal.SIGCONT)
                    self.signal(p, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for p in self.procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for p in self.procs:
            self.kill(p)


def start_synchronizer(
    procs: Procs,
    flags: Sequence[str] = (),
    *,
    state_dir: Path | None = None,
    port: int = 0,
    name: str = "synchronizer",
    timeout_s: float = 60.0,
) -> tuple[subprocess.Popen, dict[str, Any]]:
    """`python -m synchronizer serve` with `flags`, state in `state_dir` (default ROOT/state);
    returns the process and its ready file's content once it serves. RuntimeError naming the
    log if it exits first or is not ready within `timeout_s`."""
    ready = procs.root / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    proc = procs.start(
        name,
        [
            sys.executable,
            "-m",
            "synchronizer",
            "serve",
            "--port",
            str(port),
            "--metrics-port",
            "0",
            "--state-dir",
            str(state_dir or procs.root / "state"),
            "--ready-file",
            str(ready),
            *flags,
        ],
    )
    deadline = time.monotonic() + timeout_s
    while not (info := read_json(ready)):
        if proc.poll() is not None:
            raise RuntimeError(
                f"the Synchronizer exited with code {proc.returncode}; see {procs.log(name)}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the Synchronizer did not become ready within {timeout_s:g} s; see {procs.log(name)}"
            )
        time.sleep(0.05)  # another process's file: no event to wait on
    return proc, info


def rejoin_args(result: dict) -> list[str]:
    """Flags that make a restarted learner come back as the one whose result this is."""
    info = result.get("learner") or {}
    if not info.get("learner_id"):
        return []
    return ["--learner-id", info["learner_id"], "--learner-session", info.get("session", "")]
