"""The tree drafter on vllm-ascend's EAGLE proposer.

Owns :func:`tree_ascend_proposer_class`. Imports vllm_ascend and the
device-agnostic :class:`~vllm_treespec.vllm_glue.proposer.TreeEagleProposer`
lazily, when the class is built; nothing from this package.
"""

from __future__ import annotations


def tree_ascend_proposer_class() -> type:
    """The tree drafter on vllm-ascend's EAGLE proposer (its model loading,
    buffers and graph handling), adapted to the two places its interface differs
    from vLLM's: the runner calls ``_propose`` with extra keywords, and
    ``set_inputs_first_pass`` returns a fourth value (context-parallel args)."""
    from vllm_ascend.spec_decode.eagle_proposer import AscendEagleProposer

    from vllm_treespec.vllm_glue.proposer import TreeEagleProposer

    class TreeAscendEagleProposer(TreeEagleProposer, AscendEagleProposer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # The catch-up pass builds its own CommonAttentionMetadata; whether
            # vllm-ascend's metadata builder accepts it has not been run on an NPU,
            # so the drafter keeps running every step there (the old behaviour).
            self.defer_when_off = False

        def set_inputs_first_pass(self, *args, **kwargs):
            num_tokens, token_indices_to_sample, cad, *_ = super().set_inputs_first_pass(
                *args, **kwargs)
            return num_tokens, token_indices_to_sample, cad

        def _propose(self, num_speculative_tokens, target_token_ids, target_positions,
                     target_hidden_states, next_token_ids, token_indices_to_sample,
                     common_attn_metadata, target_model_batch_desc=None,
                     sampling_metadata=None, mm_embed_inputs=None,
                     num_rejected_tokens_gpu=None, **_unused):
            return self.propose(num_speculative_tokens, target_token_ids, target_positions,
                                target_hidden_states, next_token_ids,
                                token_indices_to_sample, common_attn_metadata,
                                sampling_metadata, mm_embed_inputs=mm_embed_inputs,
                                num_rejected_tokens_gpu=num_rejected_tokens_gpu)

    return TreeAscendEagleProposer
