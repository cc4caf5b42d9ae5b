"""The verl trainer hook: verl 0.9.1's synchronous PPO trainer plus the prover critic in the advantage phase.

Select it with ``trainer.v1.trainer_mode=pav_sync`` (the ``verl_prm`` config group sets it). Compared with
verl's ``PPOTrainerSync`` it changes two things:

1. worker initialisation (``_setup``): after verl has built its worker groups, a ``ProverCriticWorker`` group is
   created on a verl resource pool: verl's ``global_pool`` (``verl_prm.placement.pool=colocated``, the actor and
   rollout GPUs) or a pool of its own (``pool=own``, added to verl's ``ResourcePoolManager`` before verl
   creates its pools, so verl's GPU-availability check counts it);
2. the advantage phase (``_compute_advantage``): the responses and prompts are read from TransferQueue, split
   into steps (``StepsSection.split``: ``verl_prm.steps.split_steps`` or a code rule), scored by the critic group (``compute_step_values``), and the
   advantages of a step estimator (pav_*, prm_aggregate) are computed by
   ``verl_prm.integrations.verl.advantage.compute_advantage_with_steps`` on a DataProto carrying the step tensors; other
   estimators (e.g. the grpo baseline) go through verl's own function unchanged. The KL-in-reward and
   rollout-correction steps and the write-back are verl 0.9.1's, in the same order. ``pav/*`` metrics are
   added to the step's metrics, which verl's tracker logs; with ``verl_prm.diagnostics.reference`` the steps
   are also scored by that exact prover, for the metrics only (``diagnostics_metrics``);
3. with ``verl_prm.refresh.every = k`` (a learned PAV of format value_head), every k-th step the batch's step
   values are also sampled from the rollout replicas (as format "rollout" samples them), written as labels, and
   the PAV's value head is refitted to them on every critic worker (``verl_prm.critic.refresh``; ``_refresh``).

verl compares ``self.trainer_mode == "sync"`` in several places (replay-buffer class, dataloader refill,
checkpoint save/load of TransferQueue, re-issuing in-flight prompts, prompt persistence). ``trainer_mode`` is
therefore a read-only "sync" on this class: verl's constructor assigns the configured name, which is kept as
``registered_trainer_mode``, and every check sees "sync". The config section verl reads for the mode's options
(``trainer.v1.<mode>``, e.g. ``parameter_sync_step``) is thus ``trainer.v1.sync``, as for the sync trainer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import numpy as np
import ray
import torch
import transfer_queue as tq
from tensordict import TensorDict
from verl.protocol import DataProto
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
from verl.trainer.ppo.ray_trainer import apply_kl_penalty
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.debug import marked_timer
from verl.workers.utils.padding import response_to_nested

from verl_prm.config.hook import (
    EXACT_CRITIC_FORMAT,
    ConfigError,
    HOOK_TRAINER_NAME,
    ROLLOUT_CRITIC_FORMAT,
    HookConfig,
    build_exact_critic,
)
from verl_prm.estimators import ESTIMATORS
from verl_prm.integrations.verl.advantage import compute_advantage_with_steps
from verl_prm.integrations.verl.critic_worker import OFFLOAD_SECONDS_KEY, ProverCriticWorker, compute_step_values
from verl_prm.integrations.verl.import_hooks import run_deferred_registration
from verl_prm.integrations.verl.run_config import validate_run_config

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

__all__ = [
    "CRITIC_POOL_NAME",
    "PavSyncTrainer",
    "critic_worker_kwargs",
    "diagnostics_metrics",
    "outcome_zero_signal_share",
    "pav_metrics",
    "register_trainer_hook",
    "truncated_responses",
]

# Name of the critic's own resource pool (placement.pool=own) in verl's ResourcePoolManager.
CRITIC_POOL_NAME = "pav_critic_pool"
# verl 0.9.1 _compute_advantage's TransferQueue fields, plus what the critic needs.
_VERL_ADV_FIELDS = ["uid", "response_mask", "rm_scores", "rollout_log_probs", "old_log_probs", "ref_log_prob", "values"]
_HOOK_FIELDS = ["prompts", "responses"]
# ... and what the sampling critic (format "rollout") scores continuations with.
_MC_FIELDS = ["data_source", "reward_model", "extra_info"]


def truncated_responses(responses: torch.Tensor, response_lengths: torch.Tensor, eos_token_ids) -> torch.Tensor:
    """[B] bool: True where a response does not end with an EOS token (it hit the length limit).

    ``responses`` [B, T] right-padded ids, ``response_lengths`` [B] valid lengths, ``eos_token_ids`` an int or a
    collection of ints. A response of length 0 counts as truncated.
    """
    eos = torch.as_tensor(sorted({int(e) for e in (eos_token_ids if hasattr(eos_token_ids, "__iter__") else [eos_token_ids])}))
    last = (response_lengths.clamp(min=1) - 1).long()
    last_ids = responses.gather(1, last[:, None]).squeeze(1)
    ends_with_eos = torch.isin(last_ids, eos.to(responses.device))
    return ~ends_with_eos | (response_lengths <= 0)


def pav_metrics(
    step_values: torch.Tensor,
    prompt_values: torch.Tensor,
    num_steps: torch.Tensor,
    truncated: torch.Tensor,
    pav_config,
    critic_seconds: float,
    real_rows: torch.Tensor | None = None,
) -> dict[str, float]:
    """The hook's per-step metrics (``pav/`` prefix), over the real (non-padding) rows.

    - ``pav/steps_per_response``: mean H;  ``pav/zero_step_share``: share of responses with H = 0;
    - ``pav/process_term/mean`` and ``/std``: the process score p_h the estimator adds (times alpha) to the
      tokens of step h (progress of the Best-of-K values, clipped as configured), over all real steps;
    - ``pav/v0_mean``: mean prover value of the prompt (after Best-of-K); ``pav/critic_seconds``;
    - ``pav/truncated_share``: share of responses without EOS.
    """
    from verl_prm.advantages import best_of_k, process_scores, valid_steps

    if real_rows is not None:
        step_values, prompt_values = step_values[real_rows], prompt_values[real_rows]
        num_steps, truncated = num_steps[real_rows], truncated[real_rows]
    keep = ~truncated.bool() if pav_config.drop_truncated else None
    scores = process_scores(
        step_values.float(), prompt_values.float(), num_steps,
        best_of_k_k=pav_config.best_of_k, use_values=pav_config.uses_values, clip=pav_config.clip,
        normalize=pav_config.normalize, keep=keep, epsilon=pav_config.epsilon,
    )
    real_steps = scores[valid_steps(num_steps, scores.shape[1])]
    count = len(num_steps)
    return {
        "pav/steps_per_response": num_steps.float().mean().item() if count else 0.0,
        "pav/zero_step_share": (num_steps == 0).float().mean().item() if count else 0.0,
        "pav/process_term/mean": real_steps.mean().item() if real_steps.numel() else 0.0,
        "pav/process_term/std": real_steps.std().item() if real_steps.numel() > 1 else 0.0,
        "pav/v0_mean": best_of_k(prompt_values.float(), pav_config.best_of_k).mean().item() if count else 0.0,
        "pav/critic_seconds": float(critic_seconds),
        "pav/truncated_share": truncated.float().mean().item() if count else 0.0,
    }


def _kept_rows(real_rows: torch.Tensor) -> torch.Tensor:
    """The rows the batch metrics read: the real ones, or every row when none is real."""
    return real_rows if real_rows.any() else torch.ones_like(real_rows)


def _outcomes_and_groups(rm_scores, uids, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(outcomes [N] (sum of each response's rewards), group ids [N] of the prompts (``uid``), G) of the kept rows."""
    from verl_prm.advantages import group_ids

    scores = rm_scores.to_padded_tensor(padding=0.0) if rm_scores.is_nested else rm_scores
    outcomes = scores.float().sum(dim=-1)[keep]
    labels = [str(uid) for uid in (uids.tolist() if hasattr(uids, "tolist") else list(uids))]
    kept = [label for label, k in zip(labels, keep.tolist()) if k]
    if not kept:
        return outcomes, torch.zeros(0, dtype=torch.long), 0
    groups, count = group_ids(np.array(kept, dtype=object))
    return outcomes, groups, count


