"""Sharded islands over real gRPC: each rank of an island pushes and pulls only its slice of a
fragment; the Synchronizer merges an island's contribution whole or not at all."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence

import grpc
import pytest
import torch

from learner.client import SyncClient
from protos import codec, framing, layout, slicing
from protos import diloco_pb2 as pb
from protos.spec import ModelSpec
from tests.helpers import (
    TIMEOUT,
    Client,
    push_messages,
    serve_process,
    small_spec,
    stop_serving,
    wait_until,
)

SPEC = small_spec()
N0 = SPEC.fragments[0].numel
# Rounds close at one contribution, at once; the outer step is plain SGD with the whole delta.
SETTINGS = dict(quorum=1, grace="none", anchor="base", outer="sgd", outer_lr=1.0, update_history=0)

Runs = list[tuple[int, int]]


def halves(spec: ModelSpec, fragment: int) -> tuple[Runs, Runs]:
    """Rank 0 holds the first half of every tensor of the fragment, rank 1 the second half:
    runs that interleave, as FSDP's per-parameter sharding makes them."""
    first: Runs = []
    second: Runs = []
    for _, start, end in spec.fragments[fragment].offsets():
        mid = (start + end) // 2
        first.append((start, mid - start))
        second.append((mid, end - mid))
    return first, second


def start(address: str, seed: int = 0) -> tuple[Client, list[torch.Tensor]]:
    """The island's learner, joined, with the model initialised."""
    g = torch.Generator().manual_seed(seed)
    flats = [torch.randn(f.numel, generator=g) for f in SPEC.fragments]
    c = Client(address, SPEC, "island")
    assert c.join().needs_init
    c.init(flats)
    return c, flats


def make_slice(rank: int, ranks: int, runs: Sequence[tuple[int, int]]) -> pb.Slice:
    return pb.Slice(
        rank=rank, ranks=ranks, starts=[s for s, _ in runs], lengths=[n for _, n in runs]
    )


def gathered(x: torch.Tensor, runs: Runs) -> torch.Tensor:
    return torch.cat([x[s : s + n] for s, n in runs]) if runs else torch.empty(0)


def slice_push(
    c: Client,
    delta: torch.Tensor,
    runs: Runs,
    rank: int,
    ranks: int = 2,
    seq: int = 1,
    codec_id: int = pb.CODEC_FP32,
    base: int = 0,
    tokens: int = 50,
    steps: int = 10,
    fragment: int = 0,
    sl: pb.Slice | None = None,
) -> grpc.Future:
    """One rank's slice of `delta` pushed (the call returns at once: wait on the future)."""
    h, buf = c.header(fragment, gathered(delta, runs), codec_id, base, seq, tokens, steps)
    h.slice.CopyFrom(sl if sl is not None else make_slice(rank, ranks, runs))
    return c.stub.PushFragment.future(push_messages(h, buf), timeout=TIMEOUT)


def code_of(future: grpc.Future) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        future.result(timeout=TIMEOUT)
    return e.value.code()


def details_of(future: grpc.Future) -> str:
    return future.exception(timeout=TIMEOUT).details()


def island_count(srv, outcome: str) -> float:
    return srv.synchronizer.metrics.island_contributions.labels(outcome)._value.get()


def unchanged(srv, c: Client, flats: list[torch.Tensor]) -> None:
    """Nothing of a refused contribution was applied or entered a round."""
    frag = srv.synchronizer.model.by_id[0]
    assert frag.version == 0 and frag.admission.round is None
    assert frag.payloads.held_bytes == 0 and len(srv.synchronizer.pushes.assemblies) == 0
    version, params = c.pull(0)
    assert version == 0 and torch.equal(params, flats[0])


