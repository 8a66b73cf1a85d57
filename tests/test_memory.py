"""What the Synchronizer holds in memory: the byte-bounded update history, no full-size scratch,
a BF16 residual, checkpoints that copy nothing, and the arithmetic those savings must not
change."""

from __future__ import annotations

import json
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from bench.memory import fragment_bytes, measure, run_rounds
from protos import blockwise, codec, framing, layout
from protos import diloco_pb2 as pb
from protos.spec import TensorInfo, plan_fragments
from synchronizer import checkpoint, memory, native, receive
from synchronizer.buffers import Fp32Buffers, Payloads, Snapshots
from synchronizer.config import SynchronizerConfig
from synchronizer.core import Synchronizer
from synchronizer.disk import Disk
from synchronizer.downlink import Downlink, kept_links
from synchronizer.model import FragmentModel
from synchronizer.outer import Plain
from synchronizer.served import log_state_disk
from tests.helpers import TIMEOUT, Client, KeepsPages, resident_fraction, small_spec


def test_kept_links_follow_the_byte_budget() -> None:
    n = 1_000_000
    int8 = layout.encoded_nbytes(pb.CODEC_INT8, n)
    assert kept_links(16, 0, n, "int8") == 3  # automatic: 0.8x the FP32 bytes
    assert kept_links(16, 0, n, "fp32") == 1  # at least one
    assert kept_links(16, 5 * int8, n, "int8") == 5
    assert kept_links(16, 5 * int8 - 1, n, "int8") == 4
    assert kept_links(2, 100 * int8, n, "int8") == 2  # the count still bounds it
    assert kept_links(0, 100 * int8, n, "int8") == 0  # no chain at all
    assert kept_links(16, 1, n, "int8") == 1


def test_fragments_hold_no_full_size_scratch_and_checkpoints_copy_nothing() -> None:
    result = measure(200_000, 4, 2)
    for parts in result["by_fragment"]:
        numel = parts["params"] // 4
        assert parts["other"] == 0, parts  # no merged or decoded buffer of its own
        assert parts["chain"] == 3 * layout.encoded_nbytes(pb.CODEC_INT8, numel)
        assert parts["residual"] == 2 * numel  # BF16
    assert result["checkpoint_copies_bytes_per_param"] == 0  # live tensors are written


