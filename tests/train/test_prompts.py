"""Training prompts: deterministic, varied, and disjoint from the evaluation sets."""

import collections
import contextlib
import re

import pytest

from vllm_treespec.train import prompts as P


@pytest.fixture(scope="module")
def corpus():
    return P.build_prompts(1500, seed=7, self_queries=["How do I keep basil alive indoors?"] * 3)


def test_deterministic_and_mixed(corpus):
    again = P.build_prompts(1500, seed=7, self_queries=["How do I keep basil alive indoors?"] * 3)
    assert again == corpus
    kinds = collections.Counter(p["kind"] for p in corpus)
    for kind in ("instruct", "math", "reasoning", "extraction", "code_stub", "code_task", "docs"):
        assert kinds[kind] > 0, kinds
    assert kinds["self"] == 1  # duplicates of a self-written query are used once
    texts = [p["messages"][-1]["content"] for p in corpus]
    assert len(set(texts)) == len(texts)
    assert P.build_prompts(50, seed=8) != corpus[:50]


def test_code_stubs_are_valid_python_stubs(corpus):
    import ast

    stubs = [p["messages"][-1]["content"] for p in corpus if p["kind"] == "code_stub"]
    assert len(stubs) > 100
    parsed = 0
    for s in stubs:
        code = s.split("```python\n")[-1].split("```")[0] if "```" in s else s.split(":\n\n", 1)[-1] if s.startswith(("Complete", "Implement")) else s
        try:
            tree = ast.parse(code + "    pass\n")
        except SyntaxError:
            continue
        parsed += any(isinstance(n, ast.FunctionDef) for n in ast.walk(tree))
    assert parsed > 0.9 * len(stubs)


def _eval_texts() -> list[str]:
    """Every HumanEval prompt and MT-Bench turn (the benchmark's own loaders)."""
    from vllm_treespec.bench import pangu240

    out = []
    with contextlib.suppress(FileNotFoundError):
        out += [p["prompt"] for p in pangu240.humaneval_problems(None)]
    with contextlib.suppress(FileNotFoundError):
        out += [t for q in pangu240.mtbench_questions(None) for t in q["turns"]]
    if not out:
        pytest.skip("evaluation sets not installed")
    return out


def _ngrams(text: str, n: int = 10) -> set:
    words = re.findall(r"\w+", text.lower())
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_no_overlap_with_mtbench_or_humaneval(corpus):
    grams = set()
    for t in _eval_texts():
        grams |= _ngrams(t)
    leaked = [p["messages"][-1]["content"][:80] for p in corpus
              if _ngrams(p["messages"][-1]["content"]) & grams]
    assert not leaked, leaked[:5]


def test_self_query_prefix_opens_a_user_turn():
    class Tok:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "<|im_start|>system\nhi<|im_end|>\n<|im_start|>user\n" + messages[0]["content"] + "<|im_end|>\n"

    assert P.self_query_prefix(Tok()) == "<|im_start|>system\nhi<|im_end|>\n<|im_start|>user\n"
    assert P.clean_self_query("  What is a good name for a cat?  ") == "What is a good name for a cat?"
    assert P.clean_self_query("hi") is None
    assert P.clean_self_query("assistant: something long enough here") is None
