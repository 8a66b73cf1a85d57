"""The gRPC health service (grpc.health.v1), with Watch streams that cannot deadlock the server.

grpcio-health-checking's servicer sends each status to its Watch streams while holding the lock
that a closing Watch's callback also takes. gRPC's synchronous server runs those callbacks on
its one polling thread and a send waits for that same thread to report it done, so a status set
while any watch is closing stops the server for good: nothing is answered, and `stop()` never
returns. Here the registry lock only guards the set of watchers and is never held across a
send; a second lock, which no gRPC callback takes, keeps the statuses in order."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

Send = Callable[[Any], Any]
Status = int

SERVICE_NAME = "grpc.health.v1.Health"


class HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self._lock = threading.Lock()  # the statuses and watchers: never held across a send
        self._sending = threading.Lock()  # orders sends; gRPC's own callbacks never take it
        self._status: dict[str, Status] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._watchers: dict[str, set[Send]] = {}
        self._shutting_down = False

    def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(  # type: ignore[override]
        self,
        request: health_pb2.HealthCheckRequest,
        context: grpc.ServicerContext,
        send_response_callback: Send,
    ) -> None:
        """Answers through `send_response_callback` (gRPC passes it to a non-blocking behaviour),
        so a watch holds no worker while it waits for a change."""
        service = request.service
        with self._sending:
            with self._lock:
                status = self._status.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                self._watchers.setdefault(service, set()).add(send_response_callback)
            send_response_callback(health_pb2.HealthCheckResponse(status=status))
        context.add_callback(lambda: self._closed(service, send_response_callback))

    Watch.experimental_non_blocking = True  # type: ignore[attr-defined]
    Watch.experimental_thread_pool = None  # type: ignore[attr-defined]

    def _closed(self, service: str, send: Send) -> None:
        # Runs on gRPC's polling thread: it takes only the registry lock, held by nobody who
        # waits on gRPC.
        with self._lock:
            self._watchers.get(service, set()).discard(send)
        send(None)  # ends the call with its status (nothing, if the client already went away)

    def watching(self, service: str) -> int:
        """How many Watch streams on `service` are open."""
        with self._lock:
            return len(self._watchers.get(service, ()))

    def set(self, service: str, status: Status) -> None:
        """Sets `service`'s status and tells its watchers; ignored once shutting down."""
        with self._sending:
            with self._lock:
                if self._shutting_down:
                    return
                self._status[service] = status
                watchers = list(self._watchers.get(service, ()))
            self._tell(watchers, status)

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING, for good: later `set` calls are ignored."""
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        with self._sending:
            with self._lock:
                if self._shutting_down:
                    return
                self._shutting_down = True
                for service in self._status:
                    self._status[service] = not_serving
                watchers = [w for s in self._status for w in self._watchers.get(s, ())]
            self._tell(watchers, not_serving)

    @staticmethod
    def _tell(watchers: list[Send], status: Status) -> None:
        # A send to a watch that has ended returns at once; one to a live watch returns when
        # gRPC has taken the message.
        for send in watchers:
            send(health_pb2.HealthCheckResponse(status=status))
