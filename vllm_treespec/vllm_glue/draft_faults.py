"""Drafting steps that raise: served around, counted, and never forever.

A drafting error costs its step the drafts (plain decoding is always correct),
not a request or the engine; ``TreeEagleProposer.propose`` asks here what to do:

* out-of-memory and device errors are raised (``device_failure``): after them
  the device's state is unknown, and nothing that runs on it can be trusted;
* one error ``PERSISTENT_STEPS`` drafting steps running is raised too: that is a
  broken drafter, and serving around it would decode plainly at speculative cost
  (every step still pays for the failing drafting) for as long as the server runs;
* any other is logged, the first time with its traceback, then at most once a
  minute (the count goes to ``/metrics`` as ``vllm_treespec:draft_faults``).
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger("vllm.treespec")

# Errors after which the device's state is unknown.
DEVICE_ERRORS = (MemoryError, torch.OutOfMemoryError) + (
    (torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ())
# Device runtimes raise some of theirs as plain RuntimeErrors, known by their text.
DEVICE_ERROR_TEXT = ("out of memory", "CUDA error", "NPU function error", "ACL error",
                     "device-side assert")


def device_failure(err: BaseException) -> bool:
    return isinstance(err, DEVICE_ERRORS) or (
        isinstance(err, RuntimeError) and any(t in str(err) for t in DEVICE_ERROR_TEXT))


class DraftFaults:
    """The drafting faults of one proposer."""

    PERSISTENT_STEPS = 50
    LOG_INTERVAL_S = 60.0

    def __init__(self) -> None:
        self.count = 0
        self._last_log = 0.0
        self._error: str | None = None  # the last step's error, while steps keep failing
        self._streak = 0

    def succeeded(self) -> None:
        self._error, self._streak = None, 0

    def failed(self, err: Exception) -> None:
        """A drafting step raised ``err`` (not a ``device_failure``: the proposer
        raises those on at once): count and log it, its step then goes without
        drafts, unless it has failed every step too long."""
        self._streak = self._streak + 1 if repr(err) == self._error else 1
        self._error = repr(err)
        if self._streak >= self.PERSISTENT_STEPS:
            raise RuntimeError(
                f"eagle3_tree: drafting failed {self._streak} steps running with the same "
                f"error ({err!r}); refusing to serve plain decoding at speculative cost "
                f"behind a broken drafter") from err
        now = time.monotonic()
        first = self.count == 0
        self.count += 1
        if first or now - self._last_log >= self.LOG_INTERVAL_S:
            logger.warning("eagle3_tree: drafting failed (%d time(s) so far); this step "
                           "decodes without drafts: %r", self.count, err, exc_info=first)
            self._last_log = now
