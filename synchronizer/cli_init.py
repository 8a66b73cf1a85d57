"""`diloco-synchronizer init FILE`: initialise a running Synchronizer's model from safetensors.

The file's tensors, in file order, define the model spec (planned into `--fragments` fragments),
unless the file carries a spec in its `diloco.spec` metadata. `init` joins every shard named in
`--synchronizer` as a learner would, checks that they are the model's shards once each, uploads
to each uninitialised one its own fragments, and leaves. A Synchronizer that already holds a
model is left as it is (`AlreadyInitialised`, exit 4: refused).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import grpc

from protos import diloco_pb2 as pb
from protos import diloco_pb2_grpc as pb_grpc
from protos.channel import bearer
from protos.cli import add_log_flags, number
from protos.configload import ConfigError, add_flags
from protos.initmodel import init_model_requests
from protos.spec import ModelSpec, TensorInfo, plan_fragments, shard_owners
from synchronizer.cli_remote import RemoteConfig, connect

SPEC_METADATA_KEY = "diloco.spec"  # optional: ModelSpec proto, base64, in the safetensors metadata


class AlreadyInitialised(Exception):
    """Every shard named already holds a model: nothing was changed."""


def add_parser(sub: Any) -> None:
    """The `init` subcommand and its flags."""
    i = sub.add_parser(
        "init",
        help="upload initial parameters from a safetensors file",
        description="Initialise a running Synchronizer's model from a safetensors file of named tensors.",
    )
    i.add_argument(
        "file",
        help="safetensors file; its tensors, in file order, define the model spec unless it carries 'diloco.spec' metadata",
    )
    i.add_argument(
        "--fragments",
        type=number(int, gt=0),
        default=4,
        help="fragments to split the model into; must match the learners' (default: %(default)s)",
    )
    i.add_argument("--fragment-strategy", default="balanced", choices=("balanced", "strided"))
    i.add_argument(
        "--timeout-s",
        type=number(float, gt=0),
        metavar="SECONDS",
        default=120.0,
        help="deadline of each RPC (default: %(default)s)",
    )
    add_log_flags(i, level=False)
    add_flags(i, RemoteConfig, "{group} (also from DILOCO_CTL_* variables)")


def _read_model(args: argparse.Namespace) -> tuple[ModelSpec, dict[str, Any]]:
    """The spec (from the file's metadata, or planned from its tensors) and the tensors."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(args.file, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {n: f.get_tensor(n) for n in f.keys()}
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"cannot read {args.file} as safetensors: {e}") from None
    if SPEC_METADATA_KEY not in meta:
        infos = [
            TensorInfo(n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for n, t in tensors.items()
        ]
        return plan_fragments(infos, args.fragments, args.fragment_strategy), tensors
    import base64

    from google.protobuf.message import DecodeError

    try:
        msg = pb.ModelSpec()
        msg.ParseFromString(base64.b64decode(meta[SPEC_METADATA_KEY]))
        spec = ModelSpec.from_proto(msg)
    except (ValueError, DecodeError) as e:
        raise ConfigError(
            f"{args.file}: the {SPEC_METADATA_KEY!r} metadata is not a valid model spec: {e}"
        ) from None
    for t in spec.tensors:
        if t.name not in tensors or tuple(tensors[t.name].shape) != t.shape:
            raise ConfigError(
                f"{args.file}: its {SPEC_METADATA_KEY!r} metadata names tensor {t.name!r} of shape {t.shape}, which the file does not hold"
            )
    return spec, tensors


@dataclass
class _Joined:
    """`init`'s learner at one Synchronizer (one shard of a sharded one)."""

    address: str
    stub: pb_grpc.SynchronizerStub
    reply: pb.JoinReply


def _one_per_shard(joined: list[_Joined]) -> list[_Joined]:
    """The joined shards by index; ConfigError unless they are shards 0..S-1 of S, once each."""
    count = len(joined)
    by_index: dict[int, _Joined] = {}
    for j in joined:
        if (j.reply.shards or 1) != count:
            raise ConfigError(
                f"{j.address} answered as shard {j.reply.shard_index} of {j.reply.shards or 1}, not of the {count} addresses given; nothing was changed"
            )
        other = by_index.setdefault(j.reply.shard_index, j)
        if other is not j:
            missing = sorted(set(range(count)) - set(by_index))
            raise ConfigError(
                f"--synchronizer must name each of the {count} shards once: {other.address} and {j.address} are both shard {j.reply.shard_index} "
                f"(shards {missing} not named); nothing was changed"
            )
    return [by_index[i] for i in range(count)]


def run(args: argparse.Namespace, cfg: RemoteConfig) -> int:
    """Joins every shard named (one: an unsharded Synchronizer), checks they are the model's
    shards once each, then uploads to each uninitialised one its own fragments."""
    import torch

    spec, tensors = _read_model(args)
    count = len(cfg.addresses)
    try:
        owners = shard_owners(spec, count)
    except ValueError as e:
        raise ConfigError(f"--synchronizer names {count} shards: {e}") from None
    md = bearer(cfg.auth_token or cfg.admin_token)
    request = pb.JoinRequest(learner_name="init", spec=spec.to_proto())
    if count > 1:
        request.shards = count
        request.fragment_shards.extend(owners)
    joined: list[_Joined] = []

    def flat(fid: int) -> torch.Tensor:
        parts = spec.fragments[fid].tensors
        return torch.cat([tensors[t.name].to(torch.float32).reshape(-1) for t in parts])

    try:
        for address in cfg.addresses:
            stub = connect(cfg, address)
            joined.append(
                _Joined(address, stub, stub.Join(request, timeout=args.timeout_s, metadata=md))
            )
        shards = _one_per_shard(joined)
        todo = [j for j in shards if j.reply.needs_init]
        if not todo:
            raise AlreadyInitialised(
                "the Synchronizer's model is already initialised; nothing was changed"
            )
        versions: dict[int, int] = {}
        for j in todo:
            ids = [fid for fid, owner in enumerate(owners) if owner == j.reply.shard_index]
            requests = init_model_requests(
                j.reply.learner_id,
                j.reply.session,
                spec.spec_hash,
                (flat(fid) for fid in ids),
                fragment_ids=ids,
            )
            reply = j.stub.InitModel(requests, timeout=args.timeout_s, metadata=md)
            versions.update({v.fragment_id: v.version for v in reply.versions})
    finally:
        for j in joined:
            try:
                j.stub.Leave(
                    pb.LeaveRequest(learner_id=j.reply.learner_id, session=j.reply.session),
                    timeout=args.timeout_s,
                    metadata=md,
                )
            except grpc.RpcError:
                pass  # its lease lapses instead; the error that matters is the one above
    where = ""
    if count > 1:
        skipped = [j.reply.shard_index for j in shards if not j.reply.needs_init]
        where = f" over {count} shards" + (
            f" (shards {skipped} were already initialised and left as they were)" if skipped else ""
        )
    print(
        f"initialised {spec.numel} parameters in {len(spec.fragments)} fragments{where} (spec {spec.spec_hash[:12]}); versions {[versions[f] for f in sorted(versions)]}"
    )
    return 0
