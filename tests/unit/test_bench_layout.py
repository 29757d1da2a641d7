"""Benchmarks have one home and keep to the package's public names; their results are
cited and named one way (docs/benchmarks.md).

- No Python file under `benchmarks/` outside the results: benchmark code lives in
  `vllm_treespec/bench/`.
- No module of `vllm_treespec/bench/` reaches a private name (a leading underscore) of
  another module of the package: by import, as an attribute of something imported from the
  package, or as a private attribute the package defines on its objects. The names still
  waiting to be made public are listed, and each must still be in use.
- Every entry of `benchmarks/results/` is cited by its full name on RESULTS.md, its history,
  a page of `docs/` or the README, or in the code.
- A results entry is named `<what>-vllm<release>-<machine>-<commit>`, or is one of the
  legacy names from before the scheme.

Nothing here imports the benchmarks: their sources are read and parsed.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_treespec"
BENCH = sorted((PACKAGE / "bench").glob("*.py"))
RESULTS_DIR = ROOT / "benchmarks" / "results"
CITING = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md",
          ROOT / "benchmarks" / "history" / "RESULTS-history.md",
          *sorted((ROOT / "docs").glob("*.md"))]

# Private names of vllm_glue/ a benchmark still uses, as "module: name": made public there,
# they leave this list (the test below fails while an entry is no longer used).
WAITING: set[str] = set()

# <what>-vllm<release>-<machine>-<commit>: docs/benchmarks.md, "Results directories".
SCHEME = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*-vllm\d{3,4}-[a-z][a-z0-9]*-[0-9a-f]{7}")
# Entries from before the scheme, cited by these names on RESULTS.md and its history.
LEGACY = frozenset("""
    adaptive-test-repro-effe0cb bf16-divergence-epyc concurrency16 concurrency16-avx2
    concurrency16-chains concurrency16-cold-845c064 concurrency16-cold-b264118
    concurrency16-deferred concurrency16-epyc-chainmode concurrency16-epyc-cold-cache
    concurrency16-epyc-library-op cpu_tree_attention-avx512.json cpu_tree_attention-chains.json
    cpu_tree_attention.json cycle-priced-stops-withdrawn-avx512 drafter-allocation-epyc
    drafter-allocation-warmup-avx512 drafter-sitting-seed7-avx512 drafter_acceptance.json
    hybrid-c16-off-drop-vllm032-epyc hybrid-c16-vllm032-avx512
    hybrid-c32-off-drop-run2-vllm032-epyc hybrid-c32-off-drop-run3-vllm032-epyc
    hybrid-c32-off-drop-run4-vllm032-epyc hybrid-c32-off-drop-vllm032-epyc
    hybrid-c32-off-gate-vllm032-epyc hybrid-c64-branch-priced-vllm032-epyc
    hybrid-c64-drafted-extra-vllm032-epyc hybrid-c64-off-drop-run2-vllm032-epyc
    hybrid-c64-off-drop-vllm032-epyc hybrid-c64-off-gate-vllm032-epyc
    hybrid-code-edit-vllm032-avx512 hybrid-mtbench2-vllm032-avx512
    hybrid-pangu240-full-vllm032-epyc hybrid-pangu240-vllm032-avx512
    interleaved-ab-batch1-20turns.json interleaved-ab-chat-12turns-branch-extra.json
    interleaved-ab-chat-12turns.json interleaved-ab-none-tree.json interleaved-ab-stock.json
    interleaved-ab-sweep-m-depth4.json interleaved-ab-wide.json
    interleaved-epyc-before-chainmode.json interleaved-epyc-chainmode.json
    interleaved-epyc-paged-chains.json load-c32-c64-avx2-14a84a2
    memory-retention-prototype-avx512-cbf352d must-show-epyc-draft-overhead
    must-show-epyc-library-op mustshow-fresh-clone-3d5d9f0 mustshow-fresh-clone-avx512-04ca55d
    mustshow-fresh-clone-avx512-6e154a7 pangu240-10-fresh-clone-head241-avx2-406f80f
    pangu240-full-avx512-4349b38 pangu240-limit10 pangu240-limit10-avx2
    pangu240-limit10-backoff pangu240-limit10-chain-split pangu240-limit10-chains
    pangu240-limit10-conditional pangu240-limit10-deferred pangu240-limit10-epyc-chainmode
    pangu240-limit10-fixed-part pangu240-limit10-fresh-chunk pangu240-limit10-m8d3-845c064
    pangu240-limit10-m8d3-epyc pangu240-limit10-offpath pangu240-limit10-smallm
    pangu240-limit10-vllm0271-epyc pangu240-limit10-vllm032-avx512
    pangu240-limit10-vllm032-epyc pangu240-limit10-xeon-iomp pangu240-limit20-256-epyc-chain-ab
    pangu240-limit20-256-epyc-chainmode pangu240-limit20-256-epyc-cold
    pangu240-limit20-256-epyc-newhead pangu240-limit20-256-epyc-tree-cuts
    parallel-drafting-cost-avx2-9f0ecd7 parallel-head-avx2-51de49f
    parallel-head-second-sitting-avx512-ef739d7 parallel-step-cost-avx512-ef739d7
    parallel-tree-adaptive-side-by-side-avx512-628267f parallel-tree-must-show-avx512-519b88b
    selection-replay-pool64-depth8-avx512 served-ab-1 served-ab-11-amd-slow
    served-ab-12-epyc-before served-ab-13-epyc-paged-chains served-ab-14-chain-whole
    served-ab-15-cheaper-branching served-ab-16-best-stock served-ab-17-final
    served-ab-18-overheads served-ab-19-c16-31b3d83 served-ab-2-noprefix
    served-ab-3-fresh-chunk served-ab-4-branch-extra served-ab-5-per-tree-acceptance
    served-ab-6-chains served-ab-7-fixed-part served-ab-8-off-probes
    served-ab-9-fixed-part-reverted served-ab-batch1-20turns-a-head241-avx2-a9c41ae
    served-ab-batch1-20turns-avx512-4f493a0 served-ab-batch1-20turns-avx512-97fd833
    served-ab-batch1-20turns-b-head241-avx2-a9c41ae served-ab-batch1-20turns-cost-shift-avx512
    served-ab-batch1-20turns-cost-shift-repeat-avx512
    served-ab-batch1-20turns-early-stop-avx512 served-ab-batch1-20turns-early-stop-top1-avx512
    served-ab-batch1-20turns-head256-avx512-64a758c
    served-ab-batch1-20turns-head256-avx512-cd84d50
    served-ab-batch1-20turns-none-avx512-f51f9c6 served-ab-batch1-4methods-vllm032-epyc
    served-ab-batch1-chains-head241-avx2-1d4e5eb
    served-ab-batch1-fixed8-depth-weight-avx2-4a26fc2
    served-ab-batch1-fixed8-depth-weight-sweep-avx2-1605e08
    served-ab-batch1-fixed8-depth8-avx512-d405f19 served-ab-batch1-fixed8-head241-avx2-1d4e5eb
    served-ab-batch1-fixed8-head256-avx512 served-ab-batch1-fixed8-head260-avx512-95f2d03
    served-ab-batch1-head203-avx2-28a8ee4 served-ab-batch1-head241-avx2-1d4e5eb
    served-ab-batch1-onewide4-avx512-925a9ea served-ab-batch1-t07-avx2-28a8ee4
    served-ab-batch1-t07-avx2-6b5b1a4 served-ab-batch1-t07-avx2-c705e97
    served-ab-batch1-t07-head256-avx512-0767515 served-ab-batch1-t07-head256-avx512-c547303
    served-ab-batch1-t07-vllm032-epyc served-ab-batch1-t10-head256-avx512-0767515
    served-ab-batch1-t10-head256-avx512-c547303 served-ab-c16-avx512-4f493a0
    served-ab-c16-avx512-893ca9c served-ab-c16-cost-shift-avx512
    served-ab-c16-greedy-head241-avx2-950763e served-ab-c16-t07-head241-avx2-1d4e5eb
    served-ab-c16-t07-head256-avx512-0767515 served-ab-c16-t07-head256-avx512-967d632
    served-ab-c16-t07-vllm032-epyc served-ab-c16-vllm032-avx512 served-ab-c32-avx2-5dc591f
    served-ab-c64-avx512-2efd68c served-ab-frame-stack-room-avx512-94afadc
    served-ab-metrics-before-after-avx512 served-ab-mustshow-head203-avx2-6ea4bf6
    served-ab-one-wide-8turns-avx512-4f493a0 served-ab-one-wide-avx512-c7fddf9
    served-ab-parallel-head-old-vs-new-avx512-759e32c served-ab-structure-before-after-avx512
    served-ab-tp2-batch1-vllm032-epyc served-ab-tp2-c8-vllm032-epyc
    soak-200-adaptive-nucleus-avx512-04ca55d soak-200-epyc soak-200-epyc-3 soak-200-epyc-4
    soak-200-fixed-full-warmup-avx2-713b6b3 soak-200-fixed-three-passes-avx512-cbf352d
    soak-200-fresh-clone-avx2-8dfd08a soak-300-fixed-three-passes-idle-trim-avx512-9f4ef67
    soak-300-fixed-three-passes-idle-trim-no-settle-avx512
    soak-300-fixed-two-passes-avx512-494d02f soak-600-adaptive-avx2-6b5b1a4
    soak-600-fixed-avx2-65e76f1 soak-600-fixed-full-warmup-avx512-64a758c
    soak-600-fixed-idle-trim-avx512-5599403 stats-file-and-row-costs-avx512 step-costs-avx512
    step-profile-avx512-49708ac step-profile-avx512-97fd833
    step-profile-t07-unseeded-avx512-c547303 stock-t1-vllm032-avx512 stop-replay-avx512
    sweeps-table2-avx2-a99ee78 sweeps-table2-avx512-97fd833 tree-node-logits-cost-avx512
    tree-penalties-cost-avx512 tree-sampling-cost-avx2-28a8ee4
    tree-sampling-cost-seeded-avx2-5084a0f.json tree_attention_kernel-cpu.json
    tree_attention_kernel-h200-row-kernel.json tree_attention_kernel-h200-splits.txt
    tree_attention_kernel-h200.json tree_overhead.json
