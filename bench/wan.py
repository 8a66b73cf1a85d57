"""Slow links: data parallel against the best Decoupled configuration when every learner's link
has a set rate and round-trip time, eval loss against wall-clock for both.

M = 2 learners, so that each learner process has a core of its own on this 2-core machine (with
4 learners on 2 cores a step's compute doubled and hid data parallel's all-reduce behind CPU
starvation); the Synchronizer, the evaluator below and the link proxies share the same cores,
so both arms' compute is one core per learner, less what those take. The model, data and
per-learner batch are bench/convergence.py's (2 learners see half its tokens per step).
(a) data parallel and the Decoupled configuration it picks (`bench.convergence.BEST`: K = 1 +
adaptive grace, H = 100, P = 4, INT4 pushes, INT8 delta pulls) run over the same links: each
learner process in its own network namespace (root; see bench/net.py), whose veth is shaped by
`tc tbf` in both directions and whose every outgoing TCP connection (to the Synchronizer, to
the gloo master, to the other ranks) goes through a transparent proxy that delays each chunk
by half the round trip each way, so any two endpoints are one RTT apart. Without root or
iptables (`--net proxy`, or `auto` where namespaces cannot be made), each Decoupled learner sits
behind a rate-limiting, delaying proxy, but gloo cannot be proxied: data parallel would run on
loopback, unshaped, and that is no baseline, so it is not run and `wan_speedup` is missing (None
in the JSON, the reason under `missing`), never a number. Before the runs every link is measured from inside its slot (round trip to the
Synchronizer's address and, for data parallel's peers, to slot 0; throughput each way:
`links_measured`), and a link whose round trip is far from the one asked for is refused.

Eval loss against wall-clock: data parallel's rank 0 evaluates every steps/40 steps, and those
seconds are taken out of its clock (it runs after the Decoupled run and stops at the first eval
at or below the Decoupled run's final loss: nothing after that changes the headline); the
Decoupled run's global model is pulled and evaluated in this process every few seconds while
the learners train (on the same 2 cores: that slows the learners, not data parallel, so it errs
against Decoupled). Wall-clock runs from the first training step to the last, start-up excluded
for both.

Headline `wan_speedup` (at the first link, 50 Mbit/s with 50 ms round trip by default): the
wall time data parallel needs to reach the eval loss the Decoupled run ends with (interpolated
between its eval points) over the Decoupled run's wall time. If data parallel never gets there,
its whole run is used and the result says `"dp_reached": false` (then the speedup is a lower
bound). Each further link adds `wan_speedup_<rate>mbit`.

    python -m bench.wan [--quick | --smoke] [--json PATH] [--links 50:50,1000:10] [--steps S]
        [--rates-mbit 50,1000 [--rtt-ms 50,10]] [--net auto|netns|proxy]
`--links RATE:RTT,...` gives each link's Mbit/s and round trip in ms; `--rates-mbit` with
`--rtt-ms` (one value for all, or one per rate; 0 when left out) says the same.
Modes: --smoke a tiny model, 2 learners, 40 steps, 50 Mbit/s and 50 ms (its figure means
nothing: `"smoke_run": true`); --quick 2 x 400 steps at 50 Mbit/s and 50 ms; full 2 x 3000 steps
(the convergence run's length) at 50 Mbit/s / 50 ms and 1 Gbit/s / 10 ms.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

from bench.common import machine, parser, program, run_mode, say_mode, table, write_json
from bench.convergence import BEST, parse_set
from bench.dp import DPJob
from bench.jobs import SMOKE_SHORT, Decoupled, DilocoJob, GlobalModel, Workload
from bench.limits import shown
from bench.net import describe_links, open_links
from bench.plots import loss_curves, png_path


def reach_time(series: list[dict], target: float) -> float | None:
    """The first time an eval series gets to `target` or below, interpolated linearly between
    the eval points around the crossing; None if it never does."""
    for a, b in zip(series, series[1:], strict=False):
        if b["eval_loss"] <= target:
            if a["eval_loss"] <= target:
                return a["t"]
            f = (a["eval_loss"] - target) / (a["eval_loss"] - b["eval_loss"])
            return a["t"] + f * (b["t"] - a["t"])
    return series[0]["t"] if series and series[0]["eval_loss"] <= target else None


FULL_LINKS = [(50.0, 50.0), (1000.0, 10.0)]  # (Mbit/s, round trip ms); the first is the headline


def at_link(
    rate_mbit: float, rtt_ms: float, w: Workload, cfg: Decoupled, net: str, root: Path
) -> dict[str, Any]:
    """Both arms over links of `rate_mbit` with `rtt_ms`: the cell's figures. Where data
    parallel's traffic cannot be given those links (the per-slot proxies), it is not run and
    `wan_speedup` is None with the reason under `missing`: unshaped, it is no baseline."""
    with open_links(net, w.learners, rate_mbit * 1e6, rtt_ms / 1e3) as links:
        measured = links.verify()
        print(f"  links ({links.kind}), measured from each slot:", flush=True)
        print(describe_links(measured), flush=True)
        expected_s = w.steps / 30  # about 30 steps/s per learner with a core each
        dec = DilocoJob(cfg, w, links, root / "decoupled").run(
            evaluator=GlobalModel(w, cfg.fragments), eval_every_s=max(1.0, expected_s / 8)
        )
        unshaped = links.dp_unshaped()
        dp = None
        if unshaped is None:
            # data parallel stops at its first eval at or below the Decoupled run's final loss
            dp = DPJob(
                w,
                links,
                root / "dp",
                eval_every=max(1, w.steps // 40),
                target_loss=dec["eval_loss"],
            ).run()
    at = f"@{rate_mbit:g}Mbit/{rtt_ms:g}ms"
    dec["name"] = f"decoupled {at}"
    cell: dict[str, Any] = {
        "rate_mbit": rate_mbit,
        "rtt_ms": rtt_ms,
        "links": links.kind,
        "links_measured": measured,
        "decoupled": dec,
    }
    if dp is None:
        why = f"data parallel not run over these links: {unshaped}"
        return cell | {
            "dp": None,
            "dp_shaped": False,
            "dp_reached": None,
            "dp_time_to_decoupled_loss_s": None,
            "wan_speedup": None,
            "missing": {"wan_speedup": why},
        }
    t_dp = reach_time(dp["eval_series"], dec["eval_loss"])
    dp["name"] = f"dp {at}"
    return cell | {
        "dp_shaped": dp["shaped"],
        "dp_reached": t_dp is not None,
        "dp_time_to_decoupled_loss_s": t_dp if t_dp is not None else dp["wall_s"],
        "wan_speedup": (t_dp if t_dp is not None else dp["wall_s"]) / dec["wall_s"],
        "dp": dp,
        "missing": {},
    }


def parse_links(
    links: str | None, rates_mbit: str | None, rtt_ms: str | None
) -> list[tuple[float, float]]:
    """[(Mbit/s, round-trip ms)] from `--links 50:50,1000:10` or `--rates-mbit 50,1000` with
    `--rtt-ms` (one value for every rate, or one per rate; 0 when left out); [] if neither."""
    if links:
        out = []
        for item in links.split(","):
            rate, sep, rtt = item.partition(":")
            try:
                out.append((float(rate), float(rtt) if sep else 0.0))
            except ValueError:
                raise SystemExit(
                    f"--links {item!r}: expected RATE_MBIT:RTT_MS, e.g. 50:50"
                ) from None
        return out
    if not rates_mbit:
        if rtt_ms:
            raise SystemExit("--rtt-ms needs --rates-mbit (or use --links RATE:RTT,...)")
        return []
    rates = [float(r) for r in rates_mbit.split(",")]
    rtts = [float(t) for t in rtt_ms.split(",")] if rtt_ms else [0.0]
    if len(rtts) == 1:
        rtts *= len(rates)
    if len(rtts) != len(rates):
        raise SystemExit(
            f"--rtt-ms: give one value or one per rate ({len(rates)}), got {len(rtts)}"
        )
    return list(zip(rates, rtts, strict=True))


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--links",
        help="comma-separated RATE:RTT links, Mbit/s and round-trip ms (the first gives the headline)",
    )
    p.add_argument(
        "--rates-mbit", help="comma-separated link rates in Mbit/s (the first gives the headline)"
    )
    p.add_argument("--rtt-ms", help="round trip of each link in ms: one value, or one per rate")
    p.add_argument("--steps", type=int, help="inner steps per learner")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a setting of the Decoupled configuration",
    )
    p.add_argument(
        "--net",
        choices=("auto", "netns", "proxy"),
        default="auto",
        help="links: namespaces (root) or proxies",
    )
    p.add_argument("--out", type=Path, help="keep the runs' logs and result files here")
    args = p.parse_args(argv)
    mode = run_mode(args)
    say_mode(mode)
    if args.smoke:
        w, cfg, wan = dataclasses.replace(SMOKE_SHORT), BEST.with_(sync_every=10), FULL_LINKS[:1]
    else:
        w, cfg, wan = (
            Workload(learners=2, steps=400 if args.quick else 3000),
            BEST,
            FULL_LINKS[:1] if args.quick else FULL_LINKS,
        )
    if args.steps:
        w.steps = args.steps
    wan = parse_links(args.links, args.rates_mbit, args.rtt_ms) or wan
    labels = [f"{r:g}mbit" for r, _ in wan]
    if len(set(labels)) < len(labels):
        labels = [f"{r:g}mbit_{t:g}ms" for r, t in wan]
    cfg = parse_set(args.set, cfg)
    cells = []
    with tempfile.TemporaryDirectory(prefix="bench-wan-") as tmp:
        root = args.out or Path(tmp)
        for (rate, rtt), label in zip(wan, labels, strict=True):
            print(
                f"{w.learners} learners x {w.steps} steps, links of {rate:g} Mbit/s"
                f" with {rtt:g} ms round trip",
                flush=True,
            )
            cells.append(at_link(rate, rtt, w, cfg, args.net, root / label))
            c = cells[-1]
            c["label"] = label
            print(
                f"  wan_speedup {shown(c, 'wan_speedup', '.2f')}"
                + (
                    " (lower bound: data parallel never reached it)"
                    if c["dp_reached"] is False
                    else ""
                ),
                flush=True,
            )
    rows = []
    for c in cells:
        for kind in ("dp", "decoupled"):
            r = c[kind]
            if r is None:
                continue
            rows.append(
                {
                    "run": r["name"],
                    "eval_loss": r["eval_loss"],
                    "wall_s": r["wall_s"],
                    "steps_per_s": r["steps_per_s"],
                    "bytes_per_step": r.get("steady_bytes_per_step") or r.get("bytes_per_step"),
                    "dp_time_to_its_loss_s": c["dp_time_to_decoupled_loss_s"]
                    if kind == "decoupled"
                    else "",
                    "wan_speedup": c["wan_speedup"] if kind == "decoupled" else "",
                }
            )
    print()
    print(
        table(
            rows,
            [
                "run",
                "eval_loss",
                "wall_s",
                "steps_per_s",
                "bytes_per_step",
                "dp_time_to_its_loss_s",
                "wan_speedup",
            ],
        )
    )
    for c in cells:
        json_path = (
            args.json.with_name(f"{args.json.stem}-{c['label']}.json") if args.json else None
        )
        loss_curves(
            [r for r in (c["dp"], c["decoupled"]) if r is not None],
            png_path(json_path, ""),
            f"{w.learners} learners over {c['rate_mbit']:g} Mbit/s, {c['rtt_ms']:g} ms links",
            w.batch_size * w.context,
        )
        for kind in ("dp", "decoupled"):
            if c[kind] is not None:
                c[kind].pop("results", None)
    head = cells[0]
    missing = head["missing"] | {
        f"wan_speedup_{c['label']}": c["missing"]["wan_speedup"] for c in cells if c["missing"]
    }
    result: dict[str, Any] = {
        "wan_speedup": head["wan_speedup"],
        "wan_rate_mbit": head["rate_mbit"],
        "wan_rtt_ms": head["rtt_ms"],
        "wan_lower_bound": None if head["dp_reached"] is None else not head["dp_reached"],
        "wan_dp_shaped": head["dp_shaped"],
        **{f"wan_speedup_{c['label']}": c["wan_speedup"] for c in cells},
        "missing": missing,
        **mode,
        "links_measured": {c["label"]: c["links_measured"] for c in cells},
        "steps": w.steps,
        "learners": w.learners,
        "compute": f"{w.learners} learner processes, 1 torch thread each, on "
        f"{os.cpu_count()} cores, shared with the Synchronizer, the evaluator and the link proxies",
        "decoupled": dataclasses.asdict(cfg),
        "cells": cells,
        "machine": machine(),
    }
    print(
        f"\nwan_speedup at {head['rate_mbit']:g} Mbit/s, {head['rtt_ms']:g} ms round trip"
        f" = {shown(result, 'wan_speedup')}"
        + (" (lower bound)" if result["wan_lower_bound"] else "")
    )
    say_mode(mode)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    program(main)