@pytest.mark.parametrize("residual_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("update_codec", ["int8", "fp32"])
def test_update_link_is_added_run_by_run_exactly_as_a_whole_decoded_link(
    update_codec: str, residual_dtype: str
) -> None:
    n = 2 * (1 << 20) + 1000 + 77  # several runs and a partial last block
    g = torch.Generator().manual_seed(0)
    params, merged = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3
    down = Downlink(n, update_codec, 4, residual_dtype)
    down.residual = (torch.randn(n, generator=g) * 1e-5).to(down.residual_dtype)
    update = torch.add(down.residual.float(), merged, alpha=-0.7)  # FP32 arithmetic
    header = layout.make_header(layout.parse_codec(update_codec), n)
    decoded = codec.decode(codec.encode(update, header.codec), header, torch.empty(n))
    expected_params = params + decoded
    expected_residual = (update - decoded).to(down.residual_dtype)
    down.step(params, merged.clone(), Plain(-0.7), 1)
    assert torch.equal(params, expected_params)
    assert down.residual.dtype == down.residual_dtype
    assert torch.equal(down.residual, expected_residual)


def test_residual_is_stored_in_its_setting_and_a_checkpoints_fp32_one_is_converted() -> None:
    for setting, nbytes in (("bf16", 2), ("fp32", 4)):
        model = _model(update_residual_dtype=setting)
        model.step(0, _merge(torch.full((5000,), 1e-3)), [_Push(0, 1.0)])
        residual = model.downlink.residual
        assert residual is not None and residual.numel() == 5000
        assert residual.untyped_storage().nbytes() == nbytes * 5000
    old = torch.randn(5000, generator=torch.Generator().manual_seed(4)) * 1e-5
    down = Downlink(5000, "int8", 4)  # bf16, the default
    down.restore({"f.residual": old}, [], "f.")
    assert down.residual is not None and down.residual.dtype == torch.bfloat16
    assert torch.equal(down.residual, old.to(torch.bfloat16))


def test_bf16_residual_serves_within_bf16_precision_of_fp32_and_far_closer_than_none() -> None:
    """The same 16 updates (a steady direction plus noise, so lost quantization error would pile
    up) through both residual settings, and through the codec with no residual at all."""
    n = 200_000
    g = torch.Generator().manual_seed(5)
    start = torch.randn(n, generator=g) * 0.02
    trend = torch.randn(n, generator=g) * 1e-3
    updates = [trend + torch.randn(n, generator=g) * 3e-4 for _ in range(16)]
    served = {}
    for setting in ("fp32", "bf16"):
        down, params = Downlink(n, "int8", 4, setting), start.clone()
        for v, u in enumerate(updates):
            down.step(params, u.clone(), Plain(1.0), v + 1)
        served[setting] = params
    header = layout.make_header(pb.CODEC_INT8, n)
    served["none"] = start.clone()
    for u in updates:
        served["none"] += codec.decode(codec.encode(u, pb.CODEC_INT8), header, torch.empty(n))
    exact = start.double() + sum(u.double() for u in updates)
    error = {k: float((p.double() - exact).norm()) for k, p in served.items()}
    update_norm = float(updates[0].norm())
    apart = (served["bf16"] - served["fp32"]).double()
    assert float(apart.norm()) <= 0.005 * update_norm  # measured 0.0015
    # At most a code or two flipped by the rounding: one INT8 step is absmax / 127 of a block.
    assert float(apart.abs().max()) <= 0.02 * max(float(u.abs().max()) for u in updates)
    assert error["bf16"] <= 1.05 * error["fp32"]
    assert error["none"] >= 3 * max(error["bf16"], error["fp32"])


def _model(**settings: object) -> FragmentModel:
    cfg = SynchronizerConfig(state_dir=Path("unused"), wal=False, **settings)  # type: ignore[arg-type]
    model = FragmentModel(0, 5000, cfg)
    model.initialize(torch.randn(5000, generator=torch.Generator().manual_seed(1)))
    return model


def _merge(d: torch.Tensor) -> Callable[[float], torch.Tensor]:
    return lambda share: d * share


def _params(model: FragmentModel) -> torch.Tensor:
    assert model.params is not None
    return model.params


class _Push:
    def __init__(self, base_version: int, weight: float, learner_id: str = "l0") -> None:
        self.base_version, self.weight, self.learner_id = base_version, weight, learner_id


def test_push_staler_than_the_kept_links_is_merged_as_anchor_base_does() -> None:
    link = layout.encoded_nbytes(pb.CODEC_INT8, 5000)
    models = {
        anchor: _model(anchor=anchor, update_history=16, update_history_bytes=2 * link)
        for anchor in ("current", "base")
    }
    g = torch.Generator().manual_seed(2)
    deltas = [torch.randn(5000, generator=g) * 0.01 for _ in range(5)]
    for v, d in enumerate(deltas[:3]):
        for model in models.values():
            model.step(v, _merge(d), [_Push(v, 1.0)])
    assert [v for v, _, _ in models["current"].downlink.chain] == [2, 3]
    # Base 0 misses link 1 (gone): anchored at its base, exactly as anchor "base" merges it.
    for model in models.values():
        model.step(3, _merge(deltas[3]), [_Push(0, 1.0)])
    assert torch.equal(_params(models["current"]), _params(models["base"]))
    # Base 2 is covered by link 3: re-anchored, so the two now differ.
    for model in models.values():
        model.step(4, _merge(deltas[4]), [_Push(2, 1.0), _Push(4, 1.0)])
    assert not torch.equal(_params(models["current"]), _params(models["base"]))


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_reanchor_adds_each_link_as_the_whole_decoded_link_would(kernels: str) -> None:
    """torch: each link decoded and added as a whole decoded link would be; native: every link
    in one pass, each product code x (scale x weight) rounded before its add, in link order."""
    model = _model(anchor="current", update_history=4, max_staleness=4, kernels=kernels)
    assert model.downlink.native_kernels == (kernels == "native")
    g = torch.Generator().manual_seed(3)
    for v in range(2):
        d = torch.randn(5000, generator=g) * 0.01
        model.step(v, _merge(d), [_Push(v, 1.0)])
    merged = torch.randn(5000, generator=g)
    expected = merged.clone()
    pushes = [_Push(0, 2.0), _Push(1, 1.0), _Push(2, 1.0)]
    for v, header, encoded in model.downlink.chain:
        behind = sum(p.weight for p in pushes if p.base_version < v)
        if kernels == "torch":
            expected.add_(codec.decode(encoded, header, torch.empty(5000)), alpha=behind / 4.0)
            continue
        bs, n = int(header.block_size), int(header.numel)
        scales = blockwise.checked_scales(encoded, header.codec, n, header.scale_dtype)
        folded = (scales * (behind / 4.0)).repeat_interleave(bs)[:n]
        expected = expected + encoded[:n].view(torch.int8).float() * folded
    model._reanchor(2, pushes, merged, 1.0)
    assert torch.equal(merged, expected)


def test_checkpoint_writer_files_load_with_safetensors_even_past_the_header_room(
    tmp_path: Path,
) -> None:
    tensors = {
        "f32": torch.randn(1000),
        "u8": torch.arange(7, dtype=torch.uint8),
        "scalar": torch.tensor(5, dtype=torch.int64),
        "empty": torch.empty(0),
    }
    meta = {"note": "x" * 5000}
    for room in (checkpoint.HEADER_ROOM, 64):  # 64 bytes: the header outgrows it
        with checkpoint.Writer(tmp_path, keep=5, header_room=room) as writer:
            for name, t in tensors.items():
                writer.add({name: t})
            path = writer.finish(meta)
        loaded = load_file(str(path))
        assert loaded.keys() == tensors.keys()
        assert all(torch.equal(loaded[k], t) for k, t in tensors.items())
        found = checkpoint.load_latest(tmp_path)
        assert found is not None and found[1] == meta and found[2] == path
        assert all(torch.equal(found[0][k], t) for k, t in tensors.items())
    assert not list(tmp_path.glob(".tmp-*"))


def test_outer_step_waits_while_its_fragment_is_frozen_and_pushes_pulls_and_others_go_on(
    tmp_path: Path,
) -> None:
    cfg = SynchronizerConfig(state_dir=tmp_path, wal=False, checkpoint_interval_s=0)
    core = Synchronizer(cfg)
    try:
        spec = plan_fragments([TensorInfo(f"w{i}", (10_000,)) for i in range(2)], 2)
        core.model.serve(spec)
        for frag in core.model.fragments:
            frag.initialize(torch.randn(frag.numel))
        core.model.initialized = True
        frozen, other = core.model.fragments

        def payload(frag: Any) -> tuple[torch.Tensor, pb.PayloadHeader]:
            delta = torch.full((frag.numel,), 1e-3)
            return codec.encode(delta, pb.CODEC_INT8), layout.make_header(pb.CODEC_INT8, frag.numel)

        def round_of(frag: Any) -> Any:
            frag.submit("a", frag.version, 100, 10, 1.0, payload(frag))
            rnd = frag.admission.round
            assert rnd is not None and frag.admission.take(rnd)
            return rnd

        rnd = round_of(frozen)
        with frozen.model.frozen_state() as (tensors, meta):
            assert tensors["frag.0.params"] is frozen.model.params  # the live tensor
            stepping = threading.Thread(target=frozen.apply, args=(rnd,))
            stepping.start()
            stepping.join(0.3)
            assert stepping.is_alive() and frozen.version == meta["version"] == 0
            other.apply(round_of(other))  # another fragment's outer step goes on
            assert other.version == 1
            _, _, version, _ = frozen.model.served(pb.CODEC_FP32, None)  # a pull is answered
            assert version == 0
            verdict, _ = frozen.submit("b", 0, 100, 10, 1.0, payload(frozen))  # a push too
            assert verdict.outcome == pb.PUSH_ACCEPTED
        stepping.join()
        assert frozen.version == 1 and not frozen.model.frozen
    finally:
        core.close()


def test_checkpoints_written_while_outer_steps_run_hold_each_fragment_at_one_version(
    tmp_path: Path,
) -> None:
    """Each fragment is written frozen: whatever outer steps do meanwhile, a checkpoint's
    parameters, momentum and residual are those the fragment had at the version it records."""
    cfg = SynchronizerConfig(
        state_dir=tmp_path, wal=False, checkpoint_interval_s=0, keep_checkpoints=50
    )
    core = Synchronizer(cfg)
    seen: dict[tuple[int, int], tuple[int, int, int]] = {}
    try:
        spec = plan_fragments([TensorInfo(f"w{i}", (300_000,)) for i in range(2)], 2)
        core.model.serve(spec)
        for frag in core.model.fragments:
            frag.initialize(torch.randn(frag.numel))
        core.model.initialized = True

        def crcs(frag_model: FragmentModel) -> tuple[int, int, int]:
            assert frag_model.params is not None and frag_model.downlink.residual is not None
            (momentum,) = frag_model.outer.state_dict().values()
            return (
                framing.checksum(frag_model.params),
                framing.checksum(momentum),
                framing.checksum(frag_model.downlink.residual),
            )

        for frag in core.model.fragments:
            original = frag.model.step

            def step(*args: Any, model: FragmentModel = frag.model, step: Any = original) -> Any:
                out = step(*args)
                with model.cv:
                    seen[(model.fid, model.version)] = crcs(model)
                return out

            frag.model.step = step  # type: ignore[method-assign,assignment]
        run_rounds(core, 1, 1)
        done = threading.Event()

        def train() -> None:
            run_rounds(core, 2, 12, seed=1)
            done.set()

        worker = threading.Thread(target=train)
        worker.start()
        saved = 0
        while not done.is_set() or saved < 3:
            assert core.save_checkpoint()
            saved += 1
        worker.join()
    finally:
        core.close()
    assert len(checkpoint.list_checkpoints(tmp_path)) >= 3
    for _, path in checkpoint.list_checkpoints(tmp_path):
        stored = checkpoint.Stored(path)
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()[checkpoint.META_KEY])
        for fid, fmeta in enumerate(meta["fragments"]):
            p = f"frag.{fid}."
            got = tuple(
                framing.checksum(stored[p + k])
                for k in ("params", "outer.momentum_buffer", "residual")
            )
            assert got == seen[(fid, fmeta["version"])], (path.name, fid, fmeta["version"])


