"""The drafting-level half of every device's tree attention backend.

While the proposer grows a tree, the drafter's frontier nodes of one level
attend to their request's committed (paged) prefix plus their ancestors and
themselves in a small per-layer side buffer; nothing of the draft tree is
written to the paged cache. What is the same on every device lives here: the
level's K/V go into the layer's side buffer, the B*F queries are viewed per
request, and the result is written back into vLLM's output rows. A backend
supplies only the attention itself (``_attend_level``).
"""

from __future__ import annotations

import torch

from vllm_treespec.attention import DraftTreeLevelMetadata


class DraftLevelAttention:
    """Mixed into a vLLM attention implementation (needs ``num_heads`` and
    ``head_size``)."""

    _side_kv: torch.Tensor | None = None  # [2, B, capacity, KVH, D], grown per shape

    def _draft_level(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     kv_cache: torch.Tensor, md: DraftTreeLevelMetadata,
                     output: torch.Tensor) -> torch.Tensor:
        B, F = md.batch_size, md.width
        side = self._side_kv = md.write_side_kv(self._side_kv, key, value)
        q = query[: B * F].view(B, F, self.num_heads, self.head_size)
        out = self._attend_level(q, side[0, :B], side[1, :B], kv_cache, md)
        output[: B * F] = out.reshape((B * F,) + output.shape[1:]).to(output.dtype)
        return output

    def _attend_level(self, q: torch.Tensor, side_key: torch.Tensor, side_value: torch.Tensor,
                      kv_cache: torch.Tensor, md: DraftTreeLevelMetadata) -> torch.Tensor:
        """q [B, F, H, D]; side_key/side_value [B, capacity, KVH, D] with columns
        ``[0, side_offset + width)`` filled; returns [B, F, H, D]: softmax over the
        request's ``prefix_len`` paged entries and the side entries ``side_mask``
        allows (``attention.reference.prefix_side_attention``)."""
        raise NotImplementedError
