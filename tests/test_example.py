"""The bundled example: deterministic, disjoint data splits; a model that learns; a fixed eval."""

from __future__ import annotations

import pytest
import torch

from demo.cli import LOCAL, MODEL_AND_DATA, REPORTING, TRAINING, _parser, main
from demo.example.data import (
    ByteData,
    evaluate,
    list_files,
    shard_files,
    split_files,
    stdlib_root,
)
from demo.example.model import GPT, GPTConfig
from demo.options import LocalOptions
from demo.train import TrainOptions, lr_at, param_hash, train

TINY = GPTConfig(n_layer=1, d_model=32, n_head=2, block=32)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: more threads only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_stdlib_split_is_deterministic_disjoint_and_holds_out_about_five_percent():
    files = list_files(stdlib_root(), ".py")
    assert files == list_files(stdlib_root(), ".py")
    assert not any("site-packages" in f for f in files)
    train, held_out = split_files(files)
    assert (train, held_out) == split_files(list(reversed(files)))  # order-independent
    assert set(train).isdisjoint(held_out)
    assert set(train) | set(held_out) == set(files)
    assert 0.02 < len(held_out) / len(files) < 0.08


def test_split_of_a_file_does_not_depend_on_the_other_files():
    files = list_files(stdlib_root(), ".py")
    _, held_out = split_files(files)
    _, held_out_of_half = split_files(files[::2])
    assert set(held_out_of_half) == set(held_out) & set(files[::2])


def test_learner_shards_are_disjoint_and_cover_the_training_files():
    train, _ = split_files(list_files(stdlib_root(), ".py"))
    shards = [shard_files(train, m, 4) for m in range(4)]
    assert sum(len(s) for s in shards) == len(train)
    assert set().union(*map(set, shards)) == set(train)
    for a in range(4):
        for b in range(a + 1, 4):
            assert set(shards[a]).isdisjoint(shards[b])


def test_data_of_a_directory_of_text_files(tmp_path):
    for i in range(30):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document number {i}\n" * 40)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 100)  # binaries are skipped
    a = ByteData(tmp_path, learner=0, learners=2, block=16)
    b = ByteData(tmp_path, learner=1, learners=2, block=16)
    assert set(a.train_files).isdisjoint(b.train_files)
    assert a.eval_files == b.eval_files and a.eval_files
    assert set(a.eval_files).isdisjoint(a.train_files + b.train_files)
    assert 0 not in a.train.tolist()


