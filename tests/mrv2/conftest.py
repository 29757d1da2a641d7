"""Fixtures of the MRV2 tests (harness.py): the embedded SmolLM2 target and a few of the
integration tests' chat prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

NUM_PROMPTS = 3


@pytest.fixture(scope="session")
def target_dir() -> Path:
    from vllm_treespec.assets import cache_home, ensure_target

    home = cache_home()
    home.mkdir(parents=True, exist_ok=True)
    return ensure_target(home)


@pytest.fixture(scope="session")
def chat_prompts(target_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    from tests.integration.prompts import CHAT_PROMPTS, chat_token_ids

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return chat_token_ids(tokenizer, CHAT_PROMPTS[:NUM_PROMPTS])
