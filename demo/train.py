"""The example training loop: one learner training a model, synced through the Synchronizer.

Read top to bottom: build the model and the data, AdamW with warm-up and cosine decay, wrap the
optimizer in a `Learner` (or not, with `sync=None`, `--no-sync`: the same loop without syncing, which is
what the overhead measurement compares against), train, evaluate at start and end, write a JSON
result. The result file is rewritten at every progress line (with `"finished": false`), so the
launcher can show live progress and a learner killed mid-run still leaves its loss curve behind.

Under torchrun every rank runs this loop: the default process group is made (NCCL on GPUs, gloo
on CPUs), each rank reads its own data shard, the replicas average their gradients (DDP), and
rank 0 alone syncs with the Synchronizer, broadcasting what it merged (`learner.island`). Rank 0
writes the result to `--out`, rank r to `OUT.rankR`.

With `eval_only` (`--eval-only`) it trains nothing: it is an evaluator (`learner.evaluator`)
that pulls the served model whenever its versions change, at most every `eval_every_s`, evaluates
it with the same eval function, and reports the loss to the Synchronizer, until SIGTERM or Ctrl-C
(or `eval_reports` reports); its result's `series` holds each report.

A user model plugs in through `model="pkg.module:factory"`: `factory(learner_index, learners)`
returns `(model, batch_fn)` or `(model, batch_fn, eval_fn)`, where `batch_fn()` gives
`(inputs, targets)`, `model(inputs, targets)` returns the loss (or a tuple `(logits, loss)`), the
tokens of a step are `targets.numel()`, and `eval_fn(model)` returns a float (lower is better).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import grpc
import torch
from torch import nn

from demo.example.data import ByteData, evaluate
from demo.example.model import GPT, GPTConfig
from demo.options import TrainOptions

logger = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]


def lr_at(step: int, o: TrainOptions, warm_from: int | None = None) -> float:
    """Linear warm-up to lr, then cosine decay to min_lr_ratio * lr at the last step.

    A learner restarted with `--start-step` has a fresh AdamW state, so it warms up again from
    start_step; one resumed from its checkpoint (`--resume`) has its own and does not
    (`warm_from` 0).
    """
    start = o.start_step if warm_from is None else warm_from
    warm = min(1.0, (step - start + 1) / o.warmup_steps) if o.warmup_steps else 1.0
    progress = min(1.0, max(0, step - o.warmup_steps) / max(1, o.steps - o.warmup_steps))
    return (
        warm
        * o.lr
        * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    )


def param_hash(model: nn.Module) -> str:
    """sha256 over every parameter's FP32 bytes in named order: equal hashes, equal models."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2: a collective
        h.update(full.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def load_factory(path: str) -> Callable[..., tuple]:
    """Resolves "pkg.module:factory"; ValueError with a readable message if it cannot."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model must look like pkg.module:factory, got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} for --model: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{module_name!r} has no callable {attr!r} for --model")
    return factory


def build(
    o: TrainOptions, device: torch.device
) -> tuple[nn.Module, Callable[[], Batch], Callable[[nn.Module], float]]:
    """(model, batch_fn, eval_fn) for the bundled example or the user's factory."""
    torch.manual_seed(o.seed)  # the same initial model on every learner
    if o.model:
        made = load_factory(o.model)(o.learner_index, o.learners)
        if not isinstance(made, tuple) or len(made) not in (2, 3):
            raise ValueError(
                f"{o.model} must return (model, batch_fn) or (model, batch_fn, eval_fn)"
            )
        user_eval: Callable[[nn.Module], float] = (
            made[2] if len(made) == 3 else (lambda m: float("nan"))
        )
        return made[0].to(device), made[1], user_eval
    data = ByteData(
        o.data, learner=o.learner_index, learners=o.learners, block=o.block, max_bytes=o.max_bytes
    )
    model = GPT(GPTConfig(n_layer=o.n_layer, d_model=o.d_model, n_head=o.n_head, block=o.block)).to(
        device
    )
    # Each learner its own windows; a restarted one (start_step) other windows than its first
    seed = o.seed * 1000 + o.learner_index
    gen = torch.Generator().manual_seed(seed + 1_000_003 * o.start_step if o.start_step else seed)
    eval_set = data.eval_set(o.eval_windows)

    def batch_fn() -> Batch:
        x, y = data.batch(o.batch_size, gen)
        return x.to(device), y.to(device)

    return model, batch_fn, lambda m: evaluate(m, eval_set)


def make_optimizer(model: nn.Module, o: TrainOptions) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms, biases), as in nanoGPT."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(0.9, 0.95))


