"""verl's advantage phase -> the registered estimator: the one place that hands the step tensors to an estimator.

verl's own ``compute_advantage`` passes a plugin estimator only the rewards, mask, uid and config (patch 0001
would pass more). So the step tensors go around it: the caller runs verl's advantage phase inside
:func:`estimator_step_inputs`, a context that holds the batch's step tensors (:class:`StepInputs`), and the
estimators registered in verl (:data:`VERL_ESTIMATORS`, each :func:`verl_estimator` of an entry of
``verl_prm.estimators.ESTIMATORS``) read them from it when verl calls them. The trainer hook wraps verl's
``PPOTrainer._compute_advantage`` so (``hook_trainer``); the demo, on one process without Ray or
TransferQueue, wraps the part of it that computes the advantages, verl's
``compute_advantage_for_multi_trajectories``.
"""

from __future__ import annotations

import contextlib
import functools
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from verl_prm.estimators import ESTIMATORS, STEP_KEYS, TREE_KEYS

__all__ = ["StepInputs", "VERL_ESTIMATORS", "estimator_step_inputs", "verl_estimator"]


@dataclass(frozen=True)
class StepInputs:
    """One batch's step tensors (docs: concepts, "tensor contract"), rows in the batch's order.

    ``step_ids`` [B, T'] (-1 outside every step; T' the split's width), ``step_values`` [B, S],
    ``prompt_values`` [B], ``num_steps`` [B], ``truncated`` [B] bool; ``leaf_counts`` [B, S] the leaves below each
    step's node and ``response_values`` [B], ``response_leaf_counts`` [B] each response's own node (tree-shaped
    groups, ``verl_prm.trees.TreeValues``; None otherwise).
    """

    step_ids: torch.Tensor
    step_values: torch.Tensor
    prompt_values: torch.Tensor
    num_steps: torch.Tensor
    truncated: torch.Tensor
    leaf_counts: torch.Tensor | None = None
    response_values: torch.Tensor | None = None
    response_leaf_counts: torch.Tensor | None = None

    def estimator_kwargs(self, response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The estimator's step keyword arguments for verl's padded batch of ``response_mask`` [B, T]:
        ``step_ids`` padded with -1 (or cut) to T, as verl pads the responses to the longest, as int32."""
        rows, width = response_mask.shape
        if self.step_ids.shape[0] != rows:
            raise ValueError(
                f"the step tensors hold {self.step_ids.shape[0]} responses but verl's advantage batch has {rows}: "
                "the batch changed between the step scoring and verl's _compute_advantage"
            )
        step_ids = self.step_ids
        if step_ids.shape[1] > width:
            step_ids = step_ids[:, :width]
        elif step_ids.shape[1] < width:
            pad = step_ids.new_full((rows, width - step_ids.shape[1]), -1)
            step_ids = torch.cat([step_ids, pad], dim=1)
        # int32 ids (the contract takes both): half the bytes of int64 in the estimator's one pass over [B, T]
        kwargs = {"step_ids": step_ids.to(device=response_mask.device, dtype=torch.int32),
                  "step_values": self.step_values, "prompt_values": self.prompt_values, "num_steps": self.num_steps,
                  "truncated": self.truncated}
        for key in TREE_KEYS:
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        return kwargs


_STEP_INPUTS: ContextVar[StepInputs | None] = ContextVar("verl_prm_step_inputs", default=None)


@contextlib.contextmanager
def estimator_step_inputs(inputs: StepInputs) -> Iterator[None]:
    """Within this context, a registered step estimator that verl calls without step tensors gets ``inputs``."""
    token = _STEP_INPUTS.set(inputs)
    try:
        yield
    finally:
        _STEP_INPUTS.reset(token)


def verl_estimator(estimator: Callable[..., Any]) -> Callable[..., Any]:
    """``estimator`` as registered in verl: called without step tensors (verl's ``compute_advantage``) inside
    :func:`estimator_step_inputs`, it gets the context's; otherwise the arguments pass through unchanged (so
    outside the context the estimator's own error says what must supply them)."""

    @functools.wraps(estimator)
    def with_step_inputs(token_level_rewards, response_mask, index=None, config=None, **kwargs):
        inputs = _STEP_INPUTS.get()
        if inputs is not None and all(kwargs.get(key) is None for key in STEP_KEYS):
            kwargs.update(inputs.estimator_kwargs(response_mask))
        return estimator(token_level_rewards=token_level_rewards, response_mask=response_mask, index=index,
                         config=config, **kwargs)

    return with_step_inputs


# What the plugin registers in verl's ADV_ESTIMATOR_REGISTRY (name -> estimator).
VERL_ESTIMATORS: dict[str, Callable[..., Any]] = {name: verl_estimator(fn) for name, fn in ESTIMATORS.items()}

