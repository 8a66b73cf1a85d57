"""The metrics both programs export, scraped from their real HTTP endpoints: Prometheus
conventions (no `_created` series, build information, a projection that a sum() counts once),
the checkpoint timestamp, histogram buckets that hold at 1B parameters, registries passed in,
scrape-safe learner metrics, and the Synchronizer's `/status` page."""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from learner import Learner
from learner.metrics import register_learner_metrics, start_learner_metrics
from protos import diloco_pb2 as pb
from protos.version import version
from synchronizer import checkpoint, memory
from synchronizer.cli_status import status_json
from synchronizer.config import SynchronizerConfig
from synchronizer.metrics import Metrics
from synchronizer.server import RunningServer, serving
from tests.helpers import TIMEOUT, Client, small_spec

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def config(state_dir: Path, **overrides: Any) -> SynchronizerConfig:
    settings: dict[str, Any] = dict(
        port=0,
        metrics_port=0,
        metrics_host="127.0.0.1",
        state_dir=state_dir,
        quorum=1,
        grace="none",
        shutdown_grace_s=0.5,
        checkpoint_interval_s=0,
    )
    settings.update(overrides)
    return SynchronizerConfig(**settings)


def scrape(srv: RunningServer, path: str = "/metrics") -> str:
    return get(f"http://127.0.0.1:{srv.metrics_port}{path}")


def initialised(srv: RunningServer) -> Client:
    spec = small_spec()
    c = Client(srv.address, spec, "metrics-test")
    c.join()
    c.init([torch.zeros(f.numel) for f in spec.fragments])
    return c


# The Synchronizer ---------------------------------------------------------------------------------


def test_synchronizer_exports_build_info_and_resident_memory_and_no_created_series(
    tmp_path: Path,
) -> None:
    with serving(config(tmp_path), Metrics()) as srv:
        c = initialised(srv)
        c.close()
        text = scrape(srv)
    names = {name for name, _ in samples(text)}
    assert not [n for n in names if n.endswith("_created")], "a _created series per counter"
    assert samples(text)[("diloco_build_info", (("version", version()),))] == 1
    assert version() != "" and samples(text)[("process_resident_memory_bytes", ())] > 0
    # The registry itself still has them: only the exposition leaves them out.
    assert any(
        s.name.endswith("_created")
        for f in srv.synchronizer.metrics.registry.collect()
        for s in f.samples
    )


def test_memory_projection_is_its_components_and_a_sum_counts_the_total_once(
    tmp_path: Path,
) -> None:
    with serving(config(tmp_path), Metrics()) as srv:
        c = initialised(srv)
        c.close()
        projected = {
            dict(labels)["component"]: v
            for (name, labels), v in samples(scrape(srv)).items()
            if name == "diloco_memory_projected_bytes"
        }
        expected = memory.project(srv.synchronizer.cfg, small_spec())
    assert "total" not in projected
    assert sum(projected.values()) == expected["total"]
    assert projected == {k: v for k, v in expected.items() if k != "total"}


def test_last_checkpoint_time_is_nan_before_one_then_its_write_time_and_restored_at_start(
    tmp_path: Path,
) -> None:
    name = "diloco_checkpoint_last_success_timestamp_seconds"
    with serving(config(tmp_path), Metrics()) as srv:
        assert math.isnan(samples(scrape(srv))[(name, ())])  # no alert on "age" before any
        c = initialised(srv)
        c.close()
        before = time.time()
        assert srv.synchronizer.state.save()
        after = time.time()
        written = samples(scrape(srv))[(name, ())]
        assert before <= written <= after
    # The final checkpoint at shutdown is the newest: a restart reports its time, not NaN (or,
    # once housekeeping finds nothing changed since, the time it found the newest current).
    newest = checkpoint.list_checkpoints(tmp_path)[-1][1]
    with serving(config(tmp_path), Metrics()) as srv:
        assert newest.stat().st_mtime <= samples(scrape(srv))[(name, ())] <= time.time()


