"""Step values by Monte-Carlo sampling inside RL: the estimates of :mod:`verl_prm.monte_carlo`, made whole.

A critic that samples has no model of its own: for a response y = a_1..a_H to a prompt x it asks the policy
that wrote the batch for ``n_mc`` continuations of each prefix x + y[:end_h] that the prefix rule picks
(``verl_prm.monte_carlo``: the estimate v_h = successes / n_mc, the rules, the token budget). Two values need no
sampling: the value after the **last** step is the response's own outcome (the response ended there, by EOS or
at the length limit), and the **prompt value** is the success rate of the prompt's group of responses in the
batch (GRPO's n responses of one prompt are n Monte-Carlo samples of V^pi(x)). Successful responses are not
searched under ``first_pit``.

A step that is not sampled (not chosen by the rule, or refused by the token budget) **holds** the value of the
nearest estimated step before it (the prompt value if there is none), except that steps at or after a known zero
of ``first_pit`` are 0 (``hold_fill``).

The sampling itself is injected (``sample(requests) -> [PrefixCounts]``): the verl glue generates through the
run's rollout replicas and scores with the run's reward function; the tests use a scripted policy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from verl_prm.monte_carlo import PrefixCounts, PrefixRequest, ResponseSteps, estimate_prefixes

__all__ = ["SampledValues", "group_success_rates", "hold_fill", "sampled_step_values"]


@dataclass
class SampledValues:
    """Raw success rates in [0, 1] with the critic contract (``step_values`` [B, S], ``prompt_values`` [B]),
    which steps were estimated from samples (``sampled`` [B, S]), the first pits (-1: none found) and the cost."""

    step_values: torch.Tensor
    prompt_values: torch.Tensor
    num_steps: torch.Tensor
    sampled: torch.Tensor
    first_pits: list[int]
    prefixes_evaluated: int = 0
    prefixes_skipped: int = 0
    continuations: int = 0
    tokens: int = 0
    rounds: int = 0
    counts: dict[tuple[int, int], PrefixCounts] = field(default_factory=dict)


def group_success_rates(successes: Sequence[bool], groups: Sequence) -> list[float]:
    """The prompt value of each response: the success rate of its group, V(x) = mean_{i in group(x)} R_i."""
    totals: dict = {}
    for success, group in zip(successes, groups):
        total = totals.setdefault(group, [0, 0])
        total[0] += int(bool(success))
        total[1] += 1
    return [totals[group][0] / totals[group][1] for group in groups]


def hold_fill(estimates: torch.Tensor, prompt_values: torch.Tensor, zero_from: torch.Tensor) -> torch.Tensor:
    """Values of all steps from the estimated ones (NaN where not estimated), [B, S] -> [B, S]:

        v_h = 0                                       if h >= zero_from_b (at or after a known first pit)
            = est_{h'},  h' = max{h' <= h : estimated}  otherwise, if such an h' exists
            = prompt_values_b                          otherwise

    (a step that was not continued holds the nearest estimate before it). ``zero_from`` [B] (S or more: none).
    """
    batch, width = estimates.shape
    positions = torch.arange(width, device=estimates.device).expand(batch, width)
    estimated = ~torch.isnan(estimates)
    last = torch.where(estimated, positions, torch.full_like(positions, -1)).cummax(dim=1).values
    padded = torch.cat([prompt_values.to(estimates.dtype)[:, None], torch.nan_to_num(estimates)], dim=1)
    held = padded.gather(1, last + 1)
    return torch.where(positions >= zero_from.to(positions.device)[:, None], torch.zeros_like(held), held)


def sampled_step_values(
    responses: Sequence[ResponseSteps],
    groups: Sequence,
    sample: Callable[[list[PrefixRequest]], list[PrefixCounts]],
    *,
    prefix_rule: str,
    n_mc: int,
    prefixes_per_response: int = 4,
    token_budget: int | None = None,
    width: int | None = None,
) -> SampledValues:
    """Monte-Carlo step values of ``responses`` (``groups[b]``: the prompt group of response b) under
    ``prefix_rule`` (module docstring; ``verl_prm.monte_carlo.estimate_prefixes`` runs the rounds).

    ``token_budget`` (None: unbounded) bounds the tokens generated over all rounds. ``width``: S of the [B, S]
    values (default: the most steps of a response, at least 1).
    """
    if len(groups) != len(responses):
        raise ValueError(f"{len(groups)} groups for {len(responses)} responses")
    longest = max([0] + [r.num_steps for r in responses])
    width = max(1, longest) if width is None else width
    if width < longest:
        raise ValueError(f"width {width} is below the longest response's {longest} steps")
    estimates = estimate_prefixes(responses, sample, prefix_rule=prefix_rule, n_mc=n_mc,
                                  prefixes_per_response=prefixes_per_response, token_budget=token_budget)
    values = torch.full((len(responses), width), float("nan"), dtype=torch.float64)
    for (row, step), count in estimates.counts.items():
        values[row, step] = count.success_rate
    sampled = ~torch.isnan(values)
    for row, response in enumerate(responses):
        if response.num_steps:
            values[row, response.num_steps - 1] = float(response.success)  # the response's own outcome
    prompt_values = torch.tensor(group_success_rates([r.success for r in responses], groups), dtype=torch.float64)
    zero_from = torch.tensor([estimates.pits.get(row, width) for row in range(len(responses))], dtype=torch.long)
    step_values = hold_fill(values, prompt_values, zero_from)
    num_steps = torch.tensor([r.num_steps for r in responses], dtype=torch.long)
    step_values = torch.where(torch.arange(width)[None, :] < num_steps[:, None], step_values, 0.0)
    return SampledValues(
        step_values=step_values.float(), prompt_values=prompt_values.float(), num_steps=num_steps, sampled=sampled,
        first_pits=[estimates.pits.get(row, -1) for row in range(len(responses))],
        prefixes_evaluated=len(estimates.counts), prefixes_skipped=estimates.prefixes_skipped,
        continuations=estimates.continuations, tokens=estimates.tokens, rounds=estimates.rounds,
        counts=estimates.counts,
    )
