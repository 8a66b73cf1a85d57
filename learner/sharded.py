"""Sharded islands (FSDP2 under torchrun): every rank syncs only the slice it holds.

A model sharded with `torch.distributed.fsdp.fully_shard` keeps, on each rank, rows of every
parameter (dim-0 shards on a 1-D mesh). Such an island is one learner of the run: rank 0 joins
and heartbeats, and every rank, under the same learner id and session, pushes and pulls only its
slice of each fragment (`pb.Slice`: runs of the fragment's flat vector). The Synchronizer merges
the slices of one contribution (one seq) as that learner's push, all of them or none, and serves
each rank its runs. Nothing is gathered to one rank, except once, one fragment at a time, when the
island itself initialises the global model.

The ranks stay in step with one small all-gather per inner step (`Exchange`): which fragments
each rank has busy, the version each rank has back, and rank 0's H and next seq. From that every
rank takes the same decisions: push a due fragment only when no rank is busy with it (all with
the same seq), merge a fragment only when every rank has the same version of it back, and a rank
behind the others re-pulls its slice at their version first.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from protos import diloco_pb2 as pb
from protos.spec import Fragment


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter is a DTensor (the model was sharded with FSDP2)."""
    return any(_is_dtensor(p) for p in model.parameters())


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: the local shard of a DTensor, else the tensor."""
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined,no-any-return]


def check_shardable(model: torch.nn.Module) -> None:
    """ValueError unless every parameter is a DTensor sharded on dim 0 over one mesh dimension
    that spans the whole process group (what `fully_shard(model)` makes)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for name, p in model.named_parameters():
        if not _is_dtensor(p):
            raise ValueError(
                f"parameter {name!r} is not sharded: a sharded island needs every parameter "
                "sharded by fully_shard (wrap the root module too)"
            )
        mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
        shard0 = (
            len(placements) == 1 and placements[0].is_shard() and placements[0].dim == 0  # type: ignore[union-attr]
        )
        if mesh.ndim != 1 or not shard0 or mesh.size() != world:
            raise ValueError(
                f"parameter {name!r} is placed {tuple(placements)} on a mesh of shape "
                f"{tuple(mesh.shape)}: a sharded island supports dim-0 shards over one mesh "
                f"dimension of all {world} ranks (fully_shard without HSDP)"
            )
        if p.dim() == 0:
            raise ValueError(f"parameter {name!r} is a scalar: it cannot be sharded by rows")


def runs_of(fragment: Fragment, params: Sequence[torch.Tensor]) -> pb.Slice:
    """This rank's slice of a fragment: its rows of each tensor, as runs of the fragment's flat
    vector (adjacent runs joined). FSDP2 gives rank r rows [r*c, (r+1)*c) of n, c = ceil(n/R);
    the local shard's size is checked against that."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    starts: list[int] = []
    lengths: list[int] = []
    offset = 0
    for info, p in zip(fragment.tensors, params, strict=True):
        n = p.shape[0]
        row = p.numel() // n if n else 0
        chunk = -(-n // ranks)
        first = min(rank * chunk, n)
        rows = local(p).shape[0]
        if rows != max(0, min(chunk, n - first)):
            raise ValueError(
                f"parameter {info.name!r}: rank {rank} holds {rows} of its {n} rows, where dim-0 "
                f"sharding over {ranks} ranks gives {max(0, min(chunk, n - first))}: unsupported "
                "sharding (uneven shard placement)"
            )
        if rows:
            start, length = offset + first * row, rows * row
            if starts and starts[-1] + lengths[-1] == start:
                lengths[-1] += length
            else:
                starts.append(start)
                lengths.append(length)
        offset += p.numel()
    return pb.Slice(rank=rank, ranks=ranks, starts=starts, lengths=lengths)


@torch.no_grad()
def gather_full(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The whole fragment's flat FP32 vector on every rank (a collective): only to initialise."""
    full = [p.full_tensor().detach().reshape(-1).float().cpu() for p in params]  # type: ignore[attr-defined]
    return torch.cat(full) if full else torch.empty(0)


class Messages:
    """Rank 0 telling the other ranks what happens while it joins (one object broadcast each)."""

    @staticmethod
    def tell(message: tuple[Any, ...]) -> None:
        box = [pickle.dumps(message)]
        dist.broadcast_object_list(box, src=0)

    @staticmethod
    def hear() -> tuple[Any, ...]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        message = pickle.loads(box[0])
        assert isinstance(message, tuple)
        return message


@dataclass
class Agreed:
    """What every rank read from one exchange."""

    busy: list[bool]  # per fragment: some rank has a sync of it in flight
    versions: list[list[int]]  # per fragment, per rank: the version back (-1: none)
    sync_every: int  # rank 0's H
    next_seq: int  # rank 0's next push seq
    flags: list[int]  # per rank: the caller's flag (e.g. "idle")

    def ready(self, p: int) -> bool:
        """Every rank has the same version of fragment p back: merge it."""
        vs = self.versions[p]
        return vs[0] >= 0 and all(v == vs[0] for v in vs)

    def behind(self, p: int, rank: int, busy_here: bool) -> int | None:
        """The version this rank must re-pull fragment p at to catch up with the others (some
        rank has a newer one back and this rank has an older one, or none and nothing of p in
        flight); None when it need not."""
        vs = self.versions[p]
        top = max(vs)
        mine = vs[rank]
        if top < 0 or mine == top or (mine < 0 and busy_here):
            return None
        return top


def exchange(
    num: int,
    busy: Sequence[bool],
    versions: Sequence[int],
    sync_every: int,
    next_seq: int,
    flag: int = 0,
) -> Agreed:
    """One all-gather of every rank's state (a collective): the same `Agreed` on every rank."""
    world = dist.get_world_size()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    mine = torch.tensor(
        [int(b) for b in busy] + list(versions) + [sync_every, next_seq, flag],
        dtype=torch.int64,
        device=device,
    )
    table = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(table, mine)
    rows = torch.stack(table).tolist()
    return Agreed(
        busy=[any(r[p] for r in rows) for p in range(num)],
        versions=[[r[num + p] for r in rows] for p in range(num)],
        sync_every=rows[0][2 * num],
        next_seq=rows[0][2 * num + 1],
        flags=[r[2 * num + 2] for r in rows],
    )
