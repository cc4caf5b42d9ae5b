"""The RL settings of the arithmetic recipe and the batch pieces its evaluation shares with verl's loop.

The RL runs themselves are verl's (``python -m verl.trainer.main_ppo``, :mod:`.verl_rl`); this module holds
``RLConfig`` (the settings every arm shares), the outcome reward of sampled responses, and ``step_tensors``:
the advantage path of the trainer hook on one process (``verl_prm.steps.split_steps`` with ``task.STEP_REGEX``,
``ProverCritic.score_policy_batch``), which the evaluation uses to measure the critic and
``tests/apps/test_arithmetic.py`` uses to check ``compute_advantage_with_steps`` on a recipe batch (``build_data``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from verl_prm.apps.arithmetic.rollout import Rollouts
from verl_prm.apps.arithmetic.task import DATA_SOURCE, STEP_REGEX, Problem, compute_score

__all__ = ["RLConfig", "build_data", "outcome_rewards", "step_tensors"]


@dataclass(frozen=True)
class RLConfig:
    """The settings of every RL run (verl's ``main_ppo``; :func:`.verl_rl.main_ppo_command` maps them): PAV's
    ``alpha`` and Best-of-K, ``steps`` x ``prompts_per_step`` prompts x ``group_size`` samples, the policy's
    learning rate (one on-policy update per batch), sampling temperature, the held-out evaluation every
    ``eval_every`` steps with ``eval_samples`` samples per test prompt, verl's ``loss_agg_mode``."""

    alpha: float = 3.0
    best_of_k: int = 4
    steps: int = 60
    prompts_per_step: int = 16
    group_size: int = 8
    lr: float = 1e-4
    temperature: float = 1.0
    eval_every: int = 5
    eval_samples: int = 2
    loss_agg_mode: str = "token-mean"

    def __post_init__(self) -> None:
        for name in ("alpha", "lr", "temperature"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"RLConfig.{name} must be finite and >= 0, got {value!r}")
        for name in ("best_of_k", "steps", "prompts_per_step", "group_size", "eval_every",
                     "eval_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name} must be >= 1, got {getattr(self, name)!r}")


def outcome_rewards(rollouts: Rollouts, problems: Sequence[Problem]) -> torch.Tensor:
    """[B] 0/1 verifier outcome of each response (``problems`` indexed by ``rollouts.prompt_index``)."""
    return torch.tensor([compute_score(DATA_SOURCE, text, problems[i].answer)
                         for text, i in zip(rollouts.texts, rollouts.prompt_index)], dtype=torch.float32)


def build_data(rollouts: Rollouts, rewards: torch.Tensor, uids: Sequence[str], step_tensors: dict | None = None):
    """The verl ``DataProto`` of a rollout batch: ``responses``, ``response_mask``, ``token_level_rewards``
    (the outcome at the last valid token), the step tensors when given, and ``uid`` (the GRPO group)."""
    from verl import DataProto

    mask = rollouts.response_mask
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)
    token_level_rewards = torch.zeros_like(mask)
    token_level_rewards.scatter_(1, last[:, None], rewards[:, None])
    tensors = {"responses": rollouts.responses, "response_mask": mask, "token_level_rewards": token_level_rewards}
    tensors.update(step_tensors or {})
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": np.array(list(uids), dtype=object)})


def step_tensors(critic, rollouts: Rollouts, tokenizer, *, return_split: bool = False):
    """``step_ids``/``num_steps`` (one step per operation, ``task.STEP_REGEX``) and the critic's raw
    ``step_values``/``prompt_values``."""
    from verl_prm.steps import split_steps

    split = split_steps(rollouts.responses, rollouts.response_mask, tokenizer, regex=STEP_REGEX)
    scores = critic.score_policy_batch(rollouts.prompts, rollouts.responses, rollouts.attention_mask, split,
                                       policy_tokenizer=tokenizer)
    tensors = {"step_ids": split.step_ids, "num_steps": split.num_steps, "step_values": scores.step_values.float(),
               "prompt_values": scores.prompt_values.float()}
    return (tensors, split) if return_split else tensors
