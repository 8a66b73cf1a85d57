"""Nothing acknowledged is lost: broken streams apply nothing, checkpoints are atomic and skip damage."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import torch

from protos import diloco_pb2 as pb
from protos import framing
from protos.spec import TensorInfo, plan_fragments
from synchronizer import checkpoint
from tests.helpers import TIMEOUT, Client, small_spec, wait_until

SPEC = small_spec(fragments=1)


def test_learner_dying_mid_stream_leaves_nothing_half_applied(make_server, caplog):
    caplog.set_level(logging.WARNING, logger="synchronizer.service")
    srv = make_server(quorum=1, grace="none")
    c = Client(srv.address, SPEC)
    c.join()
    c.init([torch.zeros(SPEC.fragments[0].numel)])
    h, buf = c.header(0, torch.full((SPEC.fragments[0].numel,), 0.25), pb.CODEC_FP32, 0, seq=1)
    chunks = list(framing.iter_chunks(buf, 256))
    half_sent, never = threading.Event(), threading.Event()

    def dying() -> Iterator[pb.PushRequest]:
        yield pb.PushRequest(header=h)
        yield pb.PushRequest(chunk=chunks[0])
        half_sent.set()
        never.wait(30)  # the process "dies" here: the call is cancelled below

    future = c.stub.PushFragment.future(dying(), timeout=30)
    assert half_sent.wait(30)
    # The client has sent them; cancel only once the server's handler holds the stream (on a
    # busy machine a call cancelled before it is dispatched never reaches the handler at all).
    streams_open = srv.synchronizer.metrics.streams_open
    assert wait_until(lambda: streams_open._value.get() == 1, TIMEOUT)
    future.cancel()
    assert future.cancelled() or future.exception() is not None
    cancelled = srv.synchronizer.metrics.rpcs.labels("PushFragment", "CANCELLED")
    deadline = time.monotonic() + 30
    while cancelled._value.get() < 1 and time.monotonic() < deadline:  # the handler sees it soon
        time.sleep(0.01)
    # Only now may the request generator end: ending it earlier can half-close the stream
    # before the cancellation reaches the server, which then sees a push cut short instead.
    never.set()
    assert cancelled._value.get() == 1
    # An expected event: one warning line, no error with a traceback.
    records = [r for r in caplog.records if r.name == "synchronizer.service"]
    assert not [r for r in records if r.levelno >= logging.ERROR]
    assert [r.levelno for r in records if "went away" in r.getMessage()] == [logging.WARNING]
    frag = srv.synchronizer.model.fragments[0]
    assert (
        frag.admission.round is None
        and frag.version == 0
        and torch.equal(frag.model.params, torch.zeros(frag.numel))
    )
    retry = c.push(
        0, torch.full((SPEC.fragments[0].numel,), 0.25), seq=1
    )  # same seq: not a duplicate
    assert retry.outcome == pb.PUSH_ACCEPTED


def test_damaged_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path):
    checkpoint.save(tmp_path, {"x": torch.ones(3)}, {"n": 1}, keep=3)
    newest = checkpoint.save(tmp_path, {"x": torch.full((3,), 2.0)}, {"n": 2}, keep=3)
    newest.write_bytes(newest.read_bytes()[:20])  # torn by a crash that bypassed the rename
    latest = checkpoint.load_latest(tmp_path)
    assert latest is not None
    tensors, meta, path = latest
    assert meta == {"n": 1} and torch.equal(tensors["x"], torch.ones(3)) and path != newest


def test_only_the_last_checkpoints_are_kept_and_no_temporaries_remain(tmp_path):
    for i in range(5):
        checkpoint.save(tmp_path, {"x": torch.full((2,), float(i))}, {"n": i}, keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ckpt-0000000004.safetensors", "ckpt-0000000005.safetensors"]


def test_shutdown_merges_acknowledged_contributions_before_the_final_checkpoint(
    make_server, tmp_path
):
    state = tmp_path / "s"
    srv = make_server(
        quorum=2,
        grace="fixed",
        grace_max_s=60.0,
        state_dir=state,
        outer="sgd",
        outer_lr=1.0,
        anchor="base",
    )
    a, b = Client(srv.address, SPEC, "a"), Client(srv.address, SPEC, "b")
    a.join()
    b.join()
    a.init([torch.zeros(SPEC.fragments[0].numel)])
    assert (
        a.push(0, torch.ones(SPEC.fragments[0].numel)).outcome == pb.PUSH_ACCEPTED
    )  # round waits for K=2
    srv.server.stop(0).wait()
    srv.synchronizer.close()
    again = make_server(state_dir=state, outer="sgd")
    c = Client(again.address, SPEC)
    c.join()
    version, params = c.pull(0)
    assert version == 1 and torch.equal(params, -torch.ones(SPEC.fragments[0].numel))


def test_unreachable_state_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    try:
        checkpoint.save(blocker / "state", {"x": torch.ones(1)}, {}, keep=1)
    except OSError as e:
        assert "file" in str(e)
    else:
        raise AssertionError("expected OSError")


def test_restart_with_another_outer_optimizer_keeps_parameters_and_starts_fresh_state(
    make_server, tmp_path
):
    state = tmp_path / "s"
    srv = make_server(quorum=1, grace="none", state_dir=state, outer="nesterov")
    c = Client(srv.address, SPEC)
    c.join()
    c.init([torch.zeros(SPEC.fragments[0].numel)])
    c.push(0, torch.ones(SPEC.fragments[0].numel))
    _, before = c.pull(0, min_version=1, wait_s=10)
    srv.server.stop(0).wait()
    srv.synchronizer.close()
    again = make_server(state_dir=state, outer="sgd")
    c2 = Client(again.address, SPEC)
    c2.join()
    assert torch.equal(c2.pull(0)[1], before)


def test_a_pull_cancelled_mid_stream_is_counted_and_not_logged_as_a_failure(make_server, caplog):
    numel = 1 << 22  # 16 MiB as FP32: more than gRPC's flow-control windows hold
    spec = plan_fragments([TensorInfo("w", (numel,))], 1)
    srv = make_server()
    c = Client(srv.address, spec, "l0")
    c.join()
    c.init([torch.zeros(numel)])
    caplog.set_level(logging.WARNING, logger="synchronizer")
    replies = c.stub.PullFragment(
        pb.PullRequest(learner_id=c.learner_id, session=c.session, fragment_id=0),
        timeout=TIMEOUT,
        metadata=c.md,
    )
    assert next(replies).WhichOneof("kind") == "header"
    replies.cancel()
    cancelled = srv.synchronizer.metrics.rpcs.labels("PullFragment", "CANCELLED")
    assert wait_until(lambda: cancelled._value.get() == 1, TIMEOUT)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