def write_json(path: str | None, result: dict) -> None:
    """Atomic rewrite, so a reader never sees half a file."""
    if not path:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def stats_dict(learner: Any) -> dict:
    """The learner's stats (its id among them; not its session, a secret)."""
    return {} if learner is None else asdict(learner.stats)


def keep_session(path: str | None, learner: Any, kept: str) -> str:
    """Writes the learner's session secret to `path` (mode 0600, atomically) when it is not
    `kept` already, so that a restart can re-join as this learner; returns what is kept."""
    session = learner.client.session if learner is not None and learner.client else ""
    if not path or not session or session == kept:
        return kept
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(session + "\n")
    os.replace(tmp, path)
    return session


CHECKPOINT = "learner.pt"  # in the --resume directory


def load_checkpoint(directory: str) -> dict[str, Any] | None:
    """The checkpoint `save_checkpoint` left in `directory`, or None when there is none yet.
    ValueError naming the file when it cannot be read."""
    path = os.path.join(directory, CHECKPOINT)
    if not os.path.exists(path):
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a torn or foreign file: say which, never resume from half of one
        raise ValueError(f"cannot read the learner checkpoint {path}: {e}") from None
    if not isinstance(saved, dict) or "learner" not in saved:
        raise ValueError(f"{path} is not a learner checkpoint written by --resume")
    return saved


def save_checkpoint(
    directory: str, step: int, model: nn.Module, optimizer: Any, learner: Any, write: bool = True
) -> bool:
    """Writes the model, the inner optimizer and the learner's state (`Learner.state_dict`,
    which first waits for syncs in flight) to `directory`, atomically and durably (a temporary
    file, fsynced, renamed, the directory fsynced); False, with a warning, when the learner
    has syncs it cannot finish now (the previous checkpoint stays). Every rank of an island
    calls it (the learner's state is a collective); only the one with `write` writes (rank 0:
    the replicas are identical, and it holds the sync state)."""
    try:
        state = learner.state_dict() if learner is not None else None
    except RuntimeError as e:
        logger.warning("checkpoint at step %d skipped: %s", step, e)
        return False
    if not write:
        return True
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, CHECKPOINT)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(
            {
                "step": step,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "learner": state,
            },
            f,
        )
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


class Terminated:
    """From `install()` to `restore()`, SIGTERM only sets `requested`: the loop checkpoints and
    stops at the end of its step."""

    def __init__(self) -> None:
        self.requested = False
        self.previous: Any = None

    def install(self) -> Terminated:
        if threading.current_thread() is threading.main_thread():  # signals reach only it
            self.previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


class Stopped(Exception):
    """Training stopped on SIGTERM after its checkpoint (`diloco-learner train` exits 143)."""


def init_island() -> tuple[int, int, torch.device, bool]:
    """Under torchrun (WORLD_SIZE above 1): the default process group, NCCL on GPUs and gloo on
    CPUs, unless the caller made one; (rank, world size, this rank's device, whether the group
    was made here: its maker destroys it). Alone: (0, 1, the one device, False)."""
    cuda = torch.cuda.is_available()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, torch.device("cuda" if cuda else "cpu"), False
    import torch.distributed as dist

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), device or torch.device("cpu"), made


def any_rank(flag: bool, world: int) -> bool:
    """Whether `flag` is set on any rank of the island (a collective; `flag` alone for one)."""
    if world == 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def wait_for_learners(learner: Any, n: int, timeout_s: float = 120.0) -> None:
    """Blocks until n learners have joined the Synchronizer, so a run starts together. Learners
    that already left count: a short run may finish between two polls of another; evaluators
    do not."""
    deadline = time.monotonic() + timeout_s
    while True:
        joined = sum(not x.evaluator for x in learner.client.status().learners)
        if joined >= n:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {joined} of {n} learners joined within {timeout_s:.0f} s")
        time.sleep(0.2)


