"""The memory projection: its numbers for small specs, the gauge that exports it, and the
refusals of `memory_limit_bytes` (at Join, and at start on a state directory)."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest
import torch

from protos import diloco_pb2 as pb
from protos import layout
from synchronizer import core, memory
from synchronizer.config import SynchronizerConfig
from synchronizer.downlink import kept_links
from synchronizer.metrics import Metrics
from synchronizer.server import serving
from tests.helpers import Client, small_spec

BASELINE = 320 << 20
STREAMS = 32 * (8 << 20)  # max_concurrent_streams x max_message_bytes
# A checkpoint copies no tensor: its header (room, the largest spec in base64, 512 B for each of
# 256 learners) as text and padded, and the 1 MiB buffer that moves data behind a grown header.
CHECKPOINT = 2 * ((64 << 10) + 1_398_102 + 512 * 256) + (1 << 20)


def test_projection_of_two_fragments_with_defaults_matches_the_hand_count() -> None:
    p = memory.project(SynchronizerConfig(), [1000, 600])
    # INT8 links: 1000 + 4 blocks x 4 B = 1016 B and 600 + 3 x 4 = 612 B; the automatic budget
    # (0.8 x the FP32 bytes: 3200 and 1920 B) keeps 3 of each.
    history = 3 * 1016 + 3 * 612
    expected = {
        "params": 6400,
        "outer_state": 6400,  # nesterov momentum
        "residual": 3200,  # BF16
        "update_history": history,
        "accumulators": 4000,  # one apply thread: one FP32 buffer of the largest fragment
        "payloads": 256 << 20,  # held and pooled together: at least 256 MiB
        "snapshots": 4000,  # the budget: the largest fragment's FP32 bytes
        # one apply thread: a decode run (the whole largest fragment here) + a link (largest)
        "scratch": 4000 + 1016 + STREAMS,
        "checkpoint": CHECKPOINT,
        "baseline": BASELINE,
    }
    assert {k: v for k, v in p.items() if k != "total"} == expected
    assert p["total"] == sum(expected.values())


def test_projection_without_a_chain_or_outer_state_counts_only_what_remains() -> None:
    cfg = SynchronizerConfig(outer="sgd", update_history=0, anchor="base", max_staleness=0)
    p = memory.project(cfg, [1000, 600])
    assert p["outer_state"] == p["residual"] == p["update_history"] == 0
    assert p["scratch"] == 4000 + STREAMS  # a decode run only
    assert p["checkpoint"] == CHECKPOINT


def test_fp32_residual_costs_four_bytes_and_the_checkpoint_does_not_grow_with_the_model() -> None:
    fp32 = memory.project(SynchronizerConfig(update_residual_dtype="fp32"), [1000, 600])
    assert fp32["residual"] == 6400
    big = memory.project(SynchronizerConfig(), [1_000_000_000])
    assert big["residual"] == 2_000_000_000 and big["checkpoint"] == CHECKPOINT


def test_delayed_nesterov_keeps_two_buffers_and_more_threads_more_scratch() -> None:
    one = memory.project(SynchronizerConfig(outer="delayed_nesterov"), [1000])
    two = memory.project(SynchronizerConfig(outer="delayed_nesterov", apply_threads=2), [1000])
    assert one["outer_state"] == 8000
    assert two["scratch"] - one["scratch"] == 4000 + 1016
    assert two["accumulators"] - one["accumulators"] == 4000


def test_shared_buffers_scale_with_the_largest_fragment_not_the_model() -> None:
    large = 100_000_000
    p = memory.project(SynchronizerConfig(), [large] * 4)
    assert p["accumulators"] == 4 * large  # one apply thread
    assert p["payloads"] == 4 * large  # automatic: the largest fragment's FP32 bytes
    assert p["scratch"] - STREAMS == 4 * (1 << 20) + layout.encoded_nbytes(pb.CODEC_INT8, large)
    radial = memory.project(
        SynchronizerConfig(merge="radial", anchor="base", apply_threads=2), [large] * 4
    )
    assert radial["accumulators"] == 4 * 4 * large  # sums + decode buffer per thread
    set_budget = memory.project(SynchronizerConfig(payload_budget_bytes=12345), [large] * 4)
    assert set_budget["payloads"] == 12345


def test_update_history_is_what_the_downlink_keeps() -> None:
    cfg = SynchronizerConfig(update_history=16, update_history_bytes=5 * 1016)
    p = memory.project(cfg, [1000, 600])
    assert p["update_history"] == 5 * 1016 + kept_links(16, 5 * 1016, 600, "int8") * 612
    assert kept_links(16, 5 * 1016, 600, "int8") == 8


def test_a_spec_and_its_fragment_sizes_project_the_same() -> None:
    spec = small_spec()
    cfg = SynchronizerConfig()
    assert memory.project(cfg, spec) == memory.project(cfg, [f.numel for f in spec.fragments])
    assert memory.project(SynchronizerConfig(snapshot_budget_bytes=123), spec)["snapshots"] == 123
    assert memory.project(cfg, [])["total"] == BASELINE + STREAMS


def test_bytes_per_param_is_the_projections_slope() -> None:
    cfg = SynchronizerConfig()
    slope, fixed = memory.bytes_per_param(cfg)
    n = 100_000_000  # past the floors (the automatic payload budget's 256 MiB)
    assert memory.project(cfg, [n])["total"] == pytest.approx(fixed + slope * n, rel=1e-6)


def _limit_below(spec_numels: list[int]) -> int:
    """A limit the fixed costs fit and a model of these fragment sizes does not."""
    return memory.project(SynchronizerConfig(), spec_numels)["total"] - 1


def test_projection_is_logged_and_exported_before_and_after_the_model_is_initialised(
    make_server, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="synchronizer")
    srv = make_server()
    registry = srv.synchronizer.metrics.registry
    cfg = srv.synchronizer.cfg

    def gauge(component: str) -> float | None:
        return registry.get_sample_value("diloco_memory_projected_bytes", {"component": component})

    def exported_total() -> float:
        (family,) = [f for f in registry.collect() if f.name == "diloco_memory_projected_bytes"]
        return sum(s.value for s in family.samples)

    # The components only: a sum() over the series is the projection's total, counted once.
    assert gauge("total") is None
    assert exported_total() == memory.project(cfg, [])["total"]
    spec = small_spec()
    c = Client(srv.address, spec)
    c.join()
    c.init([torch.zeros(f.numel) for f in spec.fragments])
    expected = memory.project(cfg, spec)
    for component, nbytes in expected.items():
        assert gauge(component) == (None if component == "total" else nbytes), component
    assert exported_total() == expected["total"]
    c.close()
    logged = [r.getMessage() for r in caplog.records if "memory projection" in r.getMessage()]
    assert "bytes per model parameter" in logged[0]
    assert f"for {spec.numel} parameters in 2 fragments" in logged[1]
    assert "x the FP32 model): params " in logged[1] and "baseline 0.31 GiB" in logged[1]


def test_join_with_a_model_over_the_memory_limit_is_refused_naming_both_numbers(
    make_server,
) -> None:
    spec = small_spec()
    sizes = [f.numel for f in spec.fragments]
    limit = _limit_below(sizes)
    srv = make_server(memory_limit_bytes=limit)
    c = Client(srv.address, spec)
    with pytest.raises(grpc.RpcError) as e:
        c.join()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = e.value.details()
    assert f"memory_limit_bytes={limit:,}" in details
    assert f"{limit + 1:,} bytes" in details
    assert not srv.synchronizer.model.initialized
    c.close()


def test_start_on_a_state_dir_whose_model_cannot_fit_is_refused_before_loading_it(
    tmp_path: Path,
) -> None:
    spec = small_spec()
    settings = dict(port=0, metrics_port=-1, state_dir=tmp_path, shutdown_grace_s=1.0)
    with serving(SynchronizerConfig(**settings), Metrics()) as srv:
        c = Client(srv.address, spec)
        c.join()
        c.init([torch.zeros(f.numel) for f in spec.fragments])
        c.close()
    limit = _limit_below([f.numel for f in spec.fragments])
    with pytest.raises(memory.MemoryLimitError, match="refusing to start"):
        core.Synchronizer(SynchronizerConfig(**settings, memory_limit_bytes=limit), Metrics())
    fits = SynchronizerConfig(**settings, memory_limit_bytes=limit + 1)
    with serving(fits, Metrics()) as srv:
        assert srv.synchronizer.model.initialized