def test_two_ranks_slices_merge_bitwise_as_the_whole_delta_pushed_by_one_learner(
    make_server, tmp_path
):
    island_srv = make_server(state_dir=tmp_path / "island", **SETTINGS)
    c, flats = start(island_srv.address)
    delta = torch.randn(N0, generator=torch.Generator().manual_seed(1)) * 0.1
    first, second = halves(SPEC, 0)
    # Any push codec per rank: rank 0 INT8, rank 1 BF16.
    f0 = slice_push(c, delta, first, 0, codec_id=pb.CODEC_INT8, tokens=60, steps=10)
    f1 = slice_push(c, delta, second, 1, codec_id=pb.CODEC_BF16, tokens=40, steps=12)
    r0, r1 = f0.result(timeout=TIMEOUT), f1.result(timeout=TIMEOUT)
    assert r0 == r1 and r0.outcome == pb.PUSH_ACCEPTED and r0.round_version == 1
    version, merged = c.pull(0, min_version=1, wait_s=TIMEOUT)
    assert version == 1
    assert island_count(island_srv, "assembled") == 1
    assert island_srv.synchronizer.metrics.pushes.labels("accepted")._value.get() == 1

    # The same contribution, decoded as the Synchronizer decodes each slice, pushed whole.
    whole = torch.empty(N0)
    for runs, codec_id in ((first, pb.CODEC_INT8), (second, pb.CODEC_BF16)):
        part = gathered(delta, runs)
        header = layout.make_header(codec_id, part.numel())
        decoded = codec.decode(codec.encode(part, codec_id), header, torch.empty(part.numel()))
        offset = 0
        for s, n in runs:
            whole[s : s + n] = decoded[offset : offset + n]
            offset += n
    one_srv = make_server(state_dir=tmp_path / "one", **SETTINGS)
    one, _ = start(one_srv.address)
    reply = one.push(0, whole, pb.CODEC_FP32, base=0, seq=1, tokens=100, steps=12)
    assert reply.outcome == pb.PUSH_ACCEPTED and reply.weight == r0.weight
    assert one.pull(0, min_version=1, wait_s=TIMEOUT)[0] == 1
    assert torch.equal(merged, one.pull(0)[1])
    torch.testing.assert_close(merged, flats[0] - whole)  # outer SGD, lr 1, one contribution


def pull_slice(
    c: Client, runs: Runs, codec_id: pb.Codec = pb.CODEC_FP32, delta_ok: bool = False
) -> tuple[pb.PullHeader, torch.Tensor]:
    replies = c.stub.PullFragment(
        pb.PullRequest(
            learner_id=c.learner_id,
            session=c.session,
            fragment_id=0,
            codec=codec_id,
            slice=make_slice(0, 2, runs),
            delta_ok=delta_ok,
            have_version=0,
        ),
        timeout=TIMEOUT,
    )
    header = next(replies).header
    asm = framing.Assembler(header.payload)
    for r in replies:
        asm.add(r.chunk)
    out = torch.empty(header.payload.numel)
    return header, codec.decode(asm.finish(), header.payload, out)


