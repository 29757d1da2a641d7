"""Startup timing of the target's forwards, for the adaptive budget's step-cost
table and for device kernel choices (mixed into the tree model runner).

Live steps refine the table (``policy.StepCostTable``); these sweeps only seed
it, so that the first requests are sized by measured costs, not guesses. It lives
with the glue, not in ``policy/``, because it drives vLLM's runner (dummy forwards);
what it measures goes into the policy's own tables.
"""

from __future__ import annotations

import logging
import time

from vllm_treespec.vllm_glue import rank_agreement
from vllm_treespec.vllm_glue.frame_stack import call_on_fresh_chunk

logger = logging.getLogger("vllm.treespec")


class StepCostCalibration:
    """Needs the runner's ``_dummy_run``, ``model``, ``_sync_device``,
    ``scheduler_config`` and ``adaptive_budget``."""

    def _calibrate_kernels(self) -> None:
        """Device hook: choose kernels by timing forwards (``_time_forward``)."""

    def _time_forward(self, n: int, repeats: int = 3) -> float:
        """Best-of seconds of a forward (+ logits) over n tokens, drafter excluded.
        The drafter's dummy pass (all its steps) is not part of a verify step's
        cost, and it made the sweeps slow and noisy."""
        drafter = getattr(self, "drafter", None)
        if drafter is not None:
            drafter.dummy_run = lambda *args, **kwargs: None
        try:
            times = []
            for _ in range(repeats):
                self._sync_device()
                t0 = time.perf_counter()
                out = call_on_fresh_chunk(self._dummy_run, n)  # as live steps run
                hidden = out[0] if isinstance(out, tuple) else out
                self.model.compute_logits(hidden[:n])
                self._sync_device()  # device time, not launch time
                times.append(time.perf_counter() - t0)
            return min(times)
        finally:
            if drafter is not None:
                del drafter.dummy_run  # the class's method again

    # Verified-token counts timed at startup: dense where decode batches live.
    CALIBRATION_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)

    def _calibrate_step_cost(self) -> None:
        """Seed the adaptive budget's step-cost table: time forwards (+ logits) of
        a sweep of token counts. Live steps refine it."""
        policy = self.adaptive_budget
        if policy is None:
            return
        limit = self.scheduler_config.max_num_batched_tokens
        # Best of 7 where a forward takes milliseconds: with best of 3 a stall
        # once left the 1-token knot above the 4-token one. (The spread of the
        # 1-token knot between server starts on one machine is the process's
        # own: its live steps differ alike, and the table follows them;
        # benchmarks/history/RESULTS-history.md, "The 2.56 head, and a step-cost
        # table that follows live steps by a shift (2026-11-28, AVX-512
        # machine): `eagle3_tree` level with the best stock chain at batch 1,
        # 1.03x plain at 16 requests".)
        knots = {n: self._time_forward(n, 7 if n <= 64 else 1)
                 for n in self.CALIBRATION_SIZES if n <= limit}
        # Under tensor parallelism every rank prices steps as rank 0 does.
        for n, seconds in rank_agreement.from_rank0(knots).items():
            policy.step_cost.set_knot(n, seconds)
        cost = policy.step_cost
        cost.finish_sweep()
        logger.info("eagle3_tree: step cost %s (adaptive budget)",
                    ", ".join(f"{int(n)} tok {1e3 * t:.1f} ms"
                              for n, t in zip(cost.n, cost.t) if n in (1, 4, 16, 64, 256)))
