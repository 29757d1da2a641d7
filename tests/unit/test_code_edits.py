"""The code-editing benchmark suite (bench/code_edits.py): every turn carries a
whole function to copy back, with one edit, and any prefix keeps the mix; a long
file puts its function far back."""

from __future__ import annotations

from collections import Counter

import pytest

from vllm_treespec.bench import code_edits
from vllm_treespec.bench.pangu240 import humaneval_problems


def test_turns_carry_the_whole_function_and_rotate_the_edits():
    turns = code_edits.code_edit_turns(40)
    assert len(turns) == 40 and len({t.turn_id for t in turns}) == 40
    assert set(Counter(t.turn_id.split("/")[-1] for t in turns[:8])) == set(code_edits.EDITS)
    problems = {p["task_id"].split("/")[-1]: p for p in humaneval_problems(40)}
    for t in turns:
        number, edit = t.turn_id.split("/")[1:]
        text = t.messages[0]["content"]
        body = problems[number]["canonical_solution"].rstrip()
        if edit == "fix":  # the planted bug is in the code sent, not the solution
            assert body not in text and code_edits.plant_bug(body) in text
        else:
            assert body in text


def test_a_planted_bug_changes_one_operator():
    assert code_edits.plant_bug("    return a < b and c < d\n") == "    return a <= b and c < d\n"
    assert code_edits.plant_bug("    pass\n") is None
    with pytest.raises(ValueError, match="unknown edit 'x'"):
        code_edits.request("x", humaneval_problems(1)[0])


def test_every_suite_of_the_served_benchmark_has_its_own_turns():
    from vllm_treespec.bench.served_ab import SUITES, suite_turns

    pangu = [t.turn_id for t in suite_turns("pangu240", 2)]
    for suite in SUITES:
        turns = suite_turns(suite, 2)
        assert len(turns) == 2 and (suite == "pangu240") == ([t.turn_id for t in turns] == pangu)


def test_a_long_file_edit_starts_with_its_function_far_before_the_question():
    turns = code_edits.long_file_edit_turns(3)
    problems = humaneval_problems(3)
    assert [t.turn_id for t in turns] == ["long_file/0", "long_file/1", "long_file/2"]
    for t, p in zip(turns, problems):
        text = t.messages[0]["content"]
        module = text.split("```python\n", 1)[1].split("```", 1)[0]
        assert module.startswith(p["prompt"].strip("\n")) and len(module) >= \
            code_edits.LONG_FILE_CHARS
        assert f"`{p['entry_point']}`" in text and code_edits.camel(p["entry_point"]) in text
