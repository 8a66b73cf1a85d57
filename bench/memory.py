"""Memory: the bytes each fragment's tensors hold in a Synchronizer serving a model of N
parameters, in steady state and while a checkpoint is written.

Builds the Synchronizer's fragments in this process (default settings, no gRPC), initialises
them, and runs rounds of `--learners` INT4 pushes each until the update chain is full. Then it
counts the bytes of every tensor a fragment holds, by part: parameters, outer state, residual,
update chain, an open round's accumulator, full-pull snapshots still alive, and any other tensor
attribute of the model or its downlink (a permanent scratch); and the buffers every fragment
shares: the FP32 buffers outer steps take for round sums (`accumulators`), and the pooled and
held push payloads (`pool`). The checkpoint figure is the most
bytes the checkpoint's copies hold at once: every tensor handed to the checkpoint writer that is
not storage the fragment already holds, measured at each write (or, for a writer that takes
them all at once, in total). Bytes per parameter = bytes / N.

    python -m bench.memory [--quick | --smoke] [--params N] [--fragments 4] [--learners 4]
        [--json PATH]

Modes: full 4M parameters, --quick 1M, --smoke 100k (`--params` overrides any).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bench.common import parser, program, run_mode, write_json
from protos import codec, layout
from protos import diloco_pb2 as pb
from protos.spec import TensorInfo, plan_fragments
from synchronizer import checkpoint
from synchronizer.config import SynchronizerConfig
from synchronizer.core import Synchronizer


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors directly in `obj`: a tensor, or one inside a list, tuple, deque or dict."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)) or type(obj).__name__ == "deque":
        for v in obj:
            yield from _tensors(v)


def _storage_bytes(tensors: Iterator[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen and s.nbytes() > 0:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def fragment_bytes(frag: Any) -> dict[str, int]:
    """Bytes of the tensors one `Fragment` holds, by part (each storage counted once)."""
    model, down, adm = frag.model, frag.model.downlink, frag.admission
    seen: set[int] = set()
    parts = {
        "params": _storage_bytes(_tensors(model.params), seen),
        "outer": _storage_bytes(_tensors(model.outer.state_dict()), seen),
        "residual": _storage_bytes(_tensors(down.residual), seen),
        "chain": _storage_bytes((buf for _, _, buf in down.chain), seen),
    }
    acc = adm.round.acc if adm.round is not None else None
    parts["accumulators"] = _storage_bytes(_tensors(acc.buffer if acc else None), seen)
    parts["snapshots"] = _storage_bytes(_tensors(down.snapshots_alive()), seen)
    other = list(_tensors(list(vars(model).values()))) + list(_tensors(list(vars(down).values())))
    parts["other"] = _storage_bytes(iter(other), seen)
    return parts


def shared_bytes(core: Synchronizer) -> dict[str, int]:
    """Bytes of the buffers all fragments share: free FP32 round buffers, and push payloads
    pooled for reuse or held by open rounds."""
    frag = core.model.fragments[0]
    seen: set[int] = set()
    held = [
        h.buf for f in core.model.fragments if f.admission.round for h in f.admission.round.held
    ]
    return {
        "accumulators": _storage_bytes(_tensors(frag.fp32._free), seen),
        "pool": _storage_bytes(_tensors([list(frag.payloads._free.values()), held]), seen),
    }


def _live_storages(core: Synchronizer) -> set[int]:
    seen: set[int] = set()
    for frag in core.model.fragments:
        for part in (frag.model.__dict__, frag.model.downlink.__dict__):
            _storage_bytes(_tensors(list(part.values())), seen)
        _storage_bytes(_tensors(frag.model.outer.state_dict()), seen)
        _storage_bytes((buf for _, _, buf in frag.model.downlink.chain), seen)
    return seen


def checkpoint_copy_bytes(core: Synchronizer) -> int:
    """The most bytes of copies a checkpoint holds at once (see the module docstring)."""
    live = _live_storages(core)
    peak = 0
    held: list[int] = []

    def count(tensors: Any) -> int:
        seen = set(live)
        return _storage_bytes(_tensors(dict(tensors)), seen)

    writer = getattr(checkpoint, "Writer", None)
    if writer is not None:  # streamed: the copies of one add() are alive until the next
        original = writer.add

        def add(self: Any, tensors: Any) -> None:
            nonlocal peak
            held.append(count(tensors))
            peak = max(peak, held[-1])
            original(self, tensors)

        writer.add = add
        try:
            core.save_checkpoint()
        finally:
            writer.add = original
    else:  # one call with every tensor
        original_save = checkpoint.save

        def save(state_dir: Path, tensors: Any, meta: Any, keep: int) -> Path:
            nonlocal peak
            peak = count(tensors)
            return original_save(state_dir, tensors, meta, keep)

        checkpoint.save = save  # type: ignore[assignment]
        try:
            core.save_checkpoint()
        finally:
            checkpoint.save = original_save  # type: ignore[assignment]
    return peak


def run_rounds(core: Synchronizer, learners: int, rounds: int, seed: int = 0) -> None:
    """`rounds` rounds of every fragment, each of `learners` INT4 pushes at the current version,
    submitted and applied as the outer-step worker does (no gRPC)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        for frag in core.model.fragments:
            delta = torch.randn(frag.numel, generator=g) * 1e-3
            header = layout.make_header(pb.CODEC_INT4, frag.numel)
            payload = codec.encode(delta, pb.CODEC_INT4)
            for m in range(learners):
                buf = frag.payloads.take(payload.numel()).copy_(payload)  # as a push does
                hold = frag.payloads.reserve(buf.numel())
                frag.submit(f"l{m}", frag.version, 1000, 10, 1.0, (buf, header), hold=hold)
            rnd = frag.admission.round
            assert rnd is not None and frag.admission.take(rnd)
            frag.apply(rnd)