def test_payloads_held_and_pooled_share_one_budget() -> None:
    payloads = Payloads(1000)
    a, b = payloads.take(400), payloads.take(400)
    assert payloads.reserve(400) and payloads.reserve(400)
    assert not payloads.reserve(400)  # past the budget: added on arrival instead
    c = payloads.take(400)
    payloads.give(c)  # 800 held + 400 pooled would pass 1000: dropped
    assert payloads.pooled_bytes == 0
    payloads.release(400)
    payloads.give(a)
    assert (payloads.held_bytes, payloads.pooled_bytes) == (400, 400)
    assert payloads.take(400) is a  # reused by size
    payloads.give(a)
    payloads.claim(400)  # a replayed round holds what it held: pooled buffers make way
    assert (payloads.held_bytes, payloads.pooled_bytes) == (800, 0)
    payloads.release(800)
    payloads.give(b)
    assert payloads.pooled_bytes == 400


def test_fp32_buffers_keep_the_pools_count_and_count_those_beyond() -> None:
    beyond: list[int] = []
    fp32 = Fp32Buffers(10, keep=1, beyond=lambda: beyond.append(1))
    first = fp32.take()
    second = fp32.take()  # a round adding on arrival while an outer step holds the first
    assert (fp32.live, len(beyond)) == (2, 1)
    fp32.give(second)  # dropped: only `keep` stay
    fp32.give(first)
    assert fp32.live == 1 and fp32.take() is first
    assert first.numel() == 10 and first.dtype == torch.float32


