"""The gRPC servicer: translates RPCs into calls on the `Synchronizer` core, and refusals into
status codes.

Nothing here decides anything: each RPC forwards its request (or request stream) to the core.
A `Rejected` becomes `context.abort` with its code and message and is counted in
`diloco_rejected_requests_total`; a client that goes away mid-stream is counted as CANCELLED;
every RPC is counted by method and status code. `handlers` is the table the server registers,
with PushFragment's chunks read without copies (`synchronizer.wire`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import grpc

from protos import diloco_pb2 as pb
from synchronizer import wire
from synchronizer.core import Synchronizer
from synchronizer.credentials import SHARED, Credentials
from synchronizer.errors import Rejected
from synchronizer.streams import Call

logger = logging.getLogger(__name__)
CANCEL_HEARD_S = 1.0  # a push stream that ended short waits this long to hear of a cancel


def _went_away(context: grpc.ServicerContext) -> bool:
    """Whether a request stream that ended short was the client going away: a cancelled call
    can end its request stream before the handler hears of the cancellation, so wait up to
    CANCEL_HEARD_S for it."""
    ended = threading.Event()
    if not context.add_callback(ended.set):
        return True  # already terminated
    ended.wait(CANCEL_HEARD_S)
    return not context.is_active()


def _call(context: grpc.ServicerContext, credentials: Credentials) -> Call:
    """The call as the core sees it; Rejected (UNAUTHENTICATED) without a credential where each
    learner needs its own."""
    credential = SHARED
    if credentials.per_learner:
        presented = dict(context.invocation_metadata() or ()).get("authorization", "")
        token = presented[len("Bearer ") :] if presented.startswith("Bearer ") else None
        auth = context.auth_context()
        named = [*auth.get("x509_common_name", ()), *(context.peer_identities() or ())]
        identities = [i.decode(errors="replace") for i in named]
        credential = credentials.of_call(token, identities)
    return Call(cancel=context.cancel, on_end=context.add_callback, credential=credential)


class SynchronizerService:
    def __init__(self, core: Synchronizer) -> None:
        self.core = core
        self.metrics = core.metrics

    def _went_away(self, method: str) -> None:
        """Counts and logs a call its client left (or that was cut) before it completed."""
        self.metrics.rpcs.labels(method, "CANCELLED").inc()
        logger.warning(
            "%s: the client went away before the call completed; nothing of it was applied",
            method,
        )

    def _finish(
        self, method: str, context: grpc.ServicerContext, exc: BaseException | None
    ) -> NoReturn | None:
        if isinstance(exc, Rejected) and exc.reason == "incomplete" and _went_away(context):
            # A cancelled upload (the client gone, or the stream cut for idling) ends its request
            # stream as if short: end the call as cancelled. Aborting, not raising, because an
            # exception gRPC did not raise itself is logged by gRPC with a traceback.
            self._went_away(method)
            context.abort(grpc.StatusCode.CANCELLED, "the call ended before its payload did")
        if isinstance(exc, Rejected):
            self.metrics.rejections.labels(exc.code.name, exc.reason).inc()
            self.metrics.rpcs.labels(method, exc.code.name).inc()
            if method == "PushFragment":
                self.metrics.pushes.labels("rejected").inc()
            logger.info("%s refused (%s): %s", method, exc.code.name, exc.message)
            context.abort(grpc.StatusCode[exc.code.name], exc.message)
        if isinstance(exc, grpc.RpcError | GeneratorExit):
            # Raised by a request stream whose client went away mid-call (killed, cancelled,
            # timed out; the service makes no calls of its own), or thrown into a reply stream
            # gRPC stopped reading: expected, and nothing of a half-received push was applied.
            self._went_away(method)
            raise exc
        if exc is not None:
            code = (
                context.code()
                if hasattr(context, "code") and context.code() is not None
                else grpc.StatusCode.UNKNOWN
            )
            self.metrics.rpcs.labels(method, getattr(code, "name", "UNKNOWN")).inc()
            if not isinstance(exc, Exception) or code == grpc.StatusCode.UNKNOWN:
                logger.exception("%s failed", method, exc_info=exc)
            raise exc
        self.metrics.rpcs.labels(method, "OK").inc()
        return None

    def unary(
        self, method: str, call: Callable[..., Any], with_call: bool = False
    ) -> Callable[[Any, grpc.ServicerContext], Any]:
        """The handler of a unary-reply method; `with_call` also hands the core the `Call`
        (cancel it, hear when it ends)."""

        def handler(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                reply = (
                    call(request, _call(context, self.core.credentials))
                    if with_call
                    else call(request)
                )
            except BaseException as e:  # noqa: BLE001 - re-raised or aborted by _finish
                self._finish(method, context, e)
            self._finish(method, context, None)
            return reply

        return handler

    def streaming(
        self, method: str, call: Callable[[Any, Call], Iterator[Any]]
    ) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
        def handler(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from call(request, _call(context, self.core.credentials))
            except BaseException as e:  # noqa: BLE001 - re-raised or aborted by _finish
                self._finish(method, context, e)
            self._finish(method, context, None)

        return handler

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """The method handlers of the `diloco.v1.Synchronizer` service."""
        core = self.core
        return {
            "Join": grpc.unary_unary_rpc_method_handler(
                self.unary("Join", core.join, with_call=True),
                pb.JoinRequest.FromString,
                pb.JoinReply.SerializeToString,
            ),
            "InitModel": grpc.stream_unary_rpc_method_handler(
                self.unary("InitModel", core.init_model),
                pb.InitModelRequest.FromString,
                pb.InitModelReply.SerializeToString,
            ),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(
                self.unary("Heartbeat", core.heartbeat),
                pb.HeartbeatRequest.FromString,
                pb.HeartbeatReply.SerializeToString,
            ),
            "PushFragment": grpc.stream_unary_rpc_method_handler(
                self.unary("PushFragment", core.push, with_call=True),
                wire.parse_push_request,
                pb.PushReply.SerializeToString,
            ),
            "PullFragment": grpc.unary_stream_rpc_method_handler(
                self.streaming("PullFragment", core.pull),
                pb.PullRequest.FromString,
                wire.serialize_pull_reply,
            ),
            "Leave": grpc.unary_unary_rpc_method_handler(
                self.unary("Leave", core.leave),
                pb.LeaveRequest.FromString,
                pb.LeaveReply.SerializeToString,
            ),
            "ReportEval": grpc.unary_unary_rpc_method_handler(
                self.unary("ReportEval", core.report_eval),
                pb.EvalReport.FromString,
                pb.EvalReply.SerializeToString,
            ),
            "Status": grpc.unary_unary_rpc_method_handler(
                self.unary("Status", lambda _: core.status()),
                pb.StatusRequest.FromString,
                pb.StatusReply.SerializeToString,
            ),
        }