@pytest.mark.parametrize(
    "histogram, measured_s",
    [
        # docs/performance.md, 1B parameters on 2 cores: an outer step of a 250M-element
        # fragment 4.5-5.5 s; a checkpoint of about 14 bytes per parameter at ~240 MB/s about
        # a minute; a group commit holding one INT4 push of such a fragment (125 MB) ~0.5 s; a
        # round's wait up to one sync interval (H = 500 steps of 0.5 s: 250 s).
        ("round_apply", 5.5),
        ("checkpoint_seconds", 60.0),
        ("wal_fsync", 0.5),
        ("round_wait", 250.0),
    ],
)
def test_duration_buckets_resolve_the_figures_measured_at_1b(
    histogram: str, measured_s: float
) -> None:
    """A 1B figure lands in a finite bucket at most twice its size, with room above it for a
    model four times larger: its quantiles are not clamped to the top bucket."""
    h = getattr(Metrics(CollectorRegistry()), histogram)
    h.observe(measured_s)
    bounds = [float(s.labels["le"]) for f in h.collect() for s in f.samples if "le" in s.labels]
    finite = [b for b in bounds if math.isfinite(b)]
    assert any(measured_s <= b <= 2 * measured_s for b in finite), finite
    assert max(finite) >= 4 * measured_s, finite


def test_metrics_on_a_registry_the_caller_passes_in_are_served_beside_its_own(
    tmp_path: Path,
) -> None:
    registry = CollectorRegistry()
    mine = Counter("trainer_restarts", "The caller's own metric.", registry=registry)
    mine.inc()
    with serving(config(tmp_path), Metrics(registry)) as srv:
        got = samples(scrape(srv))
    assert got[("trainer_restarts_total", ())] == 1
    assert ("diloco_build_info", (("version", version()),)) in got
    assert not [n for n, _ in got if n.endswith("_created")]
    # The caller's registry brings its own process metrics (the global one has them): none added.
    assert not [n for n, _ in got if n.startswith("process_")]


