"""Memory as a budget: the Synchronizer's projected peak resident bytes, by component.

`project(cfg, model)` is a pure function of the settings and the fragment sizes; it counts what
the code allocates, per fragment, at its bounds:

- `params`: the FP32 parameters (4 B/param);
- `outer_state`: the outer optimizer's FP32 buffers (nesterov 4, delayed_nesterov 8, sgd 0 B/param);
- `residual`: the update chain's error-feedback residual whenever a chain is kept (2 B/param in
  BF16, the default `update_residual_dtype`; 4 in FP32);
- `update_history`: the kept encoded outer updates (`downlink.kept_links` of them per fragment);
- `accumulators`: the shared FP32 buffers of the largest fragment's size that outer steps take
  for a round's sums (`buffers.fp32_kept`: one per apply thread, two when merging radially);
  a round that adds pushes on arrival (the payload budget full) takes one more while it is open;
- `payloads`: encoded pushes held for the outer step and receive buffers pooled for reuse, all
  fragments together within `payload_budget_bytes` (`buffers.payload_budget`);
- `snapshots`: full-pull snapshots alive at once, all fragments together, within
  `snapshot_budget_bytes` (`buffers.snapshot_budget`; pullers of one version share one, freed
  when the last of them ends; a pull past it waits);
- `scratch`: per apply thread a decode run (about 1M FP32 elements) and the new link before the
  oldest is dropped, and one message per stream;
- `checkpoint`: no copies (live tensors are written, one frozen fragment at a time): only the
  header, built as text and padded into its room, and a buffer to move the data should it
  outgrow that room;
- `baseline`: the process itself (Python, torch, gRPC), measured idle;

and `total`, their sum. The Synchronizer logs it, exports the components (not `total`) as
`diloco_memory_projected_bytes{component}` and refuses a model (or a start) that cannot fit
`memory_limit_bytes`. `state_disk` projects the state directory's peak disk use, which the
Synchronizer logs beside the free space there (a WARNING when that is less).
"""

from __future__ import annotations

from collections.abc import Sequence

from protos import codec as wire_codec
from protos import layout
from protos.configload import ConfigError
from protos.spec import ModelSpec
from synchronizer.buffers import fp32_kept, payload_budget, snapshot_budget
from synchronizer.checkpoint import HEADER_ROOM
from synchronizer.config import SynchronizerConfig
from synchronizer.downlink import kept_links

COMPONENTS = (
    "params",
    "outer_state",
    "residual",
    "update_history",
    "accumulators",
    "payloads",
    "snapshots",
    "scratch",
    "checkpoint",
    "baseline",
)
OUTER_STATE_BYTES = {"sgd": 0, "nesterov": 4, "delayed_nesterov": 8}  # per parameter
RESIDUAL_BYTES = {"bf16": 2, "fp32": 4}  # per parameter, by update_residual_dtype
# Resident bytes of an idle `diloco-synchronizer serve` (Python, torch, gRPC, prometheus): 246 MiB
# measured on the reference machine, plus headroom for worker-thread stacks and allocator arenas.
BASELINE_BYTES = 320 << 20


class MemoryLimitError(ConfigError):
    """Settings, or a stored model, whose projected memory exceeds `memory_limit_bytes`."""


def _sizes(model: ModelSpec | Sequence[int]) -> list[int]:
    if isinstance(model, ModelSpec):
        return [f.numel for f in model.fragments]
    return [int(n) for n in model]


def project(cfg: SynchronizerConfig, model: ModelSpec | Sequence[int]) -> dict[str, int]:
    """Projected peak resident bytes serving `model` (a spec, or its fragment sizes) under
    `cfg`, by component (`COMPONENTS`) and `total`. An empty model gives the fixed costs."""
    sizes = _sizes(model)
    numel = sum(sizes)
    largest = max(sizes, default=0)
    chain = cfg.update_history > 0
    codec = layout.parse_codec(cfg.update_codec)

    def link_bytes(n: int) -> int:
        return layout.encoded_nbytes(codec, n)

    out = {
        "params": 4 * numel,
        "outer_state": OUTER_STATE_BYTES[cfg.outer] * numel,
        "residual": RESIDUAL_BYTES[cfg.update_residual_dtype] * numel if chain else 0,
        "update_history": sum(
            kept_links(cfg.update_history, cfg.update_history_bytes, n, cfg.update_codec)
            * link_bytes(n)
            for n in sizes
        ),
        "accumulators": fp32_kept(cfg.apply_threads, cfg.merge) * 4 * largest,
        "payloads": payload_budget(cfg.payload_budget_bytes, largest) if sizes else 0,
        "snapshots": snapshot_budget(cfg.snapshot_budget_bytes, largest) if sizes else 0,
    }
    # Per apply thread: a decode run (pushes, the new link, re-anchoring: one at a time), and
    # the newest link before the oldest is dropped.
    per_thread = 4 * wire_codec.run_elems(layout.make_header(codec, largest)) if sizes else 0
    if chain:
        per_thread += link_bytes(largest)
    streams = cfg.max_concurrent_streams * cfg.max_message_bytes
    out["scratch"] = cfg.apply_threads * per_thread + streams
    out["checkpoint"] = checkpoint_bytes(cfg) if numel else 0
    out["baseline"] = BASELINE_BYTES
    out["total"] = sum(out.values())
    return out


