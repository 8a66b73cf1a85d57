"""A sharded Synchronizer end to end, on loopback: learner processes (`python -m demo train`)
routing each fragment to its shard (`diloco-synchronizer serve --shards S --shard-index i`).

- a synchronous run (the kill -9 chaos test's settings) over two shards ends with the parameters
  of the same run against one Synchronizer, bit for bit;
- a shard killed with SIGKILL stalls only its fragments: the other shard's versions keep rising
  and the learners keep training; restarted on its state directory (the write-ahead log
  restores it, same epoch) its fragments advance again;
- a learner given the wrong shards is refused in one line (exit 2), before it trains.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from bench import chaos
from demo.cli import main as learner_main
from demo.procs import Procs, read_json, start_synchronizer
from demo.tiny import TINY, NotInTime, finish_ok, start_learner, status, wait_until

FRAGMENTS = ("--fragments", "3")  # two shards: one owns one fragment, the other two
DOWN_S = 4.0  # how long the killed shard stays down


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    ps = Procs(tmp_path)
    yield ps
    ps.stop_all(grace_s=0)


def serve_shard(
    procs: Procs, i: int, shards: int, flags: tuple[str, ...], port: int = 0, name: str = ""
) -> tuple[subprocess.Popen, dict]:
    """Shard i of `shards` (the unsharded Synchronizer when 1), state in ROOT/state-i."""
    sharding = ["--shards", str(shards), "--shard-index", str(i)] if shards > 1 else []
    try:
        return start_synchronizer(
            procs,
            [*flags, *sharding],
            state_dir=procs.root / f"state-{i}",
            port=port,
            name=name or f"shard-{i}",
        )
    except RuntimeError as e:
        raise AssertionError(f"{e}\n{procs.tails()}") from None


def final_pull(procs: Procs, address: str) -> dict:
    """The result of a learner with zero steps (it joins, adopts the served model and leaves),
    run in this process: `python -m demo train`'s own code without a process start."""
    out = procs.root / "final-pull.json"
    argv = ["train", "--synchronizer", address, "--name", "final-pull", "--learners", "1"]
    threads = torch.get_num_threads()  # the learner sets its own; the suite's stays as it was
    try:
        rc = learner_main([*argv, "--steps", "0", "--out", str(out), *TINY, *FRAGMENTS])
    finally:
        torch.set_num_threads(threads)
    served = read_json(out)
    assert rc == 0 and served.get("finished"), f"final pull exited with {rc}\n{procs.tails()}"
    return served


