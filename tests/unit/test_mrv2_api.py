"""The import-free MRV2 API check (``vllm_treespec.commands.mrv2_api``) on real vLLM files.

- The installed vLLM 0.32.0 matches the table's 0.32.0 column, row by row.
- Negative control: a copy of those files with a method renamed, a parameter renamed and
  a base changed fails exactly those rows, read from a directory and from a wheel.
- docs/mrv2.md, section 5, holds the table the check prints.
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest

from vllm_treespec.commands import mrv2_api
from vllm_treespec.commands.mrv2_rows import ROWS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed() -> mrv2_api.Source:
    try:
        source = mrv2_api.Source(mrv2_api.installed_vllm())
    except FileNotFoundError:
        pytest.skip("vLLM is not installed")
    if source.release() != "0.32.0":
        pytest.skip(f"the installed vLLM is {source.release()}, the test reads 0.32.0")
    return source


def _by_where(results):
    return {(r.row.where, r.row.kind): r for r in results}


def test_the_installed_release_matches_its_column(installed):
    results = mrv2_api.check(installed, "0.32.0")
    assert [r.row.where for r in results if not r.ok] == []
    found = _by_where(results)
    # A few rows spelled out, so that a table edited to match a wrong reader fails here.
    register = found[("v1/worker/gpu/spec_decode/speculator_config.py::"
                      "register_speculative_method", "params")]
    assert (register.found, register.missing) == (None, "no file")
    propose = found[("v1/worker/gpu/spec_decode/speculator.py::BaseSpeculator.propose",
                     "params")]
    assert propose.found[:3] == ("input_batch", "attn_metadata", "slot_mappings")
    load = found[("v1/worker/gpu/model_runner.py::GPUModelRunner.load_model", "params")]
    assert load.found == ("load_dummy_weights", "*args", "model", "**kwargs")
    assert mrv2_api.main([str(installed.path)]) == 0


def _copy_rows(installed: mrv2_api.Source, dest: Path) -> Path:
    """The files the rows read (and ``_version.py``), copied under ``dest/vllm``."""
    for rel in {row.file for row in ROWS} | {"_version.py"}:
        text = installed.read(rel)
        if text is not None:
            target = dest / "vllm" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
    return dest


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{old!r} in {path}"
    path.write_text(text.replace(old, new), encoding="utf-8")


BROKEN = {
    ("v1/worker/gpu/spec_decode/speculator.py::DraftModelSpeculator.set_attn", "params"),
    ("v1/worker/gpu/model_runner.py::GPUModelRunner.sample_tokens", "params"),
    ("v1/worker/cpu/model_runner.py::CPUModelRunner", "bases"),
}


def _break(tree: Path) -> None:
    gpu, cpu = tree / "vllm/v1/worker/gpu", tree / "vllm/v1/worker/cpu"
    _edit(gpu / "spec_decode/speculator.py", "def set_attn(", "def set_attention(")
    _edit(gpu / "model_runner.py", "self, grammar_output: GrammarOutput | None\n    ) -> AsyncOutput",
          "self, grammar: GrammarOutput | None\n    ) -> AsyncOutput")
    _edit(cpu / "model_runner.py", "class CPUModelRunner(GPUModelRunner)",
          "class CPUModelRunner(object)")


def _assert_only_broken_rows_fail(source: mrv2_api.Source) -> None:
    results = _by_where(mrv2_api.check(source, source.release()))
    assert {key for key, r in results.items() if not r.ok} == BROKEN
    renamed = results[("v1/worker/gpu/spec_decode/speculator.py::DraftModelSpeculator.set_attn",
                       "params")]
    assert (renamed.found, renamed.missing) == (None, "no set_attn")
    param = results[("v1/worker/gpu/model_runner.py::GPUModelRunner.sample_tokens", "params")]
    assert param.found == ("grammar",) and param.expected == ("grammar_output",)


def test_a_renamed_method_or_parameter_fails_its_row(installed, tmp_path):
    tree = _copy_rows(installed, tmp_path / "tree")
    assert all(r.ok for r in mrv2_api.check(mrv2_api.Source(tree), "0.32.0"))  # copy is whole
    _break(tree)
    _assert_only_broken_rows_fail(mrv2_api.Source(tree))
    assert mrv2_api.main([str(tree)]) == 1
    # The same tree as a wheel: read in place, without unpacking.
    wheel = Path(shutil.make_archive(str(tmp_path / "vllm"), "zip", tree))
    assert zipfile.ZipFile(wheel).read("vllm/_version.py")
    _assert_only_broken_rows_fail(mrv2_api.Source(wheel))


def test_a_release_without_a_column_is_reported_not_judged(installed, capsys):
    assert mrv2_api.main([str(installed.path), "--release", "0.33.0"]) == 2
    assert "no expectations for 0.33.0" in capsys.readouterr().out


def test_the_design_page_holds_the_table():
    page = (ROOT / "docs" / "mrv2.md").read_text(encoding="utf-8")
    assert mrv2_api.doc_table() in page, (
        "docs/mrv2.md, section 5: paste `python -m vllm_treespec.commands.mrv2_api --doc-table`")