def state_disk(cfg: SynchronizerConfig, model: ModelSpec | Sequence[int]) -> dict[str, int]:
    """Projected peak bytes of `state_dir` serving `model` under `cfg`: one checkpoint's tensors
    (`checkpoint`: parameters, outer state, residual, kept updates), `keep_checkpoints` of them
    and the one being written (`checkpoints`), and the write-ahead log up to
    `checkpoint_wal_bytes` or `checkpoint_log_ratio` checkpoints, whichever is more (`wal`; 0
    without a log or the first bound: the log then holds whatever arrives in
    `checkpoint_interval_s`, or until the ratio allows). Not counted: what arrives while a
    checkpoint writes."""
    p = project(cfg, model)
    one = p["params"] + p["outer_state"] + p["residual"] + p["update_history"]
    logged = cfg.wal and cfg.checkpoint_wal_bytes > 0
    out = {
        "checkpoint": one,
        "checkpoints": (cfg.keep_checkpoints + 1) * one,
        "wal": max(cfg.checkpoint_wal_bytes, int(cfg.checkpoint_log_ratio * one)) if logged else 0,
    }
    out["total"] = out["checkpoints"] + out["wal"]
    return out


def checkpoint_bytes(cfg: SynchronizerConfig) -> int:
    """What writing a checkpoint holds: its header (the spec in base64, a record per learner,
    the tensor entries; as text and padded into its room) and the 1 MiB buffer that moves the
    data behind a header that outgrew its room. The tensors are written from their own memory."""
    header = HEADER_ROOM + -(-4 * cfg.max_spec_bytes // 3) + 512 * cfg.max_learners
    return 2 * header + (1 << 20)


def bytes_per_param(cfg: SynchronizerConfig) -> tuple[float, int]:
    """(bytes per parameter, fixed bytes) of the projection of a one-fragment model: its slope
    and its intercept, past the sizes where floors (the automatic payload budget's 256 MiB, a
    decode run's 1M elements) still hold."""
    n = 1 << 27
    small, large = project(cfg, [n])["total"], project(cfg, [2 * n])["total"]
    slope = (large - small) / n
    return slope, round(small - slope * n)


def describe(projection: dict[str, int], numel: int) -> str:
    """One line: the total, its multiple of the FP32 model, and every component."""
    parts = ", ".join(f"{k} {_gib(projection[k])}" for k in COMPONENTS if projection[k])
    multiple = f" ({projection['total'] / (4 * numel):.1f}x the FP32 model)" if numel else ""
    return f"{_gib(projection['total'])}{multiple}: {parts}"


def over_limit(cfg: SynchronizerConfig, model: ModelSpec | Sequence[int]) -> str | None:
    """Why `model` cannot be served within `memory_limit_bytes`, or None if it can (or there
    is no limit)."""
    limit = cfg.memory_limit_bytes
    if not limit:
        return None
    projection = project(cfg, model)
    if projection["total"] <= limit:
        return None
    sizes = _sizes(model)
    slope, fixed = bytes_per_param(cfg)
    fits = max(0, int((limit - fixed) / slope)) if slope else 0
    what = (
        f"a model of {sum(sizes):,} parameters in {len(sizes)} fragments"
        if sizes
        else "the Synchronizer with no model yet"
    )
    return (
        f"{what} projects to {projection['total']:,} bytes of memory "
        f"({describe(projection, sum(sizes))}), above memory_limit_bytes={limit:,}; "
        f"these settings fit about {fits:,} parameters: raise the limit or serve a smaller model"
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"