def test_a_slice_pull_serves_exactly_its_runs_with_their_checksum_in_fp32_bf16_and_int8(
    make_server,
):
    srv = make_server(**SETTINGS)
    c, flats = start(srv.address)
    first, second = halves(SPEC, 0)
    for runs in (first, second, [(3, 1), (N0 - 2, 2)]):
        want = gathered(flats[0], runs)
        header, got = pull_slice(c, runs)
        assert header.links == 0 and header.version == 0
        assert header.payload.numel == want.numel() and header.payload.codec == pb.CODEC_FP32
        assert torch.equal(got, want) and header.checksum == framing.checksum(want)
        header, got = pull_slice(c, runs, pb.CODEC_BF16)
        assert header.payload.codec == pb.CODEC_BF16
        assert torch.equal(got, want.to(torch.bfloat16).float())
        assert header.checksum == framing.checksum(want)  # of the FP32 values
        header, got = pull_slice(c, runs, pb.CODEC_INT8)  # the slice's own blocks
        assert header.payload.codec == pb.CODEC_INT8 and header.checksum == framing.checksum(want)
        assert torch.equal(
            got, codec.decode(codec.encode(want, pb.CODEC_INT8), header.payload, want.clone())
        )
    header, got = pull_slice(c, [])  # a rank may hold nothing of a small fragment
    assert header.payload.numel == 0 and got.numel() == 0
    with pytest.raises(grpc.RpcError) as e:
        pull_slice(c, [(N0 - 1, 2)])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "runs",
    [[(3, 20)], [(3, 20), (250, 10), (N0 - 5, 5)], [(0, N0)]],
    ids=["one-block", "three-runs", "whole"],
)
def test_a_slice_delta_pull_holds_its_runs_of_the_served_parameters_bit_for_bit(
    make_server, runs: Runs
):
    # Kept INT8 updates: a rank holding version 0 of its runs pulls only the blocks of each
    # update that hold them, and ends with exactly the runs a full pull of the slice serves.
    srv = make_server(**{**SETTINGS, "update_history": 4})
    c, flats = start(srv.address)
    first, second = halves(SPEC, 0)
    g = torch.Generator().manual_seed(1)
    for seq in (1, 2):  # two island contributions: versions 1 and 2
        delta = torch.randn(N0, generator=g) * 0.1
        futures = [
            slice_push(c, delta, first, 0, seq=seq, base=seq - 1),
            slice_push(c, delta, second, 1, seq=seq, base=seq - 1),
        ]
        assert all(f.result(timeout=TIMEOUT).outcome == pb.PUSH_ACCEPTED for f in futures)
        assert c.pull(0, min_version=seq, wait_s=TIMEOUT)[0] == seq
    full_header, want = pull_slice(c, runs)
    assert full_header.version == 2
    rank = SyncClient(srv.address)
    try:
        rank.learner_id, rank.session, rank.spec_hash = c.learner_id, c.session, SPEC.spec_hash
        rank.slices = [make_slice(0, 2, runs), make_slice(0, 2, [])]
        rank.fragment_numels = [f.numel for f in SPEC.fragments]
        base = gathered(flats[0], runs)
        version, _, got = rank.pull(0, min_version=2, have=(0, base))  # checksum checked
        assert version == 2 and torch.equal(got, want)
        if runs == [(3, 20)]:  # one block of each update, not both
            block = layout.encoded_nbytes(pb.CODEC_INT8, layout.DEFAULT_BLOCK_SIZE)
            whole = layout.encoded_nbytes(pb.CODEC_INT8, N0)
            assert 2 * block < rank.bytes_received < 2 * whole, rank.bytes_received
    finally:
        rank.close()


@pytest.mark.parametrize(
    "codec_id", [pb.CODEC_INT8, pb.CODEC_INT4, pb.CODEC_FP4_E3M0, pb.CODEC_FP32, pb.CODEC_BF16]
)
def test_blocks_cut_from_an_encoded_update_decode_to_exactly_its_runs(codec_id: int):
    g = torch.Generator().manual_seed(codec_id)
    n, bs = 1000, 64
    x = torch.randn(n, generator=g)
    header = layout.make_header(codec_id, n, bs)
    buf = codec.encode(x, codec_id, bs)
    whole = codec.decode(buf, header, torch.empty(n))
    for runs in ([(5, 3)], [(0, 64), (64, 1), (200, 300), (990, 10)], [(63, 2), (999, 1)], []):
        ranges = slicing.covering(runs, header)
        sub, part = slicing.cut(buf, header, ranges)
        decoded = codec.decode(part, sub, torch.empty(int(sub.numel)))
        got = torch.zeros(sum(length for _, length in runs))
        slicing.add_runs(got, decoded, runs, ranges)
        assert torch.equal(got, gathered(whole, runs))
        assert sub.total_bytes < header.total_bytes or ranges == [(0, n)]


def test_a_rank_that_never_pushes_aborts_the_contribution_after_slice_wait_s(make_server):
    srv = make_server(slice_wait_s=0.5, **SETTINGS)
    c, flats = start(srv.address)
    delta = torch.full((N0,), 0.25)
    first, second = halves(SPEC, 0)
    alone = slice_push(c, delta, first, 0)
    assert code_of(alone) == grpc.StatusCode.ABORTED
    assert "ranks 1" in details_of(alone) and "nothing was applied" in details_of(alone)
    assert island_count(srv, "aborted") == 1
    unchanged(srv, c, flats)
    # The island pushes its next contribution whole: merged as usual.
    futures = [slice_push(c, delta, first, 0, seq=2), slice_push(c, delta, second, 1, seq=2)]
    assert all(f.result(timeout=TIMEOUT).outcome == pb.PUSH_ACCEPTED for f in futures)
    version, params = c.pull(0, min_version=1, wait_s=TIMEOUT)
    assert version == 1 and torch.equal(params, flats[0] - delta)


