"""`diloco-synchronizer`: serve the Synchronizer, initialise its model from a file, show status.

    diloco-synchronizer serve [--config FILE] [--host H --port P --metrics-port M --state-dir DIR ...]
    diloco-synchronizer init FILE [--synchronizer HOST:PORT[,HOST:PORT...]] [--fragments N] [connection flags]
    diloco-synchronizer status [--synchronizer HOST:PORT] [--json] [connection flags]

Every `serve` option can also come from the config file (TOML/YAML) or a `DILOCO_<OPTION>`
environment variable; flags win over the environment, which wins over the file. `init` and
`status` reach a running Synchronizer as a learner does (`RemoteConfig`: `--tls-ca` for TLS,
`--tls-cert`/`--tls-key` for mutual TLS, `--auth-token` for the learner RPCs `init` makes,
`--admin-token` for `status`), each also from its `DILOCO_<OPTION>` variable. `status` prints a
table, or with `--json` the object `status_json` documents. A bad setting, an unreadable file or
a Synchronizer that cannot be reached or refuses prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from pydantic import ConfigDict, Field, field_validator

from protos import diloco_pb2 as pb
from protos import diloco_pb2_grpc as pb_grpc
from protos.channel import ClientTLS, bearer, open_channel
from protos.configload import ConfigError, add_flags, load
from protos.initmodel import init_model_requests
from protos.spec import ModelSpec, TensorInfo, plan_fragments, shard_owners
from synchronizer.config import SynchronizerConfig
from synchronizer.server import RunningServer, serve

logger = logging.getLogger("synchronizer")
SPEC_METADATA_KEY = "diloco.spec"  # optional: ModelSpec proto, base64, in the safetensors metadata


class RemoteConfig(ClientTLS):
    """How `init` and `status` reach a running Synchronizer (the learner's settings of the same names)."""

    model_config = ConfigDict(extra="forbid")

    synchronizer: str = Field(
        default="127.0.0.1:50051",
        description="host:port of the Synchronizer's gRPC endpoint; for a sharded one (init) every shard's, comma-separated, in any order",
    )
    auth_token: str | None = Field(
        default=None,
        description="Learner bearer token: init joins and uploads as a learner (status falls back to it)",
    )
    admin_token: str | None = Field(
        default=None,
        description="Admin bearer token: status needs it when the Synchronizer has one (init may use it too)",
    )

    @field_validator("synchronizer")
    @classmethod
    def _host_port(cls, v: str) -> str:
        for address in v.split(","):
            host, _, port = address.strip().rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(
                    f"must be host:port with a port in 1..65535 (e.g. 127.0.0.1:50051), or several comma-separated, got {address.strip()!r}"
                )
        return v

    @property
    def addresses(self) -> list[str]:
        """Every address `synchronizer` names (one per shard of a sharded Synchronizer)."""
        return [a.strip() for a in self.synchronizer.split(",")]


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag prints one line (and where to look), not the whole usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="diloco-synchronizer",
        description="The Synchronizer of Decoupled DiLoCo: merges learners' outer gradients into a global model and serves it back.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    s = sub.add_parser(
        "serve",
        help="run the service until SIGTERM",
        description="Run the Synchronizer service until SIGTERM/SIGINT (then checkpoint and exit 0).",
    )
    s.add_argument(
        "--config",
        help="TOML or YAML file with settings (flags and DILOCO_* variables override it)",
    )
    s.add_argument(
        "--ready-file",
        help="once serving, write the bound ports as JSON to this path (for scripts and launchers)",
    )
    add_flags(s, SynchronizerConfig)
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
        type=_positive(int),
        default=4,
        help="fragments to split the model into; must match the learners' (default: %(default)s)",
    )
    i.add_argument("--fragment-strategy", default="balanced", choices=("balanced", "strided"))
    i.add_argument(
        "--timeout-s",
        type=_positive(float),
        default=120.0,
        help="deadline of each RPC (default: %(default)s)",
    )
    add_flags(i.add_argument_group("connection (also from DILOCO_* variables)"), RemoteConfig)
    st = sub.add_parser(
        "status",
        help="print fragments, versions and learners as a table (or --json)",
        description="Show a running Synchronizer's epoch, fragment versions and learners, as a table or as JSON.",
    )
    st.add_argument(
        "--json",
        action="store_true",
        help="print the status as one JSON object (fields documented in synchronizer/cli.py: status_json)",
    )
    st.add_argument(
        "--timeout-s",
        type=_positive(float),
        default=10.0,
        help="deadline of the RPC (default: %(default)s)",
    )
    add_flags(st.add_argument_group("connection (also from DILOCO_* variables)"), RemoteConfig)
    return parser