def _core_with(tmp_path: Path, numels: list[int], **settings: Any) -> Synchronizer:
    cfg = SynchronizerConfig(
        state_dir=tmp_path, wal=False, checkpoint_interval_s=0, metrics_port=-1, **settings
    )
    core = Synchronizer(cfg)
    spec = plan_fragments([TensorInfo(f"w{i}", (n,)) for i, n in enumerate(numels)], len(numels))
    core.model.serve(spec)
    for frag in core.model.fragments:
        frag.initialize(torch.randn(frag.numel, generator=torch.Generator().manual_seed(frag.fid)))
    core.model.initialized = True
    return core


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_fragments_share_one_fp32_buffer_and_rounds_hold_none_between_outer_steps(
    tmp_path: Path, kernels: str
) -> None:
    core = _core_with(tmp_path, [3000, 2000, 1000], kernels=kernels)
    try:
        run_rounds(core, 2, 2)
        fp32 = core.model.fragments[0].fp32
        assert all(
            f.fp32 is fp32 and f.payloads is core.model.fragments[0].payloads
            for f in core.model.fragments
        )
        # the largest fragment's; none at all where the native chain steps from the pushes
        assert fp32.numel == 3000
        assert fp32.live == (1 if kernels == "torch" or not native.resolve(kernels) else 0)
        assert all(f.admission.round is None for f in core.model.fragments)
        assert core.model.fragments[0].payloads.held_bytes == 0
    finally:
        core.close()


