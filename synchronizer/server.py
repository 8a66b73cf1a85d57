"""Running the Synchronizer: the gRPC server with health, reflection, auth and limits (every
call waits for its first message in a bounded place, `FirstMessageInterceptor`).

`serving(config)` is a context manager that starts everything (port 0 picks a free port) and
yields a `RunningServer` with the bound addresses; leaving it shuts down in the documented order:
health NOT_SERVING, stop accepting RPCs (in-flight ones get `shutdown_grace_s`), merge every
acknowledged contribution, final checkpoint. `serve(config)` runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos import diloco_pb2 as pb
from protos import exposition
from synchronizer.cli_status import status_json
from synchronizer.config import SynchronizerConfig
from synchronizer.core import Synchronizer
from synchronizer.disk import Disk
from synchronizer.health import SERVICE_NAME as HEALTH_SERVICE
from synchronizer.health import HealthServicer
from synchronizer.metrics import Metrics
from synchronizer.service import SynchronizerService
from synchronizer.streams import FirstMessages

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Synchronizer"].full_name
REFLECTION = "/grpc.reflection."
OPEN_METHODS = ("/grpc.health.v1.Health/", REFLECTION)  # probes carry no token


ADMIN_METHODS = (f"/{SERVICE_NAME}/Status",)


def _abort_handler(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call."""

    def deny(request: Any, context: grpc.ServicerContext) -> None:
        context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Checks `authorization: Bearer T` on every RPC but health and reflection.

    Learner RPCs accept a learner token (the shared one, or any of the per-learner tokens) or
    the admin token; admin RPCs need the admin token when one is configured: a valid learner
    token there gets PERMISSION_DENIED, no or a wrong token UNAUTHENTICATED.
    """

    def __init__(self, tokens: Iterable[str], admin_token: str | None) -> None:
        self.learners = {f"Bearer {t}" for t in tokens}
        self.admin = f"Bearer {admin_token}" if admin_token else None

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = details.method  # type: ignore[attr-defined]
        if method.startswith(OPEN_METHODS):
            return continuation(details)
        presented = dict(details.invocation_metadata or ()).get("authorization")  # type: ignore[attr-defined]
        known = self.learners | ({self.admin} if self.admin else set())
        if method in ADMIN_METHODS and self.admin:
            if presented == self.admin:
                return continuation(details)
            handler = continuation(details)
            if presented in known:
                return _abort_handler(
                    handler,
                    grpc.StatusCode.PERMISSION_DENIED,
                    "this RPC needs the admin token, not a learner token",
                )
            return _abort_handler(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token (metadata 'authorization: Bearer TOKEN')",
            )
        if not self.learners or presented in known:
            return continuation(details)
        return _abort_handler(
            continuation(details),
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong bearer token (metadata 'authorization: Bearer TOKEN')",
        )


_NOTHING = object()  # a request stream that ended before its first message


def _first_message_first(
    handler: grpc.RpcMethodHandler, method: str, gate: FirstMessages
) -> grpc.RpcMethodHandler:
    """`handler` as a request-streaming handler (the same on the wire) that waits for the
    call's first message in `gate`, then hands it to the real behaviour."""

    def first(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        with gate.waiting(context.peer(), method, context.cancel):
            head = next(requests, _NOTHING)
        if head is _NOTHING and not context.is_active():
            # Cut, or gone: the stream can end before the call reads as cancelled. The call is
            # over, so this answers nobody; it ends the handler without an error logged.
            context.abort(grpc.StatusCode.CANCELLED, "the call ended before its first message")
        return head

    behavior: Callable[..., Any]
    wrapped: Callable[..., Any]
    if handler.request_streaming:
        behavior = handler.stream_stream if handler.response_streaming else handler.stream_unary

        def wrapped(requests: Iterator[Any], context: grpc.ServicerContext, *more: Any) -> Any:
            head = first(requests, context)
            rest = requests if head is _NOTHING else itertools.chain((head,), requests)
            return behavior(rest, context, *more)

    else:
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary

        def wrapped(requests: Iterator[Any], context: grpc.ServicerContext, *more: Any) -> Any:
            head = first(requests, context)
            if head is _NOTHING:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{method} takes exactly one request message; the call ended without one",
                )
            return behavior(head, context, *more)

    # A non-blocking behaviour (health's Watch) stays non-blocking: it answers through the
    # callback gRPC passes (`more`), and holds no worker while it waits for changes.
    for attr in ("experimental_non_blocking", "experimental_thread_pool"):
        if hasattr(behavior, attr):
            setattr(wrapped, attr, getattr(behavior, attr))
    make = (
        grpc.stream_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.stream_unary_rpc_method_handler
    )
    return make(wrapped, handler.request_deserializer, handler.response_serializer)


