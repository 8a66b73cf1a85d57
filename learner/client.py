"""The learner's gRPC transport: one channel to the Synchronizer and one method per RPC.

Owns the channel (opened by `protos.channel`: insecure, TLS or mutual TLS, with the bearer token
sent on every call), deadlines, retries with exponential backoff and jitter on transient status
codes (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED; a bounded number of attempts, then the
`grpc.RpcError` goes to the caller, who decides what to do), and the count of bytes sent and
received (the serialized size of every message, payload chunks included). It knows nothing of
training: payloads come in already encoded, and pulls decode straight into a preallocated FP32
tensor, either from the whole fragment or, given the exact parameters of an earlier version, from
the chain of outer updates since that version (checked by the server's crc32; any mismatch falls
back to a full pull; the stream after its header is read by `learner.pull_stream`). A sharded
Synchronizer is one `SyncClient` per shard under `learner.shards.ShardedClient`; a `SyncClient`
alone is the whole (unsharded) Synchronizer.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import grpc
import torch

from learner import pull_stream
from protos import diloco_pb2 as pb
from protos import diloco_pb2_grpc as pb_grpc
from protos import framing, layout
from protos.channel import bearer, open_channel
from protos.initmodel import init_model_requests
from protos.spec import ModelSpec

if TYPE_CHECKING:
    from learner.session import Push  # session imports this module

logger = logging.getLogger(__name__)

T = TypeVar("T")
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


def is_retryable(err: BaseException) -> bool:
    return isinstance(err, grpc.RpcError) and err.code() in RETRYABLE


def backoff_s(failures: int, initial_s: float, max_s: float) -> float:
    """Exponential backoff with jitter: uniform in [d/2, d], d = min(max, initial * 2**failures)."""
    d = min(max_s, initial_s * (2 ** min(failures, 30)))
    return d * (0.5 + 0.5 * random.random())


class ShardMismatch(ValueError):
    """The Synchronizer's shards are not the ones this learner was configured with (how many,
    which index): a configuration error that no retry mends."""


def check_shards(address: str, expected: int, shards: int, index: int) -> None:
    """ShardMismatch unless the Synchronizer at `address`, shard `index` of `shards` (0 or 1:
    unsharded), is what a learner routing to `expected` shards (0: unsharded) may talk to."""
    if max(shards, 1) == max(expected, 1):
        return
    if expected <= 1:
        raise ShardMismatch(
            f"the Synchronizer at {address} is shard {index} of {shards}, but this learner was "
            f"given only it: give all {shards} shards' addresses (synchronizer='host:port,...', "
            f"any order), or shards={shards} with a name that resolves to every shard"
        )
    raise ShardMismatch(
        f"the Synchronizer at {address} is "
        + (f"one of {shards} shards" if shards > 1 else "not sharded")
        + f", but this learner was given {expected} shards: give exactly one address per shard"
    )


SERVED_KEPT = 100_000  # (epoch, fragment, version) checksums remembered
# The slowest link a whole-model transfer is given time for: 4 GB of FP32 parameters get 4000 s.
MIN_TRANSFER_BPS = 1_000_000


class SyncClient:
    """A thread-safe client of the Synchronizer; `learner_id`/`spec_hash` are set by `join`."""

    def __init__(
        self,
        address: str,
        *,
        rpc_timeout_s: float = 30.0,
        attempts: int = 3,
        retry_initial_s: float = 0.2,
        retry_max_s: float = 10.0,
        auth_token: str | None = None,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        tls_server_name: str | None = None,
        chunk_bytes: int = framing.CHUNK_BYTES,
    ) -> None:
        self.address = address
        self.rpc_timeout_s = rpc_timeout_s
        self.attempts = attempts
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.chunk_bytes = chunk_bytes
        self.metadata = bearer(auth_token)
        self.channel = open_channel(
            address,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_server_name=tls_server_name,
            options=[
                ("grpc.enable_retries", 0),  # retries are ours, with idempotency keys
                # Reconnect no slower than our own retries: gRPC's default backoff grows to
                # 120 s, and a learner that met a restarting Synchronizer a few times in a row
                # would fail fast for minutes after it was back.
                ("grpc.initial_reconnect_backoff_ms", max(50, int(retry_initial_s * 1000))),
                ("grpc.min_reconnect_backoff_ms", max(50, int(retry_initial_s * 1000))),
                ("grpc.max_reconnect_backoff_ms", max(100, int(retry_max_s * 1000))),
            ],
        )
        self.stub = pb_grpc.SynchronizerStub(self.channel)
        self.closed = threading.Event()
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.learner_id = ""
        self.session = ""  # the secret Join gave learner_id: sent with every later call
        # A rank of a sharded island: per fragment, the slice it pushes and pulls (None: whole),
        # and the fragments' whole sizes (a delta's blocks are cut from the whole update's)
        self.slices: Sequence[pb.Slice] | None = None
        self.fragment_numels: Sequence[int] = ()
        # (epoch, fragment, version) -> the checksum the server served it with: one version
        # served with two contents within an epoch is a Synchronizer bug, counted and logged.
        self.served: dict[tuple[str, int, int], int] = {}
        self.version_conflicts = 0
        self.spec_hash = ""

    # Plumbing --------------------------------------------------------------------------------

    def transfer_s(self, nbytes: int) -> float:
        """The deadline of a call that moves `nbytes`: rpc_timeout_s, plus the time those bytes
        take at MIN_TRANSFER_BPS, so a model of any size can be uploaded or pulled whole (a
        stalled stream is cut by the server's stream_idle_s long before)."""
        return self.rpc_timeout_s + nbytes / MIN_TRANSFER_BPS

    def _count(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def _retry(self, name: str, call: Callable[[], T]) -> T:
        """Runs `call` up to `attempts` times while it fails with a transient status code."""
        for attempt in range(self.attempts):
            try:
                return call()
            except grpc.RpcError as e:
                if not is_retryable(e) or attempt + 1 >= self.attempts or self.closed.is_set():
                    raise
                wait = backoff_s(attempt, self.retry_initial_s, self.retry_max_s)
                logger.debug(
                    "%s failed (%s), retry %d in %.2fs", name, e.code().name, attempt + 1, wait
                )
                if self.closed.wait(wait):
                    raise
        raise AssertionError("unreachable")

    def _unary(
        self, name: str, method: Callable[..., T], request: object, timeout_s: float | None = None
    ) -> T:
        def call() -> T:
            self._count(sent=request.ByteSize())  # type: ignore[attr-defined]
            reply = method(request, timeout=timeout_s or self.rpc_timeout_s, metadata=self.metadata)
            self._count(received=reply.ByteSize())  # type: ignore[attr-defined]
            return reply

        return self._retry(name, call)

    def _received(self, msg: pb.PullReply) -> None:
        self._count(received=msg.ByteSize())

    def _counted(self, messages: Iterator[T]) -> Iterator[T]:
        for m in messages:
            self._count(sent=m.ByteSize())  # type: ignore[attr-defined]
            yield m

    def close(self) -> None:
        """Closes the channel; RPCs in flight end with CANCELLED, backoff waits end at once."""
        self.closed.set()
        self.channel.close()

    # RPCs ------------------------------------------------------------------------------------

    def join(
        self,
        name: str,
        spec: ModelSpec,
        learner_id: str = "",
        *,
        shards: int = 0,
        fragment_shards: Sequence[int] = (),
        evaluator: bool = False,
    ) -> pb.JoinReply:
        """Joins as a new learner, or re-joins under `learner_id` with the session it holds.
        `shards` > 0: this is one of that many shards, which own the fragments as
        `fragment_shards` says. ShardMismatch when the Synchronizer's shard count is not
        `shards` (0: unsharded). `evaluator`: join as an evaluator (reports eval loss, never
        pushes, counts as no training learner)."""
        req = pb.JoinRequest(
            learner_name=name,
            spec=spec.to_proto(),
            learner_id=learner_id,
            session=self.session if learner_id else "",
            shards=shards,
            fragment_shards=fragment_shards,
            evaluator=evaluator,
        )
        try:
            reply = self._unary("Join", self.stub.Join, req)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self._explain_refusal(shards)
            raise
        check_shards(self.address, shards, reply.shards, reply.shard_index)
        self.learner_id, self.session = reply.learner_id, reply.session
        self.spec_hash = spec.spec_hash
        return reply

    def _explain_refusal(self, shards: int) -> None:
        """A refused Join: ShardMismatch if that is because this is not the shard count the
        Synchronizer has (its Status says), else nothing (the caller raises the refusal)."""
        try:
            status = self.status()
        except grpc.RpcError:
            return
        check_shards(self.address, shards, status.shards, status.shard_index)

    def shard_of(self, fragment_id: int) -> int:
        """Every fragment is served here: one shard."""
        return 0

    def init_model(
        self, fragments: Sequence[torch.Tensor], fragment_ids: Sequence[int] | None = None
    ) -> pb.InitModelReply:
        """Uploads every fragment's flat FP32 parameters (CPU tensors, in fragment order), or,
        to a shard, the fragments it owns (`fragments[i]` is fragment `fragment_ids[i]`)."""

        def call() -> pb.InitModelReply:
            messages = init_model_requests(
                self.learner_id,
                self.session,
                self.spec_hash,
                fragments,
                self.chunk_bytes,
                fragment_ids,
            )
            nbytes = sum(4 * f.numel() for f in fragments)
            reply = self.stub.InitModel(
                self._counted(messages), timeout=self.transfer_s(nbytes), metadata=self.metadata
            )
            self._count(received=reply.ByteSize())
            return reply

        return self._retry("InitModel", call)

    def heartbeat(
        self,
        counters: pb.LearnerCounters,
        step_time_s: float = 0.0,
        overlap_steps: int = 0,
        pushes_done: bool = False,
    ) -> pb.HeartbeatReply:
        req = pb.HeartbeatRequest(
            learner_id=self.learner_id,
            session=self.session,
            counters=counters,
            step_time_s=step_time_s,
            overlap_steps=overlap_steps,
            pushes_done=pushes_done,
        )
        return self._unary("Heartbeat", self.stub.Heartbeat, req)

    def push(self, push: Push) -> pb.PushReply:
        """Streams one encoded outer gradient (a CPU uint8 tensor); retries keep the seq."""
        push_header = pb.PushHeader(
            learner_id=self.learner_id,
            session=self.session,
            seq=push.seq,
            spec_hash=self.spec_hash,
            fragment_id=push.fragment_id,
            base_version=push.base_version,
            tokens=push.tokens,
            steps=push.steps,
            compute_s=push.compute_s,
            payload=push.header,
        )
        if self.slices is not None:
            push_header.slice.CopyFrom(self.slices[push.fragment_id])

        def messages() -> Iterator[pb.PushRequest]:
            yield pb.PushRequest(header=push_header)
            for chunk in framing.iter_chunks(push.encoded, self.chunk_bytes):
                yield pb.PushRequest(chunk=chunk)

        def call() -> pb.PushReply:
            reply = self.stub.PushFragment(
                self._counted(messages()),
                timeout=self.transfer_s(push.encoded.numel()),
                metadata=self.metadata,
            )
            self._count(received=reply.ByteSize())
            return reply

        return self._retry("PushFragment", call)

    def pull(
        self,
        fragment_id: int,
        min_version: int = 0,
        wait_s: float = 0.0,
        codec_id: int = pb.CODEC_FP32,
        out: torch.Tensor | None = None,
        numel: int | None = None,
        have: tuple[int, torch.Tensor] | None = None,
    ) -> tuple[int, str, torch.Tensor]:
        """(version, server epoch, FP32 flat tensor) of a fragment, waiting up to wait_s for
        min_version. Decodes into `out` (or a new tensor of `numel`).

        `have` = (version, its exact FP32 parameters on the CPU) asks for a delta pull: the
        server may send only the outer updates since that version, which are added in order and
        checked against the server's checksum. Any mismatch falls back to a full pull. A bad
        full payload raises CodecError.
        """
        if have is not None:
            try:
                return self._retry(
                    "PullFragment",
                    lambda: self._pull_once(
                        fragment_id, min_version, wait_s, codec_id, out, numel, have
                    ),
                )
            except layout.CodecError as e:
                logger.info(
                    "delta pull of fragment %d failed (%s); pulling it whole", fragment_id, e
                )
        return self._retry(
            "PullFragment",
            lambda: self._pull_once(fragment_id, min_version, wait_s, codec_id, out, numel, None),
        )

    def _pull_once(
        self,
        fragment_id: int,
        min_version: int,
        wait_s: float,
        codec_id: int,
        out: torch.Tensor | None,
        numel: int | None,
        have: tuple[int, torch.Tensor] | None,
    ) -> tuple[int, str, torch.Tensor]:
        req = pb.PullRequest(
            learner_id=self.learner_id,
            session=self.session,
            fragment_id=fragment_id,
            min_version=min_version,
            wait_s=wait_s,
            codec=codec_id,  # type: ignore[arg-type]
            delta_ok=have is not None,
            have_version=have[0] if have is not None else 0,
        )
        runs = None
        if self.slices is not None:  # only this rank's runs (a delta: the blocks holding them)
            s = self.slices[fragment_id]
            req.slice.CopyFrom(s)
            runs = list(zip(s.starts, s.lengths, strict=True))
        self._count(sent=req.ByteSize())
        full = 4 * (numel if numel is not None else out.numel() if out is not None else 0)
        stream = self.stub.PullFragment(
            req, timeout=self.transfer_s(full) + wait_s, metadata=self.metadata
        )
        messages = iter(stream)
        first = next(messages, None)
        if first is None or first.WhichOneof("kind") != "header":
            raise layout.CodecError(
                f"pull stream of fragment {fragment_id} did not start with a header"
            )
        self._count(received=first.ByteSize())
        h = first.header
        self._note_served(h)
        n = out.numel() if out is not None else numel
        received = self._received
        if h.HasField("payload"):  # the whole fragment
            target = pull_stream.whole(fragment_id, h, messages, n, out, received)
        elif have is None or h.delta_from != have[0]:
            raise layout.CodecError(
                f"fragment {fragment_id}: a delta from version {h.delta_from}, not asked for"
            )
        else:
            update_numel = self.fragment_numels[fragment_id] if runs is not None else 0
            target = pull_stream.delta(
                fragment_id, h, messages, have[1], out, runs, update_numel, received
            )
        return h.version, h.server_epoch, target

    def _note_served(self, h: pb.PullHeader) -> None:
        if not h.checksum:
            return
        key = (h.server_epoch, h.fragment_id, h.version)
        with self._lock:
            seen = self.served.setdefault(key, h.checksum)
            if len(self.served) > SERVED_KEPT:
                del self.served[next(iter(self.served))]
            if seen == h.checksum:
                return
            self.version_conflicts += 1
        logger.error(
            "fragment %d version %d was served with checksum %08x, earlier with %08x (epoch %s)",
            h.fragment_id,
            h.version,
            h.checksum,
            seen,
            h.server_epoch,
        )

    def leave(self, counters: pb.LearnerCounters) -> None:
        self._unary(
            "Leave",
            self.stub.Leave,
            pb.LeaveRequest(learner_id=self.learner_id, session=self.session, counters=counters),
        )

    def status(self) -> pb.StatusReply:
        return self._unary("Status", self.stub.Status, pb.StatusRequest())

    def report_eval(
        self, eval_loss: float, versions: dict[int, int], eval_set: str = ""
    ) -> pb.EvalReply:
        """An evaluator's eval loss of the fragment `versions` it evaluated."""
        req = pb.EvalReport(
            learner_id=self.learner_id,
            session=self.session,
            versions=[pb.FragmentVersion(fragment_id=f, version=v) for f, v in versions.items()],
            eval_loss=eval_loss,
            eval_set=eval_set,
        )
        return self._unary("ReportEval", self.stub.ReportEval, req)

    @property
    def versions_checked(self) -> int:
        """(epoch, fragment, version)s pulled with a checksum, remembered."""
        with self._lock:
            return len(self.served)
