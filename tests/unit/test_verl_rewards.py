"""Rewards in a verl run: the ``pav`` reward manager's outcome (verl_prm.integrations.verl.reward_manager), under
the rule every scorer of the library applies (a finite real number), and the startup check that verl's default
reward function knows the training data's ``data_source`` values (verl_prm.integrations.verl.data_sources)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch


def _score_one(tokenizer, reward):
    from omegaconf import OmegaConf
    from verl import DataProto

    from verl_prm.integrations.verl.reward_manager import PavRewardManager

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        return reward

    response = tokenizer.encode("The answer is 7.", add_special_tokens=False)
    batch = {"responses": torch.tensor([response]), "attention_mask": torch.ones(1, 2 + len(response)),
             "prompts": torch.tensor([[5, 6]])}
    non_tensor = {"data_source": np.array(["toy"], dtype=object),
                  "reward_model": np.array([{"ground_truth": "7"}], dtype=object),
                  "extra_info": np.array([{}], dtype=object)}
    data = DataProto.from_dict(tensors=batch, non_tensors=non_tensor)
    manager = PavRewardManager(OmegaConf.create({}), tokenizer, compute_score)
    return manager.loop.run_until_complete(manager.run_single(data))


@pytest.mark.parametrize("reward, error, problem", [
    ("1.0", TypeError, r"returned '1.0' for the response 'The answer is 7.' \(data_source='toy'\) \(a str\)"),
    (math.inf, ValueError, "returned inf for the response 'The answer is 7.'"),
    ({"score": math.nan}, ValueError, "returned nan")])
def test_a_reward_that_is_not_a_finite_real_number_is_refused_by_name(bpe_small, reward, error, problem):
    """``float("1.0")`` or an infinite score used to become the run's reward (and a success for the sampling
    critic); each is an error naming the reward function, the response and its data source."""
    with pytest.raises(error, match=f"the reward function .*compute_score {problem}.*finite real number"):
        _score_one(bpe_small, reward)


def test_a_number_of_any_real_type_is_the_reward(bpe_small):
    for reward, expected in ((1, 1.0), (np.float32(0.5), 0.5), ({"score": -1.0, "acc": 0.0}, -1.0)):
        result = _score_one(bpe_small, reward)
        assert result["reward_score"] == expected and isinstance(result["reward_score"], float)


def test_the_default_scorers_data_sources_are_the_ones_it_scores():
    """The names read from verl's ``default_compute_score`` against the function itself: the cheap rule-based ones
    score, a source outside them raises verl's NotImplementedError."""
    from verl.utils.reward_score import default_compute_score

    from verl_prm.integrations.verl.data_sources import default_scorer_data_sources

    names, prefixes = default_scorer_data_sources()
    assert {"openai/gsm8k", "lighteval/MATH", "HuggingFaceH4/MATH-500", "math_dapo", "hiyouga/geometry3k",
            "codecontests", "searchR1_nq"} <= names and prefixes == ("aime",)
    assert default_compute_score("openai/gsm8k", "so #### 7", "7") == 1.0
    assert default_compute_score("searchR1_nq", "<answer>Paris</answer>", {"target": ["Paris"]}) == 1.0
    assert "arithmetic_mod" not in names
    with pytest.raises(NotImplementedError):
        default_compute_score("arithmetic_mod", "12", "7")


def test_training_data_the_default_scorer_cannot_score_is_refused_at_startup(tmp_path):
    import json

    import pandas as pd
    from omegaconf import OmegaConf

    from verl_prm.config.hook import ConfigError
    from verl_prm.integrations.verl.run_config import check_default_scorer_data_sources

    known = tmp_path / "gsm8k.parquet"
    pd.DataFrame({"data_source": ["openai/gsm8k", "aime_2024"], "prompt": ["a", "b"]}).to_parquet(known)
    unknown = tmp_path / "mine.jsonl"
    unknown.write_text("".join(json.dumps({"data_source": s, "prompt": "q"}) + "\n"
                               for s in ("openai/gsm8k", "arithmetic_mod", "my_code")))

    def config(files, path=None):
        return OmegaConf.create({"data": {"train_files": files},
                                 "reward": {"custom_reward_function": {"path": path, "name": "compute_score"}}})

    check_default_scorer_data_sources(config([str(known)]))
    check_default_scorer_data_sources(config(str(known)))
    with pytest.raises(ConfigError, match=f"data.train_files {unknown} holds data_source values that verl's default "
                                          r"reward function does not score \('arithmetic_mod', 'my_code'; .*set "
                                          "reward.custom_reward_function.path and .name"):
        check_default_scorer_data_sources(config([str(known), str(unknown)]))
    check_default_scorer_data_sources(config([str(unknown)], path="reward.py"))  # a custom function scores them
    check_default_scorer_data_sources(config(["hdfs://elsewhere/train.parquet", str(tmp_path / "none.parquet")]))


def test_pav_truncated_counts_the_generation_config_s_eos_as_an_end(bpe_small, tmp_path):
    """A response ending at the policy's generation-config EOS is finished even when the tokenizer names another
    EOS (transformers' GGUF tokenizer of SmolLM2 says <|im_start|>, the model <|im_end|>); other ends are
    truncated. Before, only the tokenizer's EOS counted, so every such response was called truncated."""
    from omegaconf import OmegaConf
    from transformers import GenerationConfig

    from verl_prm.integrations.verl.reward_manager import PavRewardManager

    other = bpe_small.eos_token_id + 5
    GenerationConfig(eos_token_id=other).save_pretrained(tmp_path)
    config = OmegaConf.create({"actor_rollout_ref": {"model": {"path": str(tmp_path)}}})
    manager = PavRewardManager(config, bpe_small, None)
    text = bpe_small.encode("x = 1\n\ny = 2", add_special_tokens=False)
    assert manager.step_info(text + [other])["pav_truncated"] == 0.0
    assert manager.step_info(text + [bpe_small.eos_token_id])["pav_truncated"] == 0.0
    assert manager.step_info(text)["pav_truncated"] == 1.0
