"""Refusals: the one exception the Synchronizer raises to turn a request away.

`Rejected(code, reason, message)`: `code` names the gRPC status the servicer answers with (`Code`
mirrors the status codes the Synchronizer uses, so nothing below the servicer imports grpc),
`reason` is the low-cardinality label of `diloco_rejected_requests_total`, and `message` tells the
caller what was wrong and what to do. A refused request leaves the global model bit-for-bit
unchanged.
"""

from __future__ import annotations

import enum


class Code(enum.Enum):
    """The gRPC status codes a refusal can carry (same names as `grpc.StatusCode`)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    ABORTED = "ABORTED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAUTHENTICATED = "UNAUTHENTICATED"


class Rejected(Exception):
    def __init__(self, code: Code, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def invalid(reason: str, message: str) -> Rejected:
    return Rejected(Code.INVALID_ARGUMENT, reason, message)
