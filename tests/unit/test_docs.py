"""The documentation a newcomer reads stays true to the code and the measurements.

- Every command shown in the README, docs/ and benchmarks/RESULTS.md names flags its
  parser knows: `vllm-treespec SUB ...` against that sub-command's argparse parser,
  `vllm serve` / `vllm-treespec serve` against vLLM's own serve parser, `python -m
  MODULE ...` (the benchmarks: `python -m vllm_treespec.bench.X`) and `scripts/X.sh ...`
  against the flags written in the script's source. A `python benchmarks/X.py` is
  reported: the benchmark scripts live in `vllm_treespec/bench/` (docs/benchmarks.md). A `--speculative-config` that selects
  `eagle3_tree` names only keys the plugin knows.
- Every relative link resolves.
- Every ratio and bold figure the README quotes appears on benchmarks/RESULTS.md.
- The README's tree-keys table matches docs/serving.md's and the config's fields.
- README <= 250 lines, RESULTS <= 500 (issue 65).
- Code comments and docstrings (vllm_treespec/) carry no dated measurement, no
  measured figure and no machine name: measurements live in benchmarks/RESULTS.md and its
  history, cited by section title, and each title cited exists there.

Nothing here spawns a process; vLLM's parser is built once, in process.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import io
import json
import re
import shlex
import tokenize
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), RESULTS]

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
SHELL_STOP = {"|", "||", "&&", ";", ">", ">>", "2>", "<", ")"}
# Keys vLLM's own speculative config takes that the README says pass through.
PASS_THROUGH_KEYS = {"method", "model", "draft_tensor_parallel_size", "max_model_len"}


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# ---- commands ---------------------------------------------------------------------------

def _fenced_lines(text: str) -> list[str]:
    """Shell lines of fenced blocks, continuation backslashes joined, comments dropped."""
    lines: list[str] = []
    for block in FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        lines += [ln.strip() for ln in joined.splitlines()
                  if ln.strip() and not ln.strip().startswith("#")]
    return lines


def _inline_spans(text: str) -> list[str]:
    prose = FENCE.sub("", text)
    return [" ".join(span.split()) for span in INLINE.findall(prose)]


def _tokens(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in prose: not a command
        return []


def _commands(path: Path) -> list[tuple[str, list[str]]]:
    """(program, argv) for every command on the page; program is `vllm-treespec`,
    `vllm`, `python benchmarks/X.py`, `python -m MODULE` or `scripts/X.sh`."""
    found = []
    text = _text(path)
    for line in _fenced_lines(text) + _inline_spans(text):
        toks = _tokens(line)
        for i, tok in enumerate(toks):
            tok = tok.rsplit("$(", 1)[-1]
            rest = toks[i + 1:]
            for j, t in enumerate(rest):
                if t in SHELL_STOP:
                    rest = rest[:j]
                    break
            if tok in ("vllm-treespec", "vllm") and rest:
                found.append((tok, rest))
            elif tok in ("python", "python3") and rest:
                if rest[0].startswith("benchmarks/") and rest[0].endswith(".py"):
                    found.append((f"python {rest[0]}", rest[1:]))
                elif rest[0] == "-m" and len(rest) > 1 and rest[1].startswith("vllm_treespec"):
                    found.append((f"python -m {rest[1]}", rest[2:]))
            elif re.fullmatch(r"(bash )?scripts/[\w.-]+\.sh", tok):
                found.append((tok, rest))
    return found


def _flags(argv: list[str]) -> list[str]:
    """The `--flag` names of argv. Quoted values holding spaces are values, not
    flags; `[--run NAME]` (optional, as usage lines write it) counts as `--run`."""
    out = []
    for tok in argv:
        tok = tok.strip("[]")
        if tok.startswith("--") and not re.search(r"\s", tok) and len(tok) > 2:
            out.append(tok.split("=", 1)[0])
    return out


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


@functools.cache
def _treespec_options(sub: str) -> frozenset[str]:
    """Option strings of `vllm-treespec SUB`: its main() is run until it parses."""
    from vllm_treespec.cli import COMMANDS

    module_name, _, func = COMMANDS[sub][0].partition(":")
    main = getattr(importlib.import_module(module_name), func or "main")

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture):
        try:
            main([])
        except _Captured as got:
            return frozenset(got.parser._option_string_actions)
    raise AssertionError(f"vllm-treespec {sub} parsed no arguments")


@functools.cache
def _vllm_serve_options() -> frozenset[str]:
    """Option strings of vLLM's `serve` parser, where each release keeps it."""
    pytest.importorskip("vllm")
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older releases
        from vllm.utils import FlexibleArgumentParser
    for name in ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"):
        try:
            make_arg_parser = importlib.import_module(name).make_arg_parser
        except (ImportError, AttributeError):
            continue
        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
        return frozenset(o.replace("_", "-") for o in parser._option_string_actions)
    pytest.skip("vLLM's serve parser not found in this release")


