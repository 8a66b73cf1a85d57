"""A learner's optional Prometheus endpoint: progress and sync traffic, read at scrape time.

`start_learner_metrics(lambda: learner.stats, port)` serves `/metrics` from a background HTTP
thread. Nothing runs in the training loop: each scrape calls `stats_fn()` once and turns that
snapshot (a `LearnerStats`, or any object with the same fields) into samples. Names are prefixed
`diloco_learner_`, in base units; the learner's identity comes from the scrape target (the
`instance` label), never from a label here.

`diloco_learner_sync_blocked_seconds_total` is this learner's own time blocked on sync. The
Synchronizer exports the fleet-wide sum of the same quantity (reported in heartbeats) as
`diloco_learner_blocked_seconds_total`; the names differ so that summing one never double-counts
the other.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)


class LearnerCollector(Collector):
    """Turns one `stats_fn()` snapshot per scrape into the `diloco_learner_*` families."""

    def __init__(self, stats_fn: Callable[[], Any]) -> None:
        self.stats_fn = stats_fn
        self._lock = threading.Lock()
        self._last: tuple[int, float] | None = None  # (step, compute_s) at the previous scrape
        self._step_s = math.nan

    def _step_seconds(self, step: int, compute_s: float) -> float:
        """Mean compute seconds per inner step since the previous scrape (lifetime mean at first)."""
        with self._lock:
            prev_step, prev_compute = self._last if self._last is not None else (0, 0.0)
            if step > prev_step:
                self._step_s = (compute_s - prev_compute) / (step - prev_step)
            elif step < prev_step:  # a restarted learner feeding the same endpoint
                self._step_s = math.nan
            self._last = (step, compute_s)
            return self._step_s

    def describe(self) -> Iterator[Metric]:
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self.stats_fn())

    def _families(self, s: Any) -> Iterator[Metric]:
        """The families with one snapshot's values, or empty ones (for describe) when s is None."""

        def value(field: str) -> float | None:
            return None if s is None else float(getattr(s, field))

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
        yield GaugeMetricFamily(
            "diloco_learner_step_seconds",
            "Mean compute seconds per inner step since the previous scrape.",
            value=None if s is None else self._step_seconds(s.step, s.compute_s),
        )
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


def start_learner_metrics(
    stats_fn: Callable[[], Any],
    port: int,
    host: str = "127.0.0.1",
    registry: CollectorRegistry | None = None,
) -> tuple[int, Callable[[], None]]:
    """Serves `/metrics` on host:port (0 picks a free port); returns the bound port and a stop function.

    `stats_fn` is called once per scrape, on the HTTP server's thread; it must be cheap and
    thread-safe (`lambda: learner.stats` is both). Raises OSError if the port cannot be bound.
    """
    registry = registry if registry is not None else CollectorRegistry()
    registry.register(LearnerCollector(stats_fn))
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    bound = int(httpd.server_port)
    logger.info("learner metrics on http://%s:%d/metrics", host, bound)

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)

    return bound, stop
