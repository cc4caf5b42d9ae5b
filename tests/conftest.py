"""Shared fixtures. Tests are collected in importlib mode (pyproject), so this directory is no package and
cannot shadow the top-level `tests` package that the verl wheel installs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"../shared/data not found at {SHARED_DATA}: tests read the small real data set there")
    return SHARED_DATA


def _training_texts(shared: Path, limit: int = 400) -> list[str]:
    texts = []
    with open(shared / "gsm8k_test.jsonl") as f:
        for line, _ in zip(f, range(limit)):
            row = json.loads(line)
            texts.append(row["question"] + "\n\n" + row["answer"])
    with open(shared / "math500_test.jsonl") as f:
        for line, _ in zip(f, range(limit // 2)):
            row = json.loads(line)
            texts.append(row["problem"] + "\n\n" + row["solution"])
    return texts


@pytest.fixture(scope="session")
def bpe_small(shared_data):
    """Byte-level BPE with few merges (vocab 300): most tokens are bytes or short merges."""
    from verl_prm.bpe import train_byte_level_bpe

    return train_byte_level_bpe(_training_texts(shared_data), vocab_size=300)


@pytest.fixture(scope="session")
def bpe_large(shared_data):
    """Byte-level BPE with many merges (vocab 2000): merges differ from bpe_small's."""
    from verl_prm.bpe import train_byte_level_bpe

    return train_byte_level_bpe(_training_texts(shared_data), vocab_size=2000)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray cluster for the whole test session (a start costs ~40 s on 2 cores).

    num_cpus is virtual: verl's resource pools ask for `max_colocate_count` CPUs per bundle.
    """
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=16,
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}},
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """One intra-op thread for the tiny models of the tests: on 2 cores, OpenMP threads that spin-wait for busy
    cores (Ray actors, subprocesses) make tiny models up to 10x slower (80 training steps: 8.8 s with 1 thread,
    144 s with 2 under load)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
