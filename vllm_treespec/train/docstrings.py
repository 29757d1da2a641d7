"""Docstrings and documentation excerpts of installed code, for the ``code_stub``,
``code_task`` and ``docs`` prompts (see :mod:`prompts`): public functions with a
docstring and a signature from the standard library and ``DOC_PACKAGES``, and
passages of Python's topic help."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

# Packages that ship with the vLLM CPU install, so the corpus is the same on any
# machine set up by the project's scripts (for a given Python version).
DOC_PACKAGES = ["networkx", "sympy", "numpy", "jinja2", "more_itertools", "sortedcontainers"]
_SKIP_MODULES = {
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3",
    "ensurepip", "venv", "pydoc", "webbrowser", "__hello__", "__phello__", "_pydecimal",
    "pty", "tty", "crypt", "curses", "readline", "msvcrt", "winreg", "winsound", "_msi", "msilib",
}


def _clean_doc(doc: str, max_lines: int = 18) -> str:
    doc = inspect.cleandoc(doc)
    lines = doc.splitlines()
    out = []
    for line in lines:
        # numpy-style reference sections are long and not what a user writes
        if re.match(r"^\s*(See Also|References|Notes|Raises)\s*$", line):
            break
        out.append(line.rstrip())
        if len(out) >= max_lines:
            break
    while out and not out[-1].strip():
        out.pop()
    return "\n".join(out)


def _iter_modules(names: list[str]) -> Iterator:
    import pkgutil

    seen = set()
    for top in names:
        try:
            mod = importlib.import_module(top)
        except Exception:
            continue
        yield mod
        path = getattr(mod, "__path__", None)
        if not path:
            continue
        for info in pkgutil.walk_packages(path, prefix=top + "."):
            parts = info.name.split(".")[1:]
            # test suites and pytest plugins (importing those inside a pytest run
            # registers their markers) are not user-facing code
            if info.name in seen or any(p.startswith("_") or p in ("tests", "test", "testing")
                                        or "pytest" in p for p in parts):
                continue
            seen.add(info.name)
            try:
                yield importlib.import_module(info.name)
            except BaseException:
                continue


def _strip_dispatch(sig: str) -> str:
    # networkx wraps its algorithms in a backend dispatcher; users never write these
    sig = sig.replace(", *, backend=None, **backend_kwargs", "").replace(
        "*, backend=None, **backend_kwargs", "")
    # defaults that print as object reprs (with memory addresses) become `...`:
    # valid Python, and the same text in every process
    return re.sub(r"=<(?:[^<>]|<[^<>]*>)*>", "=...", sig)


def collect_docstrings(packages: list[str] | None = None, limit_per_module: int = 40,
                       limit_per_package: int = 700) -> list[dict]:
    """Public functions with a docstring and a signature, from stdlib + ``DOC_PACKAGES``."""
    stdlib = sorted(
        n for n in sys.stdlib_module_names if not n.startswith("_") and n not in _SKIP_MODULES
    )
    names = stdlib + list(packages if packages is not None else DOC_PACKAGES)
    out, seen = [], set()
    per_package: dict[str, int] = {}
    # Some modules print banners or deprecation notices on import.
    with warnings.catch_warnings(), open(os.devnull, "w") as devnull, \
            contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
        warnings.simplefilter("ignore")
        for mod in _iter_modules(names):
            top = mod.__name__.split(".")[0]
            if per_package.get(top, 0) >= limit_per_package:
                continue
            count = 0
            for attr, obj in sorted(vars(mod).items()):
                if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                    continue
                key = (getattr(obj, "__module__", None), getattr(obj, "__qualname__", attr))
                if key in seen:
                    continue
                doc = inspect.getdoc(obj)
                if not doc or len(doc) < 40:
                    continue
                try:
                    sig = _strip_dispatch(str(inspect.signature(obj)))
                except (TypeError, ValueError):
                    continue
                if len(sig) > 160:
                    continue
                seen.add(key)
                clean = _clean_doc(doc)
                summary = clean.split("\n\n")[0].replace("\n", " ").strip()
                out.append({"module": mod.__name__, "name": attr, "signature": sig, "doc": clean, "summary": summary})
                count += 1
                per_package[top] = per_package.get(top, 0) + 1
                if count >= limit_per_module or per_package[top] >= limit_per_package:
                    break
    return out


def collect_docstrings_isolated(packages: list[str] | None = None) -> list[dict]:
    """:func:`collect_docstrings` in a fresh interpreter.

    What a module exposes depends on what the process imported before (a
    package gains attributes as its submodules load), and some modules change
    global state when imported (pytest markers, warnings filters). A clean
    child process makes the list depend on the installed packages only.
    """
    import subprocess

    root = str(Path(__file__).resolve().parents[2])
    code = (
        "import json, sys\n"
        "from vllm_treespec.train.docstrings import collect_docstrings\n"
        "pk = json.loads(sys.argv[1])\n"
        "sys.stdout.write(json.dumps(collect_docstrings(pk)))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               PYTHONHASHSEED="0")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(packages)], capture_output=True, text=True,
                          env=env, check=True, cwd=root)
    return json.loads(proc.stdout)


def collect_excerpts(docs: list[dict]) -> list[str]:
    """Documentation passages: Python's topic help plus module docstrings."""
    out = []
    try:
        from pydoc_data.topics import topics

        for text in topics.values():
            paras = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 200]
            out.extend(p[:1200] for p in paras[:6])
    except ImportError:
        pass
    for d in docs:
        if len(d["doc"]) > 300:
            out.append(d["doc"][:1200])
    return out
