"""What the verl integration tests share: composing verl's config as main_ppo does, the example data, tiny critics
and the responses the reward and advantage tests score. On sys.path through pytest's ``pythonpath`` setting."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import verl
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
LAUNCHERS = sorted((EXAMPLES / "pav_grpo").glob("*.sh"))
VERL_CONFIG_DIR = str(Path(verl.__file__).resolve().parent / "trainer" / "config")
PLUGIN_OVERRIDES = ["hydra.searchpath=[pkg://verl_prm.config]", "+verl_prm=pav"]


def compose_verl(overrides: list[str]):
    """verl's ppo_trainer config composed with `overrides`, as `python -m verl.trainer.main_ppo` composes it."""
    with initialize_config_dir(config_dir=VERL_CONFIG_DIR, version_base=None):
        return compose("ppo_trainer", overrides=list(overrides))


def compose_validated(overrides: list[str]):
    """``compose_verl(overrides)`` checked by verl's own ``validate_config``, as main_ppo checks it before it
    starts."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    config = compose_verl(overrides)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    return config


def load_example(name: str):
    path = EXAMPLES / "data_preprocess" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module



def save_tiny_critic(path: Path, tokenizer, seed: int) -> Path:
    """A tiny random native-format critic (Qwen2 token classification, num_labels=1) with its tokenizer."""
    from transformers import Qwen2Config, Qwen2ForTokenClassification

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    Qwen2ForTokenClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path



def responses_for(rows, tokenizer) -> list[tuple[dict, str, list[int]]]:
    """Per row: a correct response (the reference answer, one step per line, EOS), a wrong one (last number + 1,
    EOS) and a truncated one (no EOS). Returns (row, text, ids)."""
    out = []
    for row in rows:
        answer = row["extra_info"]["answer"].replace("\n", "\n\n")
        truth = row["reward_model"]["ground_truth"]
        wrong = answer[: answer.rindex("####")] + f"#### {int(float(truth)) + 1}"
        for text, eos in ((answer, True), (wrong, True), (answer[: len(answer) // 2], False)):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
            out.append((row, text, ids))
    return out


class MemoryQueue:
    """TransferQueue's kv_batch_get / kv_batch_put over one in-memory TensorDict (the fields the hook reads)."""

    def __init__(self, stored):
        self.stored, self.written = stored, None

    def kv_batch_get(self, keys, partition_id, select_fields):
        return self.stored.select(*[name for name in select_fields if name in self.stored.keys()]).clone()

    def kv_batch_put(self, keys, partition_id, fields):
        self.written = fields
        return "written by verl"


def parity_reward_file(work: Path) -> Path:
    """A reward function file (``reward.custom_reward_function.path``) that scores 1 for a response of even length:
    the CPU loop's untrained policy never solves its arithmetic task (every value would be 0), but meets this about
    half the time, so that step values and the process term vary."""
    path = Path(work) / "parity_reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float(len(solution_str) % 2 == 0)\n")
    return path
