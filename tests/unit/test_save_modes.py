"""verl-prm writes weights through ``checkpoints.save_model`` / ``save_tensors``: safetensors alone writes its files
0600 and ``tempfile.mkdtemp`` its folders 0700, so a Ray worker or another user could not read a checkpoint."""

import os
import stat
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from verl_prm.checkpoints import save_model, save_tensors


@pytest.fixture(params=[0o022, 0o027, 0o077])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _modes(directory):
    return {str(p.relative_to(directory)): stat.S_IMODE(p.stat().st_mode) for p in [directory, *directory.rglob("*")]}


def test_save_model_gives_the_folder_and_every_file_the_modes_of_the_umask(tmp_path, umask):
    staging = Path(tempfile.mkdtemp(dir=tmp_path))  # 0700 whatever the umask
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    assert save_model(model, None, staging) == staging
    modes = _modes(staging)
    assert "model.safetensors" in modes
    expected = {name: (0o777 if (staging / name).is_dir() else 0o666) & ~umask for name in modes}
    assert modes == expected


def test_save_tensors_writes_a_readable_file_with_the_mode_of_the_umask(tmp_path, umask):
    from safetensors.torch import load_file

    file = save_tensors({"w": torch.arange(4.0)}, tmp_path / "head.safetensors", metadata={"k": "v"})
    assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~umask
    assert torch.equal(load_file(str(file))["w"], torch.arange(4.0))