def evaluate_served(o: TrainOptions) -> dict:
    """The evaluator's loop (`--eval-only`): returns (and writes) the result dict."""
    from learner.evaluator import Evaluator

    assert o.sync is not None, "an evaluator needs the Synchronizer's settings"
    model, _, eval_fn = build(o, torch.device("cpu"))
    model.eval()
    evaluator = Evaluator(model, o.sync, name=o.name)
    result: dict[str, Any] = {"name": o.name, "eval_only": True, "series": [], "finished": False}
    terminated = Terminated().install()
    pending, next_eval = False, 0.0  # a pulled model not evaluated yet; when the next may be
    try:
        while not terminated.requested:
            try:
                pending = evaluator.refresh() or pending
            except grpc.RpcError as e:  # not initialised yet, restarting: try again later
                logger.info("[%s] cannot pull the served model yet: %s", o.name, e.code().name)
            if pending and time.monotonic() >= next_eval:
                pending, next_eval = False, time.monotonic() + o.eval_every_s
                with torch.no_grad():
                    loss = eval_fn(model)
                reply = evaluator.report(loss)
                result["series"].append(
                    {
                        "t": time.time(),
                        "versions": dict(evaluator.versions),
                        "eval_loss": loss,
                        "consumed_tokens": reply.consumed_tokens,
                        "effective_goodput": reply.effective_goodput
                        if reply.has_reference
                        else None,
                    }
                )
                write_json(o.out, result)
                if o.eval_reports and len(result["series"]) >= o.eval_reports:
                    break
            time.sleep(min(evaluator.heartbeat_interval_s, o.eval_every_s))
    except KeyboardInterrupt:
        pass
    finally:
        terminated.restore()
        evaluator.close()
    result["finished"] = True
    write_json(o.out, result)
    return result


def train(o: TrainOptions) -> dict:
    """Runs the loop and returns (and writes) the result dict."""
    if o.threads:
        torch.set_num_threads(o.threads)
    if o.eval_only:
        return evaluate_served(o)
    rank, world, device, made = init_island()
    try:
        result = train_island(o, rank, world, device)
    except Stopped:  # every rank stopped at the same step (SIGTERM), its collectives done
        end_island(made)
        raise
    end_island(made)  # not after a crash: a collective may still wait for the crashed rank
    return result


def end_island(made: bool) -> None:
    """Destroys the island's process group where `init_island` made it (a group left to the
    interpreter's exit leaks it: NCCL warns, and its teardown may abort)."""
    if made:
        import torch.distributed as dist

        dist.destroy_process_group()


