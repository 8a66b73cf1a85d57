"""The operations pack, checked without external tools: every alert's runbook in
docs/runbooks.md, the dashboard's job/namespace/shard variables in every query and its
durability panels, the kube-prometheus manifests generated from the same rule and dashboard
files, and what the Kubernetes manifests give the Synchronizer and the GPU learners
(promtool and kubectl check the same files in tests/test_deploy.py where they are installed)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from synchronizer.config import SynchronizerConfig

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
RUNBOOKS = REPO / "docs" / "runbooks.md"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "goodput.json"


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


k8s_render = load(DEPLOY / "k8s" / "render.py", "diloco_k8s_render_ops")
operations = load(DEPLOY / "k8s" / "operations.py", "diloco_k8s_operations")


def alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load((DEPLOY / "prometheus" / "rules" / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def anchor(heading: str) -> str:
    """The anchor GitHub (and most Markdown renderers) give a heading."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def runbook_sections() -> dict[str, str]:
    """docs/runbooks.md's second-level sections by anchor."""
    parts = re.split(r"^## (.+)$", RUNBOOKS.read_text(), flags=re.MULTILINE)
    return {anchor(h): body for h, body in zip(parts[1::2], parts[2::2], strict=True)}


# Runbooks ---------------------------------------------------------------------------------------


def test_every_alert_has_a_description_and_a_runbook_url_that_resolves_to_its_section() -> None:
    sections = runbook_sections()
    rules = alerts()
    assert len(rules) >= 14
    for rule in rules:
        notes = rule["annotations"]
        assert notes.get("summary") and notes.get("description"), rule["alert"]
        path, _, fragment = notes["runbook_url"].partition("#")
        assert (REPO / path).resolve() == RUNBOOKS, rule["alert"]
        assert fragment in sections, f"{rule['alert']}: no heading #{fragment} in {RUNBOOKS.name}"
        assert fragment == anchor(rule["alert"]), "each alert's section is headed by its name"
        body = sections[fragment]
        for part in ("**What it means.**", "**What to look at.**", "**What to do.**"):
            assert part in body, f"{rule['alert']}'s runbook has no {part}"
    assert set(sections) == {anchor(r["alert"]) for r in rules}, "a runbook for no alert"


def test_the_write_ahead_log_and_checkpoint_age_have_alerts() -> None:
    exprs = {r["alert"]: r["expr"] for r in alerts()}
    assert "diloco_wal_failing" in exprs["DilocoWalFailing"]
    assert "diloco_checkpoint_last_success_timestamp_seconds" in exprs["DilocoCheckpointTooOld"]


def test_staleness_alert_states_the_default_bound() -> None:
    text = (DEPLOY / "prometheus" / "rules" / "alerts.yml").read_text()
    comment = text[
        text.index("- alert: DilocoStalenessHigh") : text.index(
            "expr:", text.index("- alert: DilocoStalenessHigh")
        )
    ]
    bound = SynchronizerConfig.model_fields["max_staleness"].default
    assert f"--max-staleness {bound}" in comment
    assert not re.search(r"\bat 8\b", comment)


# The dashboard ----------------------------------------------------------------------------------

