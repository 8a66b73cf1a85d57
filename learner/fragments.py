"""A model seen as fragments: the plan, flat gather/scatter, the schedule, error feedback, merges.

Everything here is local arithmetic with no network and no threads, so each piece is testable
alone. A fragment's flat vector is its tensors (in the plan's order) flattened and concatenated
into one FP32 vector: the layout every payload on the wire uses (`protos/spec.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from learner import sharded
from learner.sharded import local
from protos import codec, layout
from protos import diloco_pb2 as pb
from protos.spec import Fragment, ModelSpec, TensorInfo, plan_fragments

MERGE_MODES = ("overwrite", "mix", "rebase")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_infos(model: torch.nn.Module) -> list[TensorInfo]:
    """The model's parameters as the spec describes them, in `named_parameters()` order."""
    return [TensorInfo(n, tuple(p.shape), dtype_name(p.dtype)) for n, p in model.named_parameters()]


class FragmentPlan:
    """The spec of a model plus, per fragment, the live parameters it covers."""

    def __init__(
        self, model: torch.nn.Module, num_fragments: int, strategy: str = "balanced"
    ) -> None:
        self.spec: ModelSpec = plan_fragments(tensor_infos(model), num_fragments, strategy)
        params = dict(model.named_parameters())
        self.params: list[list[torch.nn.Parameter]] = [
            [params[t.name] for t in f.tensors] for f in self.spec.fragments
        ]
        # Of a model sharded with FSDP2, this rank's slice of each fragment (None: the whole)
        self.slices: list[pb.Slice] | None = None
        if sharded.is_sharded(model):
            sharded.check_shardable(model)
            self.slices = [
                sharded.runs_of(f, ps)
                for f, ps in zip(self.spec.fragments, self.params, strict=True)
            ]

    @property
    def fragments(self) -> tuple[Fragment, ...]:
        return self.spec.fragments

    def __len__(self) -> int:
        return len(self.spec.fragments)

    def numel(self, p: int) -> int:
        """Elements of fragment p held here: its slice's in a sharded island, else all."""
        if self.slices is not None:
            return sum(self.slices[p].lengths)
        return self.spec.fragments[p].numel

    def gather(self, p: int, device: torch.device | str | None = None) -> torch.Tensor:
        """A fresh FP32 copy of fragment p's flat vector (on `device`, default the params')."""
        return gather(self.params[p], device)

    def scatter(self, p: int, flat: torch.Tensor) -> None:
        scatter(self.params[p], flat)


@torch.no_grad()
def gather(
    params: Sequence[torch.Tensor], device: torch.device | str | None = None
) -> torch.Tensor:
    flat = torch.cat([local(t).detach().reshape(-1).float() for t in params])
    return flat if device is None else flat.to(device)


