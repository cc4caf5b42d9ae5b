"""verl reward manager ``pav``: the outcome score plus step information, in verl's reward loop.

Select it with ``reward.reward_manager.name=pav`` (the ``verl_prm`` config group sets it). For each trajectory
it returns what verl's streaming reward path accepts (one float, ``reward_score``) and, in
``reward_extra_info``, what a reader of the run needs to see the steps the hook will score:

- the outcome, exactly as verl's ``naive`` manager computes it: ``reward.custom_reward_function`` when set,
  else verl's ``default_compute_score`` (by ``data_source``); a dict result contributes all of its keys, a
  number is also reported as ``acc`` (verl's validation picks ``acc`` as its core metric);
- ``pav_num_steps`` (int), ``pav_step_spans`` (JSON text of ``[[start, end], ...]`` character spans of the
  steps in the response text decoded with ``skip_special_tokens=True, clean_up_tokenization_spaces=False``:
  text, not a list, because verl stacks every extra-info key with ``np.array`` over the batch and averages
  non-text values in validation, which ragged lists would break), ``pav_response_tokens`` (int),
  ``pav_truncated`` (1.0 when the response does not end with one of the policy's EOS ids, else 0.0: the
  tokenizer's and the policy's generation config's, ``verl_prm.special_tokens.policy_eos_token_ids``).

Steps are split by ``StepsSection.split`` with the rule of ``verl_prm.steps`` (``verl_prm.steps.split_steps``, or
``verl_prm.steps.code.code_split_steps`` for a code rule): the same call the trainer hook makes, so
``pav_num_steps`` is what the critic scores.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from verl import DataProto
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from verl_prm.config.hook import REWARD_MANAGER_NAME, StepsSection, read_hook_config
from verl_prm.integrations.verl.import_hooks import run_deferred_registration
from verl_prm.labeling.scoring import reward_number
from verl_prm.special_tokens import generation_config_of, policy_eos_token_ids

__all__ = ["PavRewardManager", "REWARD_MANAGER_NAME", "register_reward_manager"]


def _steps_config(config: Any) -> StepsSection:
    section = config.get("verl_prm", None) if hasattr(config, "get") else None
    return read_hook_config(section).steps


class PavRewardManager(RewardManagerBase):
    """Outcome reward (one float per trajectory) plus the step spans and per-response step metrics."""

    def __init__(self, config, tokenizer, compute_score, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score)
        if compute_score is None:  # verl passes default_compute_score; keep the manager usable on its own
            from verl.utils.reward_score import default_compute_score

            compute_score = default_compute_score
        self.compute_score = compute_score
        self.is_async_reward_score = inspect.iscoroutinefunction(compute_score)
        self.reward_router_address = reward_router_address
        self.reward_model_tokenizer = reward_model_tokenizer
        self.steps = _steps_config(config)
        self._eos_ids: set[int] | None = None

    def eos_token_ids(self) -> set[int]:
        """The ids a finished response ends with: the tokenizer's EOS and the policy's generation config's."""
        if self._eos_ids is None:
            from verl.utils.fs import copy_to_local

            try:
                path = self.config.actor_rollout_ref.model.path
            except AttributeError:  # a config without a policy (the manager used on its own): the tokenizer's EOS
                path = None
            generation = generation_config_of(copy_to_local(path)) if path else None
            self._eos_ids = set(policy_eos_token_ids(self.tokenizer, generation, source=f"the policy {path}"))
        return self._eos_ids

    async def run_single(self, data: DataProto) -> dict:
        data_item = data[-1:][0]  # multi-output trajectories: the last output is scored, as verl's naive manager
        response_ids = data_item.batch["responses"]
        response_length = response_ids.shape[-1]
        valid_length = int(data_item.batch["attention_mask"][-response_length:].sum())
        valid_ids = response_ids[:valid_length]

        non_tensor = data_item.non_tensor_batch
        extra_info = dict(non_tensor.get("extra_info", None) or {})
        tool_extra_fields = non_tensor.get("tool_extra_fields", None)
        if tool_extra_fields is not None:
            extra_info.update(tool_extra_fields.items())
        extra_info["num_turns"] = non_tensor.get("__num_turns__", None)
        extra_info["rollout_reward_scores"] = non_tensor.get("reward_scores", {})

        response_str = await self.loop.run_in_executor(
            None, lambda: self.tokenizer.decode(valid_ids, skip_special_tokens=True)
        )
        kwargs = dict(
            data_source=non_tensor["data_source"],
            solution_str=response_str,
            ground_truth=non_tensor["reward_model"]["ground_truth"],
            extra_info=extra_info,
        )
        if self.reward_router_address is not None:
            kwargs.update(
                reward_router_address=self.reward_router_address, reward_model_tokenizer=self.reward_model_tokenizer
            )
        if self.is_async_reward_score:
            result = await self.compute_score(**kwargs)
        else:
            result = await self.loop.run_in_executor(None, lambda: self.compute_score(**kwargs))

        reward_extra_info: dict[str, Any] = {}
        if isinstance(result, dict):
            if "score" not in result:
                raise ValueError(
                    f"the reward function returned a dict without 'score' for data_source {kwargs['data_source']!r}: "
                    f"keys {sorted(result)}; return a number or a dict with 'score'"
                )
            score = result["score"]
            reward_extra_info.update(result)
        else:
            score = result
            reward_extra_info["acc"] = score
        reward_extra_info.update(self.step_info(valid_ids))
        function = getattr(self.compute_score, "__qualname__", repr(self.compute_score))
        reward = reward_number(score, function=function, data_source=kwargs["data_source"], response=response_str)
        return {"reward_score": reward, "reward_extra_info": reward_extra_info}

    def step_info(self, valid_ids) -> dict[str, Any]:
        """The ``pav_*`` entries of ``reward_extra_info`` for one response's valid token ids [L].

        Steps come from ``StepsSection.split`` with the rule of ``verl_prm.steps``, exactly as the
        trainer hook splits them, so ``pav_num_steps`` is the H the critic will score.
        """
        import torch

        ids = torch.as_tensor(valid_ids, dtype=torch.long).reshape(1, -1)
        split = self.steps.split(ids, torch.ones_like(ids), self.tokenizer)
        num_steps = int(split.num_steps[0])
        ends = split.step_char_ends[0, :num_steps].tolist()
        spans = [[start, end] for start, end in zip([0] + ends[:-1], ends)]
        truncated = ids.shape[1] == 0 or int(ids[0, -1]) not in self.eos_token_ids()
        return {
            "pav_num_steps": num_steps,
            "pav_step_spans": json.dumps(spans),
            "pav_response_tokens": int(ids.shape[1]),
            "pav_truncated": float(truncated),
        }


def register_reward_manager() -> None:
    """Register ``pav`` in verl's reward-manager registry (idempotent)."""
    from verl.experimental.reward_loop.reward_manager import register
    from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER

    if REWARD_MANAGER.get(REWARD_MANAGER_NAME) is not PavRewardManager:
        register(REWARD_MANAGER_NAME)(PavRewardManager)


# verl's plugin loader may have asked for the registration while this module was still executing.
run_deferred_registration(__name__)
