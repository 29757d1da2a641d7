"""EAGLE-3 drafters shipped with the package (one directory per drafter, each with
config.json, model.safetensors and a MANIFEST.json of hashes and provenance)."""