def _module_file(module: str) -> Path:
    base = ROOT / module.replace(".", "/")
    return base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"


def _source_flags(path: Path) -> str:
    """A script's source, plus that of the module it hands its arguments to (`python -m
    vllm_treespec...` in a shell script, `from vllm_treespec... import main`)."""
    assert path.exists(), f"{_rel(path)} does not exist"
    source = _text(path)
    handed = re.findall(r"-m (vllm_treespec[\w.]*)", source)
    handed += re.findall(r"^from (vllm_treespec[\w.]*) import .*\bmain\b", source, re.M)
    return source + "".join(_text(_module_file(m)) for m in handed)


def _check_source(program: str, argv: list[str], source: str, where: str) -> list[str]:
    return [f"{where}: {program}: {flag} is not in its argument parser"
            for flag in _flags(argv) if f'"{flag}"' not in source and f"'{flag}'" not in source]


def _check_speculative_config(argv: list[str], where: str) -> list[str]:
    from vllm_treespec.config import TreeSpecConfig

    known = set(TreeSpecConfig.model_fields) | PASS_THROUGH_KEYS
    errors = []
    for flag, value in zip(argv, argv[1:]):
        if flag != "--speculative-config":
            continue
        try:
            config = json.loads(value)
        except json.JSONDecodeError as err:
            errors.append(f"{where}: --speculative-config is not JSON ({err}): {value}")
            continue
        if config.get("method") == "eagle3_tree":
            errors += [f"{where}: --speculative-config key {k!r} is not a tree key"
                       for k in set(config) - known]
    return errors


def _command_errors(path: Path) -> list[str]:
    from vllm_treespec.cli import COMMANDS

    where = _rel(path)
    errors = []
    for program, argv in _commands(path):
        if program == "vllm-treespec":
            sub, args = argv[0], argv[1:]
            if sub not in COMMANDS:
                errors.append(f"{where}: vllm-treespec has no sub-command {sub!r}")
                continue
            if sub == "serve":
                program, argv = "vllm", ["serve", *args]
            elif sub == "vllm":
                program, argv = "vllm", args
            else:
                known = _treespec_options(sub)
                errors += [f"{where}: vllm-treespec {sub}: {flag} is not one of its flags"
                           for flag in _flags(args) if flag not in known]
                continue
        if program == "vllm":
            if argv[:1] != ["serve"]:
                continue  # other vLLM sub-commands: vLLM's own documentation
            known = _vllm_serve_options()
            errors += [f"{where}: vllm serve: {flag} is not one of vLLM's serve flags"
                       for flag in _flags(argv[1:]) if flag.replace("_", "-") not in known]
            errors += _check_speculative_config(argv, where)
        elif program.startswith("python benchmarks/"):
            name = program.split("/")[-1].removesuffix(".py")
            errors.append(f"{where}: {program}: benchmark code lives in vllm_treespec/bench/ "
                          f"(python -m vllm_treespec.bench.{name})")
        elif program.startswith("python -m "):
            module = program.split()[-1]
            errors += _check_source(program, argv, _source_flags(_module_file(module)), where)
        elif program.endswith(".sh"):
            errors += _check_source(program, argv, _source_flags(ROOT / program.split()[-1]), where)
    return errors


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_command_shown_names_flags_its_parser_knows(page):
    if page == README:  # the extraction finds commands at all
        assert len(_commands(page)) >= 5
    errors = _command_errors(page)
    assert not errors, "\n".join(errors)