def test_a_cancelled_slice_aborts_the_ranks_waiting_with_it_at_once(make_server):
    srv = make_server(slice_wait_s=60.0, **SETTINGS)
    c, flats = start(srv.address)
    delta = torch.full((N0,), 0.25)
    third = N0 // 3
    runs: list[Runs] = [[(0, third)], [(third, third)], [(2 * third, N0 - 2 * third)]]
    waiting = slice_push(c, delta, runs[0], 0, ranks=3)
    cancelled = slice_push(c, delta, runs[1], 1, ranks=3)
    assemblies = srv.synchronizer.pushes.assemblies

    def both_waiting() -> bool:
        asm = assemblies.find((c.learner_id, 1))
        return asm is not None and len(asm.parts) == 2

    assert wait_until(both_waiting, TIMEOUT)
    cancelled.cancel()
    # Well before slice_wait_s (60 s): the wait ends as the call does.
    with pytest.raises(grpc.RpcError) as e:
        waiting.result(timeout=10.0)
    assert e.value.code() == grpc.StatusCode.ABORTED
    assert "rank 1's call ended" in e.value.details()
    unchanged(srv, c, flats)


@pytest.mark.parametrize(
    "second_runs, what",
    [
        (lambda h: [(h - 1, N0 - h + 1)], "overlap"),
        (lambda h: [(h + 1, N0 - h - 1)], "cover"),
    ],
    ids=["overlap", "gap"],
)
def test_slices_that_overlap_or_leave_a_gap_are_refused_and_nothing_applied(
    make_server, second_runs, what
):
    srv = make_server(**SETTINGS)
    c, flats = start(srv.address)
    delta = torch.full((N0,), 0.25)
    h = N0 // 2
    first = slice_push(c, delta, [(0, h)], 0)
    assert wait_until(lambda: len(srv.synchronizer.pushes.assemblies) == 1, TIMEOUT)
    second = slice_push(c, delta, second_runs(h), 1)
    for f in (first, second):
        assert code_of(f) == grpc.StatusCode.INVALID_ARGUMENT
        assert what in details_of(f) and "nothing was applied" in details_of(f)
    assert island_count(srv, "invalid") == 1
    unchanged(srv, c, flats)


@pytest.mark.parametrize(
    "sl, words",
    [
        (make_slice(0, 2, [(10, 5), (0, 5)]), "ascending"),
        (make_slice(0, 2, [(N0 - 5, 10)]), "past the fragment"),
        (make_slice(0, 2, [(0, 0)]), "length 0"),
        (make_slice(0, 1, [(0, N0)]), "ranks 1"),
        (make_slice(2, 2, [(0, 5)]), "below its ranks"),
        (pb.Slice(rank=0, ranks=2, starts=[0, 5], lengths=[5]), "lengths"),
    ],
    ids=["descending", "past-numel", "length-0", "ranks-1", "rank-too-big", "uneven"],
)
def test_bad_slices_are_refused_invalid_argument_at_once(make_server, sl, words):
    srv = make_server(**SETTINGS)
    c, flats = start(srv.address)
    runs = list(zip(sl.starts, sl.lengths, strict=False))
    h, buf = c.header(0, torch.zeros(sum(n for _, n in runs)), pb.CODEC_FP32, 0, 1)
    h.slice.CopyFrom(sl)
    with pytest.raises(grpc.RpcError) as e:
        c.stub.PushFragment(push_messages(h, buf), timeout=TIMEOUT)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
    unchanged(srv, c, flats)


