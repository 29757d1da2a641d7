"""The repetitive benchmark suites (bench/repetitive.py): one schema for every
structured record; write, test, document for each problem in turn; each question
asked again by other users in their own words."""

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


def test_each_question_is_asked_again_in_other_words_later():
    turns = repetitive.repeated_asks_turns()
    assert len(turns) == 2 * 80 * repetitive.ASKERS == len({t.turn_id for t in turns})
    first = turns[:repetitive.SPREAD * repetitive.ASKERS]
    by_question: dict[str, list[str]] = {}
    for t in first:
        question, asker = t.turn_id.rsplit("/", 1)
        by_question.setdefault(question, []).append(t.messages[0]["content"])
    assert len(by_question) == repetitive.SPREAD
    for asks in by_question.values():  # one question, worded differently by each asker
        assert len(asks) == len(set(asks)) == repetitive.ASKERS
    # a question's next asker comes after every other question of its group
    ids = [t.turn_id.rsplit("/", 1)[0] for t in first]
    assert ids[:repetitive.SPREAD] == ids[repetitive.SPREAD:2 * repetitive.SPREAD]
    solution = humaneval_problems(1)[0]["canonical_solution"].strip()
    assert not any(solution in t.messages[0]["content"] for t in turns)  # answers, not given