def test_status_page_on_the_metrics_port_is_what_status_json_prints(tmp_path: Path) -> None:
    with serving(config(tmp_path), Metrics()) as srv:
        c = initialised(srv)
        c.heartbeat(steps=30, tokens=3000, compute_s=3.0, step_time_s=0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/status", timeout=10) as r:
            content_type = r.headers["Content-Type"]
            page = json.loads(r.read())
        reply = c.stub.Status(pb.StatusRequest(), timeout=TIMEOUT)
        c.close()
    assert content_type == "application/json"
    assert page == status_json(reply)
    assert page["initialized"] and [x["learner_id"] for x in page["learners"]] == [c.learner_id]
    assert page["learners"][0]["steps"] == 30 and page["totals"]["tokens"] == 3000


@pytest.mark.parametrize(
    "tokens, needed",
    [({"admin_token": "adm", "auth_token": "lrn"}, "adm"), ({"auth_token": "lrn"}, "lrn")],
    ids=["admin-token", "learner-token"],
)
def test_status_page_asks_for_the_token_the_status_rpc_asks_for(
    tmp_path: Path, tokens: dict[str, str], needed: str
) -> None:
    with serving(config(tmp_path, **tokens), Metrics()) as srv:
        url = f"http://127.0.0.1:{srv.metrics_port}/status"
        for presented in (None, "wrong", *({"lrn"} - {needed})):
            headers = {"Authorization": f"Bearer {presented}"} if presented else {}
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
            assert e.value.code == 401 and "bearer token" in json.loads(e.value.read())["error"]
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {needed}"})
        with urllib.request.urlopen(request, timeout=10) as r:
            assert json.loads(r.read())["server_epoch"] == srv.synchronizer.epoch
        assert "diloco_build_info" in scrape(srv)  # scrapers need no token


def test_status_page_answers_while_metrics_scrapes_go_on(tmp_path: Path) -> None:
    """/status beside /metrics on one port: each path its own content, any other path the
    metrics (as prometheus_client serves them), nothing at all with the metrics port off."""
    with serving(config(tmp_path), Metrics()) as srv:
        status = json.loads(scrape(srv, "/status"))
        text = scrape(srv, "/metrics")
        assert status["initialized"] is False and status["learners"] == []
        assert "diloco_build_info" in text and "diloco_build_info" in scrape(srv, "/")
    with serving(config(tmp_path, metrics_port=-1), Metrics()) as srv:
        assert srv.metrics_port is None


# The learner ------------------------------------------------------------------------------------


class Stats:
    """A learner's stats as `Learner.stats` gives them: a fresh snapshot per call."""

    def __init__(self) -> None:
        self.step, self.compute_s = 0, 0.0

    def __call__(self) -> Any:
        from learner.learner import LearnerStats

        return LearnerStats(
            learner_id="l-0",
            step=self.step,
            tokens=self.step * 64,
            tokens_per_s=640.0,
            loss=1.5,
            compute_s=self.compute_s,
            blocked_s=0.0,
            bytes_sent=0,
            bytes_received=0,
            pushes={},
            pulls=0,
            merges=0,
            errors=0,
            fragment_versions=(0,),
            sync_every=10,
            sync_state="idle",
            step_time_s=0.1 if self.step else None,
        )


def test_two_scrapers_of_one_learner_see_the_same_values() -> None:
    """Nothing is remembered between scrapes: a second Prometheus scraping the same learner
    does not change what the first one sees (step time came from the previous scrape once)."""
    stats = Stats()
    port, stop = start_learner_metrics(stats, 0)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        stats.step, stats.compute_s = 100, 10.0
        first = samples(get(url))
        stats.step, stats.compute_s = 110, 11.0
        a, b = samples(get(url)), samples(get(url))
    finally:
        stop()
    assert a == b
    assert first[("diloco_learner_step_seconds", ())] == a[("diloco_learner_step_seconds", ())]
    assert a[("diloco_learner_steps_total", ())] == 110
    assert a[("diloco_learner_compute_seconds_total", ())] == 11.0
    assert a[("diloco_learner_build_info", (("version", version()),))] == 1
    assert all(name.startswith("diloco_learner_") for name, _ in a)


def test_learner_metrics_join_a_registry_the_caller_passes_in_and_leave_it_on_close(
    tmp_path: Path,
) -> None:
    registry = CollectorRegistry()
    with serving(config(tmp_path, metrics_port=-1), Metrics()) as srv:
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        lrn = Learner(model, opt, synchronizer=srv.address, fragments=1, metrics_registry=registry)
        try:
            assert lrn.metrics_port is None  # metrics_port -1: the caller's exporter serves it
            for _ in range(3):
                model(torch.randn(2, 8)).square().mean().backward()
                lrn.step(tokens=16)
                opt.zero_grad()
            assert registry.get_sample_value("diloco_learner_steps_total") == 3
            assert registry.get_sample_value("diloco_learner_tokens_total") == 48
            assert (registry.get_sample_value("diloco_learner_step_seconds") or 0) > 0
        finally:
            lrn.close()
        assert registry.get_sample_value("diloco_learner_steps_total") is None
    # Taken out again: the next learner in this process can use the same registry.
    unregister = register_learner_metrics(Stats(), registry)
    unregister()


def test_learner_metrics_port_in_use_is_an_oserror_and_leaves_the_registry_as_it_was() -> None:
    registry = CollectorRegistry()
    port, stop = start_learner_metrics(Stats(), 0)
    try:
        with pytest.raises(OSError):
            start_learner_metrics(Stats(), port, registry=registry)
    finally:
        stop()
    assert list(registry.collect()) == []


def test_stopping_the_synchronizer_closes_its_metrics_port(tmp_path: Path) -> None:
    with serving(config(tmp_path), Metrics()) as srv:
        port = srv.metrics_port
    with pytest.raises(urllib.error.URLError):
        get(f"http://127.0.0.1:{port}/status")