def outcome_zero_signal_share(rm_scores, uids, real_rows: torch.Tensor) -> float:
    """Share of the batch's prompt groups (``uid``) whose outcome rewards are all equal: groups where GRPO's
    advantage is zero everywhere (``verl_prm.advantages.zero_signal_groups``); padding rows are left out."""
    from verl_prm.advantages import zero_signal_groups

    outcomes, groups, count = _outcomes_and_groups(rm_scores, uids, _kept_rows(real_rows))
    if not count:
        return 0.0
    return zero_signal_groups(outcomes, groups, count).float().mean().item()


def diagnostics_metrics(step_values: torch.Tensor, prompt_values: torch.Tensor, num_steps: torch.Tensor,
                        rm_scores, uids, real_rows: torch.Tensor, threshold: float,
                        reference=None) -> dict[str, float]:
    """The ``verl_prm.diagnostics`` metrics of a batch, over the real rows (``_kept_rows``).

    The critic's process term is its progress A_h = v_h - v_{h-1} (``step_progress`` of the raw values, before
    Best-of-K, clip and normalisation). Always ``pav/zero_outcome_groups_with_signal`` (|A_h| > ``threshold``).
    With ``reference`` (``CriticScores`` of the exact prover ``verl_prm.diagnostics.reference`` on the same
    steps) also ``pav/process_corr``, ``pav/abs_adv_right``/``_slipped`` and ``pav/exact_abs_adv_right``/
    ``_slipped``, a step slipping where the reference value drops to 0 (``verl_prm.diagnostics.slipped_steps``).
    The share of groups without outcome signal is ``pav/outcome_zero_signal_groups`` (logged once, there).
    """
    from verl_prm.advantages import step_progress
    from verl_prm.diagnostics import process_term_diagnostics, slipped_steps, zero_outcome_groups_with_signal

    keep = _kept_rows(real_rows)
    outcomes, groups, count = _outcomes_and_groups(rm_scores, uids, keep)
    num_steps = num_steps[keep]
    learned = step_progress(step_values[keep].float(), prompt_values[keep].float(), num_steps)
    if reference is None:
        _, with_signal = zero_outcome_groups_with_signal(learned, num_steps, outcomes, groups, count, threshold)
        return {"pav/zero_outcome_groups_with_signal": with_signal}
    exact_values, exact_prompt = reference.step_values[keep].float(), reference.prompt_values[keep].float()
    exact = step_progress(exact_values, exact_prompt, num_steps)
    metrics = process_term_diagnostics(learned, num_steps, slipped_steps(exact_values, exact_prompt, num_steps),
                                       outcomes, groups, count, threshold, exact=exact)
    del metrics["pav/zero_outcome_groups"]  # == pav/outcome_zero_signal_groups
    return metrics


