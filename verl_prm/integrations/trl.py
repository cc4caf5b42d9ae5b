"""PAV-GRPO in TRL: ``PavGRPOTrainer``, a ``trl.GRPOTrainer`` whose advantages carry the prover's progress.

TRL (tested: ``trl==1.16.0``, the ``trl`` extra) computes one outcome advantage per completion in
``GRPOTrainer._generate_and_score_completions`` (its ``scale_rewards``, ``multi_objective_aggregation``,
reward functions and ``reward_weights``), and its ``_compute_loss`` accepts [B, T] advantages. This subclass
keeps TRL's outcome advantage ``out_i`` exactly as TRL computed it and returns, per completion token,

    adv[i, t] = (out_i + alpha * p_{i, step_ids[i, t]}) * completion_mask[i, t]

where p are the process scores of ``verl_prm.advantages.process_scores`` (progress of the Best-of-K prover
values, clipped, normalised, dropped for truncated completions as configured): the ``pav_grpo`` estimator of
the verl plugin with TRL's outcome advantage. Everything else (loss types, ``num_iterations`` with PPO-style
clipping, KL, vLLM generation, logging) is TRL's own; the ``pav/*`` metrics join TRL's logs.

    from verl_prm.critic import ProverCritic
    from verl_prm.integrations.trl import PavGRPOTrainer

    trainer = PavGRPOTrainer(
        model=model, reward_funcs=[reward], args=GRPOConfig(...), train_dataset=dataset,   # as for GRPOTrainer
        critic=ProverCritic.from_pretrained("path/to/pav_critic"),
        steps={"delimiter": "\\n"},                    # the step rule: the keys of verl_prm.steps in verl
        pav={"alpha": 3.0, "best_of_k": 4, "drop_truncated": True},  # the keys of algorithm.pav in verl
    )

This module holds only the translation (TRL's batch -> step split, critic scores -> the advantage math); it
imports no verl module. The math is ``verl_prm.advantages``, the truncation rule ``verl_prm.responses``, the
``pav/*`` metrics ``verl_prm.metrics`` (shared with the verl hook), the steps ``verl_prm.steps`` (through the step
rule ``verl_prm.config.hook.StepsSection``), the critic ``verl_prm.critic.ProverCritic``.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import asdict, fields
from typing import Any, Mapping

import torch

try:
    from trl import GRPOTrainer
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "verl_prm.integrations.trl needs TRL, which is not installed: pip install 'verl-prm[trl]' "
        "(tested with trl==1.16.0)"
    ) from error

from verl_prm import advantages as adv
from verl_prm.config import PavConfig, read_pav_config
from verl_prm.config.hook import StepsSection, read_hook_config
from verl_prm.critic import ProverCritic
from verl_prm.metrics import pav_metrics
from verl_prm.responses import truncated_responses
from verl_prm.special_tokens import policy_eos_token_ids
from verl_prm.steps import same_tokenizer

__all__ = ["PavGRPOTrainer", "TESTED_TRL_VERSION", "TRL_PAV_KEYS", "pav_config_for_trl"]

TESTED_TRL_VERSION = "1.16.0"
# The algorithm.pav knobs PAV-GRPO in TRL reads. The others belong to other verl estimators (prm_aggregate,
# pav_pure, pav_prime): set in TRL they would change nothing, so they are an error rather than ignored.
TRL_PAV_KEYS = ("alpha", "best_of_k", "process_term", "clip", "normalize", "drop_truncated", "check_inputs",
                "compile", "epsilon")


def pav_config_for_trl(pav: PavConfig | Mapping[str, Any] | None) -> PavConfig:
    """``PavConfig`` of the ``pav=`` argument, validated exactly as ``algorithm.pav`` is in verl.

    Accepts None (the defaults), a mapping of ``algorithm.pav`` keys, or a ``PavConfig``. A key that only
    another verl estimator reads (``aggregation``, ...) is an error naming it.
    """
    if pav is None:
        return PavConfig()
    if isinstance(pav, PavConfig):
        defaults = PavConfig()
        given = {f.name for f in fields(PavConfig) if getattr(pav, f.name) != getattr(defaults, f.name)}
    elif isinstance(pav, Mapping):
        given = set(pav)
    else:
        raise TypeError(f"PavGRPOTrainer(pav=...) must be a mapping of algorithm.pav keys or a PavConfig, "
                        f"got {type(pav).__name__}")
    known = {f.name for f in fields(PavConfig)}
    unused = sorted((given & known) - set(TRL_PAV_KEYS))
    if unused:
        raise ValueError(
            f"PavGRPOTrainer(pav=...): algorithm.pav.{unused[0]} belongs to another verl estimator and has no "
            f"effect in TRL; PAV-GRPO in TRL reads {', '.join(TRL_PAV_KEYS)}"
        )
    # read_pav_config: the unknown-key check and PavConfig's own validation, the same as for a verl run
    return read_pav_config({"pav": dict(pav) if isinstance(pav, Mapping) else asdict(pav)})


def _step_rule(steps: StepsSection | Mapping[str, Any] | None) -> StepsSection:
    """The step rule, validated as ``verl_prm.steps`` is in a verl run (errors name ``verl_prm.steps.<key>``)."""
    if steps is not None and not isinstance(steps, (StepsSection, Mapping)):
        raise TypeError(f"PavGRPOTrainer(steps=...) must be a mapping of verl_prm.steps keys or a StepsSection, "
                        f"got {type(steps).__name__}")
    section = asdict(steps) if isinstance(steps, StepsSection) else (dict(steps) if steps is not None else None)
    return read_hook_config({"steps": section} if section is not None else None).steps


class PavGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with PAV process advantages (see the module docstring for the formula).

    Takes every argument of ``GRPOTrainer`` plus, keyword-only:

    Args:
        critic: the prover critic, a ``verl_prm.critic.ProverCritic`` (or a checkpoint path, loaded with
            ``ProverCritic.from_pretrained(path, device=<the trainer's device>)``, format ``value_head``).
        steps: the step rule, the keys of ``verl_prm.steps`` in a verl run (``delimiter``, ``regex``,
            ``max_tokens``, ``max_steps``, ``code_rule``, ``code_depth``); default: steps end at ``"\\n\\n"``.
        pav: the estimator knobs, the keys of ``algorithm.pav`` (``TRL_PAV_KEYS``: alpha, best_of_k,
            process_term, clip, normalize, drop_truncated, check_inputs, compile, epsilon), same validation.

    Construction fails, before any model is loaded, for bad knobs and for settings that leave no single
    policy-written response per sample (``tools``, ``environment_factory``, ``rollout_func``); after TRL's own
    set-up, for a vision-language ``processing_class`` (the critic reads text).

    Completions that every reward function left unscored (TRL gives them advantage 0) get no process term either.
    With several processes, ``normalize`` uses the std over the whole gathered batch, as TRL's own ``batch``
    scaling does.
    """

    def __init__(self, *args, critic: ProverCritic | str, steps: StepsSection | Mapping | None = None,
                 pav: PavConfig | Mapping | None = None, **kwargs):
        self.pav_config = pav_config_for_trl(pav)
        self.step_rule = _step_rule(steps)
        if not isinstance(critic, (ProverCritic, str)):
            raise TypeError(f"PavGRPOTrainer(critic=...) must be a verl_prm.critic.ProverCritic or a checkpoint path, "
                            f"got {type(critic).__name__}")
        if isinstance(critic, ProverCritic) and critic.best_of_k != 1 and self.pav_config.best_of_k != 1:
            raise ValueError(
                f"the critic already applies Best-of-{critic.best_of_k} and pav.best_of_k={self.pav_config.best_of_k} "
                "would apply it again: set one of them to 1"
            )
        bound = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs).arguments
        for name, why in (
            ("tools", "tool calls put tool output into the completion, so a completion is no longer one response "
                      "written by the policy"),
            ("environment_factory", "an environment makes the rollout multi-turn, so a completion is no longer one "
                                    "response written by the policy"),
            ("rollout_func", "a custom rollout may return multi-turn completions or text the policy did not write"),
        ):
            if bound.get(name) is not None:
                raise ValueError(
                    f"PavGRPOTrainer does not support {name}=: {why}, and PAV scores the steps of a single response "
                    "per sample. Use trl.GRPOTrainer for this setting."
                )
        super().__init__(*args, **kwargs)
        if self._is_vlm:
            raise ValueError(
                "PavGRPOTrainer: the processing_class is a multimodal processor, but the prover critic scores text "
                "steps only; use a text-only policy and tokenizer"
            )
        if isinstance(critic, str):
            critic = ProverCritic.from_pretrained(critic, device=self.accelerator.device)
        self.critic = critic
        # None: the critic reads the policy's ids as they are; else the text is re-tokenised for the critic.
        self._critic_policy_tokenizer = None if same_tokenizer(self.processing_class, critic.tokenizer) else \
            self.processing_class
        self._pav_rewards_per_func: torch.Tensor | None = None
        # TRL stops at the same ids (its eos_token_ids); this names a tokenizer/generation-config disagreement
        self._policy_eos_ids = policy_eos_token_ids(self.processing_class, getattr(self.model, "generation_config", None),
                                                    source="PavGRPOTrainer: the policy")

    # ------------------------------------------------------------------ TRL hooks
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # kept for the unscorable rows (every reward function returned None), which TRL gives advantage 0
        self._pav_rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        output["advantages"], metrics = self.pav_advantages(output)
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)
        return output

    # ------------------------------------------------------------------ the translation
    def step_tensors(self, output: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float]:
        """Split TRL's completions into steps and score them with the critic.

        Returns the step tensors of the contract (``step_ids``, ``step_values``, ``prompt_values``,
        ``num_steps``, on the completions' device) and the critic's wall time in seconds.
        """
        prompt_ids, prompt_mask = output["prompt_ids"], output["prompt_mask"]
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        tokenizer = self.processing_class
        split = self.step_rule.split(completion_ids, completion_mask, tokenizer)
        start = time.perf_counter()
        scores = self.critic.score_policy_batch(
            prompt_ids, completion_ids, torch.cat([prompt_mask, completion_mask], dim=1), split,
            policy_tokenizer=self._critic_policy_tokenizer,
            sample_offset=self.accelerator.process_index * completion_ids.shape[0],
        )
        seconds = time.perf_counter() - start
        if not torch.equal(scores.num_steps.cpu(), split.num_steps.cpu()):
            bad = (scores.num_steps.cpu() != split.num_steps.cpu()).nonzero().flatten().tolist()
            raise RuntimeError(
                f"the critic scored a different number of steps than the split for completions {bad[:8]}"
            )
        device = completion_ids.device
        tensors = {
            "step_ids": split.step_ids.to(device),
            "step_values": scores.step_values.to(device, torch.float32),
            "prompt_values": scores.prompt_values.to(device, torch.float32),
            "num_steps": split.num_steps.to(device),
        }
        return tensors, seconds

    def pav_advantages(self, output: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """[B, T] PAV advantages of one TRL batch (the dict ``GRPOTrainer._generate_and_score_completions``
        returns, whose ``advantages`` [B] are TRL's outcome advantages) and the ``pav/*`` metrics."""
        pav = self.pav_config
        outcome = output["advantages"]
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        if outcome.dim() != 1:
            raise ValueError(f"expected TRL's [B] outcome advantages, got shape {tuple(outcome.shape)}")
        steps, critic_seconds = self.step_tensors(output)
        if pav.check_inputs:
            adv.check_step_inputs(steps["step_ids"], steps["step_values"], steps["prompt_values"], steps["num_steps"],
                                  completion_mask)
        # the last valid token is the mask's last set one (right-padded); a completion TRL masked whole
        # (mask_truncated_completions) has length 0 and counts as truncated
        truncated = truncated_responses(completion_ids, completion_mask.long().sum(dim=1), self._policy_eos_ids)
        keep = ~truncated if pav.drop_truncated else torch.ones_like(truncated)
        keep = keep & self._scorable_rows(outcome.shape[0], outcome.device)
        # The process scores of the whole (gathered) batch: normalize's std is a batch statistic.
        local = slice(self.accelerator.process_index * outcome.shape[0],
                      (self.accelerator.process_index + 1) * outcome.shape[0])
        step_values, prompt_values, num_steps, keep_all, truncated_all = (
            self._gather_rows(steps["step_values"]), self._gather_rows(steps["prompt_values"]),
            self._gather_rows(steps["num_steps"]), self._gather_rows(keep), self._gather_rows(truncated))
        with torch.no_grad():
            scores = pav.process_scores(step_values, prompt_values, num_steps, keep_all)
            advantages = adv.process_advantage(outcome.float(), scores[local], steps["step_ids"], completion_mask,
                                               pav.alpha, compile=pav.compile)
        return advantages, pav_metrics(scores, prompt_values, num_steps, truncated_all, pav.best_of_k, critic_seconds)

    def _scorable_rows(self, batch: int, device) -> torch.Tensor:
        """[B] bool of this process's rows: False where every reward function returned None."""
        rewards = self._pav_rewards_per_func
        if rewards is None:
            return torch.ones(batch, dtype=torch.bool, device=device)
        start = self.accelerator.process_index * batch
        return ~torch.isnan(rewards[start:start + batch]).all(dim=1).to(device)

    def _gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor of every process stacked along dim 0 (dim 1 padded to the widest); itself with one."""
        if self.accelerator.num_processes == 1:
            return tensor
        if tensor.dtype == torch.bool:  # collective back ends do not all reduce bool tensors
            return self._gather_rows(tensor.to(torch.uint8)).bool()
        if tensor.dim() == 2:  # S differs between processes; columns past num_steps are ignored
            tensor = self.accelerator.pad_across_processes(tensor, dim=1, pad_index=0)
        return self.accelerator.gather(tensor)

