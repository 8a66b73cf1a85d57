"""Shard ownership: which fragments this Synchronizer process serves when several share a model.

With `shards` S > 1, S processes each own the fragments `protos.spec.shard_owners` gives their
index (byte-balanced, a pure function of the spec and S, so learners compute the same). A shard
holds state only for its own fragments; a request for another shard's fragment is refused
`wrong_shard` with where it lives, and a Join whose shard count or assignment differs from this
shard's is refused before it records anything. The index is the StatefulSet ordinal: the trailing
`-N` of the host name, unless `shard_index` is given. A state directory written under another
layout is refused at start (`ShardLayoutError`), never served.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Any

from protos import diloco_pb2 as pb
from protos.configload import ConfigError
from protos.spec import ModelSpec, shard_owners
from synchronizer.errors import Code, Rejected

ORDINAL = re.compile(r"-(\d+)$")


class ShardLayoutError(ConfigError):
    """A state directory written by another shard layout than the configured one."""


def host_name() -> str:
    return os.environ.get("HOSTNAME") or socket.gethostname()


def resolve_index(shards: int, shard_index: int, host: str | None = None) -> int:
    """The shard index to serve as: `shard_index` when given (>= 0), 0 unsharded, else the
    trailing `-N` of the host name (a StatefulSet pod's ordinal); ValueError naming the setting."""
    if shard_index < 0:
        if shards == 1:
            return 0
        host = host if host is not None else host_name()
        m = ORDINAL.search(host)
        if m is None:
            raise ValueError(
                f"shard_index is not set and the host name {host!r} ends in no -N ordinal (a "
                f"StatefulSet pod's does): give this shard's index with --shard-index (0..{shards - 1})"
            )
        shard_index, source = int(m.group(1)), f" (the ordinal of host name {host!r})"
    else:
        source = ""
    if shard_index >= shards:
        raise ValueError(
            f"shard_index {shard_index}{source} must be below shards ({shards}): shards are numbered 0..{shards - 1}"
        )
    return shard_index


@dataclass(frozen=True)
class Layout:
    """This shard's place in the model: its index of `shards`, and the owner of every fragment."""

    shards: int
    index: int
    owners: tuple[int, ...]  # the owning shard of each fragment id

    @classmethod
    def of(cls, spec: ModelSpec, shards: int, index: int) -> Layout:
        """ValueError when the model has fewer fragments than shards."""
        return cls(shards, index, tuple(shard_owners(spec, shards)))

    @property
    def owned(self) -> list[int]:
        return [fid for fid, s in enumerate(self.owners) if s == self.index]

    def describe(self) -> str:
        return f"shard {self.index} of {self.shards} (fragments {self.owned})"

    def refuse_unowned(self, fid: int) -> None:
        """Rejected `wrong_shard` when fragment `fid` (of the model) is another shard's."""
        if self.owners[fid] != self.index:
            raise Rejected(
                Code.FAILED_PRECONDITION,
                "wrong_shard",
                f"fragment {fid} is served by shard {self.owners[fid]} of {self.shards}; this is {self.describe()}",
            )

    def meta(self) -> dict[str, Any]:
        """What a checkpoint records of the layout it was written under."""
        return {"shards": self.shards, "shard_index": self.index, "owned": self.owned}


def check_join(request: pb.JoinRequest, spec: ModelSpec, shards: int, index: int) -> Layout:
    """This shard's layout for the Join's spec; Rejected FAILED_PRECONDITION when the learner
    routes to another number of shards, assigns fragments otherwise, or the model has fewer
    fragments than there are shards."""
    routed = request.shards or 1
    here = f"this Synchronizer is shard {index} of {shards} (--shards {shards})"
    if routed != shards:
        hint = (
            f"; it serves only part of the model: give the learner every shard's address ({shards})"
            if routed == 1
            else ""
        )
        routes = "is not sharded" if routed == 1 else f"routes to {routed} shards"
        raise Rejected(
            Code.FAILED_PRECONDITION, "shard_count", f"the learner {routes}; {here}{hint}"
        )
    if len(spec.fragments) < shards:
        raise Rejected(
            Code.FAILED_PRECONDITION,
            "too_few_fragments",
            f"the model has {len(spec.fragments)} fragments, fewer than the {shards} shards serving it: "
            f"split it into at least {shards} fragments or run at most {len(spec.fragments)} shards",
        )
    layout = Layout.of(spec, shards, index)
    theirs = list(request.fragment_shards)
    if theirs and theirs != list(layout.owners):
        if len(theirs) != len(layout.owners):
            diff = (
                f"the learner assigns {len(theirs)} fragments, the model has {len(layout.owners)}"
            )
        else:
            fid = next(
                i for i, (a, b) in enumerate(zip(theirs, layout.owners, strict=True)) if a != b
            )
            diff = f"the learner assigns fragment {fid} to shard {theirs[fid]}, this Synchronizer to shard {layout.owners[fid]}"
        raise Rejected(
            Code.FAILED_PRECONDITION,
            "shard_assignment",
            f"{diff} (protos.spec.shard_owners over {shards} shards): learner and Synchronizer disagree on the assignment; run the same version of both",
        )
    return layout


def check_stored(meta: dict[str, Any], spec: ModelSpec, shards: int, index: int) -> None:
    """ShardLayoutError unless a checkpoint's metadata (one written before sharding counts as
    shard 0 of 1) was written by this shard under this layout."""
    stored_shards = int(meta.get("shards", 1))
    stored_index = int(meta.get("shard_index", 0))
    stored_owned = [int(f) for f in meta.get("owned", range(len(spec.fragments)))]
    held = (
        f"shard {stored_index} of {stored_shards} (fragments {stored_owned})"
        if stored_shards > 1
        else f"an unsharded model (all {len(spec.fragments)} fragments)"
    )
    if (stored_shards, stored_index) != (shards, index):
        raise ShardLayoutError(
            f"refusing to start: the state directory holds {held}, but this Synchronizer is shard "
            f"{index} of {shards}: give each shard its own state_dir, or start with "
            f"--shards {stored_shards} --shard-index {stored_index}"
        )
    owned = Layout.of(spec, shards, index).owned
    if owned != stored_owned:
        raise ShardLayoutError(
            f"refusing to start: the state directory holds {held}, but this version assigns "
            f"shard {index} of {shards} fragments {owned}: run the version that wrote it"
        )
