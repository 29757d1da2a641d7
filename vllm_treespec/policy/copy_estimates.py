"""Acceptance estimates of copy branches (``tree.copy_drafts``), learned live.

A copy branch's j-th token is accepted only if the j - 1 before it were, so the
estimate is kept as conditionals: c[n][j] = P(token j accepted | tokens < j
accepted) for a branch whose history matched on n tokens (a longer match is a
surer copy). A branch kept to K tokens that the target accepted L of gives a
trial at each j <= min(L + 1, K), a success where j <= L. The estimate of the
j-th node is the product of the conditionals up to j (never above its parent's,
so a branch's best nodes are a prefix of it, as the selection needs).

Nothing here sees the drafter: EAGLE nodes keep their own calibration
(``estimates``), and a node both sources proposed is priced by the higher.

Copies from other requests are learned per tenant (``TenantAcceptance``): how
often one tenant's copies were accepted never enters another's estimates. Whether a
request looks them up at all is ``LookupGate``'s call. Pure numpy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import numpy as np


class CopyAcceptance:
    # Before any trial a conditional is this (worth PRIOR_TRIALS trials): high
    # enough that a fresh engine tries its copies, which is how it learns them.
    PRIOR = 0.5
    PRIOR_TRIALS = 4.0
    RATE = 0.05  # EWMA weight of one trial: the estimate spans ~20 branches
    # While copies are found but not verified (priced out), their conditionals
    # drift back towards the prior by this much a step, so that text that turns
    # repetitive again is tried again rather than priced out for good.
    FORGET = 0.002

    def __init__(self, max_match: int, max_length: int):
        self.max_match, self.L = max_match, max_length
        self.cond = np.full((max_match + 1, max_length), self.PRIOR)
        self._weight = np.full((max_match + 1, max_length), self.PRIOR_TRIALS)

    def estimates(self, match: int, length: int) -> np.ndarray:
        """[length] acceptance estimate of each of a branch's first nodes."""
        row = self.cond[min(match, self.max_match), :min(length, self.L)]
        return np.cumprod(row)

    def observe(self, match: int, kept: int, accepted: int) -> None:
        """A branch of ``match`` kept to ``kept`` tokens; ``accepted`` of them were."""
        n = min(match, self.max_match)
        for j in range(min(accepted + 1, kept, self.L)):
            # A rate that starts at 1 / trials: the first trials move a prior of
            # a few trials' weight, later ones an EWMA.
            self._weight[n, j] += 1.0
            rate = max(1.0 / self._weight[n, j], self.RATE)
            self.cond[n, j] += rate * (float(j < accepted) - self.cond[n, j])

    def forget(self) -> None:
        """A step that found copies and verified none of them."""
        self.cond += self.FORGET * (self.PRIOR - self.cond)


class TenantAcceptance:
    """One ``CopyAcceptance`` per tenant, for copies from other requests: a
    tenant whose requests repeat each other makes no other tenant's copies look
    surer. At most ``MAX_TENANTS`` are kept,
    the least recently used out; a tenant seen again starts from the prior."""
    MAX_TENANTS = 4096  # two [5, copy_length] float arrays each: a few MB in all

    def __init__(self, max_match: int, max_length: int):
        self._shape = (max_match, max_length)
        self._of: OrderedDict[Hashable, CopyAcceptance] = OrderedDict()

    def of(self, tenant: Hashable) -> CopyAcceptance:
        est = self._of.get(tenant)
        if est is None:
            est = self._of[tenant] = CopyAcceptance(*self._shape)
            if len(self._of) > self.MAX_TENANTS:
                self._of.popitem(last=False)
        else:
            self._of.move_to_end(tenant)
        return est


class LookupGate:
    """When one request looks up copies from other requests: every drafting
    step while they pay, ever more rarely while they do not.

    After ``PATIENCE`` lookups in a row with no accepted token that only their
    copies proposed (a copy of what the drafter proposed anyway adds nothing),
    the gap to the next lookup doubles with each dry one, up to ``MAX_GAP``
    steps; such a token closes the gap again. A copy from another request runs
    until the two texts part, and they seldom meet again, while every lookup
    costs host time and every copy it grafts costs verified nodes (side by
    side, with and without the gate: benchmarks/RESULTS.md, "Copies from other
    requests"). Text that turns repetitive later is found within ``MAX_GAP``
    steps."""
    PATIENCE = 16
    MAX_GAP = 16

    def __init__(self):
        self.dry = 0      # lookups since one of theirs was accepted
        self.gap = 1      # drafting steps from one lookup to the next
        self._wait = 0    # steps still to skip

    def open(self) -> bool:
        """Whether this drafting step looks up (call once a step)."""
        if self._wait:
            self._wait -= 1
            return False
        return True

    def looked(self) -> None:
        self.dry += 1
        if self.dry >= self.PATIENCE:
            self.gap = min(2 * self.gap, self.MAX_GAP)
            self._wait = self.gap - 1

    def accepted(self) -> None:
        self.dry, self.gap, self._wait = 0, 1, 0
