"""The rollout sampler (``verl_prm.critic.source=sampled``, and ``verl_prm.refresh``) in a verl run: Monte-Carlo
step values from the run's own rollout replicas, scored by the run's own reward function.

What is sampled and how the values are estimated is the library's (``verl_prm.monte_carlo``,
``verl_prm.critic.sampled``); this module only
translates:

- a prefix of response b after step h is the token ids ``prompt_b + response_b[: step_end_h + 1]`` (the policy's
  prompt and response tokens, as generated; no re-tokenisation), continued by ``n_mc`` requests to verl's
  ``LLMServerClient.generate`` (the client verl's agent loop uses: ``PPOTrainer.get_llm_client()``, over the
  rollout replicas) with the rollout's sampling settings (``temperature``, ``top_p``, ``top_k``, as verl's agent
  loop sends them) and ``max_tokens`` = ``actor_rollout_ref.rollout.response_length`` minus the prefix's response
  tokens, so a continued response is never longer than a policy response;
- a continuation is scored like a response: the response prefix and continuation tokens are decoded with
  ``skip_special_tokens=True`` and passed with the row's ``data_source``, ``reward_model.ground_truth`` and
  ``extra_info`` to the run's reward function (``reward.custom_reward_function`` when set, else verl's
  ``default_compute_score``, as the ``pav`` and ``naive`` reward managers do); it succeeds iff its score is
  greater than ``verl_prm.critic.success_threshold``, and so does a response by its ``rm_scores``;
- with ``verl_prm.critic.pool_group_samples`` the other responses of the group whose response token ids begin
  with a sampled prefix's (and go on past it) add their outcomes to its value (``verl_prm.critic.sampled``: free
  samples); ``verl_prm.critic.group_prior_strength`` shrinks each sampled rate toward the group's success rate
  (the refresh's labels are shrunk toward the learned PAV's values by ``verl_prm.refresh.prior_strength``:
  ``integrations.verl.head_refresh``).

The trainer hook wakes the replicas with the actor's weights (``checkpoint_manager.update_weights``; the actor
has not been updated yet in this step, so these are the weights that generated the batch), samples, and puts
them back to sleep (``checkpoint_manager.sleep_replicas()``), the same cycle as verl's generation phase.
Continuations are never written to TransferQueue: they do not enter the policy update.

The startup checks of a run that samples are ``run_config.check_sampling_run`` (each error names the key).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch

from verl_prm.config.hook import CriticSection
from verl_prm.critic.sampled import SampledValues, sampled_step_values
from verl_prm.labeling.scoring import OutcomeScorer
from verl_prm.monte_carlo import PrefixCounts, PrefixRequest, ResponseSteps

__all__ = ["RolloutSampler", "mc_metrics", "run_reward_function", "sampling_params"]


def run_reward_function(config: Any):
    """The run's reward function: ``reward.custom_reward_function`` (with its ``reward_kwargs``) when set, else
    verl's ``default_compute_score``."""
    from verl.trainer.ppo.reward import get_custom_reward_fn

    function = get_custom_reward_fn(config)
    if function is None:
        from verl.utils.reward_score import default_compute_score

        function = default_compute_score
    return function


def sampling_params(rollout_config: Any) -> dict[str, Any]:
    """The sampling settings verl's agent loop sends for training rollouts (``AgentLoopManager``)."""
    return {
        "temperature": float(rollout_config.temperature),
        "top_p": float(rollout_config.top_p),
        "top_k": int(rollout_config.top_k),
        "repetition_penalty": 1.0,
        "logprobs": False,
    }


def mc_metrics(values: SampledValues, response_mask: torch.Tensor, real_rows: torch.Tensor | None = None) -> dict[str, float]:
    """The cost of one step's sampling (``pav/mc_*``): prefixes sampled and refused by the token budget (these
    hold the value of the step before them), continuations, tokens generated, rounds of generation calls, the
    share of the real rows' steps whose value was sampled, and the token ratio

        pav/mc_token_ratio = continuation tokens / response tokens of the batch,

    the response tokens being ``response_mask``'s ([B, T], padded or nested) ones of the real rows: how many
    tokens the critic generated per token the rollout generated for the batch. The samples of the real rows'
    sampled values (``verl_prm.critic.sampled``): ``pav/mc_pooled_samples`` the group's responses pooled as free
    samples, ``pav/mc_samples_per_value`` the mean samples (continuations + pooled) per sampled value."""
    real = None if real_rows is None else set(torch.as_tensor(real_rows).nonzero().flatten().tolist())
    counted = [key for key in values.counts if real is None or key[0] in real]
    sampled = values.sampled if real_rows is None else values.sampled[real_rows]
    num_steps = values.num_steps if real_rows is None else values.num_steps[real_rows]
    mask = response_mask.to_padded_tensor(padding=0) if response_mask.is_nested else response_mask
    row_tokens = mask.long().sum(dim=-1)
    response_tokens = int((row_tokens if real_rows is None else row_tokens[real_rows]).sum())
    steps = int(num_steps.sum())
    return {
        "pav/mc_prefixes_evaluated": float(values.prefixes_evaluated),
        "pav/mc_prefixes_skipped": float(values.prefixes_skipped),
        "pav/mc_continuations": float(values.continuations),
        "pav/mc_tokens": float(values.tokens),
        "pav/mc_rounds": float(values.rounds),
        "pav/mc_sampled_step_share": float(sampled.sum()) / steps if steps else 0.0,
        "pav/mc_token_ratio": values.tokens / response_tokens if response_tokens else 0.0,
        "pav/mc_pooled_samples": float(sum(values.pooled.get(key, 0) for key in counted)),
        "pav/mc_samples_per_value": (sum(values.counts[key].continuations for key in counted) / len(counted)
                                     if counted else 0.0),
    }


