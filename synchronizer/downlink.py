"""The downlink of one fragment: what pulls are served, and the update chain behind delta pulls.

Parameters served in FP32 cost 8x an INT4 push, so a learner that holds version v pulls only the
outer updates since v. The Synchronizer keeps the last `update_history` outer updates encoded
(INT8 blockwise by default) with a server-side error-feedback residual, and defines its canonical
parameters as the sum of exactly those decoded updates: a learner that applies the same links in
order holds the same parameters bit for bit, which the per-version crc32 proves. Full pulls are
served from one encoded snapshot per codec and version, shared by every puller.

`Downlink` holds no lock of its own: every method runs under the owning `FragmentModel`'s lock,
which also guards the parameters it reads and writes.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from protos import codec, framing, layout
from protos import diloco_pb2 as pb

Link = tuple[int, pb.PayloadHeader, torch.Tensor]  # (version it produces, header, encoded bytes)


class Downlink:
    def __init__(self, numel: int, update_codec: str, history: int) -> None:
        self.numel = numel
        self.history = history
        self.codec = layout.parse_codec(update_codec)
        self.chain: deque[Link] = deque()
        self.residual: torch.Tensor | None = None  # error feedback of the update codec
        self._decoded = torch.empty(0)  # the newest update as decoded, before it is added
        self._snapshots: dict[int, Link] = {}  # codec -> encoded parameters of one version
        self._checksums: dict[int, int] = {}

    def step(self, params: torch.Tensor, merged: torch.Tensor, factor: float, version: int) -> None:
        """Applies the outer update `factor * merged` through the chain: params +=
        decode(encode(update + residual)), residual = what the encoding lost. `merged` is
        scratch afterwards. The parameters are written once, by the same single add a learner
        applying the link does."""
        if self.residual is None:
            self.residual = torch.zeros(self.numel)
        update = torch.add(self.residual, merged, alpha=factor, out=merged)
        header = layout.make_header(self.codec, self.numel)
        encoded = codec.encode(update, self.codec)  # fresh: pulls may still be streaming old links
        if self._decoded.numel() != self.numel:
            self._decoded = torch.empty(self.numel)
        decoded = codec.values(encoded, header, self._decoded)
        torch.sub(update, decoded, out=self.residual)
        params.add_(decoded)
        self.chain.append((version, header, encoded))
        while len(self.chain) > self.history:
            self.chain.popleft()

    def skip(self, version: int) -> None:
        """A version whose update was refused: an all-zero link, parameters and residual as
        they were (nothing to add when no chain is kept)."""
        if self.history == 0:
            return
        header = layout.make_header(self.codec, self.numel)
        self.chain.append((version, header, codec.encode(torch.zeros(self.numel), self.codec)))
        while len(self.chain) > self.history:
            self.chain.popleft()

    def changed(self) -> None:
        """The parameters changed: cached snapshots are stale."""
        self._snapshots.clear()

    def snapshot(self, params: torch.Tensor, version: int, codec_id: pb.Codec) -> Link:
        """(version, header, encoded CPU bytes) of the parameters, shared by pullers."""
        cached = self._snapshots.get(codec_id)
        if cached is not None and cached[0] == version:
            return cached
        header = layout.make_header(codec_id, self.numel)
        snap = (version, header, codec.encode(params, codec_id).cpu())
        self._snapshots[codec_id] = snap
        return snap

    def checksum(self, params: torch.Tensor, version: int) -> int:
        """crc32 of the canonical parameters (cached per version)."""
        crc = self._checksums.get(version)
        if crc is None:
            crc = framing.checksum(params)
            self._checksums = {version: crc}
        return crc

    def since(self, have_version: int, version: int) -> list[Link] | None:
        """The kept updates after `have_version` up to `version`, or None if some are gone."""
        if have_version > version:
            return None
        links = [link for link in self.chain if link[0] > have_version]
        return links if len(links) == version - have_version else None

    def state(self, prefix: str) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        tensors = {prefix + f"chain.{i}": buf.clone() for i, (_, _, buf) in enumerate(self.chain)}
        if self.residual is not None:
            tensors[prefix + "residual"] = self.residual.clone()
        return tensors, [[v, h.codec, h.block_size] for v, h, _ in self.chain]

    def restore(self, tensors: dict[str, torch.Tensor], chain: list[Any], prefix: str) -> None:
        self.residual = tensors.get(prefix + "residual")
        self.chain = deque(
            (
                int(v),
                layout.make_header(int(c), self.numel, int(b) or layout.DEFAULT_BLOCK_SIZE),
                tensors[prefix + f"chain.{i}"],
            )
            for i, (v, c, b) in enumerate(chain)
        )
        while len(self.chain) > self.history:
            self.chain.popleft()
        self._snapshots.clear()