FUNCTION_OR_KEYWORD = re.compile(
    r"^(sum|min|max|avg|count|stddev|stdvar|topk|bottomk|quantile|group|and|or|unless|bool|"
    r"offset|by|without|on|ignoring|group_left|group_right|inf|nan)$",
    re.IGNORECASE,
)


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, its matchers) of every vector selector in a PromQL expression."""
    masked = re.sub(r"\[[^\]]*\]", " ", expr)
    masked = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", masked)
    found = []
    for m in re.finditer(r"(?<![\w:.$\"])([A-Za-z_:][\w:]*)\s*(\{[^}]*\})?", masked):
        name, matchers = m.group(1), m.group(2) or ""
        if FUNCTION_OR_KEYWORD.match(name):
            continue
        if not matchers and masked[m.end() :].lstrip().startswith("("):
            continue  # a function call
        if masked[: m.start()].count("{") > masked[: m.start()].count("}"):
            continue  # a label name inside a selector
        found.append((name, matchers))
    return found


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_selectors_parser_finds_every_metric_and_its_matchers() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (shard, le) (rate(diloco_x_bucket{a="b"}[5m]))) '
        "/ on (job) group_left job:y:rate5m"
    )
    assert selectors(expr) == [("diloco_x_bucket", '{a="b"}'), ("job:y:rate5m", "")]


def test_every_dashboard_query_selects_the_namespace_job_and_shard_variables() -> None:
    d = dashboard()
    names = [v["name"] for v in d["templating"]["list"]]
    assert names[0] == "datasource" and {"namespace", "job", "shard"} <= set(names)
    for v in d["templating"]["list"][1:]:
        assert v["includeAll"] and v["allValue"] == ".*", v["name"]  # All keeps unlabelled series
    checked = 0
    for panel in d["panels"]:
        for target in panel.get("targets", []):
            for name, matchers in selectors(target["expr"]):
                where = f"{panel['title']!r}: {name}"
                assert 'job=~"$job"' in matchers and 'namespace=~"$namespace"' in matchers, where
                learner = name.startswith("diloco_learner_") and name not in (
                    "diloco_learner_capacity_seconds_total",
                    "diloco_learner_blocked_seconds_total",
                )
                per_shard = not learner and name != "ALERTS" and not name.startswith("job:")
                per_shard = per_shard and not name.startswith(("job_bucket:", "job_outcome:"))
                per_shard = per_shard and not name.startswith("job_codec:")
                if per_shard:
                    assert 'shard=~"$shard"' in matchers, where
                checked += 1
    assert checked > 40


def test_dashboard_draws_the_log_checkpoints_resident_memory_and_firing_alerts() -> None:
    panels = {p["title"]: p for p in dashboard()["panels"]}

    def queried(title_part: str) -> str:
        hits = [p for t, p in panels.items() if title_part in t.lower()]
        assert hits, f"no panel titled like {title_part!r}"
        return " ".join(t["expr"] for p in hits for t in p["targets"])

    assert "diloco_wal_failing" in queried("write-ahead log")
    assert "diloco_wal_fsync_seconds_bucket" in queried("write-ahead log")
    assert "diloco_wal_bytes" in queried("write-ahead log on disk")
    assert "time() - " in queried("last successful checkpoint")
    assert "diloco_checkpoint_last_success_timestamp_seconds" in queried("checkpoint")
    assert "diloco_checkpoint_seconds_bucket" in queried("checkpoint duration")
    assert "process_resident_memory_bytes" in queried("resident memory")
    assert "diloco_memory_projected_bytes" in queried("resident memory")
    alerts_panel = [p for t, p in panels.items() if "firing alerts" in t.lower()]
    assert alerts_panel and 'ALERTS{alertstate="firing"' in alerts_panel[0]["targets"][0]["expr"]
    assert alerts_panel[0]["targets"][0].get("instant") is True
    assert "diloco_learner_step_seconds" not in DASHBOARD.read_text(), (
        "step time comes from the counter pair, the same for every scraper"
    )


def test_dashboard_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in dashboard()["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for y in range(g["y"], g["y"] + g["h"]):
            for x in range(g["x"], g["x"] + g["w"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


# kube-prometheus ----------------------------------------------------------------------------------


def test_generated_prometheus_rule_and_dashboard_configmap_are_up_to_date() -> None:
    for path, text in operations.documents().items():
        assert path.read_text() == text, (
            f"{path.relative_to(REPO)} is out of date: run python deploy/k8s/operations.py"
        )
    assert operations.main(["--check"]) == 0


def test_operator_overlays_ship_the_rules_and_dashboard_the_tests_check() -> None:
    rule_files = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))
    groups = [g for path in rule_files for g in yaml.safe_load(path.read_text())["groups"]]
    for overlay in ("prometheus-operator", "sharded-prometheus-operator"):
        objects = k8s_render.render(DEPLOY / "k8s" / "overlays" / overlay)
        (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
        assert rule["apiVersion"] == "monitoring.coreos.com/v1"
        assert rule["spec"]["groups"] == groups
        (cm,) = [o for o in objects if o["kind"] == "ConfigMap"]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["data"] == {DASHBOARD.name: DASHBOARD.read_text()}


# The Synchronizer and the learners on Kubernetes ------------------------------------------------

QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def synchronizer_pods() -> list[tuple[str, dict[str, Any]]]:
    base = k8s_render.render(DEPLOY / "k8s" / "base")
    sharded = k8s_render.render(DEPLOY / "k8s" / "sharded")
    (deploy,) = [o for o in base if o["kind"] == "Deployment"]
    (sts,) = [o for o in sharded if o["kind"] == "StatefulSet"]
    return [("base", deploy["spec"]["template"]), ("sharded", sts["spec"]["template"])]


@pytest.mark.parametrize("layout", ["base", "sharded"])
def test_synchronizer_memory_limit_is_its_containers_memory_limit(layout: str) -> None:
    (pod,) = [p for name, p in synchronizer_pods() if name == layout]
    (container,) = pod["spec"]["containers"]
    (env,) = [e for e in container["env"] if e["name"] == "DILOCO_SYNC_MEMORY_LIMIT_BYTES"]
    assert "value" not in env
    ref = env["valueFrom"]["resourceFieldRef"]
    assert ref == {"containerName": container["name"], "resource": "limits.memory", "divisor": "1"}
    # What Kubernetes puts in the variable (the limit in bytes) is a valid setting.
    limit = container["resources"]["limits"]["memory"]
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)", limit).groups()  # type: ignore[union-attr]
    value = str(int(number) * QUANTITY[unit])
    assert SynchronizerConfig(memory_limit_bytes=value).memory_limit_bytes == int(value)


def test_synchronizer_shards_prefer_different_nodes() -> None:
    for layout, pod in synchronizer_pods():
        terms = pod["spec"]["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        (term,) = [t["podAffinityTerm"] for t in terms]
        assert term["topologyKey"] == "kubernetes.io/hostname", layout
        assert term["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()


def dockerfile_cuda_tag() -> str:
    """The tag deploy/docker/Dockerfile's header builds with a CUDA torch index."""
    header = (DEPLOY / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    for line in header.splitlines():
        m = re.search(r"docker build .*-t (\S+) .*TORCH_INDEX_URL=\S+/whl/cu\d+", line)
        if m:
            return m.group(1)
    raise AssertionError("the Dockerfile's header shows no CUDA build")


def test_gpu_learners_run_the_cuda_image_and_cpu_learners_the_cpu_one() -> None:
    cuda = dockerfile_cuda_tag()
    for layout in ("base", "sharded"):
        objects = k8s_render.render(DEPLOY / "k8s" / layout)
        (job,) = [o for o in objects if o["kind"] == "Job"]
        (container,) = job["spec"]["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["image"] == cuda, layout
    cpu = k8s_render.render(DEPLOY / "k8s" / "overlays" / "cpu-local")
    (job,) = [o for o in cpu if o["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert container["image"] == "diloco:latest"