def measure(params: int, fragments: int, learners: int, **settings: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as state:
        cfg = SynchronizerConfig(
            state_dir=Path(state), wal=False, checkpoint_interval_s=0, metrics_port=-1, **settings
        )
        core = Synchronizer(cfg)
        try:
            per = [params // fragments] * fragments
            per[-1] += params - sum(per)
            spec = plan_fragments(
                [TensorInfo(f"layer{i}.weight", (n,)) for i, n in enumerate(per)], fragments
            )
            core.model.serve(spec)
            for frag in core.model.fragments:
                frag.initialize(torch.randn(frag.numel) * 0.02)
            core.model.initialized = True
            run_rounds(core, learners, cfg.update_history + 1)
            by_fragment = [fragment_bytes(f) for f in core.model.fragments]
            shared = shared_bytes(core)
            totals = {k: sum(f[k] for f in by_fragment) for k in by_fragment[0]}
            totals["accumulators"] += shared["accumulators"]
            totals["pool"] = shared["pool"]
            steady = sum(totals.values())
            ckpt = checkpoint_copy_bytes(core)
        finally:
            core.close()
    return {
        "params": params,
        "fragments": fragments,
        "by_fragment": by_fragment,
        "shared": shared,
        "bytes_per_param": {k: round(v / params, 3) for k, v in totals.items()},
        "steady_bytes_per_param": round(steady / params, 3),
        "checkpoint_copies_bytes_per_param": round(ckpt / params, 3),
        "peak_bytes_per_param": round((steady + ckpt) / params, 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=None, help="model parameters (default: by mode)")
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--learners", type=int, default=4)
    args = p.parse_args(argv)
    if (args.params is not None and args.params < 1) or args.fragments < 1 or args.learners < 1:
        p.error("--params, --fragments and --learners take a number >= 1")
    params = args.params or (100_000 if args.smoke else 1_000_000 if args.quick else 4_000_000)
    result = measure(params, args.fragments, args.learners) | run_mode(args)
    for fid, parts in enumerate(result["by_fragment"]):
        print(f"fragment {fid}: " + ", ".join(f"{k} {v:,}" for k, v in parts.items()))
    print("shared: " + ", ".join(f"{k} {v:,}" for k, v in result["shared"].items()))
    print("bytes per parameter:", result["bytes_per_param"])
    print(
        f"steady {result['steady_bytes_per_param']} B/param; checkpoint copies "
        f"{result['checkpoint_copies_bytes_per_param']} B/param; "
        f"peak {result['peak_bytes_per_param']} B/param"
    )
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    program(main)
