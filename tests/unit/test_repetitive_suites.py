"""The repetitive benchmark suites (bench/repetitive.py): one schema for every
structured record; write, test, document for each problem in turn."""

from __future__ import annotations

from vllm_treespec.bench import repetitive
from vllm_treespec.bench.pangu240 import humaneval_problems


def test_every_structured_record_asks_for_the_one_schema():
    turns = repetitive.structured_turns()
    assert len(turns) == repetitive.NUM_PROBLEMS == len({t.turn_id for t in turns})
    problems = humaneval_problems(repetitive.NUM_PROBLEMS)
    for t, p in zip(turns, problems):
        text = t.messages[0]["content"]
        assert len(t.messages) == 1 and repetitive.SCHEMA in text
        assert p["prompt"].strip() in text and p["canonical_solution"].strip() not in text
    assert len(repetitive.structured_turns(5)) == 5


def test_the_workflow_writes_then_tests_then_documents_each_problem():
    turns = repetitive.code_workflow_turns(9)
    assert [t.turn_id.split("/")[-1] for t in turns] == ["write", "test", "document"] * 3
    assert len({t.turn_id.split("/")[1] for t in turns}) == 3
    first = humaneval_problems(1)[0]
    write, test, document = (t.messages[0]["content"] for t in turns[:3])
    assert first["canonical_solution"].strip() not in write  # written, not given
    assert first["canonical_solution"].strip() in test and \
        first["canonical_solution"].strip() in document
    assert len(repetitive.code_workflow_turns()) == 3 * repetitive.NUM_PROBLEMS