def _held_for_the_whole_call(
    handler: grpc.RpcMethodHandler, method: str, gate: FirstMessages
) -> grpc.RpcMethodHandler:
    """A stream-stream `handler` whose call keeps its place in `gate` until it ends: reflection
    answers for as long as its stream stays open, holding a worker and naming no one, so an open
    one is bounded, displaced and cut like a call that has sent nothing."""
    behavior = handler.stream_stream

    def wrapped(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        with gate.waiting(context.peer(), method, context.cancel):
            yield from behavior(requests, context)

    return grpc.stream_stream_rpc_method_handler(
        wrapped, handler.request_deserializer, handler.response_serializer
    )


class FirstMessageInterceptor(grpc.ServerInterceptor):
    """Holds every call, of every service, in `FirstMessages` until its first request message
    arrives, so a call that sends nothing holds one bounded, displaceable place there and
    nothing else: no transfer slot, no learner's count, no worker beyond that place. gRPC would
    otherwise read a unary request on a worker before any handler runs, with no deadline but
    the client's; here the handler reads it, and the real handler gets it. Reflection streams,
    which never name a learner, keep their place until they end."""

    def __init__(self, gate: FirstMessages) -> None:
        self.gate = gate

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:
            return None
        method: str = details.method  # type: ignore[attr-defined]
        if method.startswith(REFLECTION) and handler.stream_stream is not None:
            return _held_for_the_whole_call(handler, method, self.gate)
        return _first_message_first(handler, method, self.gate)


@dataclass
class RunningServer:
    server: grpc.Server
    synchronizer: Synchronizer
    health: HealthServicer
    port: int
    metrics_port: int | None
    host: str
    metrics_httpd: Any = None

    @property
    def address(self) -> str:
        host = self.host
        if host in ("0.0.0.0", "", "[::]", "::"):
            host = "127.0.0.1"
        return f"{host}:{self.port}"


def _credentials(cfg: SynchronizerConfig) -> grpc.ServerCredentials | None:
    if cfg.tls_cert is None or cfg.tls_key is None:
        return None
    key, cert = cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes()
    ca = cfg.tls_client_ca.read_bytes() if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def _not_serving(servicer: HealthServicer, reason: str) -> None:
    logger.error("health is NOT_SERVING: %s", reason)
    for name in ("", SERVICE_NAME):
        servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def start(
    cfg: SynchronizerConfig, metrics: Metrics | None = None, disk: Disk | None = None
) -> RunningServer:
    """Starts the service; raises OSError if a port cannot be bound. `disk`: the write-ahead
    log's file operations (tests inject faults there)."""
    metrics = metrics or Metrics()
    core = Synchronizer(cfg, metrics, disk).start()
    # The first-message gate is outermost: a call refused for its token still waits for its
    # first message (gRPC reads a unary request before any handler) in a bounded place.
    interceptors: list[grpc.ServerInterceptor] = [
        FirstMessageInterceptor(core.streams.first_messages)
    ]
    learner_tokens = list(core.credentials.tokens) or ([cfg.auth_token] if cfg.auth_token else [])
    if learner_tokens or cfg.admin_token:
        interceptors.append(BearerTokenInterceptor(learner_tokens, cfg.admin_token))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=cfg.max_workers, thread_name_prefix="grpc"),
        interceptors=interceptors,
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.max_concurrent_streams", cfg.max_workers),  # per connection
        ],
    )
    handlers = SynchronizerService(core).handlers()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, HEALTH_SERVICE, reflection.SERVICE_NAME), server
    )
    bind = f"{cfg.host}:{cfg.port}"
    creds = _credentials(cfg)
    port = server.add_secure_port(bind, creds) if creds else server.add_insecure_port(bind)
    if port == 0:
        core.close()
        raise OSError(
            f"could not bind the gRPC port {bind} (in use, or not an address of this host)"
        )
    metrics_port, httpd = None, None
    if cfg.metrics_port >= 0:
        # /status: what `diloco-synchronizer status --json` prints, behind the token the Status
        # RPC asks for (the admin token, else the learner token, else none).
        httpd, _ = exposition.serve(
            cfg.metrics_port,
            cfg.metrics_host,
            metrics.registry,
            {"/status": lambda: status_json(core.status())},
            cfg.admin_token or cfg.auth_token,
        )
        metrics_port = httpd.server_port
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    core.model.health_listeners.append(lambda reason: _not_serving(health_servicer, reason))
    (logger.info if core.credentials.per_learner else logger.warning)(
        "learner credentials: %s%s",
        core.credentials.describe(),
        f"; at most {cfg.max_learners_per_credential} live learners and their streams per credential"
        if core.credentials.per_learner
        else "; use learner_tokens_file or client_cert_credentials where learners are not trusted",
    )
    logger.info(
        "Synchronizer serving gRPC on %s:%d, metrics on %s (epoch %s)",
        cfg.host,
        port,
        f"{cfg.metrics_host}:{metrics_port}" if metrics_port is not None else "nothing",
        core.epoch,
    )
    return RunningServer(server, core, health_servicer, port, metrics_port, cfg.host, httpd)


