"""The advantage phase's batch as every source of step values reads it (:class:`StepBatch`), and what a source
returns (:class:`StepValues`).

verl keeps the batch in TransferQueue as jagged (nested) tensors; :func:`read_step_batch` pads them once, splits
the responses into steps and reads the outcomes, uids and truncation, so that no source repeats it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from verl_prm.responses import truncated_responses
from verl_prm.steps import StepSplit

__all__ = ["SAMPLING_FIELDS", "STEP_FIELDS", "TREE_FIELDS", "StepBatch", "StepValues", "read_step_batch"]

# The TransferQueue fields a StepBatch is read from (verl's _compute_advantage reads uid, response_mask and
# rm_scores too) ...
STEP_FIELDS = ("uid", "response_mask", "rm_scores", "prompts", "responses")
# ... and what the rollout sampler scores continuations with ...
SAMPLING_FIELDS = ("data_source", "reward_model", "extra_info")
# ... and what the agent loop recorded per response (a tree's leaves: their parent and generated tokens).
TREE_FIELDS = ("extra_fields",)


@dataclass(frozen=True)
class StepBatch:
    """One batch of responses, padded, split into steps. B rows in TransferQueue's order (``keys``).

    ``prompts``/``prompt_mask`` [B, P] are left-padded, ``responses``/``response_mask`` [B, T] right-padded
    (``response_lengths`` [B] the valid lengths, ``response_mask`` verl's); ``split`` the step rule's
    ``StepSplit``; ``truncated`` [B] True where a response does not end with EOS; ``outcomes`` [B] each
    response's summed ``rm_scores``; ``uids`` its prompt group; ``real_rows`` [B] False for verl's padding rows;
    ``step`` verl's ``global_steps``. ``data_sources``, ``ground_truths``, ``extra_infos``: per row, when read
    (the rollout sampler's fields), else None; ``agent_fields``: each row's agent-loop ``extra_fields`` when read
    (tree-shaped groups), else None.
    """

    keys: list[str]
    step: int
    real_rows: torch.Tensor
    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    responses: torch.Tensor
    response_lengths: torch.Tensor
    response_mask: torch.Tensor
    split: StepSplit
    truncated: torch.Tensor
    outcomes: torch.Tensor
    uids: list[str]
    data_sources: list | None = None
    ground_truths: list | None = None
    extra_infos: list | None = None
    agent_fields: list | None = None

    @property
    def attention_mask(self) -> torch.Tensor:
        """[B, P + T]: the prompt's mask, then 1 on each response's valid tokens."""
        width = self.responses.shape[1]
        response_attention = (torch.arange(width)[None, :] < self.response_lengths[:, None]).long()
        return torch.cat([self.prompt_mask, response_attention], dim=1)

    @property
    def metric_rows(self) -> torch.Tensor:
        """[B] bool: the rows the metrics read: the real ones, or every row when none is real."""
        return self.real_rows if self.real_rows.any() else torch.ones_like(self.real_rows)

    def prompt_ids(self) -> list[list[int]]:
        return [row[mask.bool()].tolist() for row, mask in zip(self.prompts, self.prompt_mask)]

    def response_ids(self) -> list[list[int]]:
        return [row[: int(length)].tolist() for row, length in zip(self.responses, self.response_lengths)]


@dataclass(frozen=True)
class StepValues:
    """What a source of step values returns for a ``StepBatch``.

    ``step_values`` [B, S] and ``prompt_values`` [B] (float32, raw: before Best-of-K); ``seconds`` the source's
    wall time (``pav/critic_seconds``); ``metrics`` its own ``pav/*`` metrics (the sampler's ``pav/mc_*``, the
    refresh's ``pav/refresh/*``); ``timing`` verl ``timing_s/*`` values it measured (``pav_critic_offload``);
    ``features`` [B, S + 1, D] the value head's input when asked for (the refresh); ``sampled`` the rollout
    sampler's ``verl_prm.critic.sampled.SampledValues``; ``leaf_counts`` [B, S] the leaves below each step's node,
    ``response_values`` [B] and ``response_leaf_counts`` [B] the value and leaves of each response's own node
    (tree-shaped groups, ``verl_prm.trees.TreeValues``: what the tree estimators read).
    """

    step_values: torch.Tensor
    prompt_values: torch.Tensor
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)
    features: torch.Tensor | None = None
    sampled: Any = None
    leaf_counts: torch.Tensor | None = None
    response_values: torch.Tensor | None = None
    response_leaf_counts: torch.Tensor | None = None


def read_step_batch(fields, keys: list[str], tags: list[dict], step: int, tokenizer, steps,
                    eos_token_ids: list[int]) -> StepBatch:
    """A ``StepBatch`` of the TransferQueue fields ``fields`` (a TensorDict of ``STEP_FIELDS``, optionally
    ``SAMPLING_FIELDS``) of the rows ``keys`` with verl's ``tags``, split by the step rule ``steps``
    (``verl_prm.config.hook.StepsSection``)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts, prompt_mask = _left_padded(fields["prompts"], pad_id)
    response_lengths = fields["responses"].offsets().diff()
    responses = fields["responses"].to_padded_tensor(padding=pad_id)
    response_mask = _padded(fields["response_mask"], 0)
    split = steps.split(responses, response_mask, tokenizer)
    sampling = {}
    if "reward_model" in fields.keys():
        sampling = {"data_sources": _row_list(fields["data_source"]), "extra_infos": _row_list(fields["extra_info"]),
                    "ground_truths": [row.get("ground_truth") for row in _row_list(fields["reward_model"])]}
    if "extra_fields" in fields.keys():
        sampling["agent_fields"] = [dict(row or {}) for row in _row_list(fields["extra_fields"])]
    return StepBatch(
        keys=list(keys), step=int(step),
        real_rows=torch.tensor([not tag.get("is_padding", False) for tag in tags], dtype=torch.bool),
        prompts=prompts, prompt_mask=prompt_mask, responses=responses, response_lengths=response_lengths,
        response_mask=response_mask, split=split,
        truncated=truncated_responses(responses, response_lengths, eos_token_ids),
        outcomes=_padded(fields["rm_scores"], 0.0).float().sum(dim=-1),
        uids=[str(uid) for uid in _row_list(fields["uid"])], **sampling,
    )


def _padded(tensor: torch.Tensor, padding) -> torch.Tensor:
    return tensor.to_padded_tensor(padding=padding) if tensor.is_nested else tensor


def _row_list(value) -> list:
    """One Python value per row of a non-tensor TransferQueue field (NonTensorStack or tensordict's list)."""
    return value.tolist() if hasattr(value, "tolist") else list(value)


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
