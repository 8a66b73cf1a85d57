"""The data-parallel baseline: M processes, gradients all-reduced every step with torch.distributed.

The same model, data shards, AdamW, warm-up and cosine schedule as the example trainer
(`demo.train.build`, `make_optimizer`, `lr_at`), one process per learner slot, each on its own
`bench.net` link: gloo rendezvous over TCP at slot 0's address, parameters broadcast from rank
0 at the start (as DDP does), then every step the gradients are flattened into one bucket,
all-reduced (summed, divided by M) and clipped, and every rank takes the same optimizer step.
Every rank trains on its own batch, so M ranks see M times the tokens of one learner per step,
exactly like M DiLoCo learners.

Bytes are counted by the links (on the wire, see bench/net.py); each rank also records its own
TCP sockets' counters (TCP_INFO), which is what the no-root path uses. Rank 0 can evaluate every
`eval_every` steps; those seconds are taken out of its clock (`train_s`), so loss against
wall-clock is not penalised for the measuring. With `checkpoint`, rank 0 saves the model and
optimizer after every step and a restarted job resumes from the last one (the goodput baseline).

    python -m bench.dp [--quick | --smoke] [--json PATH] [--net auto|netns|proxy] [--rate-mbit R]
runs the baseline alone and prints its table; `python -m bench.dp rank SPEC.json` is one rank.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.common import machine, parser, program, table, write_json
from bench.jobs import SMOKE_SHORT, JobError, Workload, python, wire_bytes
from bench.net import Links, open_links, socket_bytes
from demo.procs import Procs, read_json
from demo.train import build, lr_at, make_optimizer
from demo.train import write_json as write_result

MASTER_PORT = 29500  # inside slot 0's own namespace nothing else listens


def rank_main(spec: dict) -> None:
    """One data-parallel rank (run as `python -m bench.dp rank SPEC.json`)."""
    torch.set_num_threads(1)
    rank, world = spec["rank"], spec["world"]
    w = Workload(**spec["workload"])
    o = w.options(learner_index=rank, start_step=spec.get("start_step", 0))
    model, batch_fn, eval_fn = build(o, torch.device("cpu"))
    optimizer = make_optimizer(model, o)
    params = [p for p in model.parameters() if p.requires_grad]
    ckpt = spec.get("checkpoint")
    if o.start_step and ckpt:
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{spec['master']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=spec.get("timeout_s", 120)),
    )
    with torch.no_grad():
        for p in params:  # as DDP does: everyone starts from rank 0's parameters
            dist.broadcast(p, 0)
    lead = rank == 0
    eval_every = spec.get("eval_every", 0)
    target = spec.get("target_loss")  # stop at the first eval at or below it (bench.wan)
    result: dict[str, Any] = {
        "rank": rank,
        "params": sum(p.numel() for p in params),
        "start_step": o.start_step,
        "steps_target": o.steps,
        "finished": False,
        "series": [],
        "eval_series": [],
    }
    eval_s = 0.0

    def evaluate(step: int, t_train: float) -> None:
        nonlocal eval_s
        t = time.perf_counter()
        loss = eval_fn(model)
        eval_s += time.perf_counter() - t
        result["eval_series"].append(
            {"step": step, "t_train": t_train, "t": time.time(), "eval_loss": loss}
        )

    if lead:
        evaluate(o.start_step, 0.0)
        result["eval_loss_start"] = result["eval_series"][-1]["eval_loss"]
    dist.barrier()
    result["started_at"] = time.time()
    t_start = time.perf_counter()
    compute_s = comm_s = 0.0
    window = 0.0
    for step in range(o.start_step, o.steps):
        t0 = time.perf_counter()
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, o)
        x, y = batch_fn()
        _, loss = model(x, y)
        loss.backward()
        t1 = time.perf_counter()
        grads: list[torch.Tensor] = []
        for p in params:
            assert p.grad is not None  # every parameter is in the loss
            grads.append(p.grad)
        flat = torch.cat([grad.reshape(-1) for grad in grads])  # one bucket, like DDP's
        dist.all_reduce(flat)
        flat /= world
        t2 = time.perf_counter()
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        if o.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, o.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        t3 = time.perf_counter()
        compute_s += (t1 - t0) + (t3 - t2)
        comm_s += t2 - t1
        window += loss.item()
        done = step + 1
        if lead and ckpt:
            tmp = f"{ckpt}.tmp"
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": done},
                tmp,
            )
            os.replace(tmp, ckpt)
        train_s = time.perf_counter() - t_start - eval_s
        if eval_every and done % eval_every == 0 and done < o.steps:
            stop = torch.zeros(1)
            if lead:
                evaluate(done, train_s)
                stop[0] = float(
                    target is not None and result["eval_series"][-1]["eval_loss"] <= target
                )
            if target is not None:  # everyone learns whether rank 0 saw the target reached
                t = time.perf_counter()
                dist.broadcast(stop, 0)
                eval_s += time.perf_counter() - t
                if stop.item():
                    result["stopped_at_target"] = done
        if done % o.log_every == 0 or done == o.steps:
            n = o.log_every if done % o.log_every == 0 else done % o.log_every
            result["series"].append(
                {
                    "t": time.time(),
                    "step": done,
                    "loss": window / n,
                    "t_train": train_s,
                    "compute_s": compute_s,
                }
            )
            result.update(step=done, compute_s=compute_s, comm_s=comm_s, train_s=train_s)
            window = 0.0
            write_result(spec["out"], result)
        if "stopped_at_target" in result:
            break
    train_s = time.perf_counter() - t_start - eval_s
    sent, received = socket_bytes()
    if lead:
        if "stopped_at_target" not in result:
            evaluate(o.steps, train_s)
        result["eval_loss_end"] = result["eval_series"][-1]["eval_loss"]
    last = result.get("stopped_at_target", o.steps)
    steps = last - o.start_step
    result.update(
        finished=True,
        step=last,
        compute_s=compute_s,
        comm_s=comm_s,
        eval_s=eval_s,
        train_s=train_s,
        steps_per_s=steps / train_s if train_s > 0 else 0.0,
        socket_sent=sent,
        socket_received=received,
    )
    write_result(spec["out"], result)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DPJob:
    """M ranks, one per link; `start` (again, to resume from the checkpoint) and `wait`."""

    def __init__(
        self,
        workload: Workload,
        links: Links,
        out: Path,
        eval_every: int = 0,
        checkpoint: bool = False,
        target_loss: float | None = None,
    ) -> None:
        self.workload, self.links, self.out, self.eval_every = workload, links, out, eval_every
        self.target_loss = target_loss
        self.checkpoint = out / "dp.ckpt" if checkpoint else None
        self.children = Procs(out)
        self.incarnations: list[list[Path]] = []  # per start: each rank's result file
        self.resumes: list[int] = []  # per kill: the checkpointed step the next start resumes at
        self.procs: list[Any] = []
        self.down = False

    def resume_step(self) -> int:
        if self.checkpoint is None or not self.checkpoint.exists():
            return 0
        return int(torch.load(self.checkpoint, weights_only=True)["step"])

    def start(self) -> None:
        w = self.workload
        start_step = self.resume_step()
        n = len(self.incarnations)
        master = f"{self.links.slot_host(0)}:{MASTER_PORT if self.links.kind == 'netns' else free_port()}"
        outs, self.procs = [], []
        for r in range(w.learners):
            out = self.out / f"dp-{r}.run{n}.json"
            out.unlink(missing_ok=True)
            spec = {
                "rank": r,
                "world": w.learners,
                "master": master,
                "workload": w.__dict__,
                "out": str(out),
                "start_step": start_step,
                "eval_every": self.eval_every,
                "target_loss": self.target_loss,
                "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            }
            spec_path = self.out / f"dp-{r}.run{n}.spec.json"
            spec_path.write_text(json.dumps(spec))
            cmd = python("-m", "bench.dp", "rank", str(spec_path))
            env_cmd = ["env", f"GLOO_SOCKET_IFNAME={self.links.gloo_ifname(r)}", *cmd]
            self.procs.append(self.children.start(f"dp-{r}", self.links.wrap(r, env_cmd)))
            outs.append(out)
        self.incarnations.append(outs)
        self.down = False

    def done(self) -> bool:
        return not self.down and all(p.poll() == 0 for p in self.procs)

    def failed(self) -> list[int]:
        return (
            [] if self.down else [r for r, p in enumerate(self.procs) if p.poll() not in (None, 0)]
        )

    def kill(self) -> int:
        """A failure: lockstep data parallel loses every rank. Returns the step it resumes from."""
        for p in self.procs:
            Procs.kill(p)
        self.down = True
        self.resumes.append(self.resume_step())
        return self.resumes[-1]

    def stop(self) -> None:
        self.children.stop_all()

    def results(self) -> list[list[dict]]:
        """Per start, each rank's result."""
        return [[read_json(p) for p in outs] for outs in self.incarnations]

    def run(self, timeout_s: float = 1800, tick: Callable[[DPJob], None] | None = None) -> dict:
        """Runs to the end; `tick` (fault injection) is called about 20 times a second."""
        try:
            self.links.start_sampling()
            self.start()
            deadline = time.monotonic() + timeout_s
            while not self.done():
                time.sleep(0.05)
                if tick is not None:
                    tick(self)
                if self.failed():
                    r = self.failed()[0]
                    raise JobError(
                        f"data-parallel rank {r} exited with code {self.procs[r].returncode}; see {self.children.log(f'dp-{r}')}"
                    )
                if time.monotonic() > deadline:
                    raise JobError(f"data parallel did not finish within {timeout_s:.0f} s")
            self.links.stop_sampling()
        finally:
            self.links.stop_sampling()
            self.stop()
        return self.summarize()

    def summarize(self) -> dict:
        w = self.workload
        ranks = self.results()[-1]
        lead = ranks[0]
        steps = lead["step"] - lead["start_step"]  # fewer than w.steps when stopped at a target
        wire = wire_bytes(self.links, ranks, steps)
        counted = wire["bytes_per_step"] is not None and self.links.kind == "netns"
        if not counted:  # no link counters for gloo here: the ranks' own socket counters
            wire.update(
                wire="socket",
                bytes_per_step=statistics.mean(
                    r["socket_sent"] + r["socket_received"] for r in ranks
                )
                / steps,
                steady_bytes_per_step=None,
            )
        series = lead["eval_series"]
        return {
            "name": "dp",
            "config": f"all-reduce every step (gloo), M={w.learners}",
            "eval_loss": lead["eval_loss_end"],
            "wall_s": lead["train_s"],
            "steps": steps,
            "steps_per_s": lead["steps_per_s"],
            "compute_s": statistics.mean(r["compute_s"] for r in ranks),
            "comm_s": statistics.mean(r["comm_s"] for r in ranks),
            **wire,
            "socket_bytes_per_step": statistics.mean(
                r["socket_sent"] + r["socket_received"] for r in ranks
            )
            / steps,
            "stopped_at_target": lead.get("stopped_at_target"),
            # its links limited or delayed like the learners' (not on the proxies' path)
            "shaped": bool(self.links.rate_bps or self.links.rtt_s) and self.links.shaped_dp,
            "eval_series": [
                {"t": e["t_train"], "step": e["step"], "eval_loss": e["eval_loss"]} for e in series
            ],
            "t_start": lead["started_at"],
            "results": [[r] for r in ranks],
        }


