"""The adaptive budget's cost models: a weighted straight-line fit (drafting
costs) and a piecewise-linear step-cost table (verify steps by token count)."""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np


@dataclasses.dataclass
class LinearFit:
    """Exponentially weighted least squares for y = a + b*x."""

    decay: float = 0.97
    sums: list[float] = dataclasses.field(default_factory=lambda: [0.0] * 5)
    # The fit of ``sums``, made once per sample: the budget reads it a dozen
    # times a step (on a cache-cold CPU each read costs microseconds).
    _fit: tuple[float, float] | None = dataclasses.field(default=None, init=False,
                                                         repr=False, compare=False)

    @staticmethod
    def _terms(x: float, y: float, w: float) -> list[float]:
        return [w, w * x, w * y, w * x * x, w * x * y]

    def add(self, x: float, y: float, weight: float = 1.0) -> None:
        self.sums = [self.decay * s + t for s, t in zip(self.sums, self._terms(x, y, weight))]
        self._fit = self._solve()

    def coefficients(self) -> tuple[float, float] | None:
        return self._fit if self._fit is not None else self._solve()

    def _solve(self) -> tuple[float, float] | None:
        sw, sx, sy, sxx, sxy = self.sums
        if sw <= 0:
            return None
        var = sxx * sw - sx * sx
        if var <= 1e-9 * max(sw, 1.0) ** 2 * max(sxx / sw, 1.0):
            # Every sample at one x (e.g. drafting levels of a fixed width at
            # batch 1): the mean is what it costs there.
            return sy / sw, 0.0
        b = (sxy * sw - sx * sy) / var
        a = (sy - b * sx) / sw
        return a, max(b, 0.0)

    def __call__(self, x: float) -> float | None:
        c = self.coefficients()
        return None if c is None else max(c[0] + c[1] * x, 1e-6)

    def values(self, x: np.ndarray) -> np.ndarray | None:
        """``self(x)`` for every element of ``x``."""
        c = self.coefficients()
        return None if c is None else np.maximum(c[0] + c[1] * np.asarray(x, np.float64), 1e-6)


class StepCostTable:
    """Step seconds as a function of verified tokens N: piecewise linear through
    measured knots, refined online.

    A straight line cannot describe a step: a few tokens cost about the same as
    one (the weights are read once either way), then cost grows with compute.
    Knots come from a timing sweep at startup. A live step is the sweep's dummy
    forward plus the step's own work (input preparation, sampling, bookkeeping),
    which hardly depends on N, so each live step first shifts the whole table a
    little toward what it took, then moves the two knots around its N (least
    mean squares); one outside the knots becomes a knot. Beyond the last knot
    the last segment is extended.

    The shift is additive, not a factor: the table's slope is the price of a
    verified token, and a factor would inflate it by the share of that per-step
    work. In one batch-1 CPU engine (``benchmarks/step_costs.py``) chain steps of
    3 to 6 tokens took 2 to 4 ms more than the sweep's 16.5 ms; read as a factor
    (1.1-1.3), that prices every verified token 10-30 % too high, and more so at
    concurrency, where steps verify dozens of tokens.
    """

    def __init__(self, rate: float = 0.02, shift_rate: float = 0.1):
        self.rate = rate
        self.shift_rate = shift_rate
        self.n: list[float] = []
        self.t: list[float] = []

    def set_knot(self, n: float, seconds: float) -> None:
        if n in self.n:
            self.t[self.n.index(n)] = seconds
            return
        i = bisect.bisect(self.n, n)
        self.n.insert(i, float(n))
        self.t.insert(i, seconds)

    def add(self, n: float, seconds: float) -> None:
        if not self.n or n < self.n[0] or n > self.n[-1]:
            self.set_knot(n, seconds)
            return
        shift = self.shift_rate * self._bounded_error(n, seconds)
        self.t = [max(t + shift, 1e-6) for t in self.t]
        i = min(bisect.bisect_right(self.n, n), len(self.n) - 1)
        lo = max(i - 1, 0)
        w = 0.0 if self.n[i] == self.n[lo] else (n - self.n[lo]) / (self.n[i] - self.n[lo])
        err = self._bounded_error(n, seconds)
        self.t[lo] += self.rate * (1 - w) * err
        self.t[i] += self.rate * w * err

    def _bounded_error(self, n: float, seconds: float) -> float:
        """``seconds`` minus the table's value at n, within -1/2 and +1 times that
        value: one stalled step (a pause, a page fault storm) must not swing the table."""
        predicted = self(n)
        return min(max(seconds - predicted, -0.5 * predicted), predicted)

    def nondecreasing(self) -> None:
        """Lower every knot to the cheapest at or above its N: a forward over more
        tokens never costs less, so a knot above a later one was timed in a stall
        (timed on the CPU at startup: 1 token 15.4 ms, 4 tokens 13.7 ms)."""
        for i in range(len(self.t) - 2, -1, -1):
            self.t[i] = min(self.t[i], self.t[i + 1])

    def costs(self, n: np.ndarray) -> np.ndarray | None:
        """Predicted seconds for each N in ``n`` (None before any knot)."""
        if not self.n:
            return None
        n = np.asarray(n, dtype=np.float64)
        out = np.interp(n, self.n, self.t)
        if len(self.n) > 1:
            slope = max((self.t[-1] - self.t[-2]) / (self.n[-1] - self.n[-2]), 0.0)
            out = np.where(n > self.n[-1], self.t[-1] + slope * (n - self.n[-1]), out)
        return np.maximum(out, 1e-6)

    def __call__(self, n: float) -> float | None:
        """``costs`` of one N, in plain Python (several calls a step; numpy's
        per-call overhead is most of the cost for one value)."""
        ns, ts = self.n, self.t
        if not ns:
            return None
        if n >= ns[-1]:
            slope = (max((ts[-1] - ts[-2]) / (ns[-1] - ns[-2]), 0.0) if len(ns) > 1 else 0.0)
            value = ts[-1] + slope * (n - ns[-1])
        elif n <= ns[0]:
            value = ts[0]
        else:
            i = bisect.bisect_right(ns, n)
            value = ts[i - 1] + (n - ns[i - 1]) / (ns[i] - ns[i - 1]) * (ts[i] - ts[i - 1])
        return max(value, 1e-6)


