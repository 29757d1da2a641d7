"""A tiny end-to-end distillation: prompts -> vLLM generation with hidden-state
capture -> vocabulary -> training (interrupted and resumed) -> export."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.vllm


def _cli(args, log: Path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    with open(log, "a") as f:
        proc = subprocess.run([sys.executable, "-m", "vllm_treespec", "train-drafter", *args], cwd=ROOT,
                              env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1200)
    assert proc.returncode == 0, log.read_text()[-5000:]
    return log.read_text()


@pytest.fixture(scope="module")
def target_dir():
    from vllm_treespec.assets import ensure_target

    return ensure_target()


@pytest.fixture(scope="module")
def run(target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter")
    work = out / "work"
    common = ["--target", str(target_dir), "--out", str(out), "--work", str(work), "--seed", "3",
              "--num-prompts", "8", "--self-query-frac", "0", "--max-tokens", "40", "--gen-batch", "8",
              "--shard-size", "4", "--draft-vocab", "1024", "--no-vocab-corpus", "--steps", "14",
              "--eval-every", "7", "--save-every", "7", "--eval-seqs", "1", "--tokens-per-batch", "400",
              "--lr", "3e-3", "--warmup", "2", "--threads-train", "2"]
    log = out / "log.txt"
    # A wall-clock budget spent before the first shard: nothing generated, and the
    # vocabulary is not built from the (empty) data either.
    _cli(common + ["--stages", "prompts,generate,vocab", "--max-minutes", "1e-4"], log)
    early = {"shards": len(list((work / "data").glob("shard_*.safetensors"))),
             "vocab": (work / "vocab.safetensors").exists(),
             "progress": json.loads((work / "progress.json").read_text())}
    # First call stops after its first optimizer step (time budget) ...
    _cli(common + ["--stages", "prompts,generate,vocab,train", "--max-hours", "1e-7"], log)
    # ... the second resumes from the checkpoint and finishes.
    text = _cli(common + ["--stages", "train,export"], log)
    return {"out": out, "work": work, "log": text, "target": target_dir, "early": early,
            "common": common}


def test_a_spent_budget_stops_before_a_shard_and_skips_later_stages(run):
    assert run["early"]["shards"] == 0 and not run["early"]["vocab"]
    assert run["early"]["progress"]["shards"] == 0
    assert "rerun the same command to continue" in run["log"] or "stopped for time" in run["log"]
    progress = json.loads((run["work"] / "progress.json").read_text())
    assert progress["shards"] == 2 and progress["sequences"] == 8
    assert progress["train_steps"] == 14 and progress["generate_seconds"] > 0
    assert progress["best_accept_len_proxy"] is not None
    assert "progress so far: {\"generate_seconds\"" in run["log"]  # printed at start


def test_training_continues_from_an_exported_head(run, tmp_path):
    """--init HEAD: the run takes the head's vocabulary and starts from its
    weights (its first evaluation matches the head's); a run whose vocabulary
    differs from the head's is refused."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "data").symlink_to(run["work"] / "data")
    common = [a if a != str(run["work"]) else str(work) for a in run["common"]]
    i = common.index("--steps")
    common[i + 1] = "1"
    _cli(common + ["--stages", "vocab,train", "--init", str(run["out"])], tmp_path / "log.txt")
    history = json.loads((work / "train_history.json").read_text())
    head_eval = json.loads((run["out"] / "MANIFEST.json").read_text())["training"]["heldout_eval"]
    # the head was evaluated in fp32 before its bf16 export: allow a flip or two
    assert abs(history[0]["accept_len_proxy"] - head_eval["accept_len_proxy"]) < 0.1
    from vllm_treespec.train.trainer import TrainConfig, build_model
    from vllm_treespec.train.vocab import load_vocab

    assert list(load_vocab(work / "vocab.safetensors")) == list(load_vocab(run["work"] / "vocab.safetensors"))
    # --parallel K from the same head: slots and their stand-in state are added and
    # trained, and the export is a parallel-drafting checkpoint.
    parallel_out, parallel_work = tmp_path / "parallel", tmp_path / "parallel_work"
    parallel_work.mkdir()
    (parallel_work / "data").symlink_to(run["work"] / "data")
    (parallel_work / "vocab.safetensors").symlink_to(work / "vocab.safetensors")
    common = [parallel_out.as_posix() if a == str(run["out"]) else
              parallel_work.as_posix() if a == str(work) else a for a in common]
    _cli(common + ["--stages", "train,export", "--init", str(run["out"]), "--parallel", "3",
                   "--pard-token", "5", "--dtype", "float32"], tmp_path / "log.txt")
    config = json.loads((parallel_out / "config.json").read_text())
    assert config["pard_token"] == 5 and config["parallel_drafting_slots"] == 3
    from vllm_treespec.train.model import Eagle3Drafter

    head = Eagle3Drafter.load_checkpoint(parallel_out)
    assert head.cfg.parallel and head.mask_hidden.shape == (1, 3 * 576)
    cfg = TrainConfig(target=str(run["target"]), aux_layers=(2, 15, 27), init=str(run["out"]))
    with pytest.raises(ValueError, match="draft vocabulary differ"):
        other = tmp_path / "other"
        other.mkdir()
        from safetensors.numpy import save_file

        save_file({"draft_ids": load_vocab(work / "vocab.safetensors")[:-1]}, str(other / "vocab.safetensors"))
        build_model(cfg, other, "cpu")


def test_shards_hold_the_states_hf_computes(run):
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    shards = sorted((run["work"] / "data").glob("shard_*.safetensors"))
    assert len(shards) == 2
    d = load_file(str(shards[0]))
    a, b = d["tok_offsets"][:2]
    ha, hb = d["hid_offsets"][:2]
    assert hb - ha == b - a - 1  # every fed token, not the last sampled one
    model = AutoModelForCausalLM.from_pretrained(run["target"], dtype=torch.float32)
    with torch.no_grad():
        hs = model(torch.tensor(d["tokens"][a : b - 1]).long()[None], output_hidden_states=True).hidden_states
    cap = torch.from_numpy(d["hidden"][ha:hb]).float()
    for j, layer in enumerate([2, 15, 27, 30]):  # vLLM's aux layers, then the final (normed) state
        ref = hs[layer][0]
        assert (cap[:, j] - ref).abs().max() / ref.abs().max() < 2e-3, layer


def test_training_resumes_and_lowers_the_loss(run):
    from vllm_treespec.train.data import collate, load_shard, shard_files
    from vllm_treespec.train.target_weights import load_target_head
    from vllm_treespec.train.trainer import TrainConfig, build_model, step_losses

    assert "resumed at step 1" in run["log"]
    ck = torch.load(run["work"] / "ckpt" / "last.pt", map_location="cpu", weights_only=False)
    assert ck["state"]["step"] == 14
    cfg = TrainConfig(**{k: v for k, v in ck["config"].items()})
    seqs = [s for f in shard_files(run["work"] / "data") for s in load_shard(f)]
    batch = collate(seqs[1:4], cfg.ttt_steps)
    model = build_model(cfg, run["work"], "cpu")
    _, _, head, _ = load_target_head(cfg.target)
    head_d = head[model.draft_ids]
    with torch.no_grad():
        before, _ = step_losses(model, head_d, batch, cfg)
        model.load_state_dict(ck["model"], strict=False)
        after, stats = step_losses(model, head_d, batch, cfg)
    assert float(after) < 0.8 * float(before), (float(before), float(after))


def test_export_is_a_loadable_checkpoint_with_manifest(run):
    from vllm_treespec.assets import sha256_file
    from vllm_treespec.train.model import Eagle3Drafter
    from vllm_treespec.train.target_weights import load_target_head

    out = run["out"]
    manifest = json.loads((out / "MANIFEST.json").read_text())
    for name, digest in manifest["files"].items():
        assert sha256_file(out / name) == digest
    assert manifest["seed"] == 3 and manifest["data"]["sequences"] == 8
    assert manifest["training"]["steps"] == 14
    _, embed, _, _ = load_target_head(run["target"])
    model = Eagle3Drafter.load_checkpoint(out, embed_weight=embed)
    assert model.cfg.draft_vocab_size == 1024 and model.cfg.aux_layers == (2, 15, 27)
    ids = model.draft_ids
    assert torch.all(ids[1:] > ids[:-1]) and int(model.t2d.sum()) == 1024
    assert bool(model.t2d[2])  # the end-of-turn token is always draftable
