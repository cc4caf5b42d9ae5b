"""The recipe's rollout batches as verl's trainer hook sees them: outcome rewards, step tensors, a ``DataProto``.

The RL runs themselves are verl's (``python -m verl.trainer.main_ppo``, :mod:`.verl_rl`); this module holds
the outcome reward of sampled responses (:func:`outcome_rewards`), and ``step_tensors``:
the advantage path of the trainer hook on one process (``verl_prm.steps.split_steps`` with ``task.STEP_REGEX``,
``ProverCritic.score_policy_batch``), which the evaluation uses to measure the critic and
``tests/apps/test_arithmetic_task.py`` uses to check verl's advantage phase on a recipe batch (``build_data``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from verl_prm.apps.arithmetic.rollout import Rollouts
from verl_prm.apps.arithmetic.task import DATA_SOURCE, STEP_REGEX, Problem, compute_score
from verl_prm.steps import split_steps

__all__ = ["build_data", "outcome_rewards", "step_tensors"]


def outcome_rewards(rollouts: Rollouts, problems: Sequence[Problem]) -> torch.Tensor:
    """[B] 0/1 verifier outcome of each response (``problems`` indexed by ``rollouts.prompt_index``)."""
    return torch.tensor([compute_score(DATA_SOURCE, text, problems[i].answer)
                         for text, i in zip(rollouts.texts, rollouts.prompt_index)], dtype=torch.float32)


def build_data(rollouts: Rollouts, rewards: torch.Tensor, uids: Sequence[str]):
    """The verl ``DataProto`` of a rollout batch: ``responses``, ``response_mask``, ``token_level_rewards``
    (the outcome at the last valid token) and ``uid`` (the GRPO group). The step tensors travel beside it, as
    ``StepInputs`` (``verl_prm.integrations.verl.advantage``)."""
    from verl import DataProto

    mask = rollouts.response_mask
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)
    token_level_rewards = torch.zeros_like(mask)
    token_level_rewards.scatter_(1, last[:, None], rewards[:, None])
    tensors = {"responses": rollouts.responses, "response_mask": mask, "token_level_rewards": token_level_rewards}
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": np.array(list(uids), dtype=object)})


def step_tensors(critic, rollouts: Rollouts, tokenizer, *, return_split: bool = False):
    """``step_ids``/``num_steps`` (one step per operation, ``task.STEP_REGEX``) and the critic's raw
    ``step_values``/``prompt_values``."""
    split = split_steps(rollouts.responses, rollouts.response_mask, tokenizer, regex=STEP_REGEX)
    scores = critic.score_policy_batch(rollouts.prompts, rollouts.responses, rollouts.attention_mask, split,
                                       policy_tokenizer=tokenizer)
    tensors = {"step_ids": split.step_ids, "num_steps": split.num_steps, "step_values": scores.step_values.float(),
               "prompt_values": scores.prompt_values.float()}
    return (tensors, split) if return_split else tensors
