"""The pull path: from a PullFragment request to the fragment's parameters on the wire.

In the order a pull meets them: the learner's lease and session, the codec and wait checks, a
per-learner stream, a waiting slot (`synchronizer.streams`) in which it waits (bounded) for the
model to be initialised and the fragment to reach `min_version`, a transfer slot, the served
fragment judged at one version (`FragmentModel.served`: the update chain since the version the
learner holds, or a full snapshot within the snapshot budget), then the header and chunks.
Everything runs on the first `next()`: a refusal is raised there, before anything is sent.
A rank of a sharded island pulls only its slice (`PullRequest.slice`): those runs of the
fragment, concatenated, always full, with their own checksum (`synchronizer.slices`).
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator

import torch

from protos import codec, framing, layout, slicing
from protos import diloco_pb2 as pb
from synchronizer import slices, wire
from synchronizer.config import SynchronizerConfig
from synchronizer.crc import crc32
from synchronizer.downlink import Link
from synchronizer.errors import Code, Rejected, invalid
from synchronizer.fragments import Fragment
from synchronizer.leases import Registry
from synchronizer.metrics import Metrics
from synchronizer.model import FragmentFailed
from synchronizer.records import check_credential
from synchronizer.served import ServedModel
from synchronizer.streams import SLOT_PATIENCE_S, Call, Streams


class Waker:
    """Runs the wake-ups of pulls whose calls ended on a thread of its own. gRPC runs a call's
    end callbacks on its one polling thread, and waking a waiting pull takes the fragment's lock,
    which an outer step holds for its whole length (seconds at 1B parameters): taken there, it
    would stop every call's traffic, health checks included, until the step ends."""

    def __init__(self) -> None:
        self._todo: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def __call__(self, wake: Callable[[], None]) -> None:
        """Queues `wake` (never blocks)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pull-waker", daemon=True)
                self._thread.start()
        self._todo.put(wake)

    def _run(self) -> None:
        while (wake := self._todo.get()) is not None:
            wake()

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._todo.put(None)
            thread.join(timeout=5)


class PullPath:
    def __init__(
        self,
        cfg: SynchronizerConfig,
        metrics: Metrics,
        model: ServedModel,
        registry: Registry,
        streams: Streams,
        epoch: str,
        stopping: threading.Event,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.model = model
        self.registry = registry
        self.streams = streams
        self.epoch = epoch
        self.stopping = stopping
        self.waker = Waker()

    def close(self) -> None:
        self.waker.close()

    def pull(
        self, request: pb.PullRequest, call: Call | None = None
    ) -> Iterator[pb.PullReply | wire.RawChunk]:
        """The fragment's parameters (or the updates since `have_version`), judged at one
        version, after waiting (bounded, in a waiting slot) for `min_version`."""
        call = call or Call()
        rec = self.registry.alive(request.learner_id, request.session)
        check_credential(rec, call.credential)
        codec_id = request.codec or pb.CODEC_FP32
        if codec_id not in layout.PULL_CODECS:
            raise invalid(
                "bad_codec", f"pulls are served as {layout.allowed_names(layout.PULL_CODECS)}"
            )
        if not (math.isfinite(request.wait_s) and request.wait_s >= 0):
            raise invalid("bad_wait", "wait_s must be finite and non-negative")
        sliced = request.HasField("slice")
        if self.model.initialized:
            frag = self.model.fragment(request.fragment_id)
            if sliced:
                slices.runs(request.slice, frag.numel, ranked=False)
        with contextlib.ExitStack() as held:
            held.enter_context(
                self.streams.claimed(
                    slices.stream_key(rec.learner_id, request.slice if sliced else None),
                    self.streams.counted(rec.credential),
                )
            )
            with self.streams.waiting() as free:
                if free:
                    self._wait_for(request, call)
                stream = held.enter_context(
                    self.streams.transfer(
                        "pull",
                        rec.learner_id,
                        call,
                        lambda: self.registry.renew(rec),
                        SLOT_PATIENCE_S if free else 0.0,
                    )
                )
            self.model.require_initialized()
            frag = self.model.fragment(request.fragment_id)
            self.model.check_spec_hash(rec.spec_hash)  # the spec this learner joined with
            have = request.have_version if request.delta_ok else None
            if sliced:
                part, cut, version, checksum = self._slice(frag, codec_id, request.slice, have)
                yield from stream.moving(
                    self._stream(frag.fid, request.have_version, part, cut, version, checksum)
                )
                return
            snap, links, version, checksum = self._served(frag, codec_id, have, call)
            yield from stream.moving(
                self._stream(frag.fid, request.have_version, snap, links, version, checksum)
            )

    def _served(
        self, frag: Fragment, codec_id: pb.Codec, have: int | None, call: Call
    ) -> tuple[Link | None, list[Link] | None, int, int]:
        """`FragmentModel.served` within the snapshot budget: a full pull that finds it spent
        waits (up to max_pull_wait_s, or until its client cancels) for a snapshot to end, then
        is refused RESOURCE_EXHAUSTED."""
        snapshots = self.model.snapshots
        assert snapshots is not None
        deadline = time.monotonic() + self.cfg.max_pull_wait_s
        ended: threading.Event | None = None
        while True:
            try:
                snap, links, version, checksum = frag.model.served(codec_id, have, snapshots)
            except FragmentFailed:
                raise self.model.unavailable(frag) from None
            if snap is not None or links is not None:
                return snap, links, version, checksum
            if ended is None:  # only a pull that waits hears when its call ends
                ended = threading.Event()
                call.on_end(ended.set)
            if time.monotonic() >= deadline or ended.is_set():
                raise Rejected(
                    Code.RESOURCE_EXHAUSTED,
                    "snapshot_budget",
                    f"full pulls in flight hold the whole snapshot_budget_bytes ({snapshots.budget_bytes}); retry with backoff",
                )
            snapshots.wait(min(1.0, deadline - time.monotonic()))

    def _slice(
        self, frag: Fragment, codec_id: pb.Codec, s: pb.Slice, have: int | None
    ) -> tuple[Link | None, list[Link] | None, int, int]:
        """A rank's slice of the fragment, judged at one version, with the crc32 of its FP32
        values: the updates since `have` cut to the blocks that hold its runs
        (`protos.slicing`) when the chain still covers it, else its runs concatenated in
        `codec_id`."""
        runs = slices.runs(s, frag.numel, ranked=False)
        try:
            values, version, links = frag.model.gathered(runs, have)
        except FragmentFailed:
            raise self.model.unavailable(frag) from None
        checksum = framing.checksum(values, crc32)
        if links is not None and all(slicing.cuttable(h) for _, h, _ in links):
            cut = []
            for v, h, buf in links:
                sub, part = slicing.cut(buf, h, slicing.covering(runs, h))
                cut.append((v, sub, part))
            return None, cut, version, checksum
        header = layout.make_header(codec_id, values.numel())
        # FP32: the gathered copy's own bytes
        encoded = (
            values.view(torch.uint8)
            if codec_id == pb.CODEC_FP32
            else codec.encode(values, codec_id)
        )
        return (version, header, encoded), None, version, checksum

    def _wait_for(self, request: pb.PullRequest, call: Call) -> None:
        """Waits (up to the bounded wait) until the model is initialised and the fragment at
        `min_version`; returns as soon as the client cancels."""
        wait_s = min(request.wait_s, self.cfg.max_pull_wait_s)
        fid = request.fragment_id
        model = self.model
        if wait_s <= 0 or (
            model.initialized
            and fid in model.by_id
            and request.min_version <= model.by_id[fid].version
        ):
            return
        deadline = time.monotonic() + wait_s
        ended = threading.Event()

        def wake() -> None:
            with model.initialized_cv:
                model.initialized_cv.notify_all()
            for frag in list(model.fragments):
                frag.model.wake()

        def ended_now() -> None:  # on gRPC's polling thread: nothing here may block
            ended.set()
            self.waker(wake)

        call.on_end(ended_now)
        with model.initialized_cv:
            while not model.initialized and not ended.is_set() and not self.stopping.is_set():
                if not model.initialized_cv.wait(max(0.0, deadline - time.monotonic())):
                    return
        if model.initialized and fid in model.by_id:
            model.by_id[fid].model.wait_for(request.min_version, deadline - time.monotonic(), ended)

    def _stream(
        self,
        fid: int,
        have_version: int,
        snap: Link | None,
        links: list[Link] | None,
        version: int,
        checksum: int,
    ) -> Iterator[pb.PullReply | wire.RawChunk]:
        if links is not None:
            yield pb.PullReply(
                header=pb.PullHeader(
                    fragment_id=fid,
                    version=version,
                    server_epoch=self.epoch,
                    delta_from=have_version,
                    links=len(links),
                    checksum=checksum,
                )
            )
            for v, link_header, link_buf in links:
                yield pb.PullReply(link=pb.DeltaLink(version=v, payload=link_header))
                yield from wire.pull_chunks(link_buf)
                self.metrics.bytes_out.labels(layout.codec_name(link_header.codec)).inc(
                    link_header.total_bytes
                )
            return
        assert snap is not None
        _, header, buf = snap
        yield pb.PullReply(
            header=pb.PullHeader(
                fragment_id=fid,
                version=version,
                server_epoch=self.epoch,
                payload=header,
                checksum=checksum,
            )
        )
        yield from wire.pull_chunks(buf)
        self.metrics.bytes_out.labels(layout.codec_name(header.codec)).inc(header.total_bytes)
