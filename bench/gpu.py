"""GPU: a Synchronizer and 2 learners of the bundled GPT at about 700M parameters on one GPU.

A real `python -m synchronizer serve` with default settings (state in a temporary directory),
its resident memory sampled from /proc (`bench.scale_load.RssSampler`), and two `python -m demo
train` learners on `--device cuda` (24 layers, width 1536, 12 heads; 4 fragments, INT4 pushes,
one sync every 10 steps). Learner 0 starts first and uploads the model (InitModel); learner 1
starts once the Synchronizer serves it. Both wait for the other before their first step, so
they train side by side on the GPU. Then the same two learners train again with `--no-sync`,
side by side, so that the GPU is shared the same way in both runs:

- `init_s`: learner 0's launch to the Synchronizer serving a model (Status `initialized`):
  process start, model build, Join and the whole upload, which writes the first checkpoint;
- `join_s`: learner 1's launch to its first step (the demo's `started_at`): process start,
  model build, Join, the full pull of every fragment and its first evaluation;
- `eval_loss_start`, `eval_loss_end`: learner 1's held-out loss on the model it pulled (no
  learner has stepped yet) and on the global model it adopts when it leaves;
- `steps_per_s`, `steps_per_s_no_sync`, `sync_vs_nosync`: learner 1's training steps per second
  syncing, without syncing, and the first over the second;
- `rss_peak_bytes`, `rss_ratio`: the Synchronizer's peak resident memory (VmHWM) and that over
  the model's FP32 bytes.

    python -m bench.gpu [--smoke] [--steps N] [--json PATH] [--root DIR]

Without CUDA the full mode prints one line saying so and exits 0 (the JSON says `skipped`).
`--smoke` runs the same flow on whatever device is there with the tiny model of `demo.tiny`.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from bench.common import machine, parser, program, table, write_json
from bench.scale_load import RssSampler
from demo.procs import Procs, start_synchronizer
from demo.tiny import NotInTime, finish_ok, start_learner, status, wait_until

LEARNERS = 2
SYNC = ["--fragments", "4", "--codec", "int4", "--sync-every", "10"]
# The bundled GPT at about 700M parameters; these follow (and so override) demo.tiny.TINY.
GPT_700M = [
    "--n-layer",
    "24",
    "--d-model",
    "1536",
    "--n-head",
    "12",
    "--context",
    "256",
    "--batch-size",
    "8",
    "--max-bytes",
    str(4 << 20),
    "--lr",
    "3e-4",
    "--threads",
    "4",
]
MODES = {  # model flags, steps, then timeouts (s): Synchronizer start, upload, a learner run
    "smoke": ([], 10, 60.0, 120.0, 180.0),  # one sync (H = 10): it runs, no more
    "full": (GPT_700M, 40, 300.0, 900.0, 1800.0),
}
COLUMNS = [
    "params",
    "rss_ratio",
    "init_s",
    "join_s",
    "eval_loss_start",
    "eval_loss_end",
    "steps_per_s",
    "steps_per_s_no_sync",
    "sync_vs_nosync",
]


def _learners(
    procs: Procs, address: str, steps: int, flags: list[str], finish_s: float, run: int
) -> list[dict[str, Any]]:
    """Both learners started together with `flags`, and their results once they have finished."""
    started = [
        start_learner(procs, address, i, LEARNERS, steps, *flags, run=run) for i in range(LEARNERS)
    ]
    return [finish_ok(procs, p, out, timeout_s=finish_s) for p, out in started]


def run(root: Path, mode: str, steps: int, device: str) -> dict[str, Any]:
    """One run under `root`; its figures. NotInTime (with the logs' ends) when a process does
    not get where it should in its time."""
    model, _, serve_s, upload_s, finish_s = MODES[mode]
    flags = [*model, *SYNC, "--device", device]
    procs = Procs(root)
    try:
        try:
            proc, info = start_synchronizer(procs, timeout_s=serve_s)
        except RuntimeError as e:
            raise NotInTime(f"{e}\n{procs.tails()}") from None
        rss = RssSampler(proc.pid)
        address = info["address"]
        together = [*flags, "--wait-for-learners", str(LEARNERS)]

        t0 = time.time()
        first, first_out = start_learner(procs, address, 0, LEARNERS, steps, *together)

        def initialized() -> bool:
            if first.poll() is not None:
                raise NotInTime(f"learner 0 exited with {first.returncode}\n{procs.tails()}")
            try:
                return status(address).initialized
            except grpc.RpcError:  # busy with the upload: ask again
                return False

        wait_until(initialized, upload_s, "learner 0 to upload the model", procs)
        init_s = time.time() - t0

        t1 = time.time()
        second, second_out = start_learner(procs, address, 1, LEARNERS, steps, *together)
        synced = [
            finish_ok(procs, first, first_out, timeout_s=finish_s),
            finish_ok(procs, second, second_out, timeout_s=finish_s),
        ]
        peak = rss.stop()
        alone = _learners(procs, address, steps, [*flags, "--no-sync"], finish_s, run=1)
    finally:
        procs.stop_all(grace_s=10)
    one, one_alone = synced[1], alone[1]
    params = int(one["params"])
    return {
        "params": params,
        "steps": steps,
        "rss_peak_bytes": peak,
        "rss_ratio": peak / (4 * params),
        "init_s": init_s,
        "join_s": one["started_at"] - t1,
        "eval_loss_start": one["eval_loss_start"],
        "eval_loss_end": one["eval_loss_end"],
        "steps_per_s": one["steps_per_s"],
        "steps_per_s_no_sync": one_alone["steps_per_s"],
        "sync_vs_nosync": one["steps_per_s"] / one_alone["steps_per_s"],
        "learners": [
            {k: r[k] for k in ("name", "sync", "eval_loss_start", "eval_loss_end", "steps_per_s")}
            | {"pushes": r.get("learner", {}).get("pushes", {})}
            for r in [*synced, *alone]
        ],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, help="inner steps per learner (default: by mode)")
    p.add_argument("--root", type=Path, help="keep the run's files and logs here")
    args = p.parse_args(argv)
    mode = "smoke" if args.smoke else "full"
    cuda = torch.cuda.is_available()
    if mode == "full" and not cuda:
        reason = "no CUDA device here"
        print(f"bench.gpu: {reason}; skipped")
        skipped = {"skipped": True, "reason": reason, "mode": mode, "machine": machine()}
        write_json(args.json, skipped)
        return skipped
    device = "cuda" if cuda else "cpu"
    steps = args.steps or MODES[mode][1]
    with tempfile.TemporaryDirectory() as d:
        figures = run(args.root or Path(d), mode, steps, device)
    result = {"mode": mode, "device": device, **figures, "machine": machine()}
    if cuda:
        result["machine"]["gpu"] = torch.cuda.get_device_name()
    print(table([result], COLUMNS))
    print(
        f"\n{result['params']:,} parameters on {device}: Synchronizer peak RSS "
        f"{result['rss_peak_bytes'] / (1 << 30):.2f} GiB = {result['rss_ratio']:.2f}x the FP32 "
        f"model; upload {result['init_s']:.1f} s, join {result['join_s']:.1f} s; eval loss "
        f"{result['eval_loss_start']:.3f} -> {result['eval_loss_end']:.3f}; learner 1 "
        f"{result['steps_per_s']:.2f} steps/s syncing, {result['steps_per_s_no_sync']:.2f} "
        f"without ({result['sync_vs_nosync']:.2f}x)"
    )
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    program(main)
