"""Does a vLLM define what a Model Runner V2 adapter for ``eagle3_tree`` would use?

Reads a vLLM source tree with ``ast``, never importing it, so it works on a release
that cannot run here (0.34.0 refuses x86 CPUs without triton-cpu): an installed
package, a directory holding ``vllm/``, or a wheel file as downloaded. For each row of
``mrv2_rows.ROWS`` it reports whether the file and definition exist, what was found
(parameter names, bases, or which probed names are there) and whether that equals the
table's expectation for the tree's release (read from ``vllm/_version.py``).

    python -m vllm_treespec.commands.mrv2_api                 # the installed vLLM
    python -m vllm_treespec.commands.mrv2_api vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl
    python -m vllm_treespec.commands.mrv2_api --doc-table     # docs/mrv2.md, section 5

Exit status: 0 when every row matches, 1 when one does not, 2 when the table has no
expectations for the release (the findings are still printed).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from vllm_treespec.commands.mrv2_rows import RELEASES, ROWS, Row

FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


class Source:
    """The files of one vLLM tree, by path under ``vllm/``."""

    def __init__(self, path: Path):
        self.path = path
        self._zip = zipfile.ZipFile(path) if path.is_file() else None
        if self._zip is None:
            # An installed package is ``.../vllm``; an unpacked wheel holds ``vllm/``
            # (perhaps only the parts the rows read, so no ``__init__.py`` is needed).
            self._base = path / "vllm" if (path / "vllm").is_dir() else path
            if not (self._base / "v1").is_dir():
                raise FileNotFoundError(f"no vllm package in {path}")

    def read(self, rel: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(f"vllm/{rel}").decode("utf-8")
            except KeyError:
                return None
        file = self._base / rel
        return file.read_text(encoding="utf-8") if file.is_file() else None

    def release(self) -> str | None:
        """``__version__`` of ``vllm/_version.py``, without a local part (``+cpu``)."""
        text = self.read("_version.py")
        for node in ast.parse(text).body if text else ():
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                if any(getattr(t, "id", None) == "__version__" for t in node.targets):
                    return str(node.value.value).split("+", 1)[0]
        return None


def installed_vllm() -> Path:
    """The installed package's directory, found without running its ``__init__``."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("vllm is not installed here")
    return Path(list(spec.submodule_search_locations)[0])


def _definition(module: ast.Module, name: str) -> tuple[ast.AST | None, str]:
    """The node ``name`` (``f``, ``C`` or ``C.m``) names, or None and what is missing.
    The first definition wins: a property's getter before its setter."""
    scope, found = module.body, None
    for part in name.split("."):
        found = next((n for n in scope if isinstance(n, (ast.ClassDef, *FUNCS))
                      and n.name == part), None)
        if found is None:
            return None, f"no {part}"
        scope = found.body
    return found, ""


def _params(fn: ast.FunctionDef, in_class: bool) -> tuple[str, ...]:
    a = fn.args
    names = [x.arg for x in a.posonlyargs] + (["/"] if a.posonlyargs else [])
    names += [x.arg for x in a.args]
    if in_class and names and names[0] in ("self", "cls"):
        names = names[1:]  # the method's receiver says nothing about the API
    if a.vararg:
        names.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        names.append("*")
    names += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return tuple(names)


def _class_level(cls: ast.ClassDef, kind: str) -> set[str]:
    if kind == "methods":
        return {n.name for n in cls.body if isinstance(n, FUNCS)}
    names = {n.target.id for n in cls.body
             if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    names |= {t.id for n in cls.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name)}
    return names


def _mentioned(node: ast.AST) -> set[str]:
    return ({n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            | {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)})