WATCHERS_TOLD_S = 2.0  # longest the shutdown waits to tell health watchers NOT_SERVING


def _not_serving_for_shutdown(servicer: HealthServicer) -> None:
    """Health NOT_SERVING, sent to every open Watch stream, waiting at most WATCHERS_TOLD_S: a
    watch whose client stopped reading can block that send (or fail it inside gRPC) until the
    server stops, which ends every call; the watchers then see the server go away instead."""

    def tell() -> None:
        try:
            servicer.enter_graceful_shutdown()
        except RuntimeError as e:
            logger.warning("health NOT_SERVING not sent to every watcher: %s", e)

    told = threading.Thread(target=tell, name="health-shutdown", daemon=True)
    told.start()
    told.join(WATCHERS_TOLD_S)
    if told.is_alive():
        logger.warning(
            "health watchers not told NOT_SERVING within %.0f s: stopping anyway", WATCHERS_TOLD_S
        )


def stop(running: RunningServer, grace_s: float) -> bool:
    """Health NOT_SERVING, stop RPCs within grace, merge acknowledged work, checkpoint. True if
    nothing acknowledged is lost: the final checkpoint was written, or it could not be and the
    write-ahead log holds what it would have saved (the next start replays it). Either way the log
    says what was not saved."""
    _not_serving_for_shutdown(running.health)
    running.server.stop(grace_s).wait()
    core = running.synchronizer
    saved = core.close()
    if running.metrics_httpd is not None:
        running.metrics_httpd.shutdown()
        running.metrics_httpd.server_close()
    if saved:
        logger.info("Synchronizer stopped")
        return True
    why = core.state.failure or core.unhealthy or "see the errors above"
    unsaved = core.state.unsaved() or "no version"
    if core.journal.holds_everything:
        logger.error(
            "Synchronizer stopped without its final checkpoint (%s): %s are not in a checkpoint; "
            "the write-ahead log holds them and the next start replays them, so nothing "
            "acknowledged is lost",
            why,
            unsaved,
        )
        return True
    logger.error(
        "Synchronizer stopped without its final checkpoint (%s): %s, acknowledged since the "
        "newest checkpoint on disk, are lost (no write-ahead log holds them)",
        why,
        unsaved,
    )
    return False


@contextlib.contextmanager
def serving(cfg: SynchronizerConfig, metrics: Metrics | None = None) -> Iterator[RunningServer]:
    running = start(cfg, metrics)
    try:
        yield running
    finally:
        stop(running, cfg.shutdown_grace_s)


class StopSignals:
    """SIGTERM and SIGINT as an awaitable stop request, whichever thread the kernel gives them to.

    The kernel may deliver a process's signal to any of its threads (gRPC's, torch's). Python
    then runs the handler only when the main thread next executes bytecode, and a main thread
    blocked in a lock (`Event.wait()`) never does: the process would not stop until SIGKILL,
    without its final checkpoint. The C-level handler also writes the signal's number to the
    wake-up fd (`signal.set_wakeup_fd`) from whichever thread caught it, and `wait` blocks on the
    other end of that socket, so the main thread wakes in every case. Install in the main thread,
    before the threads are started; `close` restores what was there."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        pass  # the wake-up fd carries the signal: this only replaces the default (exit) action

    def wait(self) -> str:
        """Blocks until SIGTERM or SIGINT arrives (at once if one came since `__init__`) and
        returns its name."""
        while True:
            for number in self._read.recv(64):
                if number in self.SIGNALS:
                    return signal.Signals(number).name

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._read.close()
        self._write.close()


def serve(cfg: SynchronizerConfig, on_ready: Callable[[RunningServer], None] | None = None) -> bool:
    """Runs until SIGTERM or SIGINT, then shuts down cleanly; False if acknowledged work is lost
    (the final checkpoint could not be written and no write-ahead log holds it). Owns the
    process: sets its signal handlers and torch's thread count (`compute_threads`)."""
    torch.set_num_threads(cfg.compute_threads)
    stop_signals = StopSignals()  # before start(): a signal during start-up stops it at ready
    try:
        running = start(cfg)
        try:
            if on_ready is not None:
                on_ready(running)
            logger.info(
                "%s: shutting down (grace %.1fs)", stop_signals.wait(), cfg.shutdown_grace_s
            )
        except BaseException:
            stop(running, cfg.shutdown_grace_s)
            raise
        return stop(running, cfg.shutdown_grace_s)
    finally:
        stop_signals.close()