def critic_worker_kwargs(hook: HookConfig) -> dict[str, Any]:
    """``ProverCritic.from_pretrained`` keyword arguments from ``verl_prm.critic``.

    Best-of-K stays 1 here: the estimators apply ``algorithm.pav.best_of_k`` to the raw values (applying it in
    the critic too would transform twice). With format "exact": the format and ``verl_prm.critic.options``
    (``prover`` and the prover's options; ``ExactCritic.from_options``), nothing else.
    """
    critic = hook.critic
    if critic.format == EXACT_CRITIC_FORMAT:
        return {"format": critic.format, **dict(critic.options)}
    kwargs: dict[str, Any] = {
        "format": critic.format,
        "best_of_k": 1,
        "max_tokens_per_batch": critic.max_tokens_per_batch,
        "truncation": critic.truncation,
        "allow_pickle": critic.allow_pickle,
        "calibration": critic.calibration,
    }
    if critic.dtype != "auto":
        kwargs["dtype"] = critic.dtype
    kwargs.update(dict(critic.options))
    return kwargs


def _left_padded(nested: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A jagged nested tensor of B rows -> ([B, L] left-padded ids, [B, L] mask)."""
    lengths = nested.offsets().diff()
    right = nested.to_padded_tensor(padding=pad_id)
    width = right.shape[1]
    positions = torch.arange(width)[None, :]
    mask = positions >= (width - lengths)[:, None]
    # shift each row right by its padding: index of source column for each target column
    source = (positions - (width - lengths)[:, None]).clamp(min=0)
    left = torch.where(mask, right.gather(1, source), torch.full_like(right, pad_id))
    return left, mask.long()


class PavSyncTrainer(PPOTrainerSync):
    """verl's synchronous PPO trainer with the prover critic in the advantage phase (module docstring)."""

    def __init__(self, config):
        # Startup validation before verl builds anything (no model is loaded before init()).
        self.hook_config, self.pav_config = validate_run_config(config)
        if self._samples_values() or self.hook_config.refresh.every:
            from verl_prm.integrations.verl.rollout_critic import check_rollout_critic_run

            check_rollout_critic_run(config)
        self.prover_wg = None
        self.rollout_critic = None
        self.refresh_store = None
        self._refresh_restored = False
        # verl_prm.diagnostics.reference: the exact prover of the diagnostics, in the driver (it reads text)
        reference = self.hook_config.diagnostics.reference
        self.reference_critic = (build_exact_critic(reference, "verl_prm.diagnostics.reference")
                                 if reference is not None else None)
        super().__init__(config)

    # verl checks `trainer_mode == "sync"`; this trainer is sync in every such check.
    @property
    def trainer_mode(self) -> str:
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        self.registered_trainer_mode = value

    # ------------------------------------------------------------------ worker initialisation
    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        placement = self.hook_config.placement
        if self._runs_critic() and not self._samples_values() and placement.pool == "own":
            self.resource_pool_manager.resource_pool_spec[CRITIC_POOL_NAME] = (
                [placement.n_gpus_per_node] * placement.nnodes
            )

    def _setup(self):
        super()._setup()
        if self._runs_critic():
            if self._samples_values():
                self.rollout_critic = self._init_rollout_critic()
            else:
                self.prover_wg = self._init_prover_critic()
                if self.hook_config.refresh.every:
                    self.rollout_critic = self._init_rollout_critic()
                    self.refresh_store = self._open_refresh_store()

    def _runs_critic(self) -> bool:
        estimator = self.config.algorithm.adv_estimator
        return estimator in ESTIMATORS or self.hook_config.score_outcome_estimators

    def _samples_values(self) -> bool:
        """format "rollout": the values are sampled from the rollout replicas (no critic worker group)."""
        return self.hook_config.critic.format == ROLLOUT_CRITIC_FORMAT

    def _init_rollout_critic(self):
        """The sampling critic over verl's LLM server client (the agent loop's) and the run's reward function."""
        from verl_prm.integrations.verl.rollout_critic import RolloutCritic, run_reward_function, sampling_params
        from verl_prm.labeling.scoring import OutcomeScorer

        rollout = self.config.actor_rollout_ref.rollout
        critic = self.hook_config.critic
        return RolloutCritic(critic, self.get_llm_client(), self.tokenizer,
                             OutcomeScorer(run_reward_function(self.config), critic.mc_success_threshold),
                             sampling_params(rollout), int(rollout.response_length))

    def _critic_resource_pool(self):
        name = CRITIC_POOL_NAME if self.hook_config.placement.pool == "own" else "global_pool"
        return self.resource_pool_manager.resource_pool_dict[name]

    def _policy_tokenizer_path(self) -> str | None:
        """The policy tokenizer's path when the critic's tokenizer differs from it, else None. An exact critic
        (format "exact") always gets it: it reads the response text."""
        from transformers import AutoTokenizer
        from verl.utils.fs import copy_to_local

        model = self.config.actor_rollout_ref.model
        if self.hook_config.critic.format == EXACT_CRITIC_FORMAT:
            return copy_to_local(model.get("tokenizer_path", None) or model.path)
        critic_tokenizer = AutoTokenizer.from_pretrained(
            copy_to_local(self.hook_config.critic.path), trust_remote_code=False
        )
        if critic_tokenizer.get_vocab() == self.tokenizer.get_vocab():
            return None
        return copy_to_local(model.get("tokenizer_path", None) or model.path)

    def _init_prover_critic(self):
        """Create the critic worker group on its verl resource pool and load the critic replicas."""
        from verl.utils.fs import copy_to_local

        placement = self.hook_config.placement
        if placement.shard == "fsdp":
            from verl_prm.integrations.verl.sharded_critic import ShardedProverCriticWorker as worker_class
        else:
            worker_class = ProverCriticWorker
        worker_cls = RayClassWithInitArgs(
            cls=ray.remote(worker_class),
            model_path=None if self.hook_config.critic.format == EXACT_CRITIC_FORMAT
            else copy_to_local(self.hook_config.critic.path),
            critic_kwargs=critic_worker_kwargs(self.hook_config),
            policy_tokenizer_path=self._policy_tokenizer_path(),
            offload=placement.offload,
        )
        group = RayWorkerGroup(
            resource_pool=self._critic_resource_pool(),
            ray_cls_with_init=worker_cls,
            device_name=self.config.trainer.device,
        )
        info = group.init_model()
        logger.info("prover critic worker group ready: %s", info)
        calibrations = {str(worker.get("calibration")) for worker in info if worker.get("calibration")}
        if self.hook_config.refresh.every and calibrations:
            raise ConfigError(
                f"verl_prm.refresh refits the value head of {self.hook_config.critic.path}, but its values are "
                f"calibrated ({', '.join(sorted(calibrations))}) by a map fitted for the checkpoint's head: set "
                "verl_prm.critic.calibration=none"
            )
        return group

    # ------------------------------------------------------------------ refresh of the learned PAV
    def _open_refresh_store(self):
        """The run's refresh directory (``verl_prm.refresh.directory``, default under trainer.default_local_dir),
        locked for the run; a resume must have the same refresh and sampling settings."""
        from verl_prm.critic.refresh import RefreshStore

        refresh, critic = self.hook_config.refresh, self.hook_config.critic
        directory = refresh.directory or os.path.join(self.config.trainer.default_local_dir, "pav_refresh")
        settings = {"critic_path": str(critic.path), "every": refresh.every, "window": refresh.window,
                    "mc_n": critic.mc_n, "mc_prefixes": critic.mc_prefixes,
                    "mc_prefixes_per_response": critic.mc_prefixes_per_response,
                    "mc_token_budget": critic.mc_token_budget, "mc_success_threshold": critic.mc_success_threshold}
        try:
            return RefreshStore(directory, settings)
        except ValueError as error:
            raise ConfigError(f"verl_prm.refresh.directory: {error}") from None

    def _refreshes_now(self) -> bool:
        every = self.hook_config.refresh.every
        return bool(every) and self.refresh_store is not None and self.global_steps % every == 0

    def _restore_refresh(self) -> None:
        """Once, at the run's first advantage phase: a resumed run sets the head its last refresh before this step
        fitted (the checkpoint holds the actor, not the critic's refitted head)."""
        if self._refresh_restored or self.refresh_store is None:
            return
        self._refresh_restored = True
        done = self.refresh_store.steps(self.global_steps - 1)
        if done:
            _, weight, bias = self.refresh_store.read(done[-1])
            self.prover_wg.set_value_head(weight.tolist(), bias)
            logger.info("verl_prm.refresh: resumed with the value head refitted at step %d", done[-1])

    def _refresh(self, data, split, scores, real_rows, prompts, prompt_mask, truncated) -> dict[str, float]:
        """Sample the batch's step values, compare the PAV's values (as it scored the batch) with them, write them
        as labels, refit the value head to the labels of the last ``window`` refreshes and set it on every worker
        (``verl_prm.critic.refresh``). Returns the ``pav/refresh/*`` metrics."""
        from verl_prm.critic.refresh import labelled_rows, refit_value_head, refresh_label_rows, refresh_metrics, \
            refresh_targets
        from verl_prm.integrations.verl.rollout_critic import mc_metrics

        refresh, critic = self.hook_config.refresh, self.hook_config.critic
        step = int(self.global_steps)
        values = self._sample_step_values(data, split, real_rows)
        successes, groups, outcomes = self._outcomes(data)
        real = real_rows.tolist() if real_rows is not None else [True] * len(groups)
        targets, trials = refresh_targets(values, groups, real)
        critic_values = torch.cat([scores.batch["prompt_values"].float()[:, None],
                                   scores.batch["step_values"].float()], dim=1)
        metrics = refresh_metrics(critic_values, targets.float(), trials)
        metrics.update(mc_metrics(values, data["response_mask"], real_rows if real_rows is not None and real_rows.any()
                                  else None))
        rows = labelled_rows(step, scores.batch["features"].float(), targets, trials)
        window = self.refresh_store.window(step - 1, refresh.window - 1) + [rows] if refresh.window > 1 else [rows]
        if not len(rows.targets):
            return metrics  # nothing labelled (every response empty): the head stays
        fit = refit_value_head(window)
        prompt_texts = [self.tokenizer.decode(row[mask.bool()].tolist(), skip_special_tokens=False)
                        for row, mask in zip(prompts, prompt_mask)]
        reward_models = _row_list(data["reward_model"])
        label_rows = refresh_label_rows(
            values, groups, successes, step, prompts=prompt_texts, responses=split.texts,
            step_char_ends=split.step_char_ends, outcome_scores=outcomes.tolist(),
            finished=(~truncated).tolist(),
            data_sources=_row_list(data["data_source"]), ground_truths=[row.get("ground_truth") for row in reward_models],
            strategy=critic.mc_prefixes, source=f"verl-prm refresh: the policy at step {step}", real_rows=real)
        self.refresh_store.write(rows, label_rows, fit.weight, fit.bias)
        self.prover_wg.set_value_head(fit.weight.tolist(), fit.bias)
        metrics.update({
            "pav/refresh/window_labels": float(sum(len(r.targets) for r in window)),
            "pav/refresh/fit_loss": float(fit.loss), "pav/refresh/fit_iterations": float(fit.iterations),
            "pav/refresh/fit_converged": float(fit.converged),
        })
        return metrics

    # ------------------------------------------------------------------ advantage phase
    def _score_steps(self, data, batch_keys, real_rows: torch.Tensor | None = None,
                     refresh: bool = False) -> tuple[dict[str, Any], float]:
        """Split the responses into steps and score them with the critic group (format "rollout": sample them);
        with ``refresh`` also sample them and refit the value head (``_refresh``; its metrics: ``refresh_metrics``).

        ``data.batch`` holds ``prompts`` (jagged), ``responses`` (jagged) and ``response_mask`` [B, T].
        Returns the step tensors of the contract plus ``truncated`` (and, when sampling, ``mc``: the
        ``SampledValues``; with ``verl_prm.diagnostics.reference``, ``reference``: the exact prover's
        ``CriticScores`` of the same steps, for the metrics only), and the critic's wall time (without the
        reference's).
        """
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        prompts, prompt_mask = _left_padded(data["prompts"], pad_id)
        response_lengths = data["responses"].offsets().diff()
        responses = data["responses"].to_padded_tensor(padding=pad_id)
        width = responses.shape[1]
        response_attention = (torch.arange(width)[None, :] < response_lengths[:, None]).long()
        attention = torch.cat([prompt_mask, response_attention], dim=1)
        response_mask = data["response_mask"]
        if response_mask.is_nested:
            response_mask = response_mask.to_padded_tensor(padding=0)
        split = self.hook_config.steps.split(responses, response_mask, self.tokenizer)
        # the contract's step tensors, whoever gives the values
        tensors = {"step_ids": split.step_ids, "num_steps": split.num_steps, "merged_steps": split.merged_steps,
                   "truncated": truncated_responses(responses, response_lengths, self._eos_token_ids())}
        if self.hook_config.diagnostics.reference is not None:
            # the exact reference of the diagnostics reads the split's texts, as a format=exact critic worker does
            try:
                tensors["reference"] = self.reference_critic.score_policy_batch(prompts, responses, attention,
                                                                                split, self.tokenizer)
            except ValueError as error:
                raise ValueError(f"verl_prm.diagnostics.reference: {error}") from error
        if self._samples_values():
            start = time.perf_counter()
            values = self._sample_step_values(data, split, real_rows)
            tensors.update(step_values=values.step_values.float(), prompt_values=values.prompt_values.float(),
                           mc=values)
            return tensors, time.perf_counter() - start
        critic_input = DataProto.from_dict(
            tensors={
                "prompts": prompts,
                "responses": responses,
                "attention_mask": attention,
                "step_ends": split.step_ends,
                "num_steps": split.num_steps,
                "step_ids": split.step_ids,
                "merged_steps": split.merged_steps,
                # for a critic with another tokenizer: where the steps end in the text, and the mask the text
                # was decoded with (the split's), so the critic re-reads exactly the split's text
                "step_char_ends": split.step_char_ends,
                "step_text_mask": response_mask.long(),
            }
        )
        if refresh:
            critic_input.meta_info["with_features"] = True
        start = time.perf_counter()
        scores = compute_step_values(self.prover_wg, critic_input)
        seconds = time.perf_counter() - start
        offload_seconds = scores.meta_info.get("metrics", {}).get(OFFLOAD_SECONDS_KEY)
        timing_raw = getattr(self, "timing_raw", None)
        if self.hook_config.placement.offload != "none" and offload_seconds and timing_raw is not None:
            # the workers move in parallel: the phase waits for the slowest (verl logs timing_s/pav_critic_offload)
            timing_raw["pav_critic_offload"] = max(offload_seconds)
        if not torch.equal(scores.batch["num_steps"].cpu(), split.num_steps.cpu()):
            bad = (scores.batch["num_steps"].cpu() != split.num_steps.cpu()).nonzero().flatten().tolist()
            raise RuntimeError(
                f"the critic scored a different number of steps than the split for samples {bad[:8]} "
                f"(keys {[batch_keys[i] for i in bad[:8]]}): critic and step split disagree"
            )
        tensors.update(step_values=scores.batch["step_values"].float(), prompt_values=scores.batch["prompt_values"].float())
        if refresh:
            timing_raw = getattr(self, "timing_raw", None)
            timing = (marked_timer("pav_refresh", timing_raw, color="purple") if timing_raw is not None
                      else contextlib.nullcontext())
            with timing:
                tensors["refresh_metrics"] = self._refresh(data, split, scores, real_rows, prompts, prompt_mask,
                                                           tensors["truncated"])
        return tensors, seconds

    def _outcomes(self, data) -> tuple[list[bool], list[str], torch.Tensor]:
        """(each response's success by ``verl_prm.critic.mc_success_threshold``, its prompt group (uid), its
        outcome reward [B]) of a TransferQueue batch."""
        scores = data["rm_scores"]
        outcomes = (scores.to_padded_tensor(padding=0.0) if scores.is_nested else scores).float().sum(dim=-1)
        successes = [bool(value > self.hook_config.critic.mc_success_threshold) for value in outcomes.tolist()]
        uids = data["uid"]
        groups = [str(uid) for uid in (uids.tolist() if hasattr(uids, "tolist") else list(uids))]
        return successes, groups, outcomes

    def _sample_step_values(self, data, split, real_rows: torch.Tensor | None):
        """Monte-Carlo values of the batch's steps from the rollout replicas (``rollout_critic``), between a wake-up
        with the actor's weights (not yet updated in this step: those that generated the batch) and a sleep."""
        prompts = [row.tolist() for row in data["prompts"].unbind()]
        responses = [row.tolist() for row in data["responses"].unbind()]
        successes, groups, _ = self._outcomes(data)
        reward_models = _row_list(data["reward_model"])
        timing_raw = getattr(self, "timing_raw", None)
        timing = (marked_timer("pav_mc", timing_raw, color="purple") if timing_raw is not None
                  else contextlib.nullcontext())
        with timing:
            # the replicas sleep after generation (on_sample_end); wake them with the batch's weights, whose
            # version is the previous step's
            self.checkpoint_manager.update_weights(max(self.global_steps - 1, 0))
            try:
                return self.rollout_critic.step_values(
                    prompts, responses, split.step_ends, split.num_steps, successes, groups,
                    _row_list(data["data_source"]), [row.get("ground_truth") for row in reward_models],
                    _row_list(data["extra_info"]),
                    sample_rows=real_rows.tolist() if real_rows is not None else None,
                    request_tag=str(self.global_steps),
                )
            finally:
                self.checkpoint_manager.sleep_replicas()

    def _eos_token_ids(self) -> list[int]:
        """EOS ids a finished response ends with: the tokenizer's and the generation config's (Qwen2.5
        instruct models stop at either <|im_end|> or <|endoftext|>)."""
        if getattr(self, "_eos_ids", None) is None:
            from verl.utils.fs import copy_to_local
            from verl.utils.model import get_generation_config

            ids = {self.tokenizer.eos_token_id}
            try:
                generation = get_generation_config(copy_to_local(self.config.actor_rollout_ref.model.path))
            except (OSError, ValueError) as error:  # a directory without a model config: the tokenizer's EOS
                logger.warning("no generation config for the policy (%s): EOS is the tokenizer's only", error)
                generation = None
            eos = getattr(generation, "eos_token_id", None)
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
            self._eos_ids = sorted(int(i) for i in ids if i is not None)
        return self._eos_ids

    def _compute_advantage(self, batch, metrics: dict):
        """verl 0.9.1's advantage phase with the critic's step tensors (see the module docstring)."""
        estimator = self.config.algorithm.adv_estimator
        if not self._runs_critic():
            return super()._compute_advantage(batch, metrics)
        step_estimator = estimator in ESTIMATORS
        if step_estimator:
            _check_single_output_sessions(batch.keys)

        hook_fields = _HOOK_FIELDS + (_MC_FIELDS if self._samples_values() or self.hook_config.refresh.every else [])
        fields = _VERL_ADV_FIELDS + hook_fields
        raw = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        real_rows = torch.tensor([not tag.get("is_padding", False) for tag in batch.tags], dtype=torch.bool)
        self._restore_refresh()
        refresh = self._refreshes_now()
        timing_raw = getattr(self, "timing_raw", None)
        if timing_raw is not None:
            with marked_timer("pav_critic", timing_raw, color="purple"):
                step_tensors, critic_seconds = self._score_steps(raw, batch.keys, real_rows, refresh)
        else:
            step_tensors, critic_seconds = self._score_steps(raw, batch.keys, real_rows, refresh)
        if "mc" in step_tensors:
            from verl_prm.integrations.verl.rollout_critic import mc_metrics

            metrics.update(mc_metrics(step_tensors.pop("mc"), raw["response_mask"], real_rows if real_rows.any() else None))
        metrics.update(
            pav_metrics(
                step_tensors["step_values"], step_tensors["prompt_values"], step_tensors["num_steps"],
                step_tensors["truncated"], self.pav_config, critic_seconds,
                real_rows=real_rows if real_rows.any() else None,
            )
        )
        metrics["pav/merged_steps_share"] = (step_tensors.pop("merged_steps")[real_rows] > 0).float().mean().item() if real_rows.any() else 0.0
        metrics["pav/outcome_zero_signal_groups"] = outcome_zero_signal_share(raw["rm_scores"], raw["uid"], real_rows)
        # the reference's values leave here: only the metrics read them, never the advantages
        metrics.update(diagnostics_metrics(
            step_tensors["step_values"], step_tensors["prompt_values"], step_tensors["num_steps"], raw["rm_scores"],
            raw["uid"], real_rows, self.hook_config.diagnostics.signal_threshold, step_tensors.pop("reference", None),
        ))
        metrics.update(step_tensors.pop("refresh_metrics", {}))
        if not step_estimator:
            # outcome-only estimator (the grpo baseline): verl's advantages, unchanged; metrics only
            return super()._compute_advantage(batch, metrics)

        # ---- verl 0.9.1 PPOTrainer._compute_advantage, with the step tensors in the DataProto ----
        response_mask = raw["response_mask"]
        for key in hook_fields:
            del raw[key]
        data = DataProto(batch=raw.to_padded_tensor())
        data.batch["token_level_scores"] = data.batch["rm_scores"]
        data.non_tensor_batch["uid"] = np.array(data.batch.pop("uid").tolist(), dtype=object)
        width = data.batch["response_mask"].shape[1]
        for key, value in step_tensors.items():
            if value.dim() == 2 and key == "step_ids":
                value = _fit_width(value, width, fill=-1)
            data.batch[key] = value

        if self.config.algorithm.use_kl_in_reward:
            data, kl_metrics = apply_kl_penalty(
                data, kl_ctrl=self.kl_ctrl_in_reward, kl_penalty=self.config.algorithm.kl_penalty
            )
            metrics.update(kl_metrics)
        else:
            data.batch["token_level_rewards"] = data.batch["token_level_scores"]

        rollout_corr_config = self.config.algorithm.get("rollout_correction", None)
        bypass = rollout_corr_config and rollout_corr_config.get("bypass_mode", False)
        rollout_correction = (
            rollout_corr_config is not None and "rollout_log_probs" in data.batch and not bypass
        )
        if rollout_correction:
            data, is_metrics = compute_rollout_correction_and_add_to_batch(data, rollout_corr_config)
            metrics.update(is_metrics)

        data = compute_advantage_with_steps(data, self.config.algorithm)

        fields = ["advantages", "returns"]
        if self.config.algorithm.use_kl_in_reward:
            fields.append("token_level_rewards")
        if rollout_correction:
            fields.append("response_mask")
            if "rollout_is_weights" in data.batch:
                fields.append("rollout_is_weights")
        output = TensorDict(
            {field: response_to_nested(data.batch[field], response_mask) for field in fields},
            batch_size=len(batch),
        )
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=output)