def test_a_round_adding_on_arrival_takes_sums_and_merges_as_held_pushes_do(
    tmp_path: Path,
) -> None:
    """Held or added at arrival (the payload budget full), the same pushes in the same order
    give the same parameters, bit for bit; the extra FP32 buffer is counted and dropped."""
    results = []
    for budget in (0, 1):  # automatic (all held), and one byte (every push added at arrival)
        core = _core_with(tmp_path / str(budget), [5000], payload_budget_bytes=budget)
        try:
            frag = core.model.fragments[0]
            g = torch.Generator().manual_seed(7)
            deltas = [torch.randn(5000, generator=g) * 1e-3 for _ in range(3)]
            header = layout.make_header(pb.CODEC_INT4, 5000)
            busy = frag.fp32.take()  # an outer step of another fragment holds the pool's one
            for m, d in enumerate(deltas):
                buf = frag.payloads.take(layout.encoded_nbytes(pb.CODEC_INT4, 5000))
                buf.copy_(codec.encode(d, pb.CODEC_INT4))
                hold = frag.payloads.reserve(buf.numel())
                assert hold == (budget == 0)
                order = (f"l{2 - m}", f"id{m}", 1)  # canonical order: the reverse of arrival
                frag.submit(f"l{m}", 0, 1000, 10, 1.0, (buf, header), hold=hold, order=order)
            rnd = frag.admission.round
            assert rnd is not None and (rnd.acc is not None) == (budget == 1)
            assert frag.admission.take(rnd)
            frag.fp32.give(busy)
            frag.apply(rnd)
            beyond = core.metrics.registry.get_sample_value("diloco_fp32_buffers_beyond_pool_total")
            assert beyond == budget  # the round adding on arrival took one beyond the pool
            assert frag.fp32.live == 1 and rnd.acc is None
            assert frag.model.params is not None
            results.append(frag.model.params.clone())
        finally:
            core.close()
    # Held pushes are added in canonical order, arrival-added ones in arrival order: the sums
    # agree to rounding, not bit for bit (what bit for bit needs is the same path on replay).
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-6)


def test_a_full_pull_snapshot_lives_only_while_a_pull_holds_it() -> None:
    down = Downlink(1000, "int8", 2)
    params = torch.randn(1000)
    first = down.snapshot(params, 3, pb.CODEC_FP32)
    again = down.snapshot(params, 3, pb.CODEC_FP32)
    assert first is not None and again is not None
    assert again[2] is first[2]  # shared by the pullers of one version
    assert len(down.snapshots_alive()) == 1
    del first, again
    assert down.snapshots_alive() == []  # nobody pulls it: freed at once
    old = down.snapshot(params, 3, pb.CODEC_FP32)
    down.changed()
    new = down.snapshot(params, 4, pb.CODEC_FP32)
    assert old is not None and new is not None
    assert new[2] is not old[2] and [t is new[2] for t in down.snapshots_alive()] == [True]
    del old  # the slow pull of version 3 ended
    assert [t is new[2] for t in down.snapshots_alive()] == [True]


