"""The model spec both sides agree on: tensors, the fragment plan, and its hash.

A fragment is a fixed list of named tensors flattened and concatenated in order into one flat
FP32 vector; that flat layout is what every payload on the wire encodes. The plan is a pure
function of the tensors' names and shapes, so every learner computes the same one, and the
Synchronizer refuses a learner whose spec hash differs from the served model's.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from protos import diloco_pb2 as pb

STRATEGIES = ("balanced", "strided")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Fragment:
    fragment_id: int
    tensors: tuple[TensorInfo, ...]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    def offsets(self) -> list[tuple[str, int, int]]:
        """(name, start, end) of each tensor inside the fragment's flat vector."""
        out, start = [], 0
        for t in self.tensors:
            out.append((t.name, start, start + t.numel))
            start += t.numel
        return out


@dataclass(frozen=True)
class ModelSpec:
    tensors: tuple[TensorInfo, ...]
    fragments: tuple[Fragment, ...]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    def canonical(self) -> str:
        """A stable text form: what the hash covers."""
        return json.dumps(
            {
                "tensors": [[t.name, list(t.shape), t.dtype] for t in self.tensors],
                "fragments": [[f.fragment_id, [t.name for t in f.tensors]] for f in self.fragments],
            },
            separators=(",", ":"),
        )

    @property
    def spec_hash(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()

    def to_proto(self) -> pb.ModelSpec:
        return pb.ModelSpec(
            tensors=[
                pb.TensorSpec(name=t.name, shape=list(t.shape), dtype=t.dtype) for t in self.tensors
            ],
            fragments=[
                pb.FragmentSpec(
                    fragment_id=f.fragment_id,
                    tensor_names=[t.name for t in f.tensors],
                    numel=f.numel,
                )
                for f in self.fragments
            ],
            spec_hash=self.spec_hash,
        )

    @classmethod
    def from_proto(cls, msg: pb.ModelSpec) -> ModelSpec:
        """Rebuilds and checks a spec from the wire; ValueError says what is inconsistent."""
        tensors = []
        for t in msg.tensors:
            if not t.name:
                raise ValueError("a tensor in the model spec has an empty name")
            if any(d < 0 for d in t.shape):
                raise ValueError(f"tensor {t.name!r} has a negative dimension {list(t.shape)}")
            tensors.append(TensorInfo(t.name, tuple(int(d) for d in t.shape), t.dtype or "float32"))
        by_name = {t.name: t for t in tensors}
        if len(by_name) != len(tensors):
            raise ValueError("the model spec names a tensor twice")
        fragments: list[Fragment] = []
        seen: set[str] = set()
        for i, fmsg in enumerate(msg.fragments):
            if fmsg.fragment_id != i:
                raise ValueError(
                    f"fragment ids must be 0..P-1 in order; got {fmsg.fragment_id} at position {i}"
                )
            missing = [n for n in fmsg.tensor_names if n not in by_name]
            if missing:
                raise ValueError(f"fragment {i} names unknown tensors {missing[:3]}")
            dup = seen.intersection(fmsg.tensor_names)
            if dup:
                raise ValueError(f"tensors {sorted(dup)[:3]} are in more than one fragment")
            seen.update(fmsg.tensor_names)
            frag = Fragment(i, tuple(by_name[n] for n in fmsg.tensor_names))
            if fmsg.numel != frag.numel:
                raise ValueError(
                    f"fragment {i} says numel {fmsg.numel} but its tensors hold {frag.numel}"
                )
            fragments.append(frag)
        if not fragments:
            raise ValueError("the model spec has no fragments")
        if seen != set(by_name):
            raise ValueError(f"tensors {sorted(set(by_name) - seen)[:3]} are in no fragment")
        spec = cls(tuple(tensors), tuple(fragments))
        if msg.spec_hash and msg.spec_hash != spec.spec_hash:
            raise ValueError(
                "spec_hash does not match the spec's contents (different protos version?)"
            )
        return spec

    def describe_difference(self, other: ModelSpec) -> str:
        """One line saying how another spec differs from this one (for refusals)."""
        mine = {t.name: t for t in self.tensors}
        theirs = {t.name: t for t in other.tensors}
        if mine.keys() != theirs.keys():
            only_mine = sorted(mine.keys() - theirs.keys())[:3]
            only_theirs = sorted(theirs.keys() - mine.keys())[:3]
            return f"tensor names differ: served model only has {only_mine}, yours only has {only_theirs}"
        for name, t in mine.items():
            o = theirs[name]
            if t.shape != o.shape:
                return f"tensor {name!r} has shape {list(t.shape)} in the served model, {list(o.shape)} in yours"
            if t.dtype != o.dtype:
                return f"tensor {name!r} is {t.dtype} in the served model, {o.dtype} in yours"
        if len(self.fragments) != len(other.fragments):
            return f"served model has {len(self.fragments)} fragments, yours has {len(other.fragments)}"
        for f, of in zip(self.fragments, other.fragments, strict=True):
            if [t.name for t in f.tensors] != [t.name for t in of.tensors]:
                return f"fragment {f.fragment_id} holds different tensors (different fragment plan)"
        if [t.name for t in self.tensors] != [t.name for t in other.tensors]:
            return "tensors are listed in a different order"
        return "specs are identical"


def plan_fragments(
    tensors: Sequence[TensorInfo], num_fragments: int, strategy: str = "balanced"
) -> ModelSpec:
    """Splits tensors into fragments, deterministically from names and shapes alone.

    balanced: largest tensor first into the currently smallest fragment (ties broken by id), so
    fragments are as even as whole tensors allow and the peak in-flight bytes are lowest.
    strided: tensors in model order are cut into num_fragments contiguous runs of about equal
    size, so each fragment is a band of consecutive blocks.
    Inside a fragment tensors keep model order. Empty fragments are dropped.
    """
    if num_fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {num_fragments}")
    if strategy not in STRATEGIES:
        raise ValueError(f"fragment strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not tensors:
        raise ValueError("the model has no parameters to synchronize")
    order = {t.name: i for i, t in enumerate(tensors)}
    bins: list[list[TensorInfo]] = [[] for _ in range(num_fragments)]
    if strategy == "balanced":
        sizes = [0] * num_fragments
        for t in sorted(tensors, key=lambda t: (-t.numel, order[t.name])):
            i = min(range(num_fragments), key=lambda j: (sizes[j], j))
            bins[i].append(t)
            sizes[i] += t.numel
    else:
        total = sum(t.numel for t in tensors)
        done = 0
        for t in tensors:
            i = min(num_fragments - 1, (done * num_fragments) // max(total, 1))
            bins[i].append(t)
            done += t.numel
    bins = [sorted(b, key=lambda t: order[t.name]) for b in bins if b]
    return ModelSpec(tuple(tensors), tuple(Fragment(i, tuple(b)) for i, b in enumerate(bins)))


def shard_owners(spec: ModelSpec, shards: int) -> list[int]:
    """The shard that owns each fragment (index = fragment id) when `shards` Synchronizer
    processes share the model: largest fragment first onto the shard with the fewest bytes so far
    (ties by fragment id, then shard index). A pure function of the fragments' sizes and the shard
    count, so learners and shards compute it alike; every shard owns at least one fragment."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if shards > len(spec.fragments):
        raise ValueError(
            f"{shards} shards for a model of {len(spec.fragments)} fragments would leave a shard "
            "with none; use at most as many shards as fragments"
        )
    owners = [0] * len(spec.fragments)
    load = [0] * shards
    for f in sorted(spec.fragments, key=lambda f: (-f.numel, f.fragment_id)):
        s = min(range(shards), key=lambda j: (load[j], j))
        owners[f.fragment_id] = s
        load[s] += f.numel
    return owners


def owned_fragments(spec: ModelSpec, shards: int, index: int) -> list[int]:
    """The fragment ids shard `index` of `shards` owns, in id order."""
    return [fid for fid, s in enumerate(shard_owners(spec, shards)) if s == index]