@torch.no_grad()
def scatter(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copies a flat vector back into the parameters (in place, casting to their dtype/device)."""
    params = [local(t) for t in params]
    total = sum(t.numel() for t in params)
    if flat.numel() != total:
        raise ValueError(
            f"flat vector has {flat.numel()} elements, the fragment's tensors hold {total}"
        )
    start = 0
    for t in params:
        n = t.numel()
        t.copy_(flat[start : start + n].view(t.shape))
        start += n


# Schedule --------------------------------------------------------------------------------------


def schedule_offsets(sync_every: int, num_fragments: int) -> list[int]:
    """offset_p = p*H//P: fragments are spread evenly over the H steps of a cycle."""
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")
    return [(p * sync_every) // num_fragments for p in range(num_fragments)]


class Schedule:
    """Which fragments a learner pushes after which of the run's steps (counted from 1).

    Fragments go in turn, 0..P-1, fragment p at offset p*H//P into each cycle of H steps: with
    H fixed, p is due at the steps with (step - offset_p) % H == 0. A change of H (Dynamic Local
    Updates) changes the spacing from the last push on, never the order, so learners whose H
    differ push the fragments in the same order; a synchronous round that waits for every
    learner's push of one fragment would otherwise wait for one that pushes another first.
    """

    def __init__(self, sync_every: int, num_fragments: int, step: int = 0) -> None:
        """The schedule of a learner whose next step is `step` + 1."""
        self.num = num_fragments
        self.sync_every = sync_every
        offsets = schedule_offsets(sync_every, num_fragments)
        first = [step + 1 + (off - step - 1) % sync_every for off in offsets]
        self.next = min(range(num_fragments), key=lambda p: (first[p], p))
        self.next_at = first[self.next]
        self.last_at = self.next_at - self._gap(self.next)  # when the one before was due

    def _gap(self, p: int) -> int:
        """Steps from the push of the fragment before `p` to p's, at the current H."""
        off = schedule_offsets(self.sync_every, self.num)
        return off[p] - off[p - 1] if p > 0 else self.sync_every - off[-1]

    def due(self, step: int) -> list[int]:
        """The fragments due after `step`, in order; call it after every step."""
        out: list[int] = []
        while step >= self.next_at and len(out) < self.num:
            out.append(self.next)
            self.last_at = step
            self.next = (self.next + 1) % self.num
            self.next_at = step + self._gap(self.next)
        return out

    def set_sync_every(self, sync_every: int) -> None:
        """A new H from the next push on: it is due its new spacing after the last one."""
        schedule_offsets(sync_every, self.num)  # checks it
        self.sync_every = sync_every
        self.next_at = self.last_at + self._gap(self.next)

    def follow(self, versions: Sequence[int]) -> None:
        """Joining a run under way at these fragment versions: the next push is of the fragment
        whose round the others are on, whatever this learner's own turn.

        The others push in turn, so the fragments whose rounds closed this cycle are one version
        ahead of the rest: the first fragment (in turn) of the rest is theirs, and where all are
        equal (a cycle just ended, or a run just starting) no version says it and this learner's
        own turn stands. Pushing another first would put its pushes in rounds out of the others'
        order: under strict overlap in a synchronous run, it would wait for a round that waits
        for the others' next push, which wait for its own."""
        behind = [p for p in range(self.num) if versions[p] < versions[p - 1]]
        if len(behind) == 1:  # the others' turn (more than one: rounds not in turn; leave it)
            self.next = behind[0]

    def state(self) -> list[int]:
        return [self.sync_every, self.next, self.next_at, self.last_at]

    @classmethod
    def restored(cls, state: Sequence[int], num_fragments: int) -> Schedule:
        sched = cls(int(state[0]), num_fragments)
        sched.next, sched.next_at, sched.last_at = (int(x) for x in state[1:4])
        if not 0 <= sched.next < num_fragments:
            raise ValueError(
                f"a saved schedule's next fragment {sched.next} is not one of {num_fragments}"
            )
        return sched


# Error feedback --------------------------------------------------------------------------------


class ErrorFeedback:
    """Per fragment, what earlier quantized pushes meant to send but did not.

    push: x = delta + residual; q = Q(x); the new residual is x - dequant(q). So the sum of what
    was transmitted tracks the sum of the true deltas up to one step's quantization error, instead
    of drifting. The residual is committed only once the push it belongs to is applied: a push
    that is superseded or dropped sent nothing, so the old residual still stands.
    """

    def __init__(
        self, numels: Sequence[int], device: torch.device | str, enabled: bool = True
    ) -> None:
        self.enabled = enabled
        self.residuals = [torch.zeros(n, device=device) if enabled else None for n in numels]

    def encode(
        self, p: int, delta: torch.Tensor, codec_id: int, block_size: int, scale_dtype: int
    ) -> tuple[torch.Tensor, pb.PayloadHeader, torch.Tensor | None]:
        """What to push for fragment p: (delta + residual_p encoded, its header, the residual
        that stands once it is applied, None without error feedback). Modifies delta in place.
        CodecError when it is not finite."""
        r = self.residuals[p]
        x = delta if r is None else delta.add_(r)
        header = layout.make_header(codec_id, x.numel(), block_size, scale_dtype)
        encoded = codec.encode(x, codec_id, block_size, scale_dtype)
        if not self.enabled:
            return encoded, header, None
        return encoded, header, x - codec.decode(encoded, header, torch.empty_like(x))

    def commit(self, p: int, residual: torch.Tensor | None) -> None:
        if self.enabled and residual is not None:
            self.residuals[p] = residual


# Merges ----------------------------------------------------------------------------------------


def merge_fragment(
    mode: str, local: torch.Tensor, fresh: torch.Tensor, anchor: torch.Tensor | None, alpha: float
) -> torch.Tensor:
    """The fragment's new local parameters once the fresh global `fresh` arrives.

    overwrite: fresh. mix: alpha*fresh + (1-alpha)*local (Streaming DiLoCo). rebase: fresh plus
    the local progress made since `anchor` (the fragment as it was pushed, or the base it was last
    synced to when nothing of it was applied). Returns a new tensor; inputs are not modified.
    """
    if mode == "overwrite":
        return fresh.clone()
    if mode == "mix":
        return torch.lerp(local, fresh, alpha)
    if mode == "rebase":
        if anchor is None:
            raise ValueError("rebase needs the anchor the local progress is measured from")
        return fresh + (local - anchor)
    raise ValueError(f"merge must be one of {MERGE_MODES}, got {mode!r}")
