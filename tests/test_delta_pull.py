"""Delta pulls: a learner at version v applies the kept INT8 updates and holds the served params."""

from __future__ import annotations

import torch

from protos import codec, framing, layout
from protos import diloco_pb2 as pb
from tests.helpers import Client, small_spec

SPEC = small_spec(fragments=1)
N = SPEC.fragments[0].numel


def _delta_pull(
    c: Client, have: int, base: torch.Tensor
) -> tuple[pb.PullHeader, torch.Tensor, int]:
    """Reconstructs the fragment from `base` at `have`; returns header, params, wire bytes."""
    stream = c.stub.PullFragment(
        pb.PullRequest(
            learner_id=c.learner_id,
            session=c.session,
            fragment_id=0,
            delta_ok=True,
            have_version=have,
        ),
        timeout=10,
    )
    header = next(stream).header
    params, wire = base.clone(), 0
    asm, link = None, None
    if header.HasField("payload"):  # full pull: decode it instead
        asm = framing.Assembler(header.payload)
        for msg in stream:
            asm.add(msg.chunk)
        return header, codec.decode(asm.finish(), header.payload, torch.empty(N)), wire
    for msg in stream:
        wire += msg.ByteSize()
        if msg.WhichOneof("kind") == "link":
            link, asm = msg.link, framing.Assembler(msg.link.payload)
        else:
            assert asm is not None and link is not None, "a chunk came before its link"
            asm.add(msg.chunk)
            if asm.complete:
                params.add_(codec.decode(asm.finish(), link.payload, torch.empty(N)))
    return header, params, wire


def _train(c: Client, rounds: int, start: int = 0) -> None:
    g = torch.Generator().manual_seed(start)
    for r in range(start, start + rounds):
        c.push(0, torch.randn(N, generator=g) * 0.05, pb.CODEC_INT4, base=r)
        c.pull(0, min_version=r + 1, wait_s=10)


def test_delta_chain_reproduces_the_served_parameters_bit_for_bit(make_server):
    srv = make_server(quorum=1, grace="none", update_history=4, max_staleness=4)
    c = Client(srv.address, SPEC)
    c.join()
    c.init([torch.randn(N)])
    _, v0 = c.pull(0)
    _train(c, 3)
    header, rebuilt, wire = _delta_pull(c, 0, v0)
    assert not header.HasField("payload") and header.delta_from == 0 and header.links == 3
    version, served = c.pull(0)
    assert header.version == version == 3
    assert torch.equal(rebuilt, served)
    assert framing.checksum(rebuilt) == header.checksum
    assert wire < N * 4 * 3 / 3  # three INT8 updates cost less than one FP32 pull


def test_gap_longer_than_the_kept_history_falls_back_to_a_full_pull(make_server):
    srv = make_server(quorum=1, grace="none", update_history=2, max_staleness=2)
    c = Client(srv.address, SPEC)
    c.join()
    c.init([torch.randn(N)])
    _, v0 = c.pull(0)
    _train(c, 3)
    header, _, _ = _delta_pull(c, 0, v0)
    assert header.HasField("payload") and header.version == 3  # full: the first update is gone


def test_up_to_date_learner_gets_an_empty_chain(make_server):
    srv = make_server(quorum=1, grace="none")
    c = Client(srv.address, SPEC)
    c.join()
    c.init([torch.randn(N)])
    _train(c, 1)
    _, v1 = c.pull(0)
    header, rebuilt, wire = _delta_pull(c, 1, v1)
    assert (
        header.links == 0
        and not header.HasField("payload")
        and torch.equal(rebuilt, v1)
        and wire == 0
    )


def test_error_feedback_keeps_canonical_params_close_to_exact_outer_steps(make_server):
    """Over many rounds the INT8 chain's residual stops quantization error from accumulating."""
    exact = make_server(
        quorum=1, grace="none", update_history=0, anchor="base", outer="sgd", outer_lr=1.0
    )
    chained = make_server(
        quorum=1, grace="none", update_history=4, anchor="base", outer="sgd", outer_lr=1.0
    )
    init = torch.randn(N)
    clients = []
    for srv in (exact, chained):
        c = Client(srv.address, SPEC)
        c.join()
        c.init([init])
        clients.append(c)
    g = torch.Generator().manual_seed(5)
    deltas = [torch.randn(N, generator=g) * 0.01 for _ in range(30)]
    for r, d in enumerate(deltas):
        for c in clients:
            c.push(0, d, base=r)
            c.pull(0, min_version=r + 1, wait_s=10)
    a, b = clients[0].pull(0)[1], clients[1].pull(0)[1]
    one_step_error = max(d.abs().max().item() for d in deltas) / 254 * 2
    assert (a - b).abs().max().item() <= one_step_error  # bounded by ~one step's error, not 30


def test_learner_behind_the_byte_bounded_history_gets_a_full_pull_and_the_same_params(
    make_server,
):
    link = layout.encoded_nbytes(pb.CODEC_INT8, N)
    srv = make_server(quorum=1, grace="none", update_history_bytes=2 * link + 1)
    c = Client(srv.address, SPEC)
    c.join()
    c.init([torch.randn(N)])
    assert (
        srv.synchronizer.model.fragments[0].model.downlink.history == 2
    )  # 16 by count, 2 by bytes
    _, v0 = c.pull(0)
    _train(c, 2)
    _, v2 = c.pull(0)
    _train(c, 2, start=2)
    version, served = c.pull(0)
    behind, full, _ = _delta_pull(c, 0, v0)
    assert behind.HasField("payload") and behind.version == version == 4  # links 1, 2 are gone
    assert torch.equal(full, served) and framing.checksum(full) == behind.checksum
    near, rebuilt, _ = _delta_pull(c, 2, v2)
    assert not near.HasField("payload") and near.links == 2
    assert torch.equal(rebuilt, served) and framing.checksum(rebuilt) == near.checksum