def main(argv: list[str] | None = None) -> dict:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["rank"]:
        rank_main(json.loads(Path(argv[1]).read_text()))
        return {}
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--net",
        choices=("auto", "netns", "proxy"),
        default="auto",
        help="links: namespaces (root) or loopback",
    )
    p.add_argument("--rate-mbit", type=float, help="shape every link to this rate")
    p.add_argument("--steps", type=int, help="steps per rank")
    args = p.parse_args(argv)
    w = (
        dataclasses.replace(SMOKE_SHORT)
        if args.smoke
        else Workload(steps=300 if args.quick else 1000)
    )
    if args.steps:
        w.steps = args.steps
    with (
        tempfile.TemporaryDirectory(prefix="bench-dp-") as tmp,
        open_links(args.net, w.learners, args.rate_mbit * 1e6 if args.rate_mbit else None) as links,
    ):
        r = DPJob(w, links, Path(tmp), eval_every=max(1, w.steps // 10)).run()
    print(
        table(
            [r],
            [
                "name",
                "eval_loss",
                "wall_s",
                "steps_per_s",
                "compute_s",
                "comm_s",
                "wire",
                "bytes_per_step",
                "steady_bytes_per_step",
                "socket_bytes_per_step",
            ],
        )
    )
    r.pop("results")
    result = {
        "dp_bytes_per_step": r["steady_bytes_per_step"] or r["bytes_per_step"],
        "dp_eval_loss": r["eval_loss"],
        "dp": r,
        "machine": machine(),
    }
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    program(main)
