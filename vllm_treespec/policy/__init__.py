"""Adaptive speculation budget (``budget``: its decisions; ``estimates``: what it
has learned), acceptance estimates by depth (``acceptance``), cost models
(``costs``), node selection (``selection``) and probe schedule (``probes``).
Pure Python/torch; the runner feeds it timings and acceptance counts."""

from vllm_treespec.policy.budget import AdaptiveBudget
from vllm_treespec.policy.costs import LinearFit, StepCostTable

__all__ = ["AdaptiveBudget", "LinearFit", "StepCostTable"]
