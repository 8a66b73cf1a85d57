"""The downlink of one fragment: what pulls are served, and the update chain behind delta pulls.

Parameters served in FP32 cost 8x an INT4 push, so a learner that holds version v pulls only the
outer updates since v. The Synchronizer keeps the last few outer updates encoded (INT8 blockwise
by default) with a server-side error-feedback residual, and defines its canonical parameters as
the sum of exactly those decoded updates: a learner that applies the same links in order holds
the same parameters bit for bit, which the per-version crc32 proves. Full pulls are served from
one encoded snapshot per codec and version, shared by every puller of that version and alive only
while one of them streams it: the cache holds it weakly, so a snapshot nobody pulls any more is
freed at once, and the cache never makes a second one of the same codec and version.

How many links are kept is bounded in bytes as well as in count (`kept_links`): a learner further
behind than the kept chain pulls the full parameters instead.

The residual is stored in BF16 by default (`update_residual_dtype`), half the bytes of FP32: it
only carries what one INT8 encoding lost into the next update, so its own rounding (relative
2^-9 of an already small error) changes the served parameters by far less than the update codec
does. Its arithmetic is FP32, run by run: a run is upcast, computed and rounded back.

`Downlink` holds no lock of its own: every method runs under the owning `FragmentModel`'s lock,
which also guards the parameters it reads and writes.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch

from protos import blockwise, codec, framing, layout
from protos import diloco_pb2 as pb
from synchronizer import native
from synchronizer.buffers import Snapshots
from synchronizer.crc import crc32
from synchronizer.outer import RUN_ELEMS, OuterStep, runs

Link = tuple[int, pb.PayloadHeader, torch.Tensor]  # (version it produces, header, encoded bytes)

AUTO_HISTORY_FP32_SHARE = 0.8  # update_history_bytes 0: kept links take 0.8x the fragment's FP32


def kept_links(
    update_history: int,
    history_bytes: int,
    fragment_numel: int,
    update_codec: str,
    block_size: int = layout.DEFAULT_BLOCK_SIZE,
) -> int:
    """How many outer updates one fragment keeps: `update_history`, but no more than fit in
    `history_bytes` (0: `AUTO_HISTORY_FP32_SHARE` of the fragment's FP32 bytes), and at least
    one while any are kept. The same for every run with the same settings and fragment."""
    if update_history <= 0:
        return 0
    budget = history_bytes or int(AUTO_HISTORY_FP32_SHARE * 4 * fragment_numel)
    link = layout.encoded_nbytes(layout.parse_codec(update_codec), fragment_numel, block_size)
    return min(update_history, max(1, budget // max(link, 1)))


RESIDUAL_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

_storage_uses = getattr(torch._C, "_storage_Use_Count", None)


def _holders(t: torch.Tensor) -> tuple[int, int]:
    """Who holds `t`: Python references to the tensor (this call's own included) and tensors
    (views, numpy arrays' bases) on its storage; -1 where torch cannot say."""
    uses = -1 if _storage_uses is None else _storage_uses(t.untyped_storage()._cdata)
    return sys.getrefcount(t), uses


_ALONE = _holders(torch.empty(1))  # a tensor held by nothing but the call


class Downlink:
    def __init__(
        self,
        numel: int,
        update_codec: str,
        history: int,
        residual_dtype: str = "bf16",
        native_kernels: bool = False,
        kernel_threads: int = 1,
    ) -> None:
        """`history`: links kept (see `kept_links`); `residual_dtype`: how the error-feedback
        residual is stored (`RESIDUAL_DTYPES`); `native_kernels`: an INT8 chain of a Nesterov
        or plain step runs `native.chain_int8` (one pass) instead of torch's runs, split across
        `kernel_threads` (the same numbers for any count)."""
        self.numel = numel
        self.native_kernels = native_kernels
        self.kernel_threads = kernel_threads
        self.history = history
        self.codec = layout.parse_codec(update_codec)
        self.residual_dtype = RESIDUAL_DTYPES[residual_dtype]
        self.chain: deque[Link] = deque()  # links are never written once made: shared, not copied
        self.residual: torch.Tensor | None = None  # error feedback of the update codec
        # codec -> (version, header, the encoded parameters, held weakly: the pulls hold them)
        self._snapshots: dict[int, tuple[int, pb.PayloadHeader, weakref.ref[torch.Tensor]]] = {}
        self._checksums: dict[int, int] = {}
        # An evicted link's bytes, reused by the next link where nothing holds them any more: a
        # new link's tens of MB, allocated fresh each outer step, cost a page fault per 4 KiB
        # (docs/performance.md); links made here only (a restored one may be a file's bytes).
        self._spare: torch.Tensor | None = None
        self._made: dict[int, weakref.ref[torch.Tensor]] = {}  # by id (tensors compare by value)

    def step(
        self, params: torch.Tensor, merged: torch.Tensor, outer: OuterStep, version: int
    ) -> None:
        """Applies one outer step through the chain: u = residual + factor * d (d, the outer
        step's direction from the merged delta), params += decode(encode(u)), residual = u -
        decode(encode(u)). Fused run by run (`outer.RUN_ELEMS`): a run's momentum, merged
        delta, residual and parameters are read and written once, while the direction, the
        carried update, its codes and their decoded values stay in run-sized scratch (in
        cache). Each decoded run is added to the parameters by the same single add a learner
        applying the whole link does (so the sum is the same, element for element); the link's
        bytes are those of encoding u at once. `merged` is only read."""
        residual = self._residual()
        if self._native_step(
            params, outer, version, functools.partial(native.chain_int8, params, grad=merged)
        ):
            return
        run = min(RUN_ELEMS, self.numel)
        if self.codec in blockwise.MAX_CODE:
            bs = layout.DEFAULT_BLOCK_SIZE
            run = max(bs, run // bs * bs)
        header = layout.make_header(self.codec, self.numel)
        out = self._link_bytes(int(header.total_bytes))
        encoder = codec.RunEncoder(self.codec, self.numel, run, out=out)
        direction = torch.empty(run)
        update = torch.empty(run)
        decoded = torch.empty(run)
        for start, stop in runs(self.numel, run):
            u = update[: stop - start].copy_(residual[start:stop])
            outer.add_to(start, stop, merged[start:stop], u, direction)
            values = encoder.encode(u, decoded)
            params[start:stop].add_(values)
            residual[start:stop].copy_(u.sub_(values))
        self._append((version, encoder.header, encoder.out))

    def native_chain(self, params: torch.Tensor) -> bool:
        """Whether the native kernels take this fragment's steps through its chain: kept links,
        an INT8 chain, parameters on CPU (the outer step must also have a `native_form`)."""
        return (
            self.native_kernels
            and self.history > 0
            and self.codec == pb.CODEC_INT8
            and params.device.type == "cpu"
        )

    def step_pushes(
        self,
        params: torch.Tensor,
        pushes: list[native.Push],
        summed: int,
        total: float,
        outer: OuterStep,
        version: int,
    ) -> bool:
        """`step` with the merged delta made block by block from a round's pushes
        (`native.step_int8`: the first `summed` weighted, summed and divided by `total`, the
        rest added; codes of the chain's block size), never held whole in FP32; the same
        numbers as `step` of that merged delta. False (nothing done) where the native chain does
        not take this step. The caller has shown the merged delta appliable."""
        kernel = functools.partial(native.step_int8, pushes, summed, total, params)
        return self._native_step(params, outer, version, kernel)

    def _native_step(
        self,
        params: torch.Tensor,
        outer: OuterStep,
        version: int,
        kernel: Callable[..., bool],
    ) -> bool:
        """`step` by a native kernel, where one computes this one (an INT8 chain of a Nesterov
        or plain step, on CPU); False where none does. `kernel` (`native.chain_int8` or
        `native.step_int8` with their leading arguments given) takes the chain's by keyword:
        `OuterStep.native_form`'s momentum, decay and look-ahead, the residual, the link's codes
        and scales to write, and the threads; it says whether the update was finite."""
        form = outer.native_form() if self.native_chain(params) else None
        if form is None:
            return False
        momentum, mu, nu = form
        header = layout.make_header(self.codec, self.numel)
        out = self._link_bytes(int(header.total_bytes))
        code_bytes = layout.code_bytes(self.codec, self.numel)
        scales = torch.empty(-(-self.numel // int(header.block_size)))
        finite = kernel(
            momentum=momentum,
            residual=self._residual(),
            codes=out[:code_bytes],
            scales=scales,
            block_size=int(header.block_size),
            factor=outer.factor,
            mu=mu,
            nu=nu,
            threads=self.kernel_threads,
        )
        if not finite:
            raise layout.CodecError("the outer update is not finite: it cannot be encoded")
        out[code_bytes:] = scales.view(torch.uint8)  # the scales follow the codes, unaligned
        self._append((version, header, out))
        return True

    def _residual(self) -> torch.Tensor:
        if self.residual is None:
            self.residual = torch.zeros(self.numel, dtype=self.residual_dtype)
        return self.residual

    def _link_bytes(self, nbytes: int) -> torch.Tensor:
        """Bytes for the next link: those of the link it evicts from a full chain (evicted now:
        a step that then fails leaves the chain one link shorter, which pulls that needed it
        take in full), or of one evicted before, where nothing holds them; new ones else. Links
        are served bytes: they live on the host."""
        while self.history and len(self.chain) >= self.history:
            self._keep_spare(self.chain.popleft()[2])
        spare, self._spare = self._spare, None
        if spare is not None and spare.numel() == nbytes:
            return spare
        out = torch.empty(nbytes, dtype=torch.uint8)
        self._made = {k: r for k, r in self._made.items() if r() is not None}
        self._made[id(out)] = weakref.ref(out)
        return out

    def _keep_spare(self, buf: torch.Tensor) -> None:
        """Keeps an evicted link's bytes for the next link if this downlink made them and no
        pull, checkpoint or view holds them (links are never written while anyone reads)."""
        made = self._made.get(id(buf))
        refs, uses = _holders(buf)
        if made is not None and made() is buf and 0 <= uses <= _ALONE[1] and refs <= _ALONE[0] + 1:
            self._spare = buf  # (refs: + this call's `buf`)

    def _append(self, link: Link) -> None:
        self.chain.append(link)
        while len(self.chain) > self.history:
            self._keep_spare(self.chain.popleft()[2])

    def skip(self, version: int) -> None:
        """A version whose update was refused: an all-zero link, parameters and residual as
        they were (nothing to add when no chain is kept)."""
        if self.history == 0:
            return
        header = layout.make_header(self.codec, self.numel)
        self._append((version, header, codec.encode(torch.zeros(self.numel), self.codec)))

    def changed(self) -> None:
        """The parameters changed: cached snapshots are stale."""
        self._snapshots.clear()

    def snapshot(
        self,
        params: torch.Tensor,
        version: int,
        codec_id: pb.Codec,
        budget: Snapshots | None = None,
    ) -> Link | None:
        """(version, header, encoded CPU bytes) of the parameters, shared by the pullers of this
        version: the one already made while any of them still holds it, else a new one, or None
        when a new one does not fit `budget` (whose bytes it holds until it is freed). Hold the
        returned link as long as it is streamed, and no longer."""
        cached = self._snapshots.get(codec_id)
        if cached is not None and cached[0] == version:
            buf = cached[2]()
            if buf is not None:
                return version, cached[1], buf
        header = layout.make_header(codec_id, self.numel)
        nbytes = int(header.total_bytes)
        if budget is not None and not budget.try_reserve(nbytes):
            return None
        try:
            buf = codec.encode(params, codec_id).cpu()
        except BaseException:
            if budget is not None:
                budget.release(nbytes)
            raise
        if budget is not None:
            weakref.finalize(buf, budget.release, nbytes)
        self._snapshots[codec_id] = (version, header, weakref.ref(buf))
        return version, header, buf

    def snapshots_alive(self) -> list[torch.Tensor]:
        """The cached snapshots some pull still holds."""
        return [buf for _, _, ref in self._snapshots.values() if (buf := ref()) is not None]

    def checksum(self, params: torch.Tensor, version: int) -> int:
        """crc32 of the canonical parameters (cached per version)."""
        crc = self._checksums.get(version)
        if crc is None:
            crc = framing.checksum(params, crc32)
            self._checksums = {version: crc}
        return crc

    def since(self, have_version: int, version: int) -> list[Link] | None:
        """The kept updates after `have_version` up to `version`, or None if some are gone."""
        if have_version > version:
            return None
        links = [link for link in self.chain if link[0] > have_version]
        return links if len(links) == version - have_version else None

    def covers(self, base_version: int, version: int) -> bool:
        """Whether the kept links hold every update after `base_version` up to `version`."""
        return self.since(base_version, version) is not None

    def state(self, prefix: str) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        """The chain's links and the residual by name: the live tensors, not copies (the
        caller keeps outer steps away while it reads them; links are never written)."""
        tensors = {prefix + f"chain.{i}": buf for i, (_, _, buf) in enumerate(self.chain)}
        if self.residual is not None:
            tensors[prefix + "residual"] = self.residual
        return tensors, [[v, h.codec, h.block_size] for v, h, _ in self.chain]

    def restore(self, tensors: Mapping[str, torch.Tensor], chain: list[Any], prefix: str) -> None:
        """Takes the residual (converted to `residual_dtype` if the checkpoint stored another)
        and the newest `history` links of a checkpoint (read one by one from `tensors`, which
        may load lazily)."""
        residual = tensors.get(prefix + "residual")
        self.residual = None if residual is None else residual.to(self.residual_dtype)
        first = max(0, len(chain) - self.history)
        self.chain = deque(
            (
                int(v),
                layout.make_header(int(c), self.numel, int(b) or layout.DEFAULT_BLOCK_SIZE),
                tensors[prefix + f"chain.{i}"],
            )
            for i, (v, c, b) in enumerate(chain)
            if i >= first
        )
        self._snapshots.clear()