class RolloutSampler:
    """Step values of a batch by sampling through ``client`` (an ``LLMServerClient``: ``async generate(request_id,
    *, prompt_ids, sampling_params) -> TokenOutput``) and scoring with ``scorer`` (module docstring)."""

    def __init__(self, critic: CriticSection, client: Any, tokenizer: Any, scorer: OutcomeScorer,
                 sampling: dict[str, Any], response_length: int) -> None:
        self.critic = critic
        self.client = client
        self.tokenizer = tokenizer
        self.scorer = scorer
        self.sampling = dict(sampling)
        self.response_length = int(response_length)
        self.calls = 0

    def step_values(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        step_ends: torch.Tensor,
        num_steps: torch.Tensor,
        successes: Sequence[bool],
        groups: Sequence[Any],
        data_sources: Sequence[Any],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict | None],
        sample_rows: Sequence[bool] | None = None,
        request_tag: str = "",
    ) -> SampledValues:
        """Values [B, S] (S = ``step_ends``' width) of the responses' steps; ``step_ends[b, h]`` is the position of
        step h's last token in ``responses[b]`` (``verl_prm.steps.StepSplit``); rows with ``sample_rows`` False
        (padding) are not sampled nor pooled."""
        group_index: dict[Any, int] = {}
        inputs, row_groups = [], []
        for b, response in enumerate(responses):
            keep = sample_rows is None or bool(sample_rows[b])
            # padding rows get a group of their own, so they do not count in a real prompt's value
            group = group_index.setdefault(groups[b] if keep else ("padding", b), len(group_index))
            ends = step_ends[b, : int(num_steps[b])].tolist()
            limits = [self.response_length - (end + 1) for end in ends]
            if keep and any(limit < 1 for limit in limits[:-1]):
                raise ValueError(
                    f"response {b} has a step ending at token {max(ends[:-1]) + 1} of "
                    f"actor_rollout_ref.rollout.response_length={self.response_length} before its last step: the "
                    "responses are longer than the configured response length"
                )
            inputs.append(ResponseSteps(num_steps=len(limits), success=bool(successes[b]), sample=keep,
                                        continuation_limits=[max(limit, 0) for limit in limits]))
            row_groups.append(group)

        def sample(requests: list[PrefixRequest]) -> list[PrefixCounts]:
            return self._sample(requests, prompts, responses, step_ends, data_sources, ground_truths, extra_infos,
                                request_tag)

        critic = self.critic
        tokens, ends = None, None
        if critic.pool_group_samples:  # padding rows (not sampled) are no free samples either
            tokens = [list(map(int, r)) if step.sample else None for r, step in zip(responses, inputs)]
            ends = [step_ends[b, : step.num_steps].tolist() for b, step in enumerate(inputs)]
        return sampled_step_values(inputs, row_groups, sample, prefix_rule=critic.prefix_rule, n_mc=critic.n_mc,
                                   prefixes_per_response=critic.prefixes_per_response,
                                   token_budget=critic.mc_token_budget, width=int(step_ends.shape[1]),
                                   tokens=tokens, step_ends=ends, prior_strength=critic.group_prior_strength)

    def _sample(self, requests, prompts, responses, step_ends, data_sources, ground_truths, extra_infos,
                request_tag) -> list[PrefixCounts]:
        from verl.utils.ray_utils import auto_await

        prefixes = [list(map(int, responses[r.row][: int(step_ends[r.row, r.step]) + 1])) for r in requests]
        self.calls += 1
        call = self.calls

        @auto_await
        async def generate_all():
            jobs = []
            for request, prefix in zip(requests, prefixes):
                prompt_ids = [int(t) for t in prompts[request.row]] + prefix
                params = {**self.sampling, "max_tokens": request.max_tokens}
                for j in range(request.n_mc):
                    jobs.append(self.client.generate(
                        f"pav-mc-{request_tag}-{call}-{request.row}-{request.step}-{j}",
                        prompt_ids=prompt_ids, sampling_params=dict(params)))
            return await asyncio.gather(*jobs)

        outputs = generate_all()
        texts, sources, truths, infos, owners, tokens = [], [], [], [], [], [0] * len(requests)
        cursor = 0
        for position, (request, prefix) in enumerate(zip(requests, prefixes)):
            for _ in range(request.n_mc):
                continuation = [int(t) for t in outputs[cursor].token_ids]
                cursor += 1
                if len(continuation) > request.max_tokens:
                    raise RuntimeError(
                        f"the rollout returned {len(continuation)} tokens for a continuation limited to "
                        f"max_tokens={request.max_tokens} (response {request.row}, step {request.step})"
                    )
                tokens[position] += len(continuation)
                texts.append(self.tokenizer.decode(prefix + continuation, skip_special_tokens=True))
                sources.append(data_sources[request.row])
                truths.append(ground_truths[request.row])
                infos.append(dict(extra_infos[request.row] or {}))
                owners.append(position)
        scores = self.scorer.score_many(sources, texts, truths, infos)
        wins = [0] * len(requests)
        for owner, score in zip(owners, scores):
            wins[owner] += int(self.scorer.success(score))
        return [PrefixCounts(successes=wins[i], continuations=r.n_mc, tokens=tokens[i]) for i, r in enumerate(requests)]