def test_the_command_check_catches_a_wrong_flag(tmp_path):
    """Negative control: a flag no parser has, in each kind of command, is reported."""
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nvllm-treespec soak --requests 3 --no-such-flag\n"
        "python -m vllm_treespec.bench.served_ab --turns 2 --no-such-flag\n"
        "python benchmarks/served_ab.py --turns 2\n"
        "vllm-treespec serve M --speculative-config '{\"method\": \"eagle3_tree\", \"nodes\": 3}'\n"
        "```\n`vllm-treespec bench --no-such-flag`\n", encoding="utf-8")
    errors = _command_errors(page)
    assert sum("--no-such-flag" in e for e in errors) == 3, errors  # soak, served_ab, bench
    assert any("python benchmarks/served_ab.py: benchmark code lives in" in e for e in errors)
    assert any("'nodes'" in e for e in errors), errors


# ---- links ------------------------------------------------------------------------------

def _broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", _text(path))):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#", 1)[0]).exists():
            broken.append(f"{_rel(path)}: link to {target} does not resolve")
    return broken


@pytest.mark.parametrize("page", [*PAGES, ROOT / "benchmarks" / "history" / "RESULTS-history.md"],
                         ids=_rel)
def test_every_relative_link_resolves(page):
    broken = _broken_links(page)
    assert not broken, "\n".join(broken)


# ---- figures ----------------------------------------------------------------------------

FIGURE = re.compile(r"(?<![\w.])(\d+\.\d+)\s?[x×](?!\w)|\*\*(\d+\.\d+)\*\*")


def readme_figures() -> list[str]:
    prose = FENCE.sub("", _text(README))
    return sorted({a or b for a, b in FIGURE.findall(prose)})


def test_every_figure_the_readme_quotes_is_on_the_results_page():
    figures = readme_figures()
    assert len(figures) >= 5, figures  # the headline ratios are found at all
    results = _text(RESULTS)
    missing = [f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}(?!\d)", results)]
    assert not missing, f"README figures not on benchmarks/RESULTS.md: {missing}"


# ---- the tree keys table ----------------------------------------------------------------

def _key_rows(path: Path) -> dict[str, str]:
    rows = {}
    for line in _text(path).splitlines():
        m = re.match(r"\| `(\w+)` \|", line)
        if m:
            rows[m.group(1)] = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line)
    return rows


def test_the_tree_keys_table_matches_the_config_and_the_serving_page():
    from vllm_treespec.config import TreeSpecConfig

    readme, serving = _key_rows(README), _key_rows(ROOT / "docs" / "serving.md")
    assert set(readme) == set(TreeSpecConfig.model_fields) | {"model"}
    assert readme == serving


# ---- sizes ------------------------------------------------------------------------------

def test_readme_and_results_stay_short():
    assert len(_text(README).splitlines()) <= 250
    assert len(_text(RESULTS).splitlines()) <= 500


# ---- code comments ----------------------------------------------------------------------

CODE = sorted((ROOT / "vllm_treespec").rglob("*.py"))
RESULTS_FILES = {"RESULTS.md": RESULTS,
                 "RESULTS-history.md": ROOT / "benchmarks" / "history" / "RESULTS-history.md"}
