"""A model sharded across Synchronizer processes, server side: each shard holds and serves only
its own fragments, refuses requests for another shard's and Joins that route otherwise, keeps
its own state directory, and `diloco-synchronizer init` uploads each shard its part."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import save_file

from protos import diloco_pb2 as pb
from protos.configload import ConfigError, load
from protos.initmodel import init_model_requests
from protos.spec import TensorInfo, owned_fragments, plan_fragments, shard_owners
from synchronizer.cli import main
from synchronizer.config import SynchronizerConfig
from synchronizer.server import RunningServer
from synchronizer.shards import ShardLayoutError, resolve_index
from tests.helpers import TIMEOUT, Client, small_spec

SPEC = small_spec(fragments=4)  # fragments of 300, 257, 100 and 40 elements
OWNERS = shard_owners(SPEC, 2)
OWNED = [owned_fragments(SPEC, 2, i) for i in range(2)]
Start = Callable[..., RunningServer]


def _join(c: Client, shards: int, assignment: Sequence[int] | None = None) -> pb.JoinReply:
    """Joins as a learner that routes to `shards` shards with `assignment` (default: the real one)."""
    reply = c.stub.Join(
        pb.JoinRequest(
            learner_name=c.name,
            spec=c.spec.to_proto(),
            shards=shards,
            fragment_shards=list(
                shard_owners(c.spec, shards) if assignment is None else assignment
            ),
        ),
        timeout=TIMEOUT,
    )
    c.learner_id, c.session, c.seq = reply.learner_id, reply.session, reply.next_seq - 1
    return reply


def _values(fid: int) -> torch.Tensor:
    return torch.arange(SPEC.fragments[fid].numel, dtype=torch.float32) + 1000 * fid


def _init(c: Client, ids: Sequence[int]) -> pb.InitModelReply:
    messages = init_model_requests(
        c.learner_id, c.session, SPEC.spec_hash, [_values(f) for f in ids], 1000, ids
    )
    return c.stub.InitModel(messages, timeout=TIMEOUT)


def _shard(make_server: Start, tmp_path: Path, index: int, **settings: Any) -> RunningServer:
    settings.setdefault("state_dir", tmp_path / f"shard-{index}")
    return make_server(shards=2, shard_index=index, **settings)


def _initialised_pair(make_server: Start, tmp_path: Path, **settings: Any) -> list[RunningServer]:
    servers = [_shard(make_server, tmp_path, i, **settings) for i in range(2)]
    for srv, ids in zip(servers, OWNED, strict=True):
        c = Client(srv.address, SPEC, "init")
        assert _join(c, 2).needs_init
        _init(c, ids)
        c.close()
    return servers


def _refused(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_two_shards_each_hold_only_their_fragments(make_server: Start, tmp_path: Path) -> None:
    servers = _initialised_pair(make_server, tmp_path)
    assert OWNED == [[0, 3], [1, 2]] and OWNERS == [0, 1, 1, 0]  # byte-balanced: 340 and 357
    for index, (srv, ids) in enumerate(zip(servers, OWNED, strict=True)):
        core = srv.synchronizer
        assert [f.fid for f in core.model.fragments] == ids and sorted(core.model.by_id) == ids
        numel = sum(SPEC.fragments[f].numel for f in ids)
        params = core.metrics.registry.get_sample_value(
            "diloco_memory_projected_bytes", {"component": "params"}
        )
        assert params == 4 * numel
        assert (
            core.metrics.registry.get_sample_value(
                "diloco_shard_info", {"shard": str(index), "shards": "2"}
            )
            == 1
        )
        c = Client(srv.address, SPEC)
        reply = _join(c, 2)
        assert (reply.shards, reply.shard_index, list(reply.owned_fragments)) == (2, index, ids)
        assert [v.fragment_id for v in reply.versions] == ids
        status = c.status()
        assert (status.shards, status.shard_index) == (2, index)
        assert [v.fragment_id for v in status.versions] == ids
        for fid in ids:
            assert torch.equal(c.pull(fid)[1], _values(fid))
        c.close()


def test_shards_count_their_part_of_the_learners_work_so_shards_add_up(
    make_server: Start, tmp_path: Path
) -> None:
    servers = _initialised_pair(make_server, tmp_path)
    assert [s.synchronizer.goodput.fraction for s in servers] == [340 / 697, 357 / 697]
    for srv in servers:
        c = Client(srv.address, SPEC)
        _join(c, 2)
        c.heartbeat(steps=10, tokens=1000, compute_s=10.0)
        c.close()
    flights = [s.synchronizer.goodput.in_flight() for s in servers]
    assert sum(t for t, _ in flights) == pytest.approx(1000)
    assert sum(c for _, c in flights) == pytest.approx(10.0)


def test_push_or_pull_of_another_shards_fragment_is_refused_and_changes_nothing(
    make_server: Start, tmp_path: Path
) -> None:
    srv = _initialised_pair(make_server, tmp_path, quorum=1, grace="none")[0]
    c = Client(srv.address, SPEC)
    _join(c, 2)
    before = [f.model.params.clone() for f in srv.synchronizer.model.fragments]  # type: ignore[union-attr]
    for call in (
        lambda: c.push(1, torch.ones(SPEC.fragments[1].numel)),
        lambda: c.pull(1),
    ):
        e = _refused(call)
        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "fragment 1 is served by shard 1 of 2; this is shard 0 of 2 (fragments [0, 3])" in (
            e.details() or ""
        )
    assert _refused(lambda: c.pull(9)).code() == grpc.StatusCode.NOT_FOUND  # not in the model
    core = srv.synchronizer
    assert [f.version for f in core.model.fragments] == [0, 0]
    assert all(
        torch.equal(f.model.params, b)  # type: ignore[arg-type]
        for f, b in zip(core.model.fragments, before, strict=True)
    )
    assert (
        core.metrics.registry.get_sample_value(
            "diloco_rejected_requests_total",
            {"code": "FAILED_PRECONDITION", "reason": "wrong_shard"},
        )
        == 2
    )
    assert c.push(0, torch.ones(SPEC.fragments[0].numel)).outcome == pb.PUSH_ACCEPTED  # its own
    c.close()


@pytest.mark.parametrize(
    ("shards", "assignment", "words"),
    [
        (3, None, "the learner routes to 3 shards; this Synchronizer is shard 0 of 2 (--shards 2)"),
        (0, [], "give the learner every shard's address (2)"),
        (2, [0, 1, 0, 0], "assigns fragment 2 to shard 0, this Synchronizer to shard 1"),
        (2, [0, 1, 1], "the learner assigns 3 fragments, the model has 4"),
    ],
    ids=["count", "unsharded-learner", "assignment", "assignment-length"],
)
def test_join_that_routes_otherwise_is_refused_and_records_no_learner(
    make_server: Start,
    tmp_path: Path,
    shards: int,
    assignment: list[int] | None,
    words: str,
) -> None:
    srv = _shard(make_server, tmp_path, 0)
    c = Client(srv.address, SPEC)
    e = _refused(lambda: _join(c, shards, assignment))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert words in (e.details() or "")
    assert not srv.synchronizer.registry.learners and not srv.synchronizer.model.proposed
    c.close()


def test_model_with_fewer_fragments_than_shards_is_refused_at_join(
    make_server: Start, tmp_path: Path
) -> None:
    srv = _shard(make_server, tmp_path, 1)
    one = small_spec(fragments=1)
    c = Client(srv.address, one)
    e = _refused(lambda: _join(c, 2, [0]))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "the model has 1 fragments, fewer than the 2 shards" in (e.details() or "")
    assert not srv.synchronizer.registry.learners
    c.close()


def test_init_stream_must_carry_exactly_the_shards_fragments(
    make_server: Start, tmp_path: Path
) -> None:
    srv = _shard(make_server, tmp_path, 0)
    c = Client(srv.address, SPEC)
    _join(c, 2)
    e = _refused(lambda: _init(c, [0, 1, 2, 3]))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "fragment 1 is served by shard 1 of 2" in (e.details() or "")
    e = _refused(lambda: _init(c, [0]))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "without fragments [3]" in (
        e.details() or ""
    )
    assert not srv.synchronizer.model.initialized
    assert list(_init(c, [0, 3]).versions) == [
        pb.FragmentVersion(fragment_id=0, version=0),
        pb.FragmentVersion(fragment_id=3, version=0),
    ]
    c.close()


def test_restart_restores_the_shards_fragments_and_refuses_another_layout(
    make_server: Start, tmp_path: Path
) -> None:
    settings = {"quorum": 1, "grace": "none", "outer": "sgd", "outer_lr": 1.0}
    srv = _initialised_pair(make_server, tmp_path, **settings)[1]
    c = Client(srv.address, SPEC)
    _join(c, 2)
    assert c.push(2, torch.ones(SPEC.fragments[2].numel)).outcome == pb.PUSH_ACCEPTED
    c.close()
    srv.server.stop(0).wait()
    srv.synchronizer.close()

    again = _shard(make_server, tmp_path, 1, **settings)
    core = again.synchronizer
    assert [(f.fid, f.version) for f in core.model.fragments] == [(1, 0), (2, 1)]
    c = Client(again.address, SPEC)
    _join(c, 2)
    assert torch.equal(c.pull(1)[1], _values(1))
    assert torch.allclose(c.pull(2)[1], _values(2) - 1, atol=1e-3)  # sgd, outer_lr 1
    c.close()

    state = tmp_path / "shard-1"
    layouts: list[tuple[dict[str, Any], str]] = [
        (
            {"shards": 2, "shard_index": 0},
            "holds shard 1 of 2 (fragments [1, 2]), but this Synchronizer is shard 0 of 2",
        ),
        ({"shards": 1}, "is shard 0 of 1: give each shard its own state_dir"),
        ({"shards": 3, "shard_index": 1}, "start with --shards 2 --shard-index 1"),
    ]
    for layout, words in layouts:
        with pytest.raises(ShardLayoutError, match="refusing to start") as info:
            make_server(state_dir=state, **layout)
        assert words in str(info.value)


def test_unsharded_state_is_refused_as_a_shard(make_server: Start, tmp_path: Path) -> None:
    srv = make_server(state_dir=tmp_path / "whole")
    c = Client(srv.address, SPEC)
    c.join()
    c.init([_values(f.fragment_id) for f in SPEC.fragments])
    c.close()
    srv.server.stop(0).wait()
    srv.synchronizer.close()
    with pytest.raises(ShardLayoutError, match="holds an unsharded model \\(all 4 fragments\\)"):
        _shard(make_server, tmp_path, 0, state_dir=tmp_path / "whole")


@pytest.mark.slow
def test_start_on_another_layouts_state_is_one_line_and_exit_2(
    make_server: Start, tmp_path: Path
) -> None:
    srv = _shard(make_server, tmp_path, 0)
    c = Client(srv.address, SPEC)
    _join(c, 2)
    _init(c, OWNED[0])
    c.close()
    srv.server.stop(0).wait()
    srv.synchronizer.close()
    out = subprocess.run(
        [sys.executable, "-m", "synchronizer", "serve", "--state-dir", str(tmp_path / "shard-0")]
        + ["--port", "0", "--metrics-port", "-1", "--shards", "2", "--shard-index", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "holds shard 0 of 2 (fragments [0, 3])" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_init_with_every_shards_address_uploads_each_its_part(
    make_server: Start, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = {t.name: torch.randn(t.shape) for t in SPEC.tensors}
    model = tmp_path / "model.safetensors"
    save_file(weights, str(model))
    servers = [_shard(make_server, tmp_path, i) for i in range(2)]
    a, b = (s.address for s in servers)

    rc = main(["init", str(model), "--synchronizer", f"{a},{a}", "--fragments", "4"])
    assert rc == 2
    assert "both shard 0 (shards [1] not named); nothing was changed" in capsys.readouterr().err
    # the shards themselves refuse a learner routing to 3 of them: exit 4 (refused)
    assert main(["init", str(model), "--synchronizer", f"{a},{b},{b}", "--fragments", "4"]) == 4
    assert "routes to 3 shards" in capsys.readouterr().err
    assert not any(s.synchronizer.model.initialized for s in servers)

    rc = main(["init", str(model), "--synchronizer", f"{b}, {a}", "--fragments", "4"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "in 4 fragments over 2 shards" in out and "versions [0, 0, 0, 0]" in out
    spec = plan_fragments([TensorInfo(n, tuple(t.shape)) for n, t in weights.items()], 4)
    assert spec.spec_hash == SPEC.spec_hash
    for srv, ids in zip(servers, OWNED, strict=True):
        assert [f.fid for f in srv.synchronizer.model.fragments] == ids
        c = Client(srv.address, SPEC)
        _join(c, 2)
        for fid in ids:
            expected = torch.cat([weights[t.name].reshape(-1) for t in SPEC.fragments[fid].tensors])
            assert torch.equal(c.pull(fid)[1], expected)
        c.close()
    assert main(["init", str(model), "--synchronizer", f"{a},{b}", "--fragments", "4"]) == 4
    assert "already initialised" in capsys.readouterr().err


def test_init_after_a_partial_one_uploads_only_to_the_empty_shards(
    make_server: Start, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model.safetensors"
    save_file({t.name: torch.ones(t.shape) for t in SPEC.tensors}, str(model))
    servers = [_shard(make_server, tmp_path, i) for i in range(2)]
    c = Client(servers[0].address, SPEC)
    _join(c, 2)
    _init(c, OWNED[0])
    c.close()
    rc = main(["init", str(model), "--synchronizer", ",".join(s.address for s in servers)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "(shards [0] were already initialised and left as they were)" in out
    for srv, fid, expected in [(servers[0], 0, _values(0)), (servers[1], 1, torch.ones(257))]:
        c = Client(srv.address, SPEC)
        _join(c, 2)
        assert torch.equal(c.pull(fid)[1], expected)  # shard 0 kept its own upload
        c.close()


def test_shard_index_comes_from_the_host_names_ordinal_or_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert resolve_index(1, -1, "anything") == 0
    assert resolve_index(3, -1, "diloco-synchronizer-2") == 2
    assert resolve_index(3, 1, "diloco-synchronizer-2") == 1  # given explicitly: it wins
    monkeypatch.setenv("HOSTNAME", "diloco-synchronizer-1")
    assert load(SynchronizerConfig, flags={"shards": 2}).shard_index == 1
    for flags, words in [
        ({"shards": 2, "shard_index": 2}, "shard_index 2 must be below shards (2)"),
        ({"shards": 1, "shard_index": 1}, "shard_index 1 must be below shards (1)"),
        ({"shards": 0}, "invalid setting shards"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            load(SynchronizerConfig, flags=flags)
    monkeypatch.setenv("HOSTNAME", "diloco-synchronizer-5")
    with pytest.raises(ConfigError, match=re.escape("5 (the ordinal of host name 'diloco-syn")):
        load(SynchronizerConfig, flags={"shards": 2})
    monkeypatch.setenv("HOSTNAME", "laptop")
    rc = main(["serve", "--state-dir", str(tmp_path), "--shards", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "shard_index is not set and the host name 'laptop' ends in no -N ordinal" in err
    assert "--shard-index (0..1)" in err and "Traceback" not in err


def test_unsharded_learner_and_synchronizer_see_one_shard_of_everything(
    make_server: Start, tmp_path: Path
) -> None:
    srv = make_server()
    c = Client(srv.address, SPEC)
    reply = c.join()
    assert (reply.shards, reply.shard_index, list(reply.owned_fragments)) == (1, 0, [0, 1, 2, 3])
    assert (c.status().shards, c.status().shard_index) == (1, 0)
    c.close()