def read_row(source: Source, row: Row, parsed: dict) -> tuple[tuple[str, ...] | None, str]:
    """(what the tree defines for ``row``, or None and why it is absent)."""
    if row.file not in parsed:
        text = source.read(row.file)
        parsed[row.file] = None if text is None else ast.parse(text)
    module = parsed[row.file]
    if module is None:
        return None, "no file"
    node, missing = _definition(module, row.name)
    if node is None:
        return None, missing
    if row.kind == "params":
        if not isinstance(node, FUNCS):
            return None, f"{row.name} is not a function"
        return _params(node, "." in row.name), ""
    if row.kind == "bases":
        return tuple(ast.unparse(b) for b in node.bases), ""
    if row.kind == "methods" and not row.probe:  # the whole set, in source order
        return tuple(dict.fromkeys(n.name for n in node.body if isinstance(n, FUNCS))), ""
    have = _mentioned(node) if row.kind == "mentions" else _class_level(node, row.kind)
    return tuple(p for p in row.probe if p in have), ""


@dataclass
class Result:
    row: Row
    found: tuple[str, ...] | None
    missing: str
    expected: tuple[str, ...] | None
    known: bool  # the table has an expectation for this release

    @property
    def ok(self) -> bool | None:
        return self.found == self.expected if self.known else None


def check(source: Source, release: str) -> list[Result]:
    parsed: dict = {}
    results = []
    for row in ROWS:
        found, missing = read_row(source, row, parsed)
        results.append(Result(row, found, missing, row.expected.get(release),
                              release in row.expected))
    return results


def show(row: Row, value: tuple[str, ...] | None) -> str:
    if value is None:
        return "absent"
    if row.kind in ("params", "bases"):
        return f"`({', '.join(value)})`"
    return ", ".join(f"`{v}`" for v in value) or "none"


def _reads(row: Row) -> str:
    if row.kind == "methods" and not row.probe:
        return "all methods"
    return row.kind if not row.probe else f"{row.kind}: " + ", ".join(row.probe)


def doc_table() -> str:
    """The expectations as docs/mrv2.md's section 5 prints them."""
    old, new = RELEASES
    lines = [f"| file :: definition (under `vllm/`) | reads | {old} | {new} | used for |",
             "|---|---|---|---|---|"]
    for row in ROWS:
        a, b = row.expected[old], row.expected[new]
        later = "identical" if a == b else show(row, b)
        lines.append(f"| `{row.file}` :: `{row.name}` | {_reads(row)} | {show(row, a)} "
                     f"| {later} | {row.use} |")
    return "\n".join(lines)


def report(source: Source, release: str | None, results: list[Result]) -> str:
    lines = [f"vLLM {release or '(unknown release)'} read from {source.path}"]
    for r in results:
        mark = {True: "ok  ", False: "DIFF", None: "?   "}[r.ok]
        found = show(r.row, r.found) + (f" ({r.missing})" if r.missing else "")
        line = f"{mark} {r.row.where} [{_reads(r.row)}]: {found}"
        if r.ok is False:
            line += f"; expected {show(r.row, r.expected)}"
        lines.append(line.replace("`", ""))
    bad = sum(r.ok is False for r in results)
    lines.append(f"{len(results) - bad} of {len(results)} rows as expected" if results[0].known
                 else f"no expectations for {release}: the table knows {', '.join(RELEASES)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_treespec.commands.mrv2_api",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("source", nargs="?", type=Path,
                   help="a vllm package directory, a directory holding vllm/, or a wheel "
                        "(default: the installed vllm)")
    p.add_argument("--release", help="the release to compare with (default: the tree's own)")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument("--doc-table", action="store_true",
                   help="print the expectations as docs/mrv2.md's table and exit")
    args = p.parse_args(argv)
    if args.doc_table:
        print(doc_table())
        return 0
    source = Source(args.source or installed_vllm())
    release = args.release or source.release()
    results = check(source, release or "")
    if args.json:
        for r in results:
            print(json.dumps({"where": r.row.where, "kind": r.row.kind, "found": r.found,
                              "missing": r.missing, "expected": r.expected, "ok": r.ok}))
    else:
        print(report(source, release, results))
    if not results[0].known:
        return 2
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