def _row_list(value) -> list:
    """One Python value per row of a non-tensor TransferQueue field (NonTensorStack or tensordict's list)."""
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _fit_width(tensor: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    """Pad or cut the last dimension to ``width`` (the split's width follows the padded responses)."""
    if tensor.shape[1] == width:
        return tensor
    if tensor.shape[1] > width:
        return tensor[:, :width]
    pad = torch.full((tensor.shape[0], width - tensor.shape[1]), fill, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, pad], dim=1)


def _check_single_output_sessions(keys) -> None:
    """Step estimators score each TransferQueue row as one response; a session with several outputs
    (multi-turn agent loops write ``{uid}_{session}_{index}`` with index > 0) would be mis-grouped."""
    multi = [key for key in keys if key.rsplit("_", 2)[-1] not in ("0",)]
    if multi:
        raise NotImplementedError(
            f"verl-prm step estimators support one output per trajectory (single-turn rollouts), but the batch has "
            f"outputs {multi[:4]} with index > 0 (multi-output agent loops); use a single-turn agent loop"
        )


def register_trainer_hook() -> None:
    """Register ``PavSyncTrainer`` as verl's trainer ``pav_sync`` (idempotent)."""
    if TRAINER_REGISTRY.get(HOOK_TRAINER_NAME) is not PavSyncTrainer:
        register_trainer(HOOK_TRAINER_NAME)(PavSyncTrainer)


# verl's plugin loader may have asked for the registration while this module was still executing.
run_deferred_registration(__name__)
