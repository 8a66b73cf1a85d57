"""Outer optimizers: how a merged pseudo-gradient moves one fragment's global parameters.

Each optimizer owns the state of one fragment (flat FP32 tensors of the fragment's length) and
updates the fragment's flat FP32 parameters in place. Sign convention: the pseudo-gradient is
g = base - local, so a positive g moves parameters down, and plain SGD with lr 1 applied to the
mean of the learners' g gives plain parameter averaging. No locking here: the caller holds the
fragment's lock around `step`, `state_dict` and `load_state_dict`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch

from synchronizer import shares

OUTER_KINDS = ("nesterov", "delayed_nesterov", "sgd")
# Elements per run of a fused outer step: every array a run touches (parameters, state, the
# merged delta, scratch) stays in cache between the run's operations, so memory is read and
# written about once per step whatever the number of operations (256K FP32 = 1 MiB per array).
RUN_ELEMS = 1 << 18
# torch's fused SGD kernel (`torch.optim.SGD(fused=True)`: CPU since torch 2.4, and CUDA), or
# None where this torch has none: the outer step then runs the same operations one by one.
FUSED_SGD = getattr(torch, "_fused_sgd_", None)
FUSED_DEVICES = ("cpu", "cuda")


def runs(numel: int, run: int = RUN_ELEMS) -> Iterator[tuple[int, int]]:
    """Consecutive (start, stop) ranges of at most `run` elements tiling [0, numel)."""
    for start in range(0, numel, run):
        yield start, min(start + run, numel)


class OuterStep(ABC):
    """One outer step under way: the optimizer's counters have advanced; `direction` advances
    its per-element state over one range and returns that range's direction d, and the step
    moves parameters by `factor * d`. Ranges may come in any order, each exactly once."""

    factor: float

    @abstractmethod
    def direction(
        self, start: int, stop: int, grad: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """d over [start, stop) of the pseudo-gradient `grad` (that range, FP32), written into
        `out` (may be `grad` itself) and returned; `grad` is only read unless it is `out`."""

    def add_to(
        self,
        start: int,
        stop: int,
        grad: torch.Tensor,
        target: torch.Tensor,
        scratch: torch.Tensor,
    ) -> None:
        """target += factor * d over [start, stop) (`target`: that range of the parameters, or
        of an update being built), through `scratch` (run-sized FP32) where the step is not
        one fused kernel. The same numbers as `direction` and then an add."""
        d = self.direction(start, stop, grad, scratch[: stop - start])
        target.add_(d, alpha=self.factor)

    def native_form(self) -> tuple[torch.Tensor | None, float, float] | None:
        """(momentum buffer, its decay, its look-ahead) where the native update chain computes
        this step (`native.chain_int8`: Nesterov; (None, 0.0, 0.0) for a plain step), else
        None."""
        return None


class Plain(OuterStep):
    """d = g: a step of `factor * g` with no state (SGD; or a caller's own update)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def direction(
        self, start: int, stop: int, grad: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        return grad if out is grad else out.copy_(grad)

    def native_form(self) -> tuple[torch.Tensor | None, float, float] | None:
        return None, 0.0, 0.0


def _check_range(name: str, value: float, low: float, high: float, high_open: bool) -> float:
    value = float(value)
    ok = math.isfinite(value) and low <= value and (value < high if high_open else value <= high)
    if not ok:
        bracket = ")" if high_open else "]"
        raise ValueError(f"{name} must be in [{low}, {high}{bracket}, got {value}")
    return value


def _check_lr(lr: float) -> float:
    lr = float(lr)
    if not (math.isfinite(lr) and lr > 0.0):
        raise ValueError(f"lr must be a finite number > 0, got {lr}")
    return lr


def _check_warm(warm: float) -> float:
    warm = float(warm)
    if not 0.0 < warm <= 1.0:
        raise ValueError(f"warm must be in (0, 1], got {warm}")
    return warm


def warm_up(version: int, rounds: int) -> float:
    """The learning rate of the outer step that makes `version + 1`, over the full one, when
    it rises linearly over a fragment's first `rounds` outer steps (`--outer-warmup`): 1/rounds
    for the first, 1 from step `rounds` on; 1 with no warm-up (`rounds` 0). A function of the
    version alone, so a replay of the log steps by the same rates."""
    if rounds <= 0 or version + 1 >= rounds:
        return 1.0
    return (version + 1) / rounds


def _check_count(name: str, value: int, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


class OuterOptimizer(ABC):
    """One fragment's outer optimizer.

    `step(params, grad)` updates `params` in place and may use `grad` as scratch space (it may
    be overwritten): callers pass a buffer they do not need afterwards. Both are flat, FP32 and
    of length `numel`. The caller validates finiteness before calling.

    `state_dict()` returns everything needed to resume bit-for-bit, as tensors (counters as 0-d
    int64 tensors) so it can be written with safetensors. The float buffers are the live state,
    not copies: clone them under the fragment's lock if the snapshot must outlive it.
    `load_state_dict()` copies into the existing buffers (keeping their device) and raises
    ValueError on a missing or unexpected key, or a wrong shape or dtype.
    """

    # Whether its steps have a `native_form`: known before `begin`, which may advance counters.
    native = False

    def __init__(self, numel: int, lr: float, device: torch.device | str) -> None:
        self.numel = _check_count("numel", numel, 1)
        self.lr = _check_lr(lr)
        self.device = torch.device(device)

    def step(
        self, params: torch.Tensor, grad: torch.Tensor, share: float = 1.0, warm: float = 1.0
    ) -> None:
        """params <- params + factor * direction, run by run (`runs`, `OuterStep.add_to`: one
        fused kernel where torch has one); `grad` is only read. `share`, `warm`: as for
        `begin`."""
        if params.dtype != torch.float32:
            raise TypeError(f"params must be float32, got {params.dtype}")
        if params.shape != (self.numel,):
            raise ValueError(
                f"params must be flat with {self.numel} elements, got {tuple(params.shape)}"
            )
        self._check_grad(grad)  # before begin() changes any state
        step = self.begin(share, warm)
        scratch = torch.empty(min(RUN_ELEMS, self.numel), device=params.device)
        for start, stop in runs(self.numel):
            step.add_to(start, stop, grad[start:stop], params[start:stop], scratch)

    @abstractmethod
    def begin(self, share: float = 1.0, warm: float = 1.0) -> OuterStep:
        """Advance the optimizer's counters by one pseudo-gradient; the returned step advances
        the per-element state range by range (`OuterStep.direction`), so a caller can fuse the
        update with its own passes (the update chain quantizes f * d with its residual).
        `share` in (0, 1]: the part of a whole outer step the round stands for
        (`synchronizer.shares`), its pseudo-gradient already scaled by it; Nesterov's momentum
        then decays and looks ahead by that part too, the other optimizers take it as it is.
        `warm` in (0, 1]: this step's learning rate over `lr` (`warm_up`); the state advances
        as it would at any learning rate."""

    @abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=torch.float32, device=self.device)

    def _check_grad(self, grad: torch.Tensor) -> None:
        if grad.dtype != torch.float32:
            raise TypeError(f"grad must be float32, got {grad.dtype}")
        if grad.shape != (self.numel,):
            raise ValueError(
                f"grad must be flat with {self.numel} elements, got {tuple(grad.shape)}"
            )

    @staticmethod
    def _load_into(state: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> None:
        """Check `state` against `targets` (same keys, shapes, dtypes), then copy it in."""
        missing, unexpected = targets.keys() - state.keys(), state.keys() - targets.keys()
        if missing or unexpected:
            raise ValueError(
                f"outer optimizer state has missing keys {sorted(missing)} and unexpected keys "
                f"{sorted(unexpected)}; was it saved by a different outer optimizer kind?"
            )
        for key, target in targets.items():
            src = state[key]
            if src.shape != target.shape or src.dtype != target.dtype:
                raise ValueError(
                    f"outer optimizer state {key!r} is {src.dtype}{tuple(src.shape)}, "
                    f"expected {target.dtype}{tuple(target.shape)}"
                )
        for key, target in targets.items():
            target.copy_(state[key])


class SGD(OuterOptimizer):
    """Plain outer SGD: params -= lr * g. No state."""

    native = True

    def begin(self, share: float = 1.0, warm: float = 1.0) -> OuterStep:
        return Plain(-self.lr * _check_warm(warm))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._load_into(state, {})


class Nesterov(OuterOptimizer):
    """Outer SGD with Nesterov momentum, as in DiLoCo (lr 0.7, momentum 0.9).

        buf    <- mu * buf + g
        params <- params - lr * (g + mu * buf)

    The same operations, in the same order, as torch.optim.SGD(lr, momentum=mu, nesterov=True)
    with dampening 0 and no weight decay, so the two agree bit-for-bit on CPU. A partial step of
    share s (g already scaled by s) decays by mu**s and looks ahead by s * mu:

        buf    <- mu**s * buf + g
        params <- params - lr * (g + s * mu * buf)

    so that k rounds of share 1/k move the parameters and the momentum about as one whole step
    of their mean does (a whole step is s = 1: the update above).
    """

    native = True

    def __init__(
        self, numel: int, lr: float = 0.7, momentum: float = 0.9, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(numel, lr, device)
        self.momentum = _check_range("momentum", momentum, 0.0, 1.0, high_open=True)
        self.momentum_buffer = self._zeros()

    def begin(self, share: float = 1.0, warm: float = 1.0) -> OuterStep:
        return _NesterovStep(self, share, _check_warm(warm))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"momentum_buffer": self.momentum_buffer}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._load_into(state, {"momentum_buffer": self.momentum_buffer})


class _NesterovStep(OuterStep):
    def __init__(self, opt: Nesterov, share: float, warm: float) -> None:
        # lr * 1.0 is lr exactly: out of warm-up the numbers are torch's SGD's
        self.opt, self.lr, self.whole = opt, opt.lr * warm, shares.checked(share) == 1.0
        self.factor = -self.lr
        # mu**1.0 and 1.0 * mu are mu exactly: a whole step's numbers are unchanged
        self.decay, self.look = opt.momentum**share, share * opt.momentum

    def add_to(
        self,
        start: int,
        stop: int,
        grad: torch.Tensor,
        target: torch.Tensor,
        scratch: torch.Tensor,
    ) -> None:
        """torch's fused SGD kernel (one vectorised pass: momentum, the Nesterov direction and
        the add, as `torch.optim.SGD(fused=True)` runs it), where this torch has one for the
        device; the same numbers as the separate operations (tests/test_outer.py)."""
        if FUSED_SGD is None or target.device.type not in FUSED_DEVICES or not self.whole:
            super().add_to(start, stop, grad, target, scratch)
            return
        FUSED_SGD(
            [target],
            [grad],
            [self.opt.momentum_buffer[start:stop]],
            weight_decay=0.0,
            momentum=self.opt.momentum,
            lr=self.lr,
            dampening=0.0,
            nesterov=True,
            maximize=False,
            is_first_step=False,
        )

    def native_form(self) -> tuple[torch.Tensor | None, float, float] | None:
        return self.opt.momentum_buffer, self.decay, self.look

    def direction(
        self, start: int, stop: int, grad: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        buf = self.opt.momentum_buffer[start:stop]
        buf.mul_(self.decay).add_(grad)
        return torch.add(grad, buf, alpha=self.look, out=out)


class DelayedNesterov(OuterOptimizer):
    """Delayed Nesterov (DN): Algorithm 3 of Liu et al., "Asynchronous Local-SGD Training for
    Language Modeling" (arXiv 2401.09135).

    With outer lr eta, momentum decay beta, buffer size (delay) N >= 1, momentum activation
    c in [0, 1/N] (default c = 0), state m_0 = 0, Delta = 0, t = 0, each arriving
    pseudo-gradient g_t does (as in the paper, and in the DelayedNesterovOptimizer of the HALoS
    authors' code, utnslab/halos src/halos/opt.py, which implements the same algorithm):

        Delta <- Delta + g_t
        if (t + 1) % N == 0:                          # every N-th arrival
            m_{t+1}   = beta * m_t + Delta / N        # momentum from the mean of the last N
            theta_{t+1} = theta_t - eta * ((1 - c*N + c) * beta * m_{t+1} + g_t / N)
            Delta <- 0
        else:                                         # in between: no momentum update
            m_{t+1}   = m_t
            theta_{t+1} = theta_t - eta * (c * beta * m_{t+1} + g_t / N)
        t <- t + 1

    With c = 0 the in-between steps are plain gradient steps of size eta/N, and over one period
    of N arrivals the parameters move by exactly eta * (mean(g) + beta * m_new): one Nesterov
    step on the period's mean pseudo-gradient, with each g applied as soon as it arrives. With
    N = 1 (any c) it is the `Nesterov` update, bit for bit (prefer `Nesterov` there: it needs no
    Delta buffer). Here one "arrival" is one call to `step`, i.e. one merged round.
    """

    def __init__(
        self,
        numel: int,
        lr: float = 0.7,
        momentum: float = 0.9,
        delay: int = 4,
        momentum_activation: float = 0.0,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(numel, lr, device)
        self.momentum = _check_range("momentum", momentum, 0.0, 1.0, high_open=True)
        self.delay = _check_count("delay", delay, 1)
        self.momentum_activation = _check_range(
            "momentum_activation", momentum_activation, 0.0, 1.0 / self.delay, high_open=False
        )
        self.momentum_buffer = self._zeros()  # m
        self.grad_buffer = self._zeros()  # Delta: sum of the g since the last m update
        self.steps = 0  # t: arrivals so far

    def begin(self, share: float = 1.0, warm: float = 1.0) -> OuterStep:
        warm = _check_warm(warm)
        self.steps += 1
        return _DelayedStep(self, self.steps % self.delay == 0, warm)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "momentum_buffer": self.momentum_buffer,
            "grad_buffer": self.grad_buffer,
            "steps": torch.tensor(self.steps, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        steps = torch.zeros((), dtype=torch.int64)
        self._load_into(
            state,
            {
                "momentum_buffer": self.momentum_buffer,
                "grad_buffer": self.grad_buffer,
                "steps": steps,
            },
        )
        self.steps = int(steps)


class _DelayedStep(OuterStep):
    def __init__(self, opt: DelayedNesterov, update_momentum: bool, warm: float) -> None:
        n, beta, c = opt.delay, opt.momentum, opt.momentum_activation
        self.opt, self.update_momentum, self.factor = opt, update_momentum, -opt.lr * warm / n
        # the paper's (1 - cN + c) beta on a momentum update, c beta in between
        self.coeff = (1.0 - c * (n - 1)) * beta if update_momentum else c * beta

    def direction(
        self, start: int, stop: int, grad: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        opt, n = self.opt, self.opt.delay
        grad_buffer = opt.grad_buffer[start:stop]
        grad_buffer.add_(grad)
        if self.update_momentum:
            opt.momentum_buffer[start:stop].mul_(opt.momentum).add_(grad_buffer, alpha=1.0 / n)
            grad_buffer.zero_()
        # theta -= eta * (coeff * m + g / N), as (eta / N) * (g + N * coeff * m): with N = 1
        # these are exactly Nesterov's operations.
        if self.coeff != 0.0:
            return torch.add(grad, opt.momentum_buffer[start:stop], alpha=self.coeff * n, out=out)
        return grad if out is grad else out.copy_(grad)


def make_outer(
    kind: str,
    numel: int,
    lr: float = 0.7,
    momentum: float = 0.9,
    delay: int = 4,
    device: torch.device | str = "cpu",
    momentum_activation: float = 0.0,
) -> OuterOptimizer:
    """Build the outer optimizer `kind` (one of OUTER_KINDS) for a fragment of `numel` elements.

    All arguments are validated whatever the kind (ValueError naming the argument and its allowed
    range), so a bad setting is caught at start-up even if the chosen kind ignores it.
    """
    if kind not in OUTER_KINDS:
        raise ValueError(f"kind must be one of {OUTER_KINDS}, got {kind!r}")
    _check_range("momentum", momentum, 0.0, 1.0, high_open=True)
    _check_count("delay", delay, 1)
    _check_range("momentum_activation", momentum_activation, 0.0, 1.0 / delay, high_open=False)
    if kind == "nesterov":
        return Nesterov(numel, lr, momentum, device)
    if kind == "delayed_nesterov":
        return DelayedNesterov(numel, lr, momentum, delay, momentum_activation, device)
    return SGD(numel, lr, device)
