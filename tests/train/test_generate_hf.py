"""The transformers data backend (for a GPU machine without vLLM) writes the
shards the vLLM backend writes: same answers, same states at every position."""

import numpy as np
import pytest
import torch

from vllm_treespec.train.generate import generate_self_queries, generate_shards, shard_paths

pytestmark = pytest.mark.vllm

PROMPTS = [
    {"id": "a", "kind": "test", "messages": [{"role": "user", "content": "Name three primes."}]},
    {"id": "b", "kind": "test",
     "messages": [{"role": "user", "content": "Write a Python function that reverses a string."}]},
    {"id": "c", "kind": "test", "messages": [{"role": "user", "content": "Say hello."}]},
]
AUX = (2, 15, 27)


@pytest.fixture(scope="module")
def target_dir():
    from vllm_treespec.assets import ensure_target

    return str(ensure_target())


def _shards(answerer, directory, greedy_frac=1.0):
    stats = generate_shards(answerer, PROMPTS, directory, aux_layers=AUX, seed=0, max_tokens=24,
                            greedy_frac=greedy_frac, temperatures=[1.0], shard_size=8,
                            log=lambda _: None)
    from safetensors.numpy import load_file

    from vllm_treespec.jsonl import read_jsonl

    st, meta = shard_paths(directory, 0)
    return stats, load_file(str(st)), read_jsonl(meta)


@pytest.fixture(scope="module")
def vllm_shard(target_dir, tmp_path_factory):
    from vllm_treespec.train.generate import VllmAnswerer, make_llm

    llm = make_llm(target_dir, max_num_seqs=4, max_model_len=512, seed=0)
    answerer = VllmAnswerer(llm, AUX)
    out = _shards(answerer, tmp_path_factory.mktemp("vllm"))
    queries = generate_self_queries(answerer, 8, seed=0)
    kept_states = len(answerer.capture.chunks)
    del llm, answerer
    return out + (queries, kept_states)


@pytest.fixture(scope="module")
def hf(target_dir):
    from vllm_treespec.train.generate_hf import TransformersAnswerer

    return TransformersAnswerer(target_dir, AUX, max_model_len=512, batch=2, seed=0,
                                device="cpu")


def _relative_errors(a: np.ndarray, b: np.ndarray) -> torch.Tensor:
    """Per position and state: |a - b| / |b| (vector norms over the hidden size)."""
    a, b = torch.from_numpy(a).float(), torch.from_numpy(b).float()
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def test_states_on_the_same_tokens_equal_the_vllm_capture(vllm_shard, hf):
    """What the drafter trains on: every position's aux and final states, computed
    by transformers on vLLM's own answers, match what vLLM handed out."""
    _, ref, _, _, _ = vllm_shard
    tok, hid = ref["tok_offsets"], ref["hid_offsets"]
    sequences = [ref["tokens"][tok[i]: tok[i + 1]].tolist() for i in range(len(tok) - 1)]
    states = hf._capture(sequences)
    for i, got in enumerate(states):
        err = _relative_errors(got, ref["hidden"][hid[i]: hid[i + 1]])
        for j, name in enumerate([*map(str, AUX), "final"]):
            assert float(err[:, j].max()) < 1e-2, f"sequence {i}, state {name}: {err[:, j].max()}"


def test_greedy_shards_match_the_vllm_backend(vllm_shard, hf, tmp_path):
    """Same shard layout and metadata; the greedy answers agree (transformers and
    vLLM's CPU kernels round differently, so a near-tie may flip a late token:
    every answer must agree on its first 12 tokens and most answers entirely)."""
    _, ref, ref_meta, _, _ = vllm_shard
    _, got, meta = _shards(hf, tmp_path)
    assert set(got) == set(ref) and got["hidden"].dtype == np.float16
    assert np.array_equal(got["prompt_lens"], ref["prompt_lens"])
    same = 0
    for i in range(len(meta)):
        a = got["tokens"][got["tok_offsets"][i]: got["tok_offsets"][i + 1]]
        b = ref["tokens"][ref["tok_offsets"][i]: ref["tok_offsets"][i + 1]]
        n = int(ref["prompt_lens"][i]) + 12
        assert np.array_equal(a[:n], b[:n]), f"answer {i} differs within 12 tokens"
        same += np.array_equal(a, b) and meta[i]["finish_reason"] == ref_meta[i]["finish_reason"]
    assert same >= len(meta) - 1, f"{same} of {len(meta)} answers identical"


def test_a_state_one_layer_off_is_caught(vllm_shard, hf):
    """Negative control for the tolerance above: the residual stream entering the
    next layer differs from the one vLLM hands the drafter by far more."""
    _, ref, _, _, _ = vllm_shard
    n = int(ref["hid_offsets"][1])
    tokens = ref["tokens"][: n + 1].tolist()
    with torch.no_grad():
        hs = hf.model(torch.tensor(tokens[:-1])[None], output_hidden_states=True).hidden_states
    b = torch.from_numpy(ref["hidden"][:n, 0]).float()
    assert (hs[AUX[0]][0] - b).abs().max() / b.abs().max() < 2e-3
    assert (hs[AUX[0] + 1][0] - b).abs().max() / b.abs().max() > 1e-1


def test_sampled_answers_end_at_the_stop_token_or_their_budget(hf, tmp_path):
    stats, got, meta = _shards(hf, tmp_path, greedy_frac=0.0)
    assert stats["shards"] == 1 and all(m["temperature"] == 1.0 for m in meta)
    offsets = got["tok_offsets"]
    for i, m in enumerate(meta):
        answer = got["tokens"][offsets[i] + m["prompt_len"]: offsets[i + 1]].tolist()
        assert len(answer) == m["new_tokens"] <= 24
        if m["finish_reason"] == "stop":
            assert answer[-1] in hf.eos and not set(answer[:-1]) & hf.eos
        else:
            assert m["finish_reason"] == "length" and len(answer) == 24


def test_both_backends_write_self_queries(vllm_shard, hf):
    """Stage 1's user turns written by the target (no states kept for them)."""
    *_, vllm_queries, kept_states = vllm_shard
    hf_queries = generate_self_queries(hf, 8, seed=0)
    for queries in (vllm_queries, hf_queries):
        assert queries and all(isinstance(q, str) and q.strip() for q in queries)
    assert kept_states == 0
    with pytest.raises(ValueError, match="one is supported"):
        hf.sample(["x"], 1.0, 4, stop="two tokens")
