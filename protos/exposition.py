"""How both programs serve Prometheus metrics over HTTP: `/metrics` without `_created` samples,
beside small JSON pages (the Synchronizer's `/status`).

prometheus_client exports a `<name>_created` series next to every counter and histogram (and
each of their label sets): twice the series for a timestamp nobody graphs, and a `sum()` over a
family's samples that mixes values with start times. They are left out here, per exposition
and without touching prometheus_client's process-wide switch, so a registry a user passes in
(their own metrics included) is served the same way and their other exporters are unaffected.
"""

from __future__ import annotations

import hmac
import json
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

Page = Callable[[], Any]  # a JSON page's content, computed per request


class WithoutCreated(Collector):
    """A registry's families as they are, less their `_created` samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield out


def exposed(registry: CollectorRegistry) -> CollectorRegistry:
    """The registry that `/metrics` serves for `registry`: the same samples but `_created`."""
    view = CollectorRegistry(auto_describe=False)
    view.register(WithoutCreated(registry))
    return view


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # one line per scrape on stderr is noise


def serve(
    port: int,
    host: str,
    registry: CollectorRegistry,
    pages: dict[str, Page] | None = None,
    pages_token: str | None = None,
) -> tuple[ThreadingWSGIServer, threading.Thread]:
    """Serves `registry` on host:port (0 picks a free port) from a daemon thread: each path in
    `pages` as the JSON of its function's result, every other path as `/metrics`. With
    `pages_token`, a page needs `Authorization: Bearer TOKEN` (401 without it); `/metrics`
    stays open to scrapers. Returns the server (`server_port`, `shutdown()`, `server_close()`)
    and its thread. Raises OSError if the port cannot be bound."""
    metrics_app = make_wsgi_app(exposed(registry))
    pages = dict(pages or {})
    expected = f"Bearer {pages_token}".encode() if pages_token else None

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        page = pages.get(environ.get("PATH_INFO", "/"))
        if page is None:
            return metrics_app(environ, start_response)  # type: ignore[no-any-return]
        presented = environ.get("HTTP_AUTHORIZATION", "").encode()
        status, extra = "200 OK", []
        if expected is None or hmac.compare_digest(presented, expected):
            content = page()
        else:
            status, extra = "401 Unauthorized", [("WWW-Authenticate", "Bearer")]
            content = {
                "error": "missing or wrong bearer token (header 'Authorization: Bearer TOKEN')"
            }
        body = json.dumps(content, indent=2).encode() + b"\n"
        length = ("Content-Length", str(len(body)))
        start_response(status, [("Content-Type", "application/json"), length, *extra])
        return [body]

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family

    httpd = make_server(host, port, app, Server, handler_class=_Quiet)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return httpd, thread
