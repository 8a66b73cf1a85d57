"""Effective goodput: what the merged work bought, measured against a reference run.

An evaluator (a learner that joined with `evaluator` set and never pushes) evaluates the served
model on a held-out set and reports its eval loss (`ReportEval`). With a reference curve
(`reference_curve`: the eval loss a reference run, e.g. synchronous DiLoCo of the same model,
reached after each number of training tokens), the effective goodput is

    reference tokens needed to reach the reported eval loss / training tokens consumed so far

where the tokens consumed are every training learner's cumulative reported tokens (merged,
discarded, lost or in flight alike) when the report arrives. 1 means the run bought as much
model per token as the reference; above 1, more. The reference tokens come from the curve's
running minimum (a noisy curve never "needs" more tokens for a higher loss), interpolated
linearly between points; a loss above the curve's first point needs its first tokens, and a
loss below its best needs its last tokens: the ratio is then a lower bound, which
`diloco_eval_below_reference` says. Without a curve, or before any report, the ratios are
absent (no series), never 0.

`ReferenceCurve.load` reads the curve from JSON (`[[tokens, eval_loss], ...]`, or objects with
those keys, or `{"points": ...}`) or CSV (a `tokens,eval_loss` header, then rows), and refuses a
bad file with one `ValueError` line that names it and what is wrong.
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protos import diloco_pb2 as pb
from synchronizer.errors import Code, Rejected, invalid
from synchronizer.metrics import Metrics

logger = logging.getLogger(__name__)

MAX_CURVE_POINTS = 100_000
MAX_EVAL_SETS = 8  # distinct held-out set names with series of their own
MAX_EVAL_SET_CHARS = 64
DEFAULT_EVAL_SET = "default"


def _number(value: Any, what: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} is not a number: {value!r}") from None
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{what} must be finite and non-negative, got {value!r}")
    return x


def _points(path: Path, text: str) -> list[tuple[Any, Any]]:
    """The raw (tokens, eval_loss) pairs of a JSON or CSV curve file."""
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON ({e.msg} at line {e.lineno})") from None
        if isinstance(data, dict):
            data = data.get("points")
        if not isinstance(data, list):
            raise ValueError('expected a list of [tokens, eval_loss] pairs (or {"points": [...]})')
        out = []
        for i, p in enumerate(data):
            if isinstance(p, dict) and "tokens" in p and "eval_loss" in p:
                out.append((p["tokens"], p["eval_loss"]))
            elif isinstance(p, list | tuple) and len(p) == 2:
                out.append((p[0], p[1]))
            else:
                raise ValueError(f"point {i} is neither [tokens, eval_loss] nor an object of both")
        return out
    rows = [r for r in csv.reader(io.StringIO(text)) if r and any(c.strip() for c in r)]
    if not rows or [c.strip() for c in rows[0]] != ["tokens", "eval_loss"]:
        raise ValueError("a CSV curve starts with the header 'tokens,eval_loss'")
    for i, r in enumerate(rows[1:], start=2):
        if len(r) != 2:
            raise ValueError(f"line {i} has {len(r)} columns; expected tokens,eval_loss")
    return [(r[0].strip(), r[1].strip()) for r in rows[1:]]


@dataclass(frozen=True)
class ReferenceCurve:
    """Training tokens of a reference run and the eval loss it had reached by then."""

    tokens: tuple[float, ...]
    best: tuple[float, ...]  # running minimum of the eval loss: non-increasing

    @classmethod
    def from_points(cls, points: Sequence[Sequence[Any]]) -> ReferenceCurve:
        if len(points) < 2:
            raise ValueError(f"needs at least 2 points, has {len(points)}")
        if len(points) > MAX_CURVE_POINTS:
            raise ValueError(f"has {len(points)} points; at most {MAX_CURVE_POINTS}")
        tokens: list[float] = []
        best: list[float] = []
        for i, (t, loss) in enumerate(points):
            t_i = _number(t, f"tokens of point {i}")
            loss_i = _number(loss, f"eval_loss of point {i}")
            if tokens and t_i <= tokens[-1]:
                raise ValueError(
                    f"tokens must increase from point to point: point {i} has {t_i:g} after {tokens[-1]:g}"
                )
            tokens.append(t_i)
            best.append(min(loss_i, best[-1]) if best else loss_i)
        return cls(tuple(tokens), tuple(best))

    @classmethod
    def load(cls, path: Path) -> ReferenceCurve:
        """The curve in `path`; ValueError (one line, naming the file) when it is unreadable
        or malformed."""
        try:
            return cls.from_points(_points(path, path.read_text()))
        except OSError as e:
            raise ValueError(f"reference_curve {path}: cannot read it: {e.strerror}") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"reference_curve {path}: {e}") from None

    def tokens_to_reach(self, loss: float) -> tuple[float, bool]:
        """(tokens the reference needed to reach `loss`, whether `loss` is below its best: then
        its last tokens, a lower bound)."""
        if loss < self.best[-1]:
            return self.tokens[-1], True
        # first point whose best is at or below `loss` (best is non-increasing)
        neg = [-b for b in self.best]
        i = bisect.bisect_left(neg, -loss)
        if i == 0:
            return self.tokens[0], False
        hi, lo = self.best[i - 1], self.best[i]
        share = (hi - loss) / (hi - lo) if hi > lo else 1.0
        return self.tokens[i - 1] + share * (self.tokens[i] - self.tokens[i - 1]), False


@dataclass
class EvalResult:
    eval_loss: float
    eval_set: str
    consumed_tokens: float
    reference_tokens: float | None = None
    below_curve: bool = False

    @property
    def effective_goodput(self) -> float | None:
        if self.reference_tokens is None or self.consumed_tokens <= 0:
            return None
        return self.reference_tokens / self.consumed_tokens


class Evaluations:
    """The last eval report of each held-out set and the effective goodput it gives."""

    def __init__(
        self,
        metrics: Metrics,
        curve: ReferenceCurve | None,
        consumed_tokens: Callable[[], float],
    ) -> None:
        self.metrics = metrics
        self.curve = curve
        self.consumed_tokens = consumed_tokens
        self.lock = threading.Lock()
        self.last: dict[str, EvalResult] = {}

    def check(self, request: pb.EvalReport, served: dict[int, int]) -> str:
        """Refuses a report that is not finite and non-negative, or that names a fragment the
        server does not serve or a version ahead of it; returns the eval set's name."""
        loss = request.eval_loss
        if not math.isfinite(loss) or loss < 0:
            raise invalid("bad_eval_loss", f"eval_loss must be finite and non-negative, got {loss}")
        name = request.eval_set or DEFAULT_EVAL_SET
        if len(name) > MAX_EVAL_SET_CHARS:
            raise invalid(
                "bad_eval_set",
                f"eval_set is {len(name)} characters; at most {MAX_EVAL_SET_CHARS}",
            )
        for v in request.versions:
            if v.fragment_id not in served:
                raise invalid(
                    "bad_fragment",
                    f"fragment {v.fragment_id} is not one this Synchronizer serves ({sorted(served)})",
                )
            if v.version > served[v.fragment_id]:
                raise Rejected(
                    Code.FAILED_PRECONDITION,
                    "future_version",
                    f"fragment {v.fragment_id} version {v.version} is ahead of the server's {served[v.fragment_id]}; re-pull the fragment and evaluate that",
                )
        with self.lock:
            if name not in self.last and len(self.last) >= MAX_EVAL_SETS:
                raise Rejected(
                    Code.RESOURCE_EXHAUSTED,
                    "too_many_eval_sets",
                    f"this Synchronizer already keeps {MAX_EVAL_SETS} eval sets ({sorted(self.last)}); report under one of them",
                )
        return name

    def report(self, eval_set: str, eval_loss: float) -> EvalResult:
        """Records a checked report and updates its series."""
        result = EvalResult(eval_loss, eval_set, self.consumed_tokens())
        if self.curve is not None:
            result.reference_tokens, result.below_curve = self.curve.tokens_to_reach(eval_loss)
        with self.lock:
            self.last[eval_set] = result
        m = self.metrics
        m.eval_loss.labels(eval_set).set(eval_loss)
        m.eval_consumed_tokens.labels(eval_set).set(result.consumed_tokens)
        if result.reference_tokens is not None:
            m.reference_tokens.labels(eval_set).set(result.reference_tokens)
            m.eval_below_reference.labels(eval_set).set(int(result.below_curve))
        ratio = result.effective_goodput
        if ratio is not None:
            m.effective_goodput.labels(eval_set).set(ratio)
        return result