def test_init_model_adopts_the_received_buffers_and_holds_only_params_and_outer_state(
    make_server: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """InitModel and its first checkpoint hold parameters and momentum, nothing more: the
    received FP32 buffers are the parameters, and the residual waits for the first outer step."""
    received: list[torch.Tensor] = []
    original = receive.init_fragments

    def capture(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        received.extend(original(*args, **kwargs))
        return list(received)

    monkeypatch.setattr(receive, "init_fragments", capture)
    srv = make_server(checkpoint_interval_s=0)
    spec = small_spec()
    c = Client(srv.address, spec)
    c.join()
    c.init([torch.randn(f.numel) for f in spec.fragments])
    c.close()
    core = srv.synchronizer
    assert len(checkpoint.list_checkpoints(core.cfg.state_dir)) == 1
    for frag, buf in zip(core.model.fragments, received, strict=True):
        assert frag.model.params is not None
        assert frag.model.params.data_ptr() == buf.data_ptr()  # adopted, not copied
        parts = fragment_bytes(frag)
        assert parts["params"] == parts["outer"] == 4 * frag.numel
        assert sum(parts.values()) == 8 * frag.numel, parts


def test_snapshots_beyond_the_budget_wait_for_one_to_end() -> None:
    budget = Snapshots(6000)  # one FP32 snapshot of 1000 elements, not two
    a, b = Downlink(1000, "int8", 3), Downlink(1000, "int8", 3)
    params = torch.randn(1000)
    first = a.snapshot(params, 1, pb.CODEC_FP32, budget)
    assert first is not None and budget.alive_bytes == 4000
    shared = a.snapshot(params, 1, pb.CODEC_FP32, budget)
    assert shared is not None and shared[2] is first[2] and budget.alive_bytes == 4000
    del shared
    assert b.snapshot(params, 1, pb.CODEC_FP32, budget) is None  # another fragment's: wait
    bf16 = b.snapshot(params, 1, pb.CODEC_BF16, budget)  # 2000 B still fit
    assert bf16 is not None and budget.alive_bytes == 6000
    del first, bf16  # their pulls ended: freed
    assert budget.alive_bytes == 0
    assert b.snapshot(params, 1, pb.CODEC_FP32, budget) is not None
    alone = Snapshots(100)  # below one snapshot: one at a time, never none
    assert a.snapshot(params, 2, pb.CODEC_BF16, alone) is not None


def test_a_full_pull_past_the_snapshot_budget_waits_and_is_served_when_one_ends(
    make_server: Callable[..., Any],
) -> None:
    srv = make_server(snapshot_budget_bytes=1)  # one snapshot at a time
    spec = small_spec()
    client = Client(srv.address, spec)
    client.join()
    client.init([torch.randn(f.numel) for f in spec.fragments])
    core = srv.synchronizer
    held = core.model.fragments[0].model.served(pb.CODEC_FP32, None, core.model.snapshots)[
        0
    ]  # a slow pull
    assert held is not None
    got: list[Any] = []
    puller = threading.Thread(target=lambda: got.append(client.pull(1)))
    puller.start()
    assert core.model.snapshots.alive_bytes > 0
    puller.join(0.3)
    assert puller.is_alive(), "the second full pull waits while the first snapshot is alive"
    del held  # the slow pull ended
    puller.join(TIMEOUT)
    client.close()
    assert not puller.is_alive() and got and got[0][1].numel() == spec.fragments[1].numel


@pytest.mark.parametrize("native_kernels", [False, True], ids=["torch", "native"])
def test_an_evicted_links_bytes_are_reused_only_when_nothing_holds_them(
    native_kernels: bool,
) -> None:
    """A new link each outer step would be a fresh allocation of tens of MB (a page fault per
    4 KiB); the link a full chain evicts gives its bytes to the next one, unless a pull, a
    checkpoint or a view still reads them: those bytes stay as they were."""
    n = 3 * layout.DEFAULT_BLOCK_SIZE + 5
    down = Downlink(n, "int8", 2, native_kernels=native_kernels)
    params, g = torch.zeros(n), torch.Generator().manual_seed(0)

    def step(version: int) -> torch.Tensor:
        down.step(params, torch.randn(n, generator=g) * 1e-3, Plain(-0.7), version)
        return down.chain[-1][2]

    made = [step(v).data_ptr() for v in range(1, 7)]
    assert len(set(made)) == 2  # history 2: two buffers in turn, no third
    assert [v for v, _, _ in down.chain] == [5, 6]

    pulled = down.since(4, 6)  # a delta pull streaming links 5 and 6
    view = step(7)[:8]  # a slice of link 7, alone
    array = step(8).numpy()  # link 8's bytes, as a numpy array
    state, _ = down.state("f.")  # a checkpoint writing links 7 and 8
    held = [bytes(link[2].numpy()) for link in (pulled or [])] + [
        bytes(view.numpy()),
        bytes(array),
    ]
    assert pulled is not None
    fresh = {step(v).data_ptr() for v in range(9, 11)}
    assert not fresh & {link[2].data_ptr() for link in pulled}  # not reused while pulled
    assert not fresh & {view.data_ptr(), array.ctypes.data}
    assert [bytes(link[2].numpy()) for link in pulled] + [
        bytes(view.numpy()),
        bytes(array),
    ] == held  # nothing written under the readers
    del pulled, view, array, state
    made = [step(v).data_ptr() for v in range(11, 15)]
    assert len(set(made)) == 2  # the readers gone, two buffers in turn again

    restored = Downlink(n, "int8", 1, native_kernels=native_kernels)
    tensors, chain = down.state("f.")
    restored.restore({k: t.clone() for k, t in tensors.items()}, chain, "f.")
    link = weakref.ref(restored.chain[0][2])  # held by the chain alone
    restored.step(params, torch.randn(n, generator=g) * 1e-3, Plain(-0.7), 15)
    assert link() is None  # a restored link (perhaps a file's bytes) is freed, never reused


@pytest.mark.skipif(sys.platform != "linux", reason="page cache residency is read with mincore")
def test_a_checkpoint_leaves_the_page_cache_as_it_is_written(tmp_path, monkeypatch):
    """Each `_WRITE_BYTES` are fdatasync'd and dropped, so a checkpoint of many GB reuses its
    first pages rather than taking as many fresh ones (a host fault each on a virtual machine:
    1 GiB in 5.7 s that way here, 1.4 s reusing them)."""
    monkeypatch.setattr(checkpoint, "_WRITE_BYTES", 1 << 20)
    tensors = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(3)}  # 12 MiB

    class Counting(Disk):
        fsyncs = 0

        def fsync(self, fd: int) -> None:
            Counting.fsyncs += 1
            super().fsync(fd)

    resident = {}
    for name, disk in (("kept", KeepsPages()), ("forgotten", Counting())):
        path = checkpoint.save(tmp_path / name, tensors, {"round": 1}, keep=2, disk=disk)
        resident[name] = resident_fraction(path)
    if resident["kept"] < 0.5:
        pytest.skip(f"this filesystem does not keep written pages cached ({resident})")
    assert resident["forgotten"] < 0.1, resident
    assert Counting.fsyncs >= 12  # as it went, not once at the end
    restored = checkpoint.load_latest(tmp_path / "forgotten")
    assert restored is not None and restored[1] == {"round": 1}
    assert all(torch.equal(restored[0][k], v) for k, v in tensors.items())


def test_state_disk_projects_a_checkpoints_bytes_and_warns_when_the_disk_has_too_little(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = SynchronizerConfig(state_dir=tmp_path, wal=False, checkpoint_interval_s=0)
    core = Synchronizer(cfg)
    try:
        spec = plan_fragments([TensorInfo(f"w{i}", (300_000,)) for i in range(2)], 2)
        with caplog.at_level(logging.INFO, logger="synchronizer.served"):
            core.model.serve(spec)
        assert "state disk projection" in caplog.text and "too little" not in caplog.text
        for frag in core.model.fragments:
            frag.initialize(torch.randn(frag.numel))
        core.model.initialized = True
        run_rounds(core, 2, 2 * cfg.update_history)  # every fragment's kept updates at its bound
        assert core.save_checkpoint()
        need = memory.state_disk(cfg, [f.numel for f in spec.fragments])
        size = checkpoint.list_checkpoints(tmp_path)[-1][1].stat().st_size
        assert need["checkpoint"] <= size <= need["checkpoint"] + (1 << 20)  # and its header
        assert need["total"] == (cfg.keep_checkpoints + 1) * need["checkpoint"]  # no log
    finally:
        core.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="synchronizer.served"):
        log_state_disk(cfg.model_copy(update={"keep_checkpoints": 1 << 30}), [300_000, 300_000])
    assert any(r.levelno == logging.WARNING and "too little" in r.message for r in caplog.records)


@pytest.mark.parametrize(
    "settings, log",
    [
        ({}, "one checkpoint"),  # checkpoint_log_ratio 1: 13.05 GB at 1B, above 8 GiB
        ({"checkpoint_log_ratio": 0.5}, 8 << 30),  # 6.5 GB: checkpoint_wal_bytes is the bound
        ({"checkpoint_log_ratio": 0}, 8 << 30),
        ({"checkpoint_wal_bytes": 0}, 0),  # the log has no bound: the projection cannot say
        ({"wal": False}, 0),
    ],
)
def test_the_projected_log_is_checkpoint_wal_bytes_or_the_ratio_of_a_checkpoint_if_more(
    tmp_path: Path, settings: dict[str, Any], log: int | str
) -> None:
    cfg = SynchronizerConfig(state_dir=tmp_path, **settings)
    need = memory.state_disk(cfg, [250_000_000] * 4)
    assert 12e9 < need["checkpoint"] < 14e9  # 1B parameters: 13.05 GB (operations.md)
    assert need["wal"] == (need["checkpoint"] if log == "one checkpoint" else log)
    assert need["total"] == need["checkpoints"] + need["wal"]