def test_batches_are_windows_of_the_shard_with_next_byte_targets():
    data = ByteData(learner=1, learners=4, block=32, max_bytes=1 << 18, eval_bytes=1 << 16)
    assert len(data.train) == 1 << 18
    x, y = data.batch(8, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = data.batch(8, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)


def test_eval_is_deterministic_across_processes_views():
    data = ByteData(block=32, max_bytes=1 << 16, eval_bytes=1 << 16)
    other = ByteData(learner=2, learners=3, block=32, max_bytes=1 << 16, eval_bytes=1 << 16)
    assert torch.equal(data.eval_set(16)[0], other.eval_set(16)[0])
    torch.manual_seed(0)
    model = GPT(TINY)
    assert evaluate(model, data.eval_set(16)) == evaluate(model, other.eval_set(16))


def test_model_has_the_documented_size_and_a_tied_head():
    model = GPT(GPTConfig())
    assert model.num_params() == 123_520
    assert model.head.weight is model.tok_emb.weight


def test_loss_decreases_over_thirty_steps_of_plain_training():
    data = ByteData(block=TINY.block, max_bytes=1 << 18, eval_bytes=1 << 16)
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eval_set = data.eval_set(32)
    before = evaluate(model, eval_set)
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        _, loss = model(*data.batch(16, gen))
        loss.backward()
        opt.step()
        opt.zero_grad()
    after = evaluate(model, eval_set)
    assert after < before - 1.0


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    o = TrainOptions(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, o) == 0.1 and lr_at(9, o) == 1.0
    assert abs(lr_at(99, o) - 0.1) < 1e-3
    resumed = TrainOptions(steps=100, start_step=50, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(50, resumed) < lr_at(59, resumed) == lr_at(59, o)


def test_no_sync_training_writes_a_result_and_learns(tmp_path):
    out = tmp_path / "result.json"
    o = TrainOptions(
        steps=30,
        sync=None,
        n_layer=1,
        d_model=32,
        block=32,
        batch_size=8,
        max_bytes=1 << 18,
        eval_windows=16,
        log_every=10,
        out=str(out),
        threads=1,
    )
    result = train(o)
    assert result["finished"] and result["eval_loss_end"] < result["eval_loss_start"]
    assert out.exists() and len(result["series"]) == 3
    assert result["bytes_sent"] == 0 and result["steps_per_s"] > 0


def test_param_hash_tells_models_apart():
    torch.manual_seed(0)
    a = GPT(TINY)
    torch.manual_seed(0)
    b = GPT(TINY)
    assert param_hash(a) == param_hash(b)
    with torch.no_grad():
        b.ln_f.bias[0] += 1e-6
    assert param_hash(a) != param_hash(b)


class Bigram(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(256, 256)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.table(x).reshape(-1, 256), y.reshape(-1))


def factory(learner_index: int, learners: int):
    """A user model for `--model tests.test_example:factory`: bytes that count up, mod 256."""
    gen = torch.Generator().manual_seed(learner_index)

    def batch_fn():
        x = torch.randint(0, 256, (8, 8), generator=gen)
        return x, (x + 1) % 256

    held_out = batch_fn()
    return Bigram(), batch_fn, lambda model: model(*held_out).item()


def test_a_user_model_plugs_in_by_import_path():
    result = train(
        TrainOptions(
            steps=40,
            sync=None,
            model="tests.test_example:factory",
            lr=0.1,
            warmup_steps=1,
            log_every=20,
            threads=1,
        )
    )
    assert result["eval_loss_end"] < result["eval_loss_start"] - 1.0
    assert result["tokens"] == 40 * 8 * 8


def test_train_and_local_flags_default_to_their_options_models():
    train_flags = vars(_parser().parse_args(["train"]))
    for name in f"{TRAINING} {REPORTING} {MODEL_AND_DATA}".split():
        assert train_flags[name] == getattr(TrainOptions(), name), name
    local_flags = vars(_parser().parse_args(["local"]))
    given = {name: local_flags[name] for name in LOCAL.split() if local_flags[name] is not None}
    assert LocalOptions(**given) == LocalOptions()
    assert (LocalOptions().slow_learner, LocalOptions().kill_learner) == (1, 2)
    assert (LocalOptions(learners=2).slow_learner, LocalOptions(learners=2).kill_learner) == (1, -1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--synchronizer", "localhost"], "--synchronizer must be HOST:PORT"),
        (["train", "--synchronizer", "host:99999"], "--synchronizer must be HOST:PORT"),
        (["train", "--data", "/no/such/dir"], "--data /no/such/dir: no such directory"),
        (
            ["train", "--no-sync", "--model", "nomodule"],
            "--model must look like pkg.module:factory",
        ),
        (
            ["train", "--no-sync", "--model", "no_such_module_x:f"],
            "cannot import 'no_such_module_x'",
        ),
        (["train", "--no-sync", "--d-model", "30", "--n-head", "4"], "must be divisible"),
        (["train", "--codec", "int3"], "unknown codec 'int3'"),
        (["train", "--steps", "-5"], "--steps: must be >= 0"),
        (["local", "--kill-learner", "7"], "--kill-learner 7 must be -1 (none)"),
        (["local", "--data", "/no/such/dir"], "no such directory"),
    ],
)
def test_bad_input_gives_one_line_and_no_traceback(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def _island_rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank of a 2-rank island as torchrun starts it: the group is the example's to make."""
    import os

    import torch.distributed as dist

    os.environ.update(
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    o = TrainOptions(steps=4, sync=None, n_layer=1, d_model=32, block=32, batch_size=4)
    result = train(o.model_copy(update={"max_bytes": 1 << 16, "eval_windows": 4, "threads": 1}))
    torch.save({"hash": result["param_hash"], "group": dist.is_initialized()}, f"{out}{rank}.pt")


@pytest.mark.slow  # spawns two gloo processes
def test_a_torchrun_island_ends_with_the_process_group_it_made_destroyed(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_island_rank, args=(2, port, str(tmp_path / "rank")), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["hash"] == ranks[1]["hash"]  # replicas averaged their gradients
    assert not ranks[0]["group"] and not ranks[1]["group"]
