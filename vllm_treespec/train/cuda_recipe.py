"""The drafter's CUDA recipe: train the SmolLM2 EAGLE-3 head on a GPU machine that
has torch, transformers and triton but no vLLM and no network, and that receives
its inputs in pieces of at most 64 MiB (with the repository itself).

Two halves (``scripts/train-drafter-cuda.sh`` calls them):

``pack DIR`` (here) writes what the GPU machine lacks: the target's GGUF cut into
parts of ``--part-mib`` (it is 94 MB; the repository travels with each part),
each with its SHA-256, and the ``gguf`` wheel that transformers needs to read the
GGUF; optionally a ``prompts.jsonl`` made here. ``pack.json`` lists it all.

``run DIR`` (on the GPU machine, once per delivery, then as often as needed)
moves the parts found in DIR into a store outside the repository, checked
part by part; once all are there it joins them, checks the whole file against
the hash the assets pin, converts it to an fp32 Hugging Face directory, and runs
``train-drafter`` with the transformers backend on CUDA for at most
``--minutes``. Every stage resumes, so the same command continues where the
last one stopped; when the head is exported it is copied to ``--out`` (with
``--out-part-mib``, its weights in parts for a machine that hands back only
small files; ``join-head DIR`` here rejoins them, checked against the head's
``MANIFEST.json``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_treespec import assets

DEFAULT_STORE = Path.home() / ".cache" / "vllm-treespec" / "cuda-recipe"
# ~3.3M self-distilled positions (9000 prompts and 10 % follow-ups, ~330 positions
# each), four epochs; every invocation is bounded by --max-minutes.
TRAIN_ARGS = ["--num-prompts", "9000", "--self-query-frac", "0.14", "--max-tokens", "320",
              "--gen-batch", "128", "--shard-size", "256", "--epochs", "4",
              "--tokens-per-batch", "16384", "--eval-seqs", "256", "--no-vocab-corpus"]


def _holds(path: Path, sha256: str) -> bool:
    return path.exists() and assets.sha256_file(path) == sha256


def _cut(src: Path, dst: Path, part_mib: float) -> list[Path]:
    """``src`` as ``dst/<name>.part0, .part1, ...`` of at most ``part_mib`` MiB each."""
    parts, size = [], int(part_mib * 2**20)
    if size < 1:
        raise ValueError(f"part size {part_mib} MiB is under one byte")
    with open(src, "rb") as f:
        while chunk := f.read(size):
            parts.append(dst / f"{src.name}.part{len(parts)}")
            parts[-1].write_bytes(chunk)
    return parts


def pack(out: Path, part_mib: float, prompts_from: Path | None = None,
         wheel: Path | None = None) -> dict:
    """Write the parts, wheel (and prompts) into ``out``; returns ``pack.json``.
    Without ``wheel`` the installed ``gguf``'s version is downloaded from the
    package index."""
    out.mkdir(parents=True, exist_ok=True)
    gguf = assets.find_gguf()
    parts = [{"name": part.name, "bytes": part.stat().st_size,
              "sha256": assets.sha256_file(part)} for part in _cut(gguf, out, part_mib)]
    if prompts_from is not None:
        shutil.copy(prompts_from, out / "prompts.jsonl")
    if wheel is None:  # the version installed here, which reads this file
        from importlib.metadata import version

        wheel_dir = Path(tempfile.mkdtemp(prefix="gguf-wheel-"))
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                        str(wheel_dir), f"gguf=={version('gguf')}"], check=True)
        wheel = next(wheel_dir.glob("gguf-*.whl"))
    shutil.copy(wheel, out / wheel.name)
    manifest = {"gguf": gguf.name, "sha256": assets.GGUF_SHA256, "parts": parts,
                "prompts": "prompts.jsonl" if prompts_from is not None else None,
                "wheel": wheel.name}
    (out / "pack.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def collect(pack_dir: Path, store: Path) -> list[str]:
    """Move the parts present in ``pack_dir`` into ``store`` (each checked), copy
    the prompts and wheel; return the names of the parts still missing."""
    manifest = json.loads((pack_dir / "pack.json").read_text())
    store.mkdir(parents=True, exist_ok=True)
    shutil.copy(pack_dir / "pack.json", store / "pack.json")
    for name in filter(None, (manifest["prompts"], manifest["wheel"])):
        if (pack_dir / name).exists():
            shutil.copy(pack_dir / name, store / name)
    missing = []
    for part in manifest["parts"]:
        src, dst = pack_dir / part["name"], store / part["name"]
        if _holds(dst, part["sha256"]):
            continue
        if not src.exists():
            missing.append(part["name"])
            continue
        digest = assets.sha256_file(src)
        if digest != part["sha256"]:
            raise ValueError(f"{src} is corrupt: SHA-256 {digest}, expected {part['sha256']}")
        shutil.copy(src, dst)
    return missing


def join(store: Path) -> Path:
    """The whole GGUF from its parts in ``store``, checked against the pinned hash."""
    manifest = json.loads((store / "pack.json").read_text())
    gguf = store / manifest["gguf"]
    if not _holds(gguf, assets.GGUF_SHA256):
        with open(gguf.with_suffix(".tmp"), "wb") as f:
            for part in manifest["parts"]:
                f.write((store / part["name"]).read_bytes())
        digest = assets.sha256_file(gguf.with_suffix(".tmp"))
        if digest != assets.GGUF_SHA256:
            raise ValueError(f"the joined {gguf.name} has SHA-256 {digest}, expected "
                             f"{assets.GGUF_SHA256}")
        gguf.with_suffix(".tmp").replace(gguf)
    return gguf


def target_from(store: Path, gguf: Path) -> Path:
    target = store / assets.TARGET_NAME
    if not (target / "config.json").exists():
        try:
            import gguf as _  # noqa: F401
        except ImportError:
            manifest = json.loads((store / "pack.json").read_text())
            subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                            "-q", "--target", str(store / "pylib"),
                            str(store / manifest["wheel"])], check=True)
            sys.path.insert(0, str(store / "pylib"))
        tmp = store / (assets.TARGET_NAME + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        assets.convert_gguf(gguf, tmp)
        tmp.replace(target)
    return target


def run(pack_dir: Path, store: Path, minutes: float, out: Path, device: str,
        extra: list[str] = (), out_part_mib: float | None = None) -> str:
    """One bounded invocation on the GPU machine; returns what state it left."""
    missing = collect(pack_dir, store)
    if missing:
        return f"waiting for parts {missing} (rerun with them in {pack_dir})"
    target = target_from(store, join(store))
    work = store / "work"
    work.mkdir(exist_ok=True)
    if (store / "prompts.jsonl").exists() and not (work / "prompts.jsonl").exists():
        shutil.copy(store / "prompts.jsonl", work / "prompts.jsonl")  # made with the pack
    head = store / "head"
    common = ["--target", str(target), "--out", str(head), "--work", str(work), "--backend",
              "transformers", "--device", device]
    started = time.time()
    _train_drafter([*common, "--stages", "prompts,generate,followups,vocab,train,export",
                    "--max-minutes", str(minutes), *TRAIN_ARGS, *extra])
    exported = (head / "config.json").exists() and (head / "config.json").stat().st_mtime >= started
    if not exported and (work / "ckpt" / "last.pt").exists():
        # Training stopped for time before its last step: export the best evaluated step
        # so far all the same, since a lease may end before a rerun; a rerun trains on
        # from the checkpoint and exports again.
        try:
            _train_drafter([*common, *TRAIN_ARGS, *extra, "--stages", "export"])
        except RuntimeError as e:  # no evaluated step yet
            print(f"no head to export yet: {e}")
    if (head / "config.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(head, out)
        if out_part_mib:  # a machine that returns only small files: join-head puts it back
            weights = out / "model.safetensors"
            _cut(weights, out, out_part_mib)
            weights.unlink()
        if exported:
            return f"done: head exported to {out}"
        return f"partial: the best step so far exported to {out}; rerun to train on"
    return "progress: rerun the same command to continue"


def join_head(head: Path) -> Path:
    """A head returned in parts (``run --out-part-mib``) made whole again, each
    file checked against the SHA-256 its ``MANIFEST.json`` lists."""
    files = json.loads((head / "MANIFEST.json").read_text())["files"]
    for name, digest in files.items():
        parts = sorted(head.glob(f"{name}.part*"), key=lambda p: int(p.name.rsplit("part", 1)[1]))
        whole = head / name
        if parts:
            with open(whole.with_name(name + ".tmp"), "wb") as f:
                for part in parts:
                    f.write(part.read_bytes())
            whole.with_name(name + ".tmp").replace(whole)
        if not _holds(whole, digest):
            raise ValueError(f"{whole} does not match its MANIFEST (SHA-256 {digest}): a part "
                             f"is missing or corrupt ({[p.name for p in parts]})")
        for part in parts:
            part.unlink()
    return head


def _train_drafter(argv: list[str]) -> None:
    from vllm_treespec.train.cli import main

    if main(argv) != 0:
        raise RuntimeError(f"train-drafter {' '.join(argv)} failed")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_treespec.train.cuda_recipe")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="here: write the GGUF parts, prompts and wheel into DIR")
    a.add_argument("dir", type=Path)
    a.add_argument("--part-mib", type=float, default=32)
    a.add_argument("--prompts", type=Path, default=None,
                   help="a prompts.jsonl to carry (default: the GPU machine writes them)")
    r = sub.add_parser("run", help="on the GPU machine: collect parts, then train for a while")
    r.add_argument("dir", type=Path)
    r.add_argument("--store", type=Path, default=DEFAULT_STORE)
    r.add_argument("--minutes", type=float, default=8.0)
    r.add_argument("--out", type=Path, required=True, help="where the exported head goes")
    r.add_argument("--device", default="cuda")
    r.add_argument("--train-args", default="",
                   help="train-drafter options that override the recipe's (a smaller run)")
    r.add_argument("--out-part-mib", type=float, default=None,
                   help="write the head's weights in parts of this size (join-head rejoins)")
    j = sub.add_parser("join-head", help="here: rejoin a head returned in parts, checked")
    j.add_argument("dir", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "pack":
        print(json.dumps(pack(args.dir, args.part_mib, args.prompts), indent=2))
    elif args.cmd == "join-head":
        print(f"[cuda-recipe] head whole and checked: {join_head(args.dir)}")
    else:
        state = run(args.dir, args.store, args.minutes, args.out, args.device,
                    shlex.split(args.train_args), args.out_part_mib)
        print(f"[cuda-recipe] {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
