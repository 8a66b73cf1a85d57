"""A multi-GPU island (torchrun): rank 0 alone syncs, and the other ranks receive what it merged.

With torchrun (default process group initialised, parameters replicated as in DDP) rank 0 alone
talks to the Synchronizer. At the end of every `Learner.step()` all ranks take part in one small
broadcast of which fragments rank 0 merged, then one broadcast per merged fragment of its flat
parameters, so the island stays identical. Without torch.distributed the island is one rank and
nothing is broadcast.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from learner.fragments import FragmentPlan


class Island:
    """This process's rank in its torchrun island, and the broadcasts that keep ranks identical."""

    def __init__(self, plan: FragmentPlan, device: torch.device) -> None:
        self.plan, self.device = plan, device  # the model's parameters' device
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world = 0, 1
        self.leader = self.rank == 0  # the rank that talks to the Synchronizer

    @torch.no_grad()
    def broadcast(self, merged: set[int], announce: bool = True) -> None:
        """Rank 0 sends the fragments it merged to the other ranks; a collective, a no-op alone.
        Without `announce` every rank already knows which fragments (all of them, say)."""
        if self.world == 1:
            return
        frags = sorted(merged)
        if announce:
            mask = torch.zeros(len(self.plan), dtype=torch.int32, device=self.device)
            if self.leader and frags:
                mask[frags] = 1
            dist.broadcast(mask, src=0)
            frags = mask.nonzero().flatten().tolist()
        for p in frags:
            flat = (
                self.plan.gather(p, self.device)
                if self.leader
                else torch.empty(self.plan.numel(p), dtype=torch.float32, device=self.device)
            )
            dist.broadcast(flat, src=0)
            if not self.leader:
                self.plan.scatter(p, flat)