def test_a_slice_of_an_accepted_contribution_sent_again_is_a_duplicate(make_server):
    srv = make_server(**SETTINGS)
    c, flats = start(srv.address)
    delta = torch.full((N0,), 0.25)
    first, second = halves(SPEC, 0)
    futures = [slice_push(c, delta, first, 0), slice_push(c, delta, second, 1)]
    accepted = [f.result(timeout=TIMEOUT) for f in futures]
    _, after = c.pull(0, min_version=1, wait_s=TIMEOUT)
    again = slice_push(c, delta, second, 1).result(timeout=TIMEOUT)
    assert again.outcome == pb.PUSH_DUPLICATE and again.round_version == accepted[0].round_version
    version, params = c.pull(0)
    assert version == 1 and torch.equal(params, after) and torch.equal(after, flats[0] - delta)
    assert len(srv.synchronizer.pushes.assemblies) == 0


def test_an_island_contribution_in_the_log_survives_kill_9(tmp_path):
    state, ready = tmp_path / "state", tmp_path / "ready.json"
    command = [sys.executable, "-m", "synchronizer"]
    flags = ("--quorum", "1", "--grace", "none", "--checkpoint-interval-s", "0")
    proc, info = serve_process(command, state, ready, *flags)
    try:
        c, _ = start(info["address"])
        delta = torch.randn(N0, generator=torch.Generator().manual_seed(2)) * 0.1
        first, second = halves(SPEC, 0)
        futures = [slice_push(c, delta, first, 0), slice_push(c, delta, second, 1)]
        assert all(f.result(timeout=TIMEOUT).outcome == pb.PUSH_ACCEPTED for f in futures)
        before = c.pull(0, min_version=1, wait_s=TIMEOUT)
        assert before[0] == 1
        proc.send_signal(signal.SIGKILL)  # no checkpoint but the first: only the log has it
        proc.wait(TIMEOUT)
    finally:
        proc.kill()
    proc, again = serve_process(command, state, ready, *flags)
    try:
        assert again["epoch"] == info["epoch"]
        c2 = Client(again["address"], SPEC, "island")
        c2.session = c.session
        c2.join(c.learner_id)
        version, params = c2.pull(0)
        assert version == before[0] and torch.equal(params, before[1])
        retry = slice_push(c2, delta, first, 0).result(timeout=TIMEOUT)
        assert retry.outcome == pb.PUSH_DUPLICATE
    finally:
        stop_serving(proc, TIMEOUT)


def test_slices_of_one_seq_that_disagree_abort_the_contribution(make_server):
    srv = make_server(**SETTINGS)
    c, flats = start(srv.address)
    delta = torch.full((N0,), 0.25)
    first, second = halves(SPEC, 0)
    waiting = slice_push(c, delta, first, 0)
    assert wait_until(lambda: len(srv.synchronizer.pushes.assemblies) == 1, TIMEOUT)
    other = slice_push(c, delta, second, 1, ranks=3)
    assert code_of(other) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(waiting) == grpc.StatusCode.ABORTED
    unchanged(srv, c, flats)


def test_concurrent_islands_each_merge_their_own_contribution(make_server):
    """Two islands, quorum 2: one round holds both contributions; slices interleave."""
    srv = make_server(**{**SETTINGS, "quorum": 2})
    a, flats = start(srv.address)
    b = Client(srv.address, SPEC, "island-b")
    b.join()
    first, second = halves(SPEC, 0)
    da, db = torch.full((N0,), 0.5), torch.full((N0,), 0.25)
    futures = []
    barrier = threading.Barrier(4)

    def push(c: Client, d: torch.Tensor, runs: Runs, rank: int) -> None:
        barrier.wait(TIMEOUT)
        futures.append(slice_push(c, d, runs, rank))

    threads = [
        threading.Thread(target=push, args=args)
        for args in ((a, da, first, 0), (b, db, first, 0), (a, da, second, 1), (b, db, second, 1))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert all(f.result(timeout=TIMEOUT).outcome == pb.PUSH_ACCEPTED for f in futures)
    version, params = a.pull(0, min_version=1, wait_s=TIMEOUT)
    assert version == 1
    torch.testing.assert_close(params, flats[0] - (da + db) / 2)
