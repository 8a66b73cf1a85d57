"""Network faults on one learner's link while a job trains, timed by what crosses the link.

`bench.net.Namespaces` cuts, heals and resets a slot's link; this module decides when, from the
slot's veth counters (the kernel's count of every frame, not the code under test's), and
records what each fault did:

- `await_transfer`: returns once a push's (bytes sent) or a pull's (bytes received) payload is
  flowing across the link: more bytes within a few milliseconds than heartbeats and
  acknowledgements ever move. The link must be paced (`Namespaces.shape`) so that a transfer of
  a few KiB lasts long enough to be caught in the middle.
- `LinkFaults`: on one slot, a stall (a short partition begun while a transfer flows), a reset
  (every connection of the slot aborted, its peers sent a RST) and a partition for a given time;
  each a `Fault` with the bytes the transfer had moved when it was cut and what moved while the
  link was down (nothing, or the cut did not hold).
- `slow_factor`: how much slower learners must run (`--slow`) for a run to last as long on any
  machine, idle or loaded, from one inner step timed here.
- `FaultJob`: a `bench.jobs.DilocoJob` that keeps the Synchronizer's last metrics in its summary
  and watches, while it runs, which learners the Synchronizer lists, in which state, and how
  many its metrics count dead.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.jobs import Decoupled, DilocoJob, Workload
from bench.net import Namespaces
from demo.procs import metric, scrape
from demo.tiny import status
from demo.train import build, make_optimizer

SENT, RECEIVED = 0, 1  # directions, as in `Links.counters`: the learner's sent, its received
DIRECTION = {SENT: "push", RECEIVED: "pull"}


def await_transfer(
    links: Namespaces,
    slot: int,
    direction: int,
    min_bytes: int,
    timeout_s: float,
    window_s: float = 0.05,
    poll_s: float = 0.002,
) -> int:
    """Polls slot's counters until at least `min_bytes` crossed its link in `direction` within
    `window_s` (a payload flowing, not heartbeats or acknowledgements); returns those bytes.
    TimeoutError when none flows within `timeout_s`."""
    seen: deque[tuple[float, int]] = deque()
    deadline = time.monotonic() + timeout_s
    while True:
        now = time.monotonic()
        moved = links.counters()[slot][direction]
        seen.append((now, moved))
        while seen[0][0] < now - window_s:
            seen.popleft()
        if moved - seen[0][1] >= min_bytes:
            return moved - seen[0][1]
        if now > deadline:
            raise TimeoutError(
                f"no {DIRECTION[direction]} flowed across slot {slot}'s link within {timeout_s} s"
            )
        time.sleep(poll_s)  # polling the kernel's counters: there is no event to wait on


def slow_factor(workload: Workload, step_s: float, steps: int = 15) -> float:
    """The `--slow` factor that makes an inner step of the workload's model take about
    `step_s` of wall time here, now: the median of `steps` steps timed in this process on one
    thread, as a learner runs them (at least 1.5, at most 20)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, batch_fn, _ = build(workload.options(), torch.device("cpu"))
        optimizer = make_optimizer(model, workload.options())
        times = []
        for _ in range(steps + 3):  # the first few warm up
            t = time.perf_counter()
            x, y = batch_fn()
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return min(20.0, max(1.5, step_s / statistics.median(times[3:])))


@dataclass
class Fault:
    """One fault on a slot's link and what its counters saw."""

    kind: str  # "stall_push", "stall_pull", "reset_push", "partition"
    slot: int
    started: float  # wall clock
    ended: float
    caught_bytes: int = 0  # of the transfer it was timed on, crossed within the trigger window
    moved_while_cut: tuple[int, int] = (0, 0)  # (sent, received) while the link was down
    connections_reset: int = 0


class LinkFaults:
    """Faults on one slot's link, each recorded in `faults`."""

    def __init__(self, links: Namespaces, slot: int, min_bytes: int = 1200) -> None:
        self.links, self.slot, self.min_bytes = links, slot, min_bytes
        self.faults: list[Fault] = []

    def _moved(self) -> tuple[int, int]:
        return self.links.counters()[self.slot]

    def stall(self, direction: int, seconds: float, timeout_s: float) -> Fault:
        """Waits for a transfer in `direction` and cuts the link in its middle for `seconds`."""
        caught = await_transfer(self.links, self.slot, direction, self.min_bytes, timeout_s)
        return self.partition(seconds, kind=f"stall_{DIRECTION[direction]}", caught=caught)

    def partition(
        self,
        seconds: float,
        kind: str = "partition",
        caught: int = 0,
        during: Any = None,
    ) -> Fault:
        """Cuts the link for `seconds`; `during(deadline)`, if given, runs while it is cut (it
        must return by the monotonic `deadline`). The link is healed however this ends."""
        started = time.time()
        self.links.partition(self.slot)
        try:
            before = self._moved()
            end = time.monotonic() + seconds
            if during is not None:
                during(end)
            time.sleep(max(0.0, end - time.monotonic()))  # the fault's length: nothing to await
            after = self._moved()
        finally:
            self.links.heal(self.slot)
        fault = Fault(
            kind,
            self.slot,
            started,
            time.time(),
            caught,
            (after[0] - before[0], after[1] - before[1]),
        )
        self.faults.append(fault)
        return fault

    def reset(self, direction: int, timeout_s: float) -> Fault:
        """Waits for a transfer in `direction` and resets every connection of the slot."""
        caught = await_transfer(self.links, self.slot, direction, self.min_bytes, timeout_s)
        started = time.time()
        n = self.links.reset(self.slot)
        fault = Fault(f"reset_{DIRECTION[direction]}", self.slot, started, time.time(), caught)
        fault.connections_reset = n
        self.faults.append(fault)
        return fault


