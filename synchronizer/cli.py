"""`diloco-synchronizer`: serve the Synchronizer, initialise its model from a file, show status.

    diloco-synchronizer serve [--config FILE] [--host H --port P --metrics-port M --state-dir DIR ...]
    diloco-synchronizer init FILE [--synchronizer HOST:PORT] [--fragments N]
    diloco-synchronizer status [--synchronizer HOST:PORT]

Every `serve` option can also come from the config file (TOML/YAML) or a `DILOCO_<OPTION>`
environment variable; flags win over the environment, which wins over the file. A bad setting
prints one line naming it and exits 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc

from protos import codec, framing
from protos import diloco_pb2 as pb
from protos import diloco_pb2_grpc as pb_grpc
from protos.configload import ConfigError, add_flags, load
from protos.spec import ModelSpec, TensorInfo, plan_fragments
from synchronizer.config import SynchronizerConfig
from synchronizer.server import RunningServer, serve

logger = logging.getLogger("synchronizer")
SPEC_METADATA_KEY = "diloco.spec"  # optional: ModelSpec proto, base64, in the safetensors metadata


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco-synchronizer",
        description="The Synchronizer of Decoupled DiLoCo: merges learners' outer gradients into a global model and serves it back.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the service until SIGTERM", description="Run the Synchronizer service until SIGTERM/SIGINT (then checkpoint and exit 0).")
    s.add_argument("--config", help="TOML or YAML file with settings (flags and DILOCO_* variables override it)")
    s.add_argument("--ready-file", help="once serving, write the bound ports as JSON to this path (for scripts and launchers)")
    add_flags(s, SynchronizerConfig)
    i = sub.add_parser("init", help="upload initial parameters from a safetensors file", description="Initialise a running Synchronizer's model from a safetensors file of named tensors.")
    i.add_argument("file", help="safetensors file; its tensors, in file order, define the model spec unless it carries 'diloco.spec' metadata")
    i.add_argument("--synchronizer", default="127.0.0.1:50051", help="address of the Synchronizer (default: %(default)s)")
    i.add_argument("--fragments", type=int, default=4, help="fragments to split the model into; must match the learners' (default: %(default)s)")
    i.add_argument("--fragment-strategy", default="balanced", choices=("balanced", "strided"))
    i.add_argument("--auth-token", default=os.environ.get("DILOCO_AUTH_TOKEN"), help="bearer token, if the service requires one (env DILOCO_AUTH_TOKEN)")
    i.add_argument("--timeout-s", type=float, default=120.0, help="deadline of each RPC")
    st = sub.add_parser("status", help="print the service's status as JSON")
    st.add_argument("--synchronizer", default="127.0.0.1:50051")
    st.add_argument("--auth-token", default=os.environ.get("DILOCO_AUTH_TOKEN"))
    st.add_argument("--timeout-s", type=float, default=10.0)
    return parser


def _metadata(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


def _init(args: argparse.Namespace) -> int:
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(args.file, framework="pt") as f:
            names = list(f.keys())
            meta = f.metadata() or {}
            tensors = {n: f.get_tensor(n) for n in names}
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"cannot read {args.file} as safetensors: {e}") from None
    if SPEC_METADATA_KEY in meta:
        import base64

        msg = pb.ModelSpec()
        msg.ParseFromString(base64.b64decode(meta[SPEC_METADATA_KEY]))
        spec = ModelSpec.from_proto(msg)
    else:
        infos = [TensorInfo(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors.items()]
        spec = plan_fragments(infos, args.fragments, args.fragment_strategy)
    channel = grpc.insecure_channel(args.synchronizer)
    stub = pb_grpc.SynchronizerStub(channel)
    md = _metadata(args.auth_token)
    joined = stub.Join(pb.JoinRequest(learner_name="init", spec=spec.to_proto()), timeout=args.timeout_s, metadata=md)
    if not joined.needs_init:
        stub.Leave(pb.LeaveRequest(learner_id=joined.learner_id), timeout=args.timeout_s, metadata=md)
        raise ConfigError("the Synchronizer's model is already initialised; nothing was changed")

    def requests() -> Iterator[pb.InitModelRequest]:
        yield pb.InitModelRequest(start=pb.InitStart(learner_id=joined.learner_id, spec_hash=spec.spec_hash))
        for frag in spec.fragments:
            flat = torch.cat([tensors[t.name].to(torch.float32).reshape(-1) for t in frag.tensors])
            header = codec.make_header(pb.CODEC_FP32, frag.numel)
            yield pb.InitModelRequest(fragment=pb.InitFragmentHeader(fragment_id=frag.fragment_id, payload=header))
            for chunk in framing.iter_chunks(codec.encode(flat, pb.CODEC_FP32).cpu()):
                yield pb.InitModelRequest(chunk=chunk)

    reply = stub.InitModel(requests(), timeout=args.timeout_s, metadata=md)
    stub.Leave(pb.LeaveRequest(learner_id=joined.learner_id), timeout=args.timeout_s, metadata=md)
    print(f"initialised {spec.numel} parameters in {len(spec.fragments)} fragments (spec {spec.spec_hash[:12]}); versions {[v.version for v in reply.versions]}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    stub = pb_grpc.SynchronizerStub(grpc.insecure_channel(args.synchronizer))
    reply = stub.Status(pb.StatusRequest(), timeout=args.timeout_s, metadata=_metadata(args.auth_token))
    print(json.dumps(MessageToDict(reply), indent=2))
    return 0


def _serve(args: argparse.Namespace) -> int:
    cfg = load(SynchronizerConfig, args.config, vars(args))
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def ready(running: RunningServer) -> None:
        if args.ready_file:
            tmp = Path(args.ready_file + ".tmp")
            tmp.write_text(json.dumps({"address": running.address, "port": running.port, "metrics_port": running.metrics_port, "epoch": running.service.epoch}))
            tmp.replace(args.ready_file)

    serve(cfg, on_ready=ready)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "init":
            return _init(args)
        return _status(args)
    except ConfigError as e:
        print(f"diloco-synchronizer: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        print(f"diloco-synchronizer: {e.code().name}: {e.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    except OSError as e:
        print(f"diloco-synchronizer: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
