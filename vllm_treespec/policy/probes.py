"""When the adaptive budget explores: the probe schedule.

A probe drafts one level deeper than the plan (from "off": a chain of one) and
verifies each request's chain to that depth even when the estimates say no, so
the statistics of the next depth stay current and wrong estimates can recover.
While speculating, probes come every ``every`` steps. While off, each probe
that leaves speculation off doubles the gap to the next one (up to
``MAX_GAP`` x ``every``), so a drafter that does not pay on this device costs
ever fewer probes and still gets re-examined; and a probe never comes sooner
after the last one than the caller's cost floor allows (the budget prices a
probe at the batch size at hand, see ``AdaptiveBudget.probe_cost_gap``).

Pure Python; counts steps, knows nothing of costs.
"""

from __future__ import annotations

from collections.abc import Callable


class ProbeSchedule:
    MAX_GAP = 8  # while off, probes back off to one per 8 x every steps

    def __init__(self, every: int):
        self.every = every  # 0: never probe
        self.gap: int | None = None    # steps from one probe to the next (set at first use)
        self._next: int | None = None  # the step of the next probe
        self._last = 0                 # the step of the last probe

    def due(self, step: int, speculating: bool, off_floor: Callable[[], int]) -> bool:
        """Whether step ``step`` (counted from 1) probes. ``speculating``: the
        plan drafts; ``off_floor()``: the fewest steps between probes while off
        (called only when a probe would be due while off)."""
        if not self.every:
            return False
        if self._next is None:
            self.gap = self._next = self.every
        if speculating:  # speculating (again): the gap of the on state
            self.gap = self.every
            self._next = min(self._next, step + self.every)
        if step < self._next:
            return False
        if not speculating:
            floor = self._last + off_floor()
            if step < floor:
                self._next = floor
                return False
        self.gap = self.every if speculating else min(2 * self.gap, self.MAX_GAP * self.every)
        self._next = step + self.gap
        self._last = step
        return True
