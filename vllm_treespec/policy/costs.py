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
        if a < 0:
            # Nothing costs less than nothing at x = 0: a steep line through a
            # narrow range of x (drafting seen at batches 7 and 8) extrapolated
            # to zero below it, and drafting at batch 3 was priced free (issue
            # 83's adaptive test, recorded). Through the origin instead.
            return 0.0, max(sxy / sxx, 0.0)
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
    work. In a batch-1 CPU engine (``bench/budget_trace.py``,
    its report's ``step_costs``) chain steps took
    the sweep's time plus a few milliseconds of their own work; read as a factor,
    that overprices every verified token, and more so at concurrency, where steps
    verify dozens of tokens (benchmarks/history/RESULTS-history.md, "The 2.56
    head, and a step-cost table that follows live steps by a shift (2026-11-28,
    AVX-512 machine): `eagle3_tree` level with the best stock chain at batch 1,
    1.03x plain at 16 requests").

    The table never prices more tokens below fewer. After the sweep
    (``finish_sweep``), each segment keeps at least the rise the sweep timed
    across it: the sweep times clean forwards (best of several), and a live step
    over more tokens does that work and more. So a live step that moves its
    knots carries the knots on the side it moved toward along (one dearer than
    the table raises those above it; one cheaper lowers those below). Without
    that, per-step work that every step pays, plain or not, piled onto the knot
    where live steps land: while speculation is off every step lands on the
    plain step's knot (N = batch), and after 500 steps 6 ms above a sweep of
    8 -> 30.0 ms, 12 -> 30.5, 16 -> 31.0 the table priced 12 tokens 0.4 ms
    below 8, so drafting looked free (issue 83).
    """

    def __init__(self, rate: float = 0.02, shift_rate: float = 0.1):
        self.rate = rate
        self.shift_rate = shift_rate
        self.n: list[float] = []
        self.t: list[float] = []
        # The sweep's knots (``finish_sweep``), and for each segment of the
        # table the least rise it may have: the sweep's rise across it.
        self._sweep: tuple[list[float], list[float]] | None = None
        self._rise: list[float] = []

    def set_knot(self, n: float, seconds: float) -> None:
        if n in self.n:
            self.t[self.n.index(n)] = seconds
            return
        i = bisect.bisect(self.n, n)
        self.n.insert(i, float(n))
        self.t.insert(i, seconds)
        self._rise = [self._sweep_rise(a, b) for a, b in zip(self.n, self.n[1:])]

    def add(self, n: float, seconds: float) -> None:
        if not self.n or n < self.n[0] or n > self.n[-1]:
            below = bool(self.n) and n < self.n[0]
            self.set_knot(n, seconds)
            # The new end knot was measured: the knots beside it follow.
            self._keep_order(self.n.index(n), dearer=below)
            return
        shift = self.shift_rate * self._bounded_error(n, seconds)
        self.t = [max(t + shift, 1e-6) for t in self.t]
        i = min(bisect.bisect_right(self.n, n), len(self.n) - 1)
        lo = max(i - 1, 0)
        w = 0.0 if self.n[i] == self.n[lo] else (n - self.n[lo]) / (self.n[i] - self.n[lo])
        err = self._bounded_error(n, seconds)
        self.t[lo] += self.rate * (1 - w) * err
        self.t[i] += self.rate * w * err
        self._keep_order(lo if err > 0 else i, dearer=err > 0)

    def finish_sweep(self) -> None:
        """The startup sweep is in: lower knots timed in a stall
        (``nondecreasing``), and keep each segment's rise as its least from now on."""
        self.nondecreasing()
        self._sweep = (list(self.n), list(self.t))
        self._rise = [self._sweep_rise(a, b) for a, b in zip(self.n, self.n[1:])]

    def _sweep_rise(self, a: float, b: float) -> float:
        """What the sweep timed between N = a and N = b (a < b); 0 before it is
        in and beyond its knots."""
        if self._sweep is None:
            return 0.0
        ns, ts = self._sweep
        return max(float(np.interp(b, ns, ts) - np.interp(a, ns, ts)), 0.0)

    def _keep_order(self, k: int, dearer: bool) -> None:
        """Restore every segment's least rise around knot ``k``, which live steps
        just moved: a dearer knot raises the knots above it, a cheaper one
        lowers those below (never under a microsecond)."""
        t, rise = self.t, self._rise
        if dearer:
            for j in range(k + 1, len(t)):
                t[j] = max(t[j], t[j - 1] + rise[j - 1])
        else:
            for j in range(k - 1, -1, -1):
                t[j] = max(min(t[j], t[j + 1] - rise[j]), 1e-6)

    def _bounded_error(self, n: float, seconds: float) -> float:
        """``seconds`` minus the table's value at n, within -1/2 and +1 times that
        value: one stalled step (a pause, a page fault storm) must not swing the table."""
        predicted = self(n)
        return min(max(seconds - predicted, -0.5 * predicted), predicted)

    def nondecreasing(self) -> None:
        """Lower every knot to the cheapest at or above its N: a forward over more
        tokens never costs less, so a knot above a later one was timed in a stall
        (a CPU startup sweep once timed 1 token above 4; benchmarks/history/
        RESULTS-history.md, "The 2.56 head, and a step-cost table that follows
        live steps by a shift (2026-11-28, AVX-512 machine): `eagle3_tree` level
        with the best stock chain at batch 1, 1.03x plain at 16 requests")."""
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
