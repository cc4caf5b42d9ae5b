"""Fixtures of the verl integration tests (tiny policy and critic directories, real GSM8K rows)."""

from __future__ import annotations

from pathlib import Path

import pytest
from verl_support import load_example, save_tiny_critic


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, bpe_small) -> Path:
    """The policy 'model' directory verl reads the tokenizer from (byte-level BPE, vocab 300)."""
    path = tmp_path_factory.mktemp("policy")
    bpe_small.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def critic_dir(tmp_path_factory, bpe_small) -> Path:
    """A critic with the policy's tokenizer."""
    return save_tiny_critic(tmp_path_factory.mktemp("critic"), bpe_small, seed=0)


@pytest.fixture(scope="module")
def critic_dir_other_vocab(tmp_path_factory, bpe_large) -> Path:
    """A critic with another tokenizer than the policy's (byte-level BPE, vocab 2000)."""
    return save_tiny_critic(tmp_path_factory.mktemp("critic_other_vocab"), bpe_large, seed=1)


@pytest.fixture(scope="module")
def gsm8k_rows(repo_data):
    """Real GSM8K test rows, made by the example's data preparation (verl's row layout)."""
    gsm8k = load_example("gsm8k")
    return gsm8k.make_rows(gsm8k.read_jsonl(repo_data / "gsm8k_test.jsonl")[:4], "test")
