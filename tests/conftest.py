"""Shared fixtures. Tests are collected in importlib mode (pyproject), so this directory is no package and
cannot shadow the top-level `tests` package that the verl wheel installs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# The small real data set that ships with the repository (provenance and licences: data/README.md).
REPO_DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="session")
def repo_data() -> Path:
    """The repository's data/ folder (GSM8K test, MATH500, Math-Shepherd and PRM800K sample rows)."""
    missing = [name for name in ("gsm8k_test.jsonl", "math500_test.jsonl", "math_shepherd_samples.jsonl",
                                 "prm800k_samples.jsonl") if not (REPO_DATA / name).is_file()]
    if missing:
        pytest.fail(f"data files missing from {REPO_DATA}: {missing}; they are part of the repository (git checkout data/)")
    return REPO_DATA


def _training_texts(data_dir: Path, limit: int = 400) -> list[str]:
    texts = []
    with open(data_dir / "gsm8k_test.jsonl") as f:
        for line, _ in zip(f, range(limit)):
            row = json.loads(line)
            texts.append(row["question"] + "\n\n" + row["answer"])
    with open(data_dir / "math500_test.jsonl") as f:
        for line, _ in zip(f, range(limit // 2)):
            row = json.loads(line)
            texts.append(row["problem"] + "\n\n" + row["solution"])
    return texts


@pytest.fixture(scope="session")
def bpe_small(repo_data):
    """Byte-level BPE with few merges (vocab 300): most tokens are bytes or short merges."""
    from verl_prm.bpe import train_byte_level_bpe

    return train_byte_level_bpe(_training_texts(repo_data), vocab_size=300)


@pytest.fixture(scope="session")
def bpe_large(repo_data):
    """Byte-level BPE with many merges (vocab 2000): merges differ from bpe_small's."""
    from verl_prm.bpe import train_byte_level_bpe

    return train_byte_level_bpe(_training_texts(repo_data), vocab_size=2000)


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


@pytest.fixture
def assert_umask_modes():
    """A check that every file under a written directory has mode ``0o666 & ~umask`` and every folder
    ``0o777 & ~umask``, what ``open`` and ``mkdir`` give (safetensors alone writes its files 0600)."""
    mask = os.umask(0o022)
    os.umask(mask)

    def check(directory: Path) -> None:
        directory = Path(directory)
        modes = {path: path.stat().st_mode & 0o777 for path in [directory, *directory.rglob("*")]}
        wrong = {str(path): oct(mode) for path, mode in modes.items()
                 if mode != (0o777 if path.is_dir() else 0o666) & ~mask}
        assert not wrong, f"not the modes of umask {oct(mask)}: {wrong}"

    return check


@pytest.fixture
def restored_environ():
    """The whole process environment restored after the test: verl's ``Worker`` writes LOCAL_RANK and other keys
    into ``os.environ`` itself, which would make later tests (accelerate, TRL) start torch.distributed."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def worker_env(restored_environ, monkeypatch):
    """What verl's RayWorkerGroup puts in a worker's environment (one worker, rank 0)."""
    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29599"}.items():
        monkeypatch.setenv(key, value)