def synchronous_run(
    root: Path, shards: int, steps: int, learners: int = 2
) -> tuple[str, list[int]]:
    """Learners in lockstep (the chaos test's synchronous settings) against `shards` shards;
    the hash of the parameters served at the end, and their versions."""
    procs = Procs(root)
    try:
        with ThreadPoolExecutor(shards) as pool:  # the shards start side by side
            started = list(
                pool.map(lambda i: serve_shard(procs, i, shards, chaos.SYNCHRONIZER), range(shards))
            )
        address = ",".join(info["address"] for _, info in started)
        lockstep = ("--wait-for-learners", str(learners), "--strict-overlap", *FRAGMENTS)
        runs = [
            start_learner(procs, address, i, learners, steps, *lockstep) for i in range(learners)
        ]
        for p, out in runs:
            finish_ok(procs, p, out, timeout_s=120)
        served = final_pull(procs, address)
        return str(served["param_hash"]), list(served["learner"]["fragment_versions"])
    finally:
        procs.stop_all(grace_s=0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_synchronous_run_over_two_shards_ends_with_the_parameters_of_one_synchronizer(
    tmp_path: Path,
):
    one, versions = synchronous_run(tmp_path / "one", 1, steps=60)
    two, sharded_versions = synchronous_run(tmp_path / "two", 2, steps=60)
    print(
        f"final parameters: 1 shard {one[:16]} {versions}, 2 shards {two[:16]} {sharded_versions}"
    )
    assert versions == sharded_versions and min(versions) >= 5  # every fragment went through rounds
    assert one == two


def shard_versions(address: str) -> dict[int, int] | None:
    """{fragment: version} the shard at `address` serves; None when it does not answer."""
    try:
        return {fv.fragment_id: fv.version for fv in status(address).versions}
    except grpc.RpcError:  # down or restarting
        return None


Row = tuple[float, str, dict[int, int] | None, dict[int, int] | None, list[int], list[int]]


def table(rows: list[Row]) -> str:
    lines = [
        f"{'t (s)':>6}  {'phase':18} {'shard 0 {fragment: version}':28} "
        f"{'shard 1 {fragment: version}':28} {'learner 0 sees':16} learner steps"
    ]
    for t, phase, v0, v1, seen, steps in rows:
        if not seen:  # the learners are still starting
            continue
        lines.append(
            f"{t:6.1f}  {phase:18} {str(v0 if v0 is not None else 'down'):28} "
            f"{str(v1 if v1 is not None else 'down'):28} {str(seen):16} {steps}"
        )
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_killed_shard_stalls_only_its_fragments_and_they_catch_up_after_its_restart(
    procs: Procs,
):
    flags = ("--quorum", "0", "--lease-s", "5", "--checkpoint-interval-s", "1")
    shards = [serve_shard(procs, i, 2, flags) for i in range(2)]
    addresses = [info["address"] for _, info in shards]
    runs = [
        start_learner(procs, ",".join(addresses), i, 2, 1_000_000, *FRAGMENTS) for i in range(2)
    ]
    rows: list[Row] = []
    t0 = time.monotonic()

    def sample(phase: str) -> Row:
        v0, v1 = (shard_versions(a) for a in addresses)
        results = [read_json(out) for _, out in runs]
        seen = list(results[0].get("learner", {}).get("fragment_versions", []))
        row = (time.monotonic() - t0, phase, v0, v1, seen, [int(r.get("step", 0)) for r in results])
        rows.append(row)
        return row

    def watch(phase: str, done: Callable[[Row], object], timeout_s: float) -> Row:
        """A row every 0.5 s until done(row); NotInTime (with the table) after timeout_s."""
        last: list[Row] = []

        def sampled() -> bool:
            if rows and time.monotonic() - t0 - rows[-1][0] < 0.5:
                return False
            last[:] = [sample(phase)]
            return bool(done(last[0]))

        try:
            wait_until(sampled, timeout_s, phase, procs)
        except NotInTime as e:
            raise NotInTime(f"{table(rows)}\n{e}") from None
        return last[0]

    def training() -> None:
        assert all(p.poll() is None for p, _ in runs), f"{table(rows)}\n{procs.tails()}"

    up = watch(  # both learners training (joined to both shards) and both shards serving
        "both up",
        lambda r: r[2] and r[3] and min([*r[2].values(), *r[3].values()]) >= 2 and min(r[5]) > 0,
        90,
    )
    assert up[2] is not None and up[3] is not None
    stalled, at_kill = sorted(up[3]), up[3]  # shard 1's fragments and their last versions
    Procs.kill(shards[1][0])  # SIGKILL
    killed = sample("shard 1 killed")
    free, steps_at_kill = killed[2] or {}, killed[5]
    assert free, table(rows)
    down = watch(
        "shard 1 down",
        lambda r: (
            r[0] >= killed[0] + DOWN_S
            and r[3] is None
            and r[2] is not None
            and all(r[2][p] >= free[p] + 3 for p in free)
            and min(r[5]) >= max(steps_at_kill) + 30
        ),
        60,
    )
    training()
    during = [r for r in rows if r[1] == "shard 1 down"][2:]  # after a second to settle
    assert len({tuple(r[4][p] for p in stalled) for r in during}) == 1, table(rows)  # stopped

    restarted, info = serve_shard(procs, 1, 2, flags, port=shards[1][1]["port"], name="shard-1b")
    assert info["epoch"] == shards[1][1]["epoch"], "the write-ahead log keeps the epoch"
    back = shard_versions(addresses[1]) or {}
    assert all(back.get(p, -1) >= at_kill[p] for p in stalled), (back, at_kill)
    free_down = down[2] or {}
    watch(
        "shard 1 restarted",
        lambda r: (
            r[2] is not None
            and r[3] is not None
            and all(r[3][p] >= back[p] + 2 for p in stalled)
            and all(r[2][p] >= free_down[p] + 2 for p in free_down)
        ),
        90,
    )
    training()
    print("\n" + table(rows))


@pytest.fixture
def shard_servers(make_server, tmp_path: Path) -> dict[str, str]:
    """Shards 0 and 1 of 2 (s0, s1) and another shard 0 of 2 (x0), in-process on port 0."""
    return {
        name: make_server(shards=2, shard_index=index, state_dir=tmp_path / name).address
        for name, index in (("s0", 0), ("s1", 1), ("x0", 0))
    }


@pytest.mark.parametrize(
    ("synchronizer", "extra", "words"),
    [
        ("{s0}", [], "is shard 0 of 2, but this learner was given only it"),
        ("{s0},{s1}", ["--shards", "3"], "shards=3 but synchronizer lists 2 addresses"),
        ("{s0},{x0}", [], "needs shards 0..1 once each, but"),
        ("{s1},{s0},{x0}", [], "is one of 2 shards, but this learner was given 3 shards"),
    ],
    ids=["one-of-two", "shards-3-for-2", "shard-0-twice", "three-for-two"],
)
def test_a_learner_given_the_wrong_shards_is_refused_in_one_line_with_exit_2(
    shard_servers, capsys, synchronizer, extra, words
):
    argv = ["train", "--synchronizer", synchronizer.format(**shard_servers), "--steps", "1"]
    rc = learner_main([*argv, *TINY, *FRAGMENTS, "--join-timeout-s", "20", *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert words in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