class CycleFit:
    """Engine cycles at one batch size, each from a verify step's start to the
    next's: the rate they commit tokens at, and the seconds one more verified
    token adds to a cycle.

    ``AdaptiveBudget.level_pays`` weighs a drafting level's expected tokens
    against its price at a rate. The right rate is the long-run one the policy
    itself achieves (stopping a level is worth it iff its tokens per second fall
    short of what cycles yield on average: Dinkelbach's criterion for a ratio of
    expectations, fixed point included), and the right price of a verified token
    is what it adds to a whole cycle, sampler, acceptance and the engine's
    per-step work around the runner included. Neither shows in the startup
    sweep: traced at batch 1 on the CPU, cycles grew by ~0.9 ms a verified token
    where the sweep's forwards grew by ~0.4 ms, and the rule priced with the
    sweep and the planned step's rate ran 3.3 levels a step where a replay of
    the same drafts found 2.7 best.

    The price is the coefficient of verified tokens in an exponentially weighted
    least-squares fit of a cycle's seconds, drafting excluded, on verified and
    committed tokens (committed ones carry the engine's per-output work, which
    grows with acceptance, not with what is verified). None until ``min_weight``
    cycles with some spread in verified tokens were seen.

    Only cycles that verified drafts count (the caller's job), and the first
    ``warmup`` are skipped: served, the first decode steps of a fresh engine ran
    several times slower than later ones, and an "off" stretch yields the plain
    rate, not the speculating one levels trade against; fitted from those, the
    rule stopped whole turns at depth 1 and the budget turned speculation off.
    """

    def __init__(self, decay: float = 0.99, min_weight: float = 32.0, warmup: int = 32):
        self.decay, self.min_weight, self.warmup = decay, min_weight, warmup
        self.xtx = np.zeros((3, 3))
        self.xty = np.zeros(3)
        self.weight = self.tokens = self.seconds = 0.0
        self._price: float | None = None
        self._solved = True

    def add(self, verified: float, committed: float, drafting_s: float, period_s: float) -> None:
        if period_s <= 0:
            return
        if self.warmup > 0:
            self.warmup -= 1
            return
        rest = max(period_s - drafting_s, 0.0)
        if self.weight >= self.min_weight:
            # One stalled cycle (a pause, a page-fault storm) must not swing the fit.
            mean = self.seconds / self.weight
            rest, period_s = min(rest, 2.0 * mean), min(period_s, 2.0 * mean)
        x = np.array([1.0, float(verified), float(committed)])
        d = self.decay
        self.xtx = d * self.xtx + np.outer(x, x)
        self.xty = d * self.xty + x * rest
        self.weight = d * self.weight + 1.0
        self.tokens = d * self.tokens + committed
        self.seconds = d * self.seconds + period_s
        self._solved = False

    def rate(self) -> float | None:
        """Committed tokens per second of the cycles seen (None before ``min_weight``)."""
        if self.weight < self.min_weight or self.seconds <= 0:
            return None
        return self.tokens / self.seconds

    def seconds_at(self, verified: np.ndarray) -> np.ndarray | None:
        """Predicted cycle seconds, drafting included, for each count of verified
        tokens: the mean cycle moved by ``token_price`` a token (None while unknown)."""
        price = self.token_price()
        if price is None or self.rate() is None:
            return None
        mean_verified = self.xtx[0, 1] / self.weight
        mean_seconds = self.seconds / self.weight
        return np.maximum(mean_seconds + price * (np.asarray(verified, np.float64)
                                                  - mean_verified), 1e-6)

    def token_price(self) -> float | None:
        """Seconds one more verified token adds to a cycle (None while unknown)."""
        if not self._solved:
            self._price, self._solved = self._solve(), True
        return self._price

    def _solve(self) -> float | None:
        w = self.weight
        if w < self.min_weight:
            return None
        mean = self.xtx[0] / w
        var_verified = self.xtx[1, 1] / w - mean[1] ** 2
        if var_verified < 0.05:  # every cycle verified as much: no slope to see
            return None
        # A small ridge on the token terms: committed tokens follow verified ones
        # closely where nearly every draft is accepted.
        ridge = np.diag([0.0, 1e-3, 1e-3]) * w
        beta = np.linalg.solve(self.xtx + ridge, self.xty)
        return max(float(beta[1]), 0.0)
