"""`diloco-synchronizer status`: a running Synchronizer's epoch, fragments and learners.

`status_json` turns a Status reply into the object `status --json` prints (its fields are
documented there) and `status_table` into the table people read; given every shard of a sharded
Synchronizer, `shards_json` and `shards_table` show them all in one view, asked at once, a shard
that does not answer shown as down (exit 3, as for one address that does not answer, only when
none answers).
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from protos import diloco_pb2 as pb
from protos.channel import bearer
from protos.cli import add_log_flags, number
from protos.configload import add_flags
from synchronizer.cli_remote import (
    DOWN,
    HINTS,
    RemoteConfig,
    RemoteError,
    Unanswered,
    connect,
    rpc_error_text,
)


def add_parser(sub: Any) -> None:
    """The `status` subcommand and its flags."""
    st = sub.add_parser(
        "status",
        help="print fragments, versions and learners as a table (or --json)",
        description="Show a running Synchronizer's epoch, fragment versions and learners, as a table or as JSON; "
        "with --synchronizer a:PORT,b:PORT, every shard of a sharded Synchronizer in one view.",
    )
    st.add_argument(
        "--json",
        action="store_true",
        help="print the status as one JSON object (fields documented in synchronizer/cli_status.py: status_json, and shards_json for several shards)",
    )
    st.add_argument(
        "--timeout-s",
        type=number(float, gt=0),
        metavar="SECONDS",
        default=10.0,
        help="deadline of the RPC, to each shard at once (default: %(default)s)",
    )
    add_log_flags(st, level=False)
    add_flags(st, RemoteConfig, "{group} (also from DILOCO_CTL_* variables)")


def status_json(reply: pb.StatusReply) -> dict[str, Any]:
    """The Status reply as `status --json` prints it:

    - `server_epoch` (str, new at every start), `initialized` (bool), `spec_hash` (str, "" before
      the first learner), `outer_steps` (int, summed over its fragments);
    - `shards` (int, 1 when unsharded) and `shard_index` (int): which shard of how many answered;
    - `fragments`: [{`fragment_id`, `version`}] in id order (a shard's own fragments only);
    - `learners`: [{`learner_id`, `name`, `state` ("alive", "dead" or "left"), `steps`, `tokens`,
      `compute_s`, `blocked_s`, `evaluator`}], their cumulative counters as last reported
      (`evaluator`: it joined to report eval loss, and trains nothing);
    - `totals`: `learners` by state, and `steps`, `tokens`, `compute_s`, `blocked_s` summed;
    - `goodput`: the Synchronizer's goodput, merged compute / learner capacity over its goodput
      window (0-1; `diloco_goodput_ratio`), which discounts dropped, lost and blocked work; a
      shard's counts its `model_fraction` (share of the parameters it serves; 1 unsharded) of
      the learners' work and capacity;
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
            "evaluator": x.evaluator,
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
        "shards": max(reply.shards, 1),
        "shard_index": reply.shard_index,
        "fragments": [
            {"fragment_id": v.fragment_id, "version": v.version}
            for v in sorted(reply.versions, key=lambda v: v.fragment_id)
        ],
        "learners": learners,
        "totals": totals,
        "goodput": reply.goodput,
        "model_fraction": reply.model_fraction or 1.0,
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
    shard = f"shard {s['shard_index']} of {s['shards']}, " if s["shards"] > 1 else ""
    lines = [
        f"Synchronizer {shard}epoch {s['server_epoch']}: "
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
                x["state"] + (" (evaluator)" if x.get("evaluator") else ""),
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
        f"goodput: {s['goodput']:.1%} of learner capacity merged (diloco_goodput_ratio)"
        if s["learners"]
        else "goodput: none yet (no learner has joined, so there is no capacity to merge)",
        f"loop goodput: {_share(t['compute_s'], t['compute_s'] + t['blocked_s'])} of the learners' time in inner steps, "
        "the rest blocked on sync"
        if t["compute_s"] + t["blocked_s"] > 0
        else "loop goodput: no inner steps reported yet",
    ]
    if s["unhealthy"]:
        lines = [f"UNHEALTHY: {s['unhealthy']}", *lines]
    return "\n".join(lines)


def shards_json(answers: list[tuple[str, pb.StatusReply | grpc.RpcError]]) -> dict[str, Any]:
    """Every shard's status, by address in the order given, as `status --json` prints it for
    several addresses:

    - `shards`: [{`address`, `up` (bool), `error` ("CODE: details" of a shard that did not
      answer, else null), and for a shard that answered every field of `status_json`}];
    - `totals`: `shards` (addresses given), `up`, `down`; over the shards that answered:
      `fragments` and `outer_steps` summed (each shard serves its own fragments), `goodput`
      the shards' goodputs weighted by their `model_fraction` (a shard that is down counts as
      merging nothing: its fraction of the model is learners' work going nowhere), `learners`
      by state, the most any shard counts (every learner joins every shard);
    - `problems`: what does not add up, each a sentence: shards on different model specs, two
      addresses answering as one shard index, a shard count other than the addresses given.
    """
    shards: list[dict[str, Any]] = [
        {"address": address, "up": False, "error": rpc_error_text(answer)}
        if isinstance(answer, grpc.RpcError)
        else {"address": address, "up": True, "error": None, **status_json(answer)}
        for address, answer in answers
    ]
    up = [x for x in shards if x["up"]]
    totals = {
        "shards": len(shards),
        "up": len(up),
        "down": len(shards) - len(up),
        "fragments": sum(len(x["fragments"]) for x in up),
        "outer_steps": sum(x["outer_steps"] for x in up),
        "goodput": sum(x["goodput"] * x["model_fraction"] for x in up),
        "learners": {
            state: max((x["totals"]["learners"][state] for x in up), default=0)
            for state in ("alive", "dead", "left")
        },
    }
    problems = []
    specs = sorted({x["spec_hash"][:12] for x in up if x["spec_hash"]})
    if len(specs) > 1:
        problems.append(f"the shards hold different model specs ({', '.join(specs)})")
    for index in sorted({x["shard_index"] for x in up}):
        at = [x["address"] for x in up if x["shard_index"] == index]
        if len(at) > 1:
            problems.append(f"shard index {index} answers at {len(at)} addresses: {', '.join(at)}")
    for count in sorted({x["shards"] for x in up} - {len(shards)}):
        at = [x["address"] for x in up if x["shards"] == count]
        problems.append(f"{', '.join(at)}: shards {count}, but {len(shards)} addresses were given")
    return {"shards": shards, "totals": totals, "problems": problems}


def shards_table(view: dict[str, Any]) -> str:
    """`shards_json`'s object for people: totals and problems, then each shard's `status_table`."""
    t = view["totals"]
    lines = [
        f"shards: {t['shards']} given, {t['up']} up, {t['down']} down; "
        f"{t['fragments']} fragments, {t['outer_steps']} outer steps",
        f"goodput: {t['goodput']:.1%} of learner capacity merged (each shard's for its part of the model)"
        if sum(t["learners"].values())
        else "goodput: none yet (no learner has joined, so there is no capacity to merge)",
        f"learners: {t['learners']['alive']} alive, {t['learners']['dead']} dead, "
        f"{t['learners']['left']} left (the most any shard counts)",
        *(f"PROBLEM: {p}" for p in view["problems"]),
    ]
    for shard in view["shards"]:
        body = status_table(shard) if shard["up"] else f"DOWN: {shard['error']}"
        lines += ["", shard["address"], *(f"  {line}".rstrip() for line in body.splitlines())]
    return "\n".join(lines)


def run(args: argparse.Namespace, cfg: RemoteConfig) -> int:
    def ask(address: str) -> pb.StatusReply:
        reply: pb.StatusReply = connect(cfg, address).Status(
            pb.StatusRequest(),
            timeout=args.timeout_s,
            metadata=bearer(cfg.admin_token or cfg.auth_token),
        )
        return reply

    addresses = cfg.addresses
    if len(addresses) == 1:
        s = status_json(ask(addresses[0]))
        print(json.dumps(s, indent=2) if args.json else status_table(s))
        return 0

    def answer(address: str) -> pb.StatusReply | grpc.RpcError:
        try:
            return ask(address)
        except grpc.RpcError as e:
            if e.code() in DOWN:  # type: ignore[attr-defined]
                return e
            raise RemoteError(address, e) from None  # refused: a setting to fix, not a dead shard

    with ThreadPoolExecutor(
        len(addresses)
    ) as pool:  # a dead shard costs one deadline, not one each
        view = shards_json(list(zip(addresses, pool.map(answer, addresses), strict=True)))
    print(json.dumps(view, indent=2) if args.json else shards_table(view))
    if view["totals"]["up"] == 0:
        raise Unanswered(
            f"none of the {len(addresses)} shards answered ({HINTS[grpc.StatusCode.UNAVAILABLE]})"
        )
    return 0
