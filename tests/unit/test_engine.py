"""The tree engine (``vllm_treespec.engine``): free of vLLM, and one step carried
through it (layout -> acceptance -> commit) on plain tensors, as any runner
adapter drives it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from vllm_treespec.engine.accept import TreeSampling, accept_trees
from vllm_treespec.engine.commit import commit_accepted
from vllm_treespec.engine.layout import set_tree_positions, verify_rows
from vllm_treespec.engine.step import VerifyStep, node_rows
from vllm_treespec.tree import TreeBatch, apply_compaction

V = 16
BLOCK = 4

# A finder that refuses vLLM: what an engine module imports must not need it.
_NO_VLLM = textwrap.dedent("""
    import importlib.abc, sys
    class NoVllm(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "vllm" or name.startswith("vllm."):
                raise ImportError("vLLM is blocked: " + name)
    sys.meta_path.insert(0, NoVllm())
""")


def _import_without_vllm(*modules: str) -> subprocess.CompletedProcess:
    code = _NO_VLLM + "import importlib\n" + "".join(
        f"importlib.import_module({m!r})\n" for m in modules)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_the_engine_imports_without_vllm():
    run = _import_without_vllm(*(f"vllm_treespec.engine.{m}"
                                 for m in ("step", "layout", "accept", "commit", "levels")))
    assert run.returncode == 0, run.stderr[-2000:]
    # Negative control: the blocker bites on the V1 adapter, which imports vLLM.
    run = _import_without_vllm("vllm_treespec.vllm_glue.tree_sampler")
    assert run.returncode != 0 and "vLLM is blocked" in run.stderr


def _one_step():
    """Two requests in one flat batch: request 0 (prefix 5) carries the tree
    root -> 1, 2; 2 -> 3 and its logits choose 2 then 3, then the bonus 9;
    request 1 (prefix 2) decodes a single row before it."""
    tree = TreeBatch.from_parents([[7, 1, 2, 3]], [[0, 0, 0, 2]], tree_size=4, max_children=2)
    step = VerifyStep(req_index=torch.tensor([1]), tree=tree, prefix_len=torch.tensor([5]),
                      token_start=torch.tensor([1]), logit_start=torch.tensor([1]), num_reqs=2)
    logits = torch.zeros(5, V)
    logits[1, 2] = logits[3, 3] = logits[4, 9] = 5.0  # root -> 2 (row of node 2) -> 3 -> 9
    logits[2, 8] = 5.0                                 # node 1's row: never on the path
    return step, logits


def test_one_step_through_layout_acceptance_and_commit():
    step, logits = _one_step()
    positions = torch.tensor([2, 5, 6, 7, 8])  # flat rows: request 0's one, then the tree
    set_tree_positions(step, positions)
    assert positions.tolist() == [2, 5, 6, 6, 7]  # prefix + depth while verifying
    block_table = torch.tensor([[0, 1, 2], [3, 4, 5]])
    rows = verify_rows(step, total_rows=5, with_metadata=True, block_table=block_table,
                       block_size=BLOCK, spare_blocks=[])
    assert rows.rows.tolist() == [1, 2, 3, 4] and not rows.covers_batch
    assert rows.meta.block_table.tolist() == [[3, 4, 5]]

    acc = accept_trees(logits, step, TreeSampling(all_greedy=True), {}, draw_seeded=None)
    assert acc.path[0].tolist()[:3] == [0, 2, 3] and acc.tokens[0].tolist()[:3] == [2, 3, 9]

    # KV of request 1's slots: slot s holds the value s (blocks 3, 4, 5: positions 0..11).
    kv = torch.arange(6 * BLOCK, dtype=torch.float32).view(6, BLOCK, 1) - 3 * BLOCK
    input_ids = torch.tensor([11, 7, 1, 2, 3])
    hidden = torch.arange(5, dtype=torch.float32).view(5, 1)
    step.hidden_states = hidden
    commit_accepted(step, acc, block_table, BLOCK,
                    lambda src, dst: apply_compaction(kv, src, dst), input_ids, positions)
    # Nodes 2 and 3 (slots 7 and 8) now sit at prefix + 1 and + 2 (slots 6 and 7).
    flat_kv = kv[3:].reshape(-1)
    assert flat_kv[5:8].tolist() == [5.0, 7.0, 8.0]
    assert input_ids.tolist() == [11, 7, 2, 3, 3] and hidden.view(-1).tolist() == [0, 1, 3, 4, 4]
    assert positions.tolist() == [2, 5, 6, 7, 8]  # linear again


def test_a_shifted_logits_row_changes_the_accepted_path():
    """Negative control: acceptance reads each node's own row (``node_rows``);
    the logits of one row later accept something else."""
    step, logits = _one_step()
    good = accept_trees(logits, step, TreeSampling(all_greedy=True), {}, draw_seeded=None)
    shifted = torch.roll(logits, shifts=-1, dims=0)
    bad = accept_trees(shifted, step, TreeSampling(all_greedy=True), {}, draw_seeded=None)
    assert node_rows(step)[0].tolist() == [1, 2, 3, 4]
    assert not torch.equal(good.tokens, bad.tokens)