def _connect(cfg: RemoteConfig, address: str | None = None) -> pb_grpc.SynchronizerStub:
    try:
        channel = open_channel(
            address or cfg.synchronizer,
            tls_ca=cfg.tls_ca,
            tls_cert=cfg.tls_cert,
            tls_key=cfg.tls_key,
            tls_server_name=cfg.tls_server_name,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return pb_grpc.SynchronizerStub(channel)


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


def _init(args: argparse.Namespace, cfg: RemoteConfig) -> int:
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
            stub = _connect(cfg, address)
            joined.append(
                _Joined(address, stub, stub.Join(request, timeout=args.timeout_s, metadata=md))
            )
        shards = _one_per_shard(joined)
        todo = [j for j in shards if j.reply.needs_init]
        if not todo:
            raise ConfigError(
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


def status_json(reply: pb.StatusReply) -> dict[str, Any]:
    """The Status reply as `status --json` prints it:

    - `server_epoch` (str, new at every start), `initialized` (bool), `spec_hash` (str, "" before
      the first learner), `outer_steps` (int, summed over fragments);
    - `fragments`: [{`fragment_id`, `version`}] in id order;
    - `learners`: [{`learner_id`, `name`, `state` ("alive", "dead" or "left"), `steps`, `tokens`,
      `compute_s`, `blocked_s`}], their cumulative counters as last reported;
    - `totals`: `learners` by state, and `steps`, `tokens`, `compute_s`, `blocked_s` summed;
    - `goodput`: the Synchronizer's goodput, merged compute / learner capacity over its goodput
      window (0-1; `diloco_goodput_ratio`), which discounts dropped, lost and blocked work;
    - `loop_goodput`: compute_s / (compute_s + blocked_s) over every learner (null before any
      step): the share of the learners' training time spent in inner steps rather than waiting
      on syncs;
    - `unhealthy`: why the Synchronizer cannot serve its whole model (a failed outer step), or
      null while it is healthy.
    """
    learners = [
        {
            "learner_id": x.learner_id,
            "name": x.name,
            "state": x.state,
            "steps": x.counters.steps,
            "tokens": x.counters.tokens,
            "compute_s": x.counters.compute_s,
            "blocked_s": x.counters.blocked_s,
        }
        for x in reply.learners
    ]
    by_state = {
        state: sum(x["state"] == state for x in learners) for state in ("alive", "dead", "left")
    }
    totals: dict[str, Any] = {"learners": by_state}
    for key in ("steps", "tokens", "compute_s", "blocked_s"):
        totals[key] = sum(x[key] for x in learners)
    busy = totals["compute_s"] + totals["blocked_s"]
    return {
        "server_epoch": reply.server_epoch,
        "initialized": reply.initialized,
        "spec_hash": reply.spec_hash,
        "outer_steps": reply.outer_steps,
        "fragments": [
            {"fragment_id": v.fragment_id, "version": v.version}
            for v in sorted(reply.versions, key=lambda v: v.fragment_id)
        ],
        "learners": learners,
        "totals": totals,
        "goodput": reply.goodput,
        "loop_goodput": totals["compute_s"] / busy if busy > 0 else None,
        "unhealthy": reply.unhealthy or None,
    }


def _table(header: list[str], rows: list[list[str]], text_columns: int = 1) -> list[str]:
    """Columns as wide as their widest cell: the first `text_columns` left-aligned, numbers right."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(
            c.ljust(w) if i < text_columns else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in [header, *rows]
    ]


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole > 0 else "-"


def status_table(s: dict[str, Any]) -> str:
    """`status_json`'s object for people: a summary line, fragments, learners, goodput."""
    lines = [
        f"Synchronizer epoch {s['server_epoch']}: "
        + (
            f"initialised, spec {s['spec_hash'][:12]}, {s['outer_steps']} outer steps"
            if s["initialized"]
            else "not initialised yet (no model)"
        ),
        "",
    ]
    if s["fragments"]:
        lines += _table(
            ["fragment", "version"],
            [[str(f["fragment_id"]), str(f["version"])] for f in s["fragments"]],
        ) + [""]
    if s["learners"]:
        rows = [
            [
                x["name"] or "-",
                x["learner_id"],
                x["state"],
                f"{x['steps']:,}",
                f"{x['tokens']:,}",
                f"{x['compute_s']:.1f}",
                f"{x['blocked_s']:.1f}",
                _share(x["compute_s"], x["compute_s"] + x["blocked_s"]),
            ]
            for x in s["learners"]
        ]
        lines += _table(
            ["learner", "id", "state", "steps", "tokens", "compute_s", "blocked_s", "loop goodput"],
            rows,
            text_columns=3,
        )
    else:
        lines.append("no learners")
    t = s["totals"]
    lines += [
        "",
        f"learners: {t['learners']['alive']} alive, {t['learners']['dead']} dead, {t['learners']['left']} left; "
        f"{t['steps']:,} steps, {t['tokens']:,} tokens",
        f"goodput: {s['goodput']:.1%} of learner capacity merged (diloco_goodput_ratio)",
        f"loop goodput: {_share(t['compute_s'], t['compute_s'] + t['blocked_s'])} of the learners' time in inner steps, "
        "the rest blocked on sync"
        if t["compute_s"] + t["blocked_s"] > 0
        else "loop goodput: no inner steps reported yet",
    ]
    if s["unhealthy"]:
        lines = [f"UNHEALTHY: {s['unhealthy']}", *lines]
    return "\n".join(lines)


def _status(args: argparse.Namespace, cfg: RemoteConfig) -> int:
    reply = _connect(cfg).Status(
        pb.StatusRequest(),
        timeout=args.timeout_s,
        metadata=bearer(cfg.admin_token or cfg.auth_token),
    )
    s = status_json(reply)
    print(json.dumps(s, indent=2) if args.json else status_table(s))
    return 0


HINTS = {
    grpc.StatusCode.UNAVAILABLE: "is a Synchronizer serving there, with TLS exactly when --tls-ca is given?",
    grpc.StatusCode.UNAUTHENTICATED: "give its token with --auth-token or --admin-token (or DILOCO_AUTH_TOKEN / DILOCO_ADMIN_TOKEN)",
    grpc.StatusCode.PERMISSION_DENIED: "status needs the admin token: --admin-token or DILOCO_ADMIN_TOKEN",
    grpc.StatusCode.DEADLINE_EXCEEDED: "no answer within --timeout-s; raise it or check the network",
}


def _remote(args: argparse.Namespace) -> int:
    """`init` or `status`; a failed RPC is one line naming the address, the code and what to do."""
    cfg = load(RemoteConfig, None, vars(args))
    try:
        return _init(args, cfg) if args.command == "init" else _status(args, cfg)
    except grpc.RpcError as e:
        code: grpc.StatusCode = e.code()  # type: ignore[attr-defined]
        details = ((e.details() or "").splitlines() or [""])[0]  # type: ignore[attr-defined]
        hint = f" ({HINTS[code]})" if code in HINTS else ""
        print(
            f"diloco-synchronizer: {args.command} at {cfg.synchronizer}: {code.name}: {details}{hint}",
            file=sys.stderr,
        )
        return 2


def _serve(args: argparse.Namespace) -> int:
    cfg = load(SynchronizerConfig, args.config, vars(args))
    logging.basicConfig(
        level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    def ready(running: RunningServer) -> None:
        if args.ready_file:
            tmp = Path(args.ready_file + ".tmp")
            tmp.write_text(
                json.dumps(
                    {
                        "address": running.address,
                        "port": running.port,
                        "metrics_port": running.metrics_port,
                        "epoch": running.synchronizer.epoch,
                    }
                )
            )
            tmp.replace(args.ready_file)

    return 0 if serve(cfg, on_ready=ready) else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _serve(args) if args.command == "serve" else _remote(args)
    except ConfigError as e:
        print(f"diloco-synchronizer: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"diloco-synchronizer: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
