"""Islands: bytes each rank of a sharded (FSDP2) island sends, against a replicated island's rank 0.

Two runs of the main job (`diloco-learner local`), one after the other, each one learner that is
a torchrun island of N ranks (gloo on CPU) against its own Synchronizer, with the same model,
data, seed, H, fragments and codec: the island replicated (DDP: rank 0 alone pushes and pulls
whole fragments) and sharded (FSDP2: every rank pushes and pulls only its slice of each
fragment). From each rank's own byte counters:

- `rank_bytes_ratio`: the most any FSDP2 rank sent while training (after joining: rank 0's upload
  of the initial model is left out) over what the replicated island's rank 0 sent (expected
  about 1/N: a slice is 1/N of each fragment, plus per-push headers);
- `island_bytes_ratio`: all FSDP2 ranks together over the replicated rank 0 (about 1);
- `rank_received_ratio`: the most any FSDP2 rank received over what the replicated rank 0
  received (about 1/N: a rank pulls its runs, and of each kept update only the blocks that hold
  them, `protos.slicing`);
- `eval_ratio`: the sharded island's final global eval loss over the replicated one's. The two
  islands see the same data, so they differ only by the order of floating-point reductions and
  what that does through the codec (the codec's error bound per push).

    python -m bench.islands [--quick | --smoke] [--json PATH] [--ranks N] [--steps S]
Modes: --smoke 2 ranks x 40 steps; --quick 2 ranks x 150 steps (about 2 minutes here); full
2 ranks x 400 steps.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from bench.common import machine, parser, program, run_mode, say_mode, table, write_json
from demo.local import run
from demo.options import LocalOptions
from demo.procs import read_json

MODES = {"smoke": 40, "quick": 150, "full": 400}


def arm(fsdp: bool, ranks: int, steps: int, out: Path) -> dict[str, Any]:
    """One island of `ranks` ranks, alone against its Synchronizer; each rank's bytes."""
    o = LocalOptions(
        learners=1,
        island_size=ranks,
        fsdp=fsdp,
        steps=steps,
        out=out,
        quorum=1,
        sync_every=10,
        fragments=4,
        codec="int8",
        plot=False,
        live=False,
        log_every=10,
    )
    summary = run(o)
    first = out / "learner-0.json"
    per_rank = [read_json(first), *(read_json(Path(f"{first}.rank{r}")) for r in range(1, ranks))]
    # Bytes sent while training: the join (and rank 0's upload of the initial model) left out
    sent = [
        int(r.get("bytes_sent", 0)) - int(r.get("learner", {}).get("bytes_sent_joining", 0))
        for r in per_rank
    ]
    received = [int(r.get("bytes_received", 0)) for r in per_rank]
    island = summary["per_learner"][next(iter(summary["per_learner"]))].get("island", {})
    return {
        "arm": "fsdp2" if fsdp else "replicated",
        "ranks": ranks,
        "steps": steps,
        "rank_bytes_sent": sent,
        "rank_bytes_received": received,
        "pushes": per_rank[0].get("learner", {}).get("pushes", {}),
        "eval_loss_start": summary["eval_loss_start"],
        "eval_loss_end": summary["eval_loss_end"],
        "ranks_finished": island.get("finished"),
        "ranks_identical": island.get("identical"),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks per island (default 2)")
    p.add_argument("--steps", type=int, help="inner steps (default by mode)")
    args = p.parse_args(argv)
    mode = run_mode(args, quick_is_smoke="")
    say_mode(mode)
    steps = args.steps or MODES[mode["mode"]]
    with tempfile.TemporaryDirectory(prefix="bench-islands-") as tmp:
        rep = arm(False, args.ranks, steps, Path(tmp) / "replicated")
        shd = arm(True, args.ranks, steps, Path(tmp) / "fsdp2")
    base = rep["rank_bytes_sent"][0]
    result: dict[str, Any] = {
        **mode,
        "machine": machine(),
        "replicated": rep,
        "fsdp2": shd,
        "rank_bytes_ratio": max(shd["rank_bytes_sent"]) / base if base else None,
        "island_bytes_ratio": sum(shd["rank_bytes_sent"]) / base if base else None,
        "rank_received_ratio": max(shd["rank_bytes_received"]) / rep["rank_bytes_received"][0]
        if rep["rank_bytes_received"][0]
        else None,
        "expected_rank_ratio": 1 / args.ranks,
        "eval_ratio": shd["eval_loss_end"] / rep["eval_loss_end"],
    }
    rows = [
        {
            "arm": a["arm"],
            "ranks": a["ranks"],
            "bytes sent per rank": " / ".join(f"{b:,}" for b in a["rank_bytes_sent"]),
            "bytes received per rank": " / ".join(f"{b:,}" for b in a["rank_bytes_received"]),
            "eval start": a["eval_loss_start"],
            "eval end": a["eval_loss_end"],
        }
        for a in (rep, shd)
    ]
    print(table(rows, list(rows[0])))
    print(
        f"rank_bytes_ratio {result['rank_bytes_ratio']:.3f} (expected about "
        f"{result['expected_rank_ratio']:.3f}), island_bytes_ratio "
        f"{result['island_bytes_ratio']:.3f}, rank_received_ratio "
        f"{result['rank_received_ratio']:.3f}, eval_ratio {result['eval_ratio']:.4f}"
    )
    say_mode(mode)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    program(main)