# A citation of a results section: `RESULTS.md, "<heading>"`; a heading may name its date,
# machine and figures, which is where they belong.
CITATION = re.compile(r'(RESULTS(?:-history)?\.md),\s*"([^"]+)"')
# Version facts, not measurements: the vllm-ascend commit a vLLM pairing targets.
VERSION_FACT = re.compile(r"vllm-ascend main of 2026-\d\d-\d\d")
DATED_MEASUREMENT = re.compile(
    r"2026-\d"
    r"|\bmeasured\b[^.;]{0,80}?\d(?:\.\d+)?\s?(?:ms|us|µs|%|tok/s|MB|GB)(?![\w/])"
    r"|\b(?:AVX2|AVX-512|EPYC|Xeon|2-core)\b", re.I)


def _comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every docstring and every block of comments on adjacent lines
    (joined, so that a citation may wrap), whitespace collapsed."""
    found = []
    block: list[str] = []
    start = last = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        if block and tok.start[0] != last + 1:
            found.append((start, " ".join(block)))
            block = []
        if not block:
            start = tok.start[0]
        block.append(tok.string.lstrip("#").strip())
        last = tok.start[0]
    if block:
        found.append((start, " ".join(block)))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((node.body[0].lineno, doc))
    return [(line, " ".join(text.split())) for line, text in found]


@functools.cache
def _headings(name: str) -> frozenset[str]:
    return frozenset(re.findall(r"^#+ (.+)$", _text(RESULTS_FILES[name]), re.M))


def _dated_measurements(path: Path) -> list[str]:
    """A dated or measured figure, or a machine, in a comment or docstring of ``path``;
    a cited section heading (cited headings must exist) and version facts are allowed."""
    errors = []
    for line, text in _comments_and_docstrings(path.read_text(encoding="utf-8")):
        for name, heading in CITATION.findall(text):
            if heading not in _headings(name):
                errors.append(f"{_rel(path)}:{line}: cites no section of {name}: {heading!r}")
        prose = VERSION_FACT.sub("", CITATION.sub("", text))
        for m in DATED_MEASUREMENT.finditer(prose):
            around = prose[max(0, m.start() - 50):m.end() + 30]
            errors.append(f"{_rel(path)}:{line}: {m.group(0)!r} in ...{around}...")
    return errors


def test_code_comments_carry_no_dated_measurements():
    """Comments stay true: they say what and why; a measurement, its date and its machine
    live in benchmarks/RESULTS.md (or its history) and are cited by section title."""
    assert len(CODE) >= 50  # the scan finds the package at all
    errors = [e for path in CODE for e in _dated_measurements(path)]
    assert not errors, "\n".join(errors)


def test_the_comment_check_catches_a_dated_measurement(tmp_path):
    """Negative control: a dated figure in a comment, a measured one and a machine in a
    docstring, and a citation of a section that does not exist are reported; a citation
    whose heading names a date, and a version fact, are not."""
    source = tmp_path / "planted.py"
    source.write_text(
        '"""Module.\n\nMeasured on the other box: a forward 12.5 ms."""\n\n\n'
        "def f():\n"
        '    """Fast on an AMD EPYC."""\n'
        "    # the sweep took 3 ms (2026-11-30)\n"
        "    # see benchmarks/RESULTS.md, \"No such section\"\n"
        "    return 1\n\n\n"
        "# targets vllm-ascend main of 2026-08-22; benchmarks/history/\n"
        "# RESULTS-history.md, \"Latest (2026-11-25): the served-only cost found (CPython\n"
        "# frame-stack chunks)\"\n", encoding="utf-8")
    errors = _dated_measurements(source)
    assert any(":1: 'Measured on the other box: a forward 12.5 ms'" in e for e in errors), errors
    assert any(":7: 'EPYC'" in e for e in errors), errors
    assert any(":8: '2026-1'" in e for e in errors), errors
    assert any("cites no section of RESULTS.md: 'No such section'" in e for e in errors), errors
    assert len(errors) == 4, errors
