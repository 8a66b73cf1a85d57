"""A learner's optional Prometheus endpoint: progress and sync traffic, read at scrape time.

`start_learner_metrics(lambda: learner.stats, port)` serves `/metrics` from a background HTTP
thread. Nothing runs in the training loop: each scrape calls `stats_fn()` once and turns that
snapshot (a `LearnerStats`, or any object with the same fields) into samples. Names are prefixed
`diloco_learner_`, in base units; the learner's identity comes from the scrape target (the
`instance` label), never from a label here.

Scrapes change nothing: every value is the snapshot's, so any number of Prometheus servers may
scrape one learner. Step time over a window is `rate(diloco_learner_compute_seconds_total)` /
`rate(diloco_learner_steps_total)`; `diloco_learner_step_seconds` is the learner's own moving
average (the one its heartbeats report).

`register_learner_metrics(stats_fn, registry)` adds the same families to a registry of the
caller's (the process's global `prometheus_client.REGISTRY`, served by their own exporter);
`start_learner_metrics(..., registry=...)` serves that registry.

`diloco_learner_sync_blocked_seconds_total` is this learner's own time blocked on sync. The
Synchronizer exports the fleet-wide sum of the same quantity (reported in heartbeats) as
`diloco_learner_blocked_seconds_total`; the names differ so that summing one never double-counts
the other (and so the learner's build information is `diloco_learner_build_info`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protos import exposition
from protos.version import version

logger = logging.getLogger(__name__)


class LearnerCollector(Collector):
    """Turns one `stats_fn()` snapshot per scrape into the `diloco_learner_*` families."""

    def __init__(self, stats_fn: Callable[[], Any]) -> None:
        self.stats_fn = stats_fn

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self.stats_fn())

    def _families(self, s: Any) -> Iterator[Metric]:
        """The families with one snapshot's values, or empty ones (for describe) when s is None."""

        def value(field: str) -> float | None:
            return None if s is None else float(getattr(s, field))

        info = GaugeMetricFamily(
            "diloco_learner_build_info",
            "1, labelled with the running decoupled-diloco version.",
            labels=["version"],
        )
        if s is not None:
            info.add_metric([version()], 1)
        yield info

        yield CounterMetricFamily(
            "diloco_learner_steps", "Inner optimizer steps taken.", value=value("step")
        )
        yield CounterMetricFamily(
            "diloco_learner_tokens", "Tokens trained on.", value=value("tokens")
        )
        yield CounterMetricFamily(
            "diloco_learner_compute_seconds",
            "Seconds spent in inner steps.",
            value=value("compute_s"),
        )
        step_s = GaugeMetricFamily(
            "diloco_learner_step_seconds",
            "Moving average of compute seconds per inner step over about the last 10 steps, as "
            "heartbeats report it (absent before the first step); rate(compute_seconds_total) / "
            "rate(steps_total) is the mean over any window.",
        )
        if s is not None and getattr(s, "step_time_s", None) is not None:
            step_s.add_metric([], float(s.step_time_s))
        yield step_s
        yield GaugeMetricFamily(
            "diloco_learner_tokens_per_second",
            "Recent training throughput.",
            value=value("tokens_per_s"),
        )
        loss = GaugeMetricFamily(
            "diloco_learner_loss", "Most recent training loss (absent before the first step)."
        )
        if s is not None and s.loss is not None:
            loss.add_metric([], float(s.loss))
        yield loss
        yield CounterMetricFamily(
            "diloco_learner_sync_blocked_seconds",
            "Seconds this learner's training loop waited on synchronization.",
            value=value("blocked_s"),
        )
        yield CounterMetricFamily(
            "diloco_learner_sent_bytes",
            "Payload bytes sent to the Synchronizer.",
            value=value("bytes_sent"),
        )
        yield CounterMetricFamily(
            "diloco_learner_received_bytes",
            "Payload bytes received from the Synchronizer.",
            value=value("bytes_received"),
        )
        pushes = CounterMetricFamily(
            "diloco_learner_pushes", "Fragment pushes by outcome.", labels=["outcome"]
        )
        for outcome, n in sorted(s.pushes.items()) if s is not None else ():
            pushes.add_metric([outcome], n)
        yield pushes
        yield CounterMetricFamily(
            "diloco_learner_sync_errors",
            "Failed sync RPCs (each was retried or superseded).",
            value=value("errors"),
        )


def register_learner_metrics(
    stats_fn: Callable[[], Any], registry: CollectorRegistry
) -> Callable[[], None]:
    """Adds the `diloco_learner_*` families, read from `stats_fn()` at each scrape, to
    `registry`; returns the function that takes them out again. Raises ValueError if the
    registry holds them already (one learner per registry)."""
    collector = LearnerCollector(stats_fn)
    registry.register(collector)
    return lambda: registry.unregister(collector)


def start_learner_metrics(
    stats_fn: Callable[[], Any],
    port: int,
    host: str = "127.0.0.1",
    registry: CollectorRegistry | None = None,
) -> tuple[int, Callable[[], None]]:
    """Serves `/metrics` on host:port (0 picks a free port); returns the bound port and a stop function.

    `stats_fn` is called once per scrape, on the HTTP server's thread; it must be cheap and
    thread-safe (`lambda: learner.stats` is both). `registry`: where the families are added and
    what is served (default: a registry of their own); stop takes them out again. Raises
    OSError if the port cannot be bound.
    """
    registry = registry if registry is not None else CollectorRegistry()
    unregister = register_learner_metrics(stats_fn, registry)
    try:
        httpd, thread = exposition.serve(port, host, registry)
    except BaseException:
        unregister()
        raise
    bound = int(httpd.server_port)
    logger.info("learner metrics on http://%s:%d/metrics", host, bound)

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
        unregister()

    return bound, stop
