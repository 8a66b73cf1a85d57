"""Effective goodput: evaluators' eval loss reports, the reference curve, and what they give.

A real in-process Synchronizer on port 0: an evaluator joins (JoinRequest.evaluator), reports
the served model's eval loss, and the Synchronizer scores it as the reference run's tokens to
reach that loss over the tokens the training learners consumed. Bad reports and bad curve files
are refused with one clear message; an evaluator is never counted as a training learner.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from protos import diloco_pb2 as pb
from protos.configload import ConfigError, load
from synchronizer.cli_status import status_json
from synchronizer.config import SynchronizerConfig
from synchronizer.evaluation import ReferenceCurve
from tests.helpers import REPO, Client, small_spec, wait_until

SPEC = small_spec()
CURVE = [[0, 5.0], [1000, 3.0], [2000, 3.5], [4000, 2.0]]  # noisy: 3.5 after 3.0


def write_curve(tmp_path: Path, points: Any = CURVE, name: str = "curve.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(points) if name.endswith(".json") else points)
    return path


def sample(srv: Any, name: str, eval_set: str = "default") -> float | None:
    return srv.synchronizer.metrics.registry.get_sample_value(name, {"eval_set": eval_set})


def trainer_and_evaluator(srv: Any) -> tuple[Client, Client]:
    trainer = Client(srv.address, SPEC, "trainer")
    trainer.join()
    trainer.init([torch.zeros(f.numel) for f in SPEC.fragments])
    evaluator = Client(srv.address, SPEC, "evaluator")
    evaluator.join(evaluator=True)
    return trainer, evaluator


# The curve ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loss", "tokens", "below"),
    [
        (6.0, 0.0, False),  # above the curve's start: its first tokens
        (5.0, 0.0, False),
        (4.0, 500.0, False),  # halfway from 5.0 to 3.0
        (3.0, 1000.0, False),
        (3.2, 900.0, False),  # 3.5 at 2000 never raises what 3.0 at 1000 reached
        (2.5, 3000.0, False),  # running best 3.0 at 2000, 2.0 at 4000
        (2.0, 4000.0, False),
        (1.5, 4000.0, True),  # below the best: the last tokens, a lower bound
    ],
)
def test_reference_tokens_interpolate_the_running_best_of_the_curve(loss, tokens, below):
    curve = ReferenceCurve.from_points(CURVE)
    assert curve.tokens_to_reach(loss) == pytest.approx((tokens, below))


def test_a_csv_curve_reads_as_the_same_json_one(tmp_path):
    csv = write_curve(tmp_path, "tokens,eval_loss\n0,5\n1000,3\n2000,3.5\n4000,2\n", "c.csv")
    assert ReferenceCurve.load(csv) == ReferenceCurve.load(write_curve(tmp_path))
    points = {"points": [{"tokens": t, "eval_loss": x} for t, x in CURVE]}
    assert ReferenceCurve.load(write_curve(tmp_path, points, "o.json")) == ReferenceCurve.load(csv)


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("c.json", "[[0, 5.0]]", "at least 2 points"),
        ("c.json", "[[0, 5.0], [0, 4.0]]", "tokens must increase"),
        ("c.json", "[[0, 5.0], [10, -1]]", "eval_loss of point 1 must be finite and non-negative"),
        ("c.json", '[[0, 5.0], [10, "x"]]', "eval_loss of point 1 is not a number"),
        ("c.json", "[[0, 5.0], [10, NaN]]", "must be finite"),
        ("c.json", "{not json", "not valid JSON"),
        ("c.json", '{"curve": []}', "expected a list"),
        ("c.csv", "steps,loss\n0,5\n", "header 'tokens,eval_loss'"),
        ("c.csv", "tokens,eval_loss\n0,5,1\n", "line 2 has 3 columns"),
    ],
)
def test_a_bad_reference_curve_is_one_config_error_line_naming_the_file(
    tmp_path, name, content, words
):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ConfigError) as e:
        load(SynchronizerConfig, None, {"reference_curve": str(path)}, {})
    message = str(e.value)
    assert words in message and str(path) in message, message
    assert len(message.strip().splitlines()) == 1, message


@pytest.mark.slow
def test_serve_with_a_bad_or_missing_reference_curve_exits_2_with_one_line(tmp_path):
    bad = write_curve(tmp_path, [[0, 5.0], [0, 4.0]])
    for path, words in ((bad, "tokens must increase"), (tmp_path / "none.json", "cannot read")):
        out = subprocess.run(
            [sys.executable, "-m", "synchronizer", "serve", "--state-dir", str(tmp_path)]
            + ["--reference-curve", str(path)],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, out.stderr
        assert words in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


# Reports over gRPC -------------------------------------------------------------------------------


def test_effective_goodput_is_reference_tokens_over_tokens_consumed(make_server, tmp_path):
    srv = make_server(reference_curve=write_curve(tmp_path), quorum=1, grace="none")
    trainer, evaluator = trainer_and_evaluator(srv)
    trainer.heartbeat(steps=10, tokens=1500)
    other = Client(srv.address, SPEC, "other")
    other.join()
    other.heartbeat(steps=5, tokens=500)
    evaluator.heartbeat(steps=99, tokens=10**6)  # an evaluator's tokens are not training tokens
    reply = evaluator.report_eval(2.5, {0: 0, 1: 0})
    # the reference needed 3000 tokens to reach 2.5; the learners consumed 1500 + 500
    assert reply.has_reference and not reply.below_curve
    assert (reply.reference_tokens, reply.consumed_tokens) == (3000.0, 2000.0)
    assert reply.effective_goodput == 1.5
    assert sample(srv, "diloco_eval_loss") == 2.5
    assert sample(srv, "diloco_reference_tokens") == 3000.0
    assert sample(srv, "diloco_eval_consumed_tokens") == 2000.0
    assert sample(srv, "diloco_effective_goodput_ratio") == 1.5
    assert sample(srv, "diloco_eval_below_reference") == 0
    assert srv.synchronizer.goodput.in_flight()[0] == 2000  # nor goodput's

    trainer.heartbeat(steps=20, tokens=7500)  # 8000 consumed: a loss below the curve's best
    reply = evaluator.report_eval(1.0, eval_set="wiki")
    assert reply.below_curve and reply.effective_goodput == 4000 / 8000
    assert sample(srv, "diloco_effective_goodput_ratio", "wiki") == 0.5
    assert sample(srv, "diloco_eval_below_reference", "wiki") == 1
    assert sample(srv, "diloco_effective_goodput_ratio") == 1.5  # each set keeps its own


def test_a_learner_restarted_under_its_id_adds_its_new_processs_tokens(make_server, tmp_path):
    srv = make_server(reference_curve=write_curve(tmp_path))
    trainer, evaluator = trainer_and_evaluator(srv)
    trainer.heartbeat(steps=10, tokens=1200)
    trainer.heartbeat(steps=8, tokens=800)  # a new process under the id counts from zero
    trainer.heartbeat(steps=9, tokens=900)
    assert evaluator.report_eval(3.0).consumed_tokens == 1200 + 900
    # a restart keeps it: the checkpoint holds both counts
    registry = srv.synchronizer.registry
    registry.restore(registry.snapshot())
    assert registry.consumed_tokens() == 2100


def test_effective_goodput_is_absent_without_a_curve_or_before_any_report(make_server, tmp_path):
    with_curve = make_server(reference_curve=write_curve(tmp_path))
    trainer_and_evaluator(with_curve)[0].heartbeat(steps=1, tokens=100)
    assert sample(with_curve, "diloco_effective_goodput_ratio") is None
    assert sample(with_curve, "diloco_eval_loss") is None
    assert "diloco_effective_goodput_ratio{" not in _exposition(with_curve)

    without = make_server(state_dir=tmp_path / "other")
    trainer, evaluator = trainer_and_evaluator(without)
    trainer.heartbeat(steps=1, tokens=100)
    reply = evaluator.report_eval(3.0)
    assert not reply.has_reference and reply.consumed_tokens == 100
    assert sample(without, "diloco_eval_loss") == 3.0
    assert sample(without, "diloco_effective_goodput_ratio") is None
    assert sample(without, "diloco_reference_tokens") is None


def _exposition(srv: Any) -> str:
    from prometheus_client import generate_latest

    return generate_latest(srv.synchronizer.metrics.registry).decode()


@pytest.mark.parametrize(
    ("loss", "versions", "code", "words"),
    [
        (math.nan, {}, grpc.StatusCode.INVALID_ARGUMENT, "finite and non-negative"),
        (math.inf, {}, grpc.StatusCode.INVALID_ARGUMENT, "finite and non-negative"),
        (-0.5, {}, grpc.StatusCode.INVALID_ARGUMENT, "finite and non-negative"),
        (2.0, {0: 3}, grpc.StatusCode.FAILED_PRECONDITION, "ahead of the server's 0"),
        (2.0, {7: 0}, grpc.StatusCode.INVALID_ARGUMENT, "fragment 7 is not one"),
    ],
)
def test_a_bad_eval_report_is_refused_and_changes_nothing(
    make_server, tmp_path, loss, versions, code, words
):
    srv = make_server(reference_curve=write_curve(tmp_path))
    evaluator = trainer_and_evaluator(srv)[1]
    with pytest.raises(grpc.RpcError) as e:
        evaluator.report_eval(loss, versions)
    assert e.value.code() == code and words in e.value.details(), e.value.details()
    assert sample(srv, "diloco_eval_loss") is None


def test_only_a_joined_evaluator_reports_and_an_evaluator_never_pushes(make_server, tmp_path):
    srv = make_server(reference_curve=write_curve(tmp_path))
    trainer, evaluator = trainer_and_evaluator(srv)
    with pytest.raises(grpc.RpcError) as e:
        trainer.report_eval(2.0)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "joined as an evaluator" in e.value.details()
    stranger = Client(srv.address, SPEC, "stranger")
    stranger.learner_id, stranger.session = "nobody", "x"
    with pytest.raises(grpc.RpcError) as e:
        stranger.report_eval(2.0)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    impostor = Client(srv.address, SPEC, "impostor")
    impostor.learner_id, impostor.session = evaluator.learner_id, "wrong"
    with pytest.raises(grpc.RpcError) as e:
        impostor.report_eval(2.0)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    early = make_server(state_dir=tmp_path / "empty")  # nothing to evaluate yet
    waiting = Client(early.address, SPEC, "early")
    waiting.join(evaluator=True)
    with pytest.raises(grpc.RpcError) as e:
        waiting.report_eval(2.0)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no parameters yet" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        evaluator.push(0, torch.ones(SPEC.fragments[0].numel))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "never pushes" in e.value.details()


def test_an_evaluator_counts_for_no_quorum_capacity_or_learner_slot(make_server):
    # quorum 0: a round waits for every live learner; max_learners 1: one trainer fills it
    srv = make_server(quorum=0, grace="none", max_learners=1)
    trainer, evaluator = trainer_and_evaluator(srv)
    registry = srv.synchronizer.registry
    assert registry.capacity_slots() == 1 and registry.counts()["alive"] == 1
    assert registry.live_ids() == {trainer.learner_id}
    status = {learner.name: learner for learner in trainer.status().learners}
    assert status["evaluator"].evaluator and not status["trainer"].evaluator
    shown = {x["name"]: x for x in status_json(trainer.status())["learners"]}
    assert shown["evaluator"]["evaluator"] and not shown["trainer"]["evaluator"]
    # the trainer alone closes the round: it is every live learner
    assert trainer.push(0, torch.full((SPEC.fragments[0].numel,), 0.1)).outcome == pb.PUSH_ACCEPTED
    version, _ = trainer.pull(0, min_version=1, wait_s=10)
    assert version == 1
    assert evaluator.report_eval(2.0, {0: 1}).consumed_tokens == 0  # the trainer sent no heartbeat
    with pytest.raises(grpc.RpcError) as e:
        Client(srv.address, SPEC, "second").join()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    second = Client(srv.address, SPEC, "second evaluator")
    second.join(evaluator=True)  # evaluators take no max_learners slot


# The example's evaluator -------------------------------------------------------------------------


def test_the_examples_eval_only_reports_each_new_served_model(make_server, tmp_path):
    from demo.options import TrainOptions
    from demo.train import build, train
    from learner.config import LearnerConfig
    from learner.fragments import FragmentPlan

    srv = make_server(reference_curve=write_curve(tmp_path), quorum=1, grace="none")
    torch.set_num_threads(1)
    tiny = {"n_layer": 1, "d_model": 32, "n_head": 2, "block": 32, "max_bytes": 1 << 16}
    o = TrainOptions(**tiny, eval_windows=8, eval_only=True, eval_every_s=0.1, eval_reports=2)
    o = o.model_copy(
        update={
            "out": str(tmp_path / "eval.json"),
            "sync": LearnerConfig(synchronizer=srv.address, fragments=2),
        }
    )
    model = build(o, torch.device("cpu"))[0]
    plan = FragmentPlan(model, 2)
    trainer = Client(srv.address, plan.spec, "trainer")
    trainer.join()
    trainer.init([plan.gather(p) for p in range(len(plan))])
    trainer.heartbeat(steps=1, tokens=100)

    def second_model_once_first_is_reported() -> None:
        assert wait_until(lambda: sample(srv, "diloco_eval_loss") is not None, 60)
        trainer.push(0, torch.full((plan.spec.fragments[0].numel,), 1e-2))
        trainer.heartbeat(steps=2, tokens=300)

    pusher = threading.Thread(target=second_model_once_first_is_reported)
    pusher.start()
    result = train(o)
    pusher.join(30)
    series = result["series"]
    assert [s["versions"] for s in series] == [{0: 0, 1: 0}, {0: 1, 1: 0}]
    assert all(math.isfinite(s["eval_loss"]) for s in series)
    assert all(s["effective_goodput"] is not None for s in series)  # 0 here: above the curve
    assert series[1]["consumed_tokens"] == 300
    assert sample(srv, "diloco_eval_loss") == series[1]["eval_loss"]
    assert json.loads((tmp_path / "eval.json").read_text())["finished"]
    assert srv.synchronizer.registry.counts()["alive"] == 1  # the evaluator left; never counted


def test_an_evaluator_of_a_sharded_synchronizer_reports_to_every_shard(make_server, tmp_path):
    from learner.config import LearnerConfig
    from learner.evaluator import Evaluator
    from tests.test_shards import OWNED, _init, _join, _values
    from tests.test_shards import SPEC as SHARDED_SPEC

    model = torch.nn.Module()  # the parameters SHARDED_SPEC names
    for i, n in enumerate((300, 257, 100, 40)):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.zeros(n))
        model.add_module(f"layer{i}", layer)
    curve = write_curve(tmp_path)
    servers = [
        make_server(shards=2, shard_index=i, state_dir=tmp_path / f"s{i}", reference_curve=curve)
        for i in range(2)
    ]
    for srv, ids in zip(servers, OWNED, strict=True):
        trainer = Client(srv.address, SHARDED_SPEC, "trainer")
        _join(trainer, 2)
        _init(trainer, ids)
        trainer.heartbeat(steps=1, tokens=1000)
    addresses = ",".join(s.address for s in servers)
    evaluator = Evaluator(model, LearnerConfig(synchronizer=addresses, fragments=4))
    assert evaluator.refresh() and not evaluator.refresh()  # pulled once; nothing new after
    for p in range(4):
        assert torch.equal(evaluator.plan.gather(p), _values(p))
    assert evaluator.report(2.5).effective_goodput == 3000 / 1000
    for srv in servers:
        assert sample(srv, "diloco_eval_loss") == 2.5
        assert sample(srv, "diloco_effective_goodput_ratio") == 3.0
        assert srv.synchronizer.registry.capacity_slots() == 1
    evaluator.close()


@pytest.mark.parametrize("checkpoint", [True, False], ids=["checkpoint", "log"])
def test_an_evaluator_stays_one_and_tokens_stay_consumed_across_a_restart(tmp_path, checkpoint):
    from synchronizer.metrics import Metrics
    from synchronizer.server import serving

    cfg = SynchronizerConfig(
        port=0, metrics_port=-1, state_dir=tmp_path / "state", shutdown_grace_s=1.0, lease_s=120.0
    )
    with serving(cfg, Metrics()) as srv:
        trainer, evaluator = trainer_and_evaluator(srv)
        trainer.heartbeat(steps=1, tokens=700)
        if checkpoint:
            assert srv.synchronizer.save_checkpoint()
    with serving(cfg, Metrics()) as srv:
        registry = srv.synchronizer.registry
        assert registry.learners[evaluator.learner_id].evaluator
        assert registry.capacity_slots() == 1 and registry.live_ids() == {trainer.learner_id}
        assert registry.consumed_tokens() == 700
        again = Client(srv.address, SPEC, "evaluator")  # a new port: the same evaluator
        again.learner_id, again.session = evaluator.learner_id, evaluator.session
        assert again.report_eval(2.5).consumed_tokens == 700  # its session kept too