@dataclass
class Sighting:
    """A learner as the Synchronizer's Status listed it at one moment."""

    t: float  # wall clock when the request left: the state held then or later
    learner_id: str
    name: str
    state: str
    t_reply: float = float("inf")  # when the reply came: the state held then or earlier


@dataclass
class Reading:
    """The Synchronizer's count of dead learners at one moment (its Prometheus samples)."""

    t: float  # wall clock
    dead: float  # diloco_learners{state="dead"}


@dataclass
class Watch:
    """Every learner the Synchronizer listed while a job ran, and how many it counted dead,
    polled from this process."""

    sightings: list[Sighting] = field(default_factory=list)
    readings: list[Reading] = field(default_factory=list)
    errors: int = 0

    def ids(self, name_prefix: str = "") -> set[str]:
        return {s.learner_id for s in self.sightings if s.name.startswith(name_prefix)}

    def states(
        self,
        learner_id: str,
        since: float = 0.0,
        until: float = float("inf"),
        whole: bool = False,
    ) -> set[str]:
        """The states it was seen in by requests sent from `since` to `until`; `whole`: only
        those whose reply also came by `until`, so the state certainly held inside the window
        (a reply slowed by load may list a state from after it)."""
        return {
            s.state
            for s in self.sightings
            if s.learner_id == learner_id
            and since <= s.t <= until
            and (not whole or s.t_reply <= until)
        }

    def state_of(self, learner_id: str) -> str:
        """Its state at the last sighting ("" if never seen)."""
        seen = [s.state for s in self.sightings if s.learner_id == learner_id]
        return seen[-1] if seen else ""

    def wait_for(self, learner_id: str, state: str, timeout_s: float) -> float:
        """Until the Synchronizer lists the learner in `state`; the wall time it was seen so.
        TimeoutError naming the state it was in otherwise."""
        deadline = time.monotonic() + timeout_s
        since = time.time()
        while time.monotonic() < deadline:
            seen = [s.t for s in self.sightings if s.learner_id == learner_id and s.t >= since]
            if seen and self.state_of(learner_id) == state:
                return seen[-1]
            time.sleep(0.05)  # the watch polls another process: nothing to wait on here
        raise TimeoutError(
            f"learner {learner_id} not {state} within {timeout_s} s (last seen: "
            f"{self.state_of(learner_id) or 'never'})"
        )


class FaultJob(DilocoJob):
    """A `DilocoJob` whose summary keeps the Synchronizer's metrics as scraped once every
    learner finished (`samples`), and which polls the Synchronizer's Status every `watch_s`
    while it runs (`watch`)."""

    def __init__(
        self,
        cfg: Decoupled,
        workload: Workload,
        links: Namespaces,
        out: Path,
        watch_s: float = 0.2,
    ) -> None:
        super().__init__(cfg, workload, links, out)
        self.watch = Watch()
        self.watch_s = watch_s
        self._stop = threading.Event()

    def _poll(self) -> None:
        while not self._stop.wait(self.watch_s):
            if not self.address:
                continue
            # a sighting is stamped when its request left: the states the reply lists held then
            # or later, never earlier (a reply slowed by a loaded machine is not news from later)
            now = time.time()
            try:
                reply = status(self.address)
            except Exception:  # the Synchronizer starting or stopping: counted, polled again
                self.watch.errors += 1
                continue
            answered = time.time()
            self.watch.sightings += [
                Sighting(now, r.learner_id, r.name, r.state, answered) for r in reply.learners
            ]
            try:
                samples = scrape(self.metrics_url)
            except OSError:
                self.watch.errors += 1
                continue
            self.watch.readings.append(
                Reading(time.time(), metric(samples, "diloco_learners", state="dead"))
            )

    def start(self) -> None:
        super().start()
        threading.Thread(target=self._poll, name="status-watch", daemon=True).start()

    def run(self, *args: Any, **kwargs: Any) -> dict:
        try:
            return super().run(*args, **kwargs)
        finally:
            self._stop.set()

    def summarize(self, samples: dict, final: dict, evals: list[dict]) -> dict:
        return {**super().summarize(samples, final, evals), "samples": samples}
