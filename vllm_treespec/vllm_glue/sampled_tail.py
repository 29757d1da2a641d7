"""A step's sampled tokens that vLLM's token table does not hold yet.

vLLM's runner writes a step's sampled tokens into ``input_batch.token_ids_cpu``
after the drafter ran when the drafter takes the padded batch, before it
otherwise. So a request's history at drafting time is the tokens the table
holds (``num_tokens_no_spec``) plus the step's sampled tokens, unless they are
there already (the count grew since sampling). The runner records the sampler's
output once a step; the copy branches and the drafter's grammar matchers read
each row's tail from the same record.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class SampledTail:
    """The sampled tokens [B, width] (-1 padded) of one step and each batch row's
    token count when they were sampled; empty without arguments."""

    def __init__(self, sampled_token_ids: Any = None, num_tokens: np.ndarray | None = None):
        self.emitted: list[list[int]] = ([] if sampled_token_ids is None
                                         else sampled_token_ids.tolist())
        self.counted = (np.zeros(0, dtype=np.int64) if num_tokens is None
                        else np.array(num_tokens[:len(self.emitted)], dtype=np.int64))

    def tail(self, b: int, n: int) -> list[int]:
        """Batch row ``b``'s sampled tokens not in a table that holds ``n`` of its
        tokens now ([] once vLLM's bookkeeping wrote them)."""
        if b < len(self.emitted) and n == self.counted[b]:
            return [t for t in self.emitted[b] if t >= 0]
        return []
