"""One torchft DiLoCo replica training the bundled example: the peer that `bench.peers` runs
this project against (`python -m bench.torchft_learner SPEC.json`, one process per link slot).

The same model, data shard, AdamW, warm-up and cosine schedule and clipping as the example
trainer (`demo.train.build`, `make_optimizer`, `lr_at`), wrapped as torchft's own example
(`train_diloco.py`) wraps its model: a `Manager` with a synchronous quorum, `ProcessGroupGloo`,
`DiLoCo(sync_every=H)` with an outer SGD Nesterov optimizer, and a state dict (model, inner
optimizer, inner step) that a restarted replica heals from. Each replica is its own replica
group (world size 1) with its own TCPStore; the lighthouse is the harness's. `init_sync` is off:
every replica builds the same initial model from the same seed (what torchft's docs advise).

Addresses are the slot's own (`spec["host"]`), not the machine's hostname, so that replicas in
separate network namespaces reach each other's manager, store and checkpoint server.

The result file (rewritten at every progress line) holds the loss series, `compute_s` (forward,
backward and inner optimizer steps, not the DiLoCo syncs inside `optimizer.step()`), every sync
(manager step before and after, participants: a step that went up by one merged this replica's
own work; one that jumped further healed it from a peer, discarding its last H steps; one that
stayed failed to commit), the final model's eval loss and hash, and the bytes of this process's
TCP sockets (`bench.net.socket_bytes`, used where the links cannot count).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchft import Manager, ProcessGroupGloo
from torchft.checkpointing.http_transport import HTTPTransport
from torchft.local_sgd import DiLoCo

from bench.jobs import Workload
from bench.net import socket_bytes
from demo.train import build, lr_at, make_optimizer, param_hash, write_json

logger = logging.getLogger(__name__)


class SlotTransport(HTTPTransport):
    """torchft's HTTP checkpoint server, advertised at the slot's address instead of the
    machine's hostname (which a replica in another network namespace cannot reach)."""

    def __init__(self, host: str, timeout: timedelta) -> None:
        self.host = host  # before the server starts: its constructor logs address()
        super().__init__(timeout=timeout, num_chunks=0)

    def address(self) -> str:
        port = self._server.socket.getsockname()[1]
        return f"http://{self.host}:{port}/checkpoint/"


def wait_for_go(go: Path, timeout_s: float = 300.0) -> None:
    """The harness starts training on every replica at once (as `--wait-for-learners` does for
    this project's learners), once each has its manager heartbeating the lighthouse."""
    deadline = time.monotonic() + timeout_s
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go file {go} within {timeout_s:.0f} s")
        time.sleep(0.02)  # another process's file: no event to wait on


def main(spec: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    slot, host = spec["slot"], spec["host"]
    w = Workload(**spec["workload"])
    o = w.options(learner_index=slot, start_step=spec.get("start_step", 0))
    timeout = timedelta(seconds=spec.get("timeout_s", 30))
    model, batch_fn, eval_fn = build(o, torch.device("cpu"))
    inner = make_optimizer(model, o)
    outer = torch.optim.SGD(
        model.parameters(), lr=spec["outer_lr"], momentum=spec["outer_momentum"], nesterov=True
    )
    done = o.start_step  # inner steps completed (a healed replica takes its source's)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner_optim": inner.state_dict(), "done": done}

    def load_state_dict(state: dict[str, Any]) -> None:
        nonlocal done
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner_optim"])
        done = state["done"]

    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)  # this replica group's
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        use_async_quorum=False,  # DiLoCo needs it
        timeout=timeout,
        quorum_timeout=timedelta(seconds=spec.get("quorum_timeout_s", 600)),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr=host,
        store_port=store.port,
        lighthouse_addr=spec["lighthouse"],
        replica_id=f"replica_{slot}",
        hostname=host,
        checkpoint_transport=SlotTransport(host, timeout),
        init_sync=False,
    )
    result: dict[str, Any] = {
        "slot": slot,
        "params": sum(p.numel() for p in model.parameters()),
        "start_step": o.start_step,
        "steps_target": o.steps,
        "finished": False,
        "ready": True,
        "series": [],
        "syncs": [],
    }
    write_json(spec["out"], result)
    wait_for_go(Path(spec["go"]))
    result["started_at"] = time.time()

    # A post-step hook registered before DiLoCo's: it runs first, so the time up to it is the
    # step's compute and the time after it, up to the end of optimizer.step(), the sync.
    t_hook = 0.0

    def count_step(*_: Any) -> None:
        nonlocal done, t_hook
        done += 1
        t_hook = time.perf_counter()

    inner.register_step_post_hook(count_step)
    sync_every = spec["sync_every"]
    compute_s = window = 0.0
    window_steps = 0
    calls = 0  # inner steps this process trained
    with DiLoCo(manager, [model], inner, outer, sync_every=sync_every):
        while done < o.steps:
            t0 = time.perf_counter()
            for g in inner.param_groups:
                g["lr"] = lr_at(done, o)
            x, y = batch_fn()
            _, loss = model(x, y)
            loss.backward()
            if o.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip)
            before = manager.current_step()
            inner.step()  # every H-th call, DiLoCo syncs inside it
            inner.zero_grad(set_to_none=True)
            compute_s += t_hook - t0
            calls += 1
            if calls % sync_every == 0:
                result["syncs"].append(
                    {
                        "t": time.time(),
                        "done": done,
                        "before": before,
                        "after": manager.current_step(),
                        "participants": manager.num_participants(),
                        "sync_s": time.perf_counter() - t_hook,
                    }
                )
            window += loss.item()
            window_steps += 1
            if done % o.log_every == 0 or done >= o.steps:
                result["series"].append(
                    {"t": time.time(), "step": done, "loss": window / max(1, window_steps)}
                )
                window, window_steps = 0.0, 0
                result.update(
                    step=done, calls=calls, compute_s=compute_s, manager_step=manager.current_step()
                )
                write_json(spec["out"], result)
    train_s = time.time() - result["started_at"]
    sent, received = socket_bytes()
    result.update(
        finished=True,
        step=done,
        calls=calls,
        compute_s=compute_s,
        train_s=train_s,
        steps_per_s=calls / train_s if train_s > 0 else 0.0,
        manager_step=manager.current_step(),
        eval_loss_end=eval_fn(model),
        param_hash=param_hash(model),
        socket_sent=sent,
        socket_received=received,
    )
    write_json(spec["out"], result)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    main(json.loads(Path(sys.argv[1]).read_text()))
    sys.stdout.flush()
    os._exit(0)  # torchft's server threads would otherwise hold the exit up