def train_island(o: TrainOptions, rank: int, world: int, device: torch.device) -> dict:
    """The loop as `rank` of an island of `world` (0 of 1 alone)."""
    if o.fsdp and (world == 1 or o.resume):
        raise ValueError("fsdp needs a torchrun island of 2 or more ranks, and no resume")
    out = o.out if rank == 0 or not o.out else f"{o.out}.rank{rank}"
    saved = load_checkpoint(o.resume) if o.resume else None
    if saved is not None:  # continue where the checkpoint left off, data order included
        o = o.model_copy(update={"start_step": saved["step"]})
    # Under torchrun every rank reads a data shard of its own: shard index * world + rank
    shard = {"learner_index": o.learner_index * world + rank, "learners": o.learners * world}
    model, batch_fn, eval_fn = build(o.model_copy(update=shard), device)
    forward: Callable[..., Any] = model
    if world > 1 and o.fsdp:  # each rank keeps a shard of every parameter (a sharded island)
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    elif world > 1:  # the island's replicas average their gradients and stay identical
        from torch.nn.parallel import DistributedDataParallel

        forward = DistributedDataParallel(model)
    optimizer = make_optimizer(model, o)
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        logger.info("[%s] resuming from %s at step %d", o.name, o.resume, saved["step"])

    learner = None
    if o.sync is not None:
        from learner.learner import Learner  # the client library

        # Joins and adopts the global model, or (resumed) comes back as itself, keeping its own
        learner = Learner(
            model,
            optimizer,
            config=o.sync,
            state=saved["learner"] if saved is not None else None,
            # restarted without a checkpoint: its fragments due at the run's steps, as the others'
            start_step=o.start_step if saved is None else 0,
        )
        if o.wait_for_learners > 1 and learner.leader:
            wait_for_learners(learner, o.wait_for_learners)
        any_rank(False, world)  # the island starts together

    session_file = o.session_out or (f"{o.out}.session" if o.out and rank == 0 else None)
    kept = keep_session(session_file, learner, "")
    eval_start = eval_fn(model)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "[%s] %d parameters on %s, eval loss %.4f at start", o.name, n_params, device, eval_start
    )
    result: dict[str, Any] = {
        "name": o.name,
        "learner_index": o.learner_index,
        "rank": rank,  # in its torchrun island of `world` ranks (0 of 1 alone)
        "world": world,
        "sync": learner is not None,
        "params": n_params,
        "steps_target": o.steps,
        "start_step": o.start_step,
        "eval_loss_start": eval_start,
        "finished": False,
        "step": o.start_step,
        "series": [],
        "started_at": time.time(),
        "session_file": session_file if kept else None,
    }

    tokens = 0
    compute_s = 0.0  # seconds in the steps themselves, without the --slow sleep
    window_loss, window_steps = 0.0, 0  # mean training loss since the last progress line
    t_start, cpu_start = time.perf_counter(), time.process_time()
    if learner is not None:
        learner.reset_clock()  # the evaluation and barrier above are not training compute
    warm_from = 0 if saved is not None else None  # a resumed optimizer needs no new warm-up
    terminated = Terminated().install()  # SIGTERM: checkpoint and stop after this step
    try:
        for step in range(o.start_step, o.steps):
            t0 = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, o, warm_from)
            x, y = batch_fn()
            output = forward(x, y)
            loss = output[1] if isinstance(output, tuple) else output
            loss.backward()
            if o.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip)
            tokens += y.numel()
            loss_value = loss.item()
            window_loss += loss_value
            window_steps += 1
            if learner is not None:
                learner.step(
                    tokens=y.numel(), loss=loss_value
                )  # optimizer.step(), then syncs and merges
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            compute_s += dt
            if o.slow > 1:
                time.sleep((o.slow - 1) * dt)

            if (step + 1) % o.log_every == 0 or step + 1 == o.steps:
                elapsed = time.perf_counter() - t_start
                mean_loss = window_loss / window_steps
                window_loss, window_steps = 0.0, 0
                stats = stats_dict(learner)
                kept = keep_session(session_file, learner, kept)  # a re-join gets a new one
                sync_state = stats.get("sync_state", "off")
                logger.info(
                    "[%s] step %5d/%d | loss %.4f | %8.0f tok/s | %s",
                    o.name,
                    step + 1,
                    o.steps,
                    mean_loss,
                    tokens / elapsed,
                    sync_state,
                )
                result["series"].append({"t": time.time(), "step": step + 1, "loss": mean_loss})
                result.update(
                    step=step + 1,
                    tokens=tokens,
                    loss=mean_loss,
                    tokens_per_s=tokens / elapsed,
                    sync_state=sync_state,
                    learner=stats,
                )
                write_json(out, result)
            stop = any_rank(terminated.requested, world)  # every rank stops at the same step
            if stop or (o.resume and (step + 1) % o.save_every == 0):
                saved_now = o.resume is not None and save_checkpoint(
                    o.resume, step + 1, model, optimizer, learner, write=rank == 0
                )
                if stop:
                    result.update(step=step + 1, stopped=True, checkpointed=saved_now)
                    write_json(out, result)
                    raise Stopped(
                        f"stopped by SIGTERM at step {step + 1}"
                        + (f"; checkpoint in {o.resume}" if saved_now else "; no checkpoint")
                    )
    except BaseException:  # Ctrl-C or a crash: stop the sync threads (no final pull) and re-raise
        if learner is not None:
            learner.close()
        raise
    finally:
        terminated.restore()

    train_s = time.perf_counter() - t_start
    cpu_s = time.process_time() - cpu_start  # every thread of this process, sync threads included
    steps = o.steps - o.start_step
    if learner is not None:
        learner.finish()  # waits for in-flight syncs, adopts the newest global model, leaves
    eval_end = eval_fn(model)
    stats = stats_dict(learner)
    result.update(
        finished=True,
        step=o.steps,
        tokens=tokens,
        eval_loss_end=eval_end,
        train_s=train_s,
        compute_s=compute_s,
        steps_per_s=steps / train_s if train_s > 0 else 0.0,
        compute_steps_per_s=steps / compute_s if compute_s > 0 else 0.0,
        cpu_s=cpu_s,
        bytes_sent=stats.get("bytes_sent", 0),
        bytes_received=stats.get("bytes_received", 0),
        blocked_s=stats.get("blocked_s", 0.0),
        param_hash=param_hash(model),
        learner=stats,
    )
    write_json(out, result)
    logger.info(
        "[%s] done: %d steps in %.1f s (%.2f steps/s), eval loss %.4f -> %.4f, sent %d B, received %d B",
        o.name,
        steps,
        train_s,
        result["steps_per_s"],
        eval_start,
        eval_end,
        result["bytes_sent"],
        result["bytes_received"],
    )
    return result