""".split())


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# ---- one home ---------------------------------------------------------------------------

def test_benchmark_code_has_one_home():
    """A results directory may keep the one-off script its run used, a record of what
    ran (three do, cited by the history); nothing else under benchmarks/ is code."""
    assert len(BENCH) >= 20  # the benchmarks are found at all
    stray = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*.py")
                   if not p.is_relative_to(RESULTS_DIR))
    assert not stray, f"benchmark code belongs in vllm_treespec/bench/: {stray}"


# ---- public names only ------------------------------------------------------------------

def _private(name: str) -> bool:
    return len(name) > 1 and name.startswith("_") and not (
        name.startswith("__") and name.endswith("__"))


def _defined_private(tree: ast.AST) -> set[str]:
    """Private names a source defines for attribute access: functions, classes and
    methods, class attributes, and attributes it assigns on any object."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                        names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {n for n in names if _private(n)}


@functools.cache
def package_private_attributes() -> frozenset[str]:
    return frozenset().union(*(_defined_private(ast.parse(_text(p)))
                               for p in PACKAGE.rglob("*.py")))


def _ours(module: str | None, level: int) -> bool:
    return level > 0 or module == "vllm_treespec" or (module or "").startswith("vllm_treespec.")


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) of every private name of the package ``source`` reaches: imported
    (``from vllm_treespec.x import _y``, or through a private module), as an attribute of
    a name imported from the package (``tree_sampler._node_rows``), or as an attribute the
    package defines privately and the source does not (``budget._steps``). vLLM's own
    names, ``self``'s and ``cls``'s attributes and dunders are not counted."""
    tree = ast.parse(source)
    ours: set[str] = set()  # names bound to something imported from the package
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _ours(node.module, node.level):
            found += [(node.lineno, p) for p in (node.module or "").split(".") if _private(p)]
            for alias in node.names:
                if _private(alias.name):
                    found.append((node.lineno, alias.name))
                ours.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name, 0):
                    found += [(node.lineno, p) for p in alias.name.split(".") if _private(p)]
                    ours.add(alias.asname or alias.name.split(".")[0])
    own = _defined_private(tree)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        base = node.value
        while isinstance(base, ast.Attribute):
            base = base.value
        root = base.id if isinstance(base, ast.Name) else None
        if root in ("self", "cls"):
            continue
        if root in ours:
            found.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
        elif node.attr in package_private_attributes() and node.attr not in own:
            found.append((node.lineno, f".{node.attr}"))
    return sorted(set(found))


@functools.cache
def _bench_private_uses() -> dict[str, list[int]]:
    uses: dict[str, list[int]] = {}
    for path in BENCH:
        for line, name in private_uses(_text(path)):
            uses.setdefault(f"{path.name}: {name}", []).append(line)
    return uses


def test_benchmarks_use_only_public_names_of_the_package():
    uses = _bench_private_uses()
    new = {f"vllm_treespec/bench/{k} (line {v[0]})" for k, v in uses.items() if k not in WAITING}
    assert not new, ("private names of the package, used by benchmark code (make them public "
                     f"in their module): {sorted(new)}")


def test_the_private_names_waiting_are_still_used():
    """An entry of WAITING made public (or no longer used) leaves the list."""
    gone = WAITING - set(_bench_private_uses())
    assert not gone, f"no longer used, drop from WAITING: {sorted(gone)}"


def test_the_private_name_check_catches_a_planted_use():
    """Negative control: each kind of private use is reported; vLLM's private modules,
    the source's own private attributes, ``self``'s and dunders are not."""
    assert "_steps" in package_private_attributes()  # AdaptiveBudget's step counter
    planted = (
        "import vllm_treespec\n"
        "import vllm_treespec.policy._hidden\n"
        "from vllm import _custom_ops\n"
        "from vllm_treespec.tree import accept as acc\n"
        "from vllm_treespec.vllm_glue.tree_sampler import VerifyStep, _node_rows\n"
        "\n"
        "class Mine:\n"
        "    def __init__(self):\n"
        "        self._own = 1\n"
        "\n"
        "def f(budget, runner):\n"
        "    runner._ab_steps = []\n"
        "    walk = acc._greedy_accept_trees\n"
        "    steps = budget._steps\n"
        "    return Mine()._own, runner._ab_steps, vllm_treespec.__version__, _custom_ops\n")
    assert private_uses(planted) == [(2, "_hidden"), (5, "_node_rows"),
                                     (13, "acc._greedy_accept_trees"), (14, "._steps")]
    assert private_uses("from vllm_treespec.tree.accept import probs_at_nodes\n") == []


# ---- results: cited, named one way ------------------------------------------------------

def _entries() -> list[str]:
    return sorted(p.name for p in RESULTS_DIR.iterdir() if not p.name.startswith("."))


def uncited(names: list[str], texts: list[str]) -> list[str]:
    """The names no text cites in full: a longer name, an abbreviation (``...-run2-...``)
    or a brace or glob pattern is not a citation."""
    return [n for n in names
            if not any(re.search(rf"(?<![\w.-]){re.escape(n)}(?![\w-]|\.\w)", t) for t in texts)]


def test_every_results_entry_is_cited():
    names = _entries()
    assert len(names) >= 40  # the directory is found at all
    missing = uncited(names, [_text(p) for p in CITING])
    assert not missing, ("benchmarks/results/ entries no page cites: cite them by their full "
                         f"name or `git rm -r` them (docs/benchmarks.md): {missing}")


def test_the_citation_check_needs_the_full_name():
    names = ["served-ab-c16-vllm032-epyc-c8e7cf3", "served-ab-c16-run2-vllm032-epyc-c8e7cf3",
             "hybrid-c32-off-drop-run2-vllm032-epyc", "tree_overhead.json"]
    text = ("`results/served-ab-c16{,-run2}-vllm032-epyc-c8e7cf3/`, "
            "`results/hybrid-c32-off-drop-vllm032-epyc/`, `...-run2-...`, "
            "`results/tree_overhead.json.bak`")
    assert uncited(names, [text]) == names
    cited = ("`results/served-ab-c16-vllm032-epyc-c8e7cf3/`, "
             "results/served-ab-c16-run2-vllm032-epyc-c8e7cf3/summary.json; "
             "(`hybrid-c32-off-drop-run2-vllm032-epyc`) and `results/tree_overhead.json`.")
    assert uncited(names, [cited]) == []


def misnamed(names: list[str], legacy: frozenset[str] = LEGACY) -> list[str]:
    return [n for n in names if n not in legacy and not SCHEME.fullmatch(n)]


def test_results_entries_follow_the_naming_scheme():
    names = _entries()
    wrong = misnamed(names)
    assert not wrong, ("name new results <what>-vllm<release>-<machine>-<commit> "
                       f"(docs/benchmarks.md): {wrong}")
    assert LEGACY <= set(names), f"legacy names with no entry: {sorted(LEGACY - set(names))}"


def test_the_naming_check_catches_a_wrong_name():
    good = ["soak-600-adaptive-vllm032-epyc-5dd9c48", "pangu240-limit10-vllm0271-avx2-0123abc",
            "served-ab-c16-run2-vllm032-epyc-c8e7cf3"]
    bad = ["served-ab-c16-epyc-fb3b4ca",          # no release
           "soak-600-vllm032-epyc",               # no commit
           "soak-600-vllm032-epyc-5dd9c4",        # a short commit
           "Soak-600-vllm032-epyc-5dd9c48",       # upper case
           "soak_600-vllm032-epyc-5dd9c48",       # an underscore
           "tree_overhead.json"]                  # a file, not legacy here
    assert misnamed(good + bad, frozenset()) == bad
    assert misnamed(["tree_overhead.json"]) == []  # grandfathered
