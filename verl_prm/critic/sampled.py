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

Two refinements of a sampled value, both off by the arguments' defaults:

* **free samples** (``tokens``): the other responses of the group that begin with a sampled prefix's tokens and go
  on past it are samples of its value too (``verl_prm.monte_carlo.shared_prefix_outcomes``); their outcomes are
  pooled with the continuations', v_h = (k_h + k'_h) / (n_mc + n'_h), still unbiased;
* **shrinkage** (``prior_strength`` s > 0): each sampled rate becomes the posterior mean of a Beta prior of mean
  m_h and strength s (``shrink_success_rates``), m_h the value given in ``prior`` (e.g. the learned PAV's) or else
  the group's success rate: fewer samples, closer to the prior, which trades a bias for less variance before the
  Best-of-K transform amplifies it. The last step's outcome and the prompt value are not shrunk.

The sampling itself is injected (``sample(requests) -> [PrefixCounts]``): the verl glue generates through the
run's rollout replicas and scores with the run's reward function; the tests use a scripted policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from verl_prm.monte_carlo import (
    PrefixCounts,
    PrefixRequest,
    ResponseSteps,
    estimate_prefixes,
    shared_prefix_outcomes,
)

__all__ = ["SampledValues", "group_success_rates", "hold_fill", "pool_group_samples", "sampled_step_values",
           "shrink_labels", "shrink_success_rates"]


@dataclass
class SampledValues:
    """Success rates in [0, 1] (before Best-of-K; shrunk when ``prior_strength`` > 0) with the critic contract
    (``step_values`` [B, S], ``prompt_values`` [B]), which steps were estimated from samples (``sampled`` [B, S]),
    the first pits (-1: none found) and the cost. ``counts[(b, h)]`` holds every sample of a sampled value: its
    ``continuations`` are the generated ones plus the ``pooled_samples`` responses of the group that continue the
    prefix (module docstring), its ``tokens`` the generated ones only; ``continuations`` and ``tokens`` (the
    totals) are what was generated."""

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
    pooled_samples: int = 0
    pooled: dict[tuple[int, int], int] = field(default_factory=dict)


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


def shrink_success_rates(successes: torch.Tensor, samples: torch.Tensor, prior: torch.Tensor,
                         strength: float) -> torch.Tensor:
    """Posterior means of success rates under Beta priors, elementwise (broadcast), any device:

        v = (k + s m) / (n + s),

    k = ``successes`` out of n = ``samples`` and a Beta(s m, s (1 - m)) prior of mean m = ``prior`` in [0, 1] and
    strength s = ``strength`` (its pseudo-samples). s = 0 gives k / n (the Monte-Carlo estimate, unbiased);
    s > 0 moves the estimate toward m by the weight s / (n + s), so a value of few samples moves most. With
    Q the true rate, E[v] - Q = s (m - Q) / (n + s) and Var[v] = n Q (1 - Q) / (n + s)^2 for a fixed m.
    """
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength) \
            or strength < 0:
        raise ValueError(f"prior_strength must be a finite number >= 0, got {strength!r}")
    successes, samples = successes.to(prior.dtype), samples.to(prior.dtype)
    return (successes + strength * prior) / (samples + strength)


def shrink_labels(rates: torch.Tensor, samples: torch.Tensor, prior: torch.Tensor, mask: torch.Tensor,
                  strength: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled labels shrunk as the values are (``shrink_success_rates``), with their weights: where ``mask``, a
    rate y of t samples becomes

        y' = (t y + s m) / (t + s)   with   t' = t + s  trials,

    s pseudo-samples at the prior m = ``prior``, so a likelihood weighted by t' is the samples' own plus s times
    the cross-entropy to m; elsewhere (y, t) are unchanged. Tensors of one shape; returns (y', t')."""
    rates, samples = rates.to(prior.dtype), samples.to(prior.dtype)
    shrunk = shrink_success_rates(rates * samples, samples, prior, strength)
    return torch.where(mask, shrunk, rates), torch.where(mask, samples + strength, samples)


def pool_group_samples(counts: dict[tuple[int, int], PrefixCounts], groups: Sequence,
                       tokens: Sequence[Sequence[Hashable] | None], step_ends: Sequence[Sequence[int]],
                       successes: Sequence[bool]) -> tuple[dict[tuple[int, int], PrefixCounts], dict]:
    """``counts`` with the free samples of the group added (module docstring): the prefix of (b, h) with h >= 0
    is ``tokens[b][: step_ends[b][h] + 1]``; a response with ``tokens`` None (padding) is no sample. Returns the
    pooled counts (k + k', n + n', the generated tokens) and n' of each prefix."""
    keys = [key for key in counts if key[1] >= 0]
    prefixes = [(groups[b], tokens[b][: int(step_ends[b][h]) + 1]) for b, h in keys]
    outcomes = shared_prefix_outcomes(prefixes, [b for b, _ in keys], groups, tokens, successes)
    pooled_counts, pooled = dict(counts), {}
    for key, (wins, samples) in zip(keys, outcomes):
        count = counts[key]
        pooled_counts[key] = PrefixCounts(count.successes + wins, count.continuations + samples, count.tokens)
        pooled[key] = samples
    return pooled_counts, pooled


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
    tokens: Sequence[Sequence[Hashable] | None] | None = None,
    step_ends: Sequence[Sequence[int]] | None = None,
    prior: torch.Tensor | None = None,
    prior_strength: float = 0.0,
) -> SampledValues:
    """Monte-Carlo step values of ``responses`` (``groups[b]``: the prompt group of response b) under
    ``prefix_rule`` (module docstring; ``verl_prm.monte_carlo.estimate_prefixes`` runs the rounds).

    ``token_budget`` (None: unbounded) bounds the tokens generated over all rounds. ``width``: S of the [B, S]
    values (default: the most steps of a response, at least 1). ``tokens`` (with ``step_ends``: ``step_ends[b][h]``
    the position of step h's last token; None: no pooling): each response's tokens, to pool the group's free samples
    (``pool_group_samples``). ``prior`` [B, S] (None: each row's group success rate) and ``prior_strength``: the
    shrinkage of the sampled rates (``shrink_success_rates``).
    """
    if len(groups) != len(responses):
        raise ValueError(f"{len(groups)} groups for {len(responses)} responses")
    longest = max([0] + [r.num_steps for r in responses])
    width = max(1, longest) if width is None else width
    if width < longest:
        raise ValueError(f"width {width} is below the longest response's {longest} steps")
    if prior is not None and tuple(prior.shape) != (len(responses), width):
        raise ValueError(f"prior has shape {tuple(prior.shape)}, expected {(len(responses), width)} (rows, steps)")
    estimates = estimate_prefixes(responses, sample, prefix_rule=prefix_rule, n_mc=n_mc,
                                  prefixes_per_response=prefixes_per_response, token_budget=token_budget)
    counts, pooled = estimates.counts, {}
    if tokens is not None:
        if step_ends is None or len(tokens) != len(responses):
            raise ValueError(f"pooling needs the tokens and step ends of all {len(responses)} responses")
        counts, pooled = pool_group_samples(counts, groups, tokens, step_ends, [r.success for r in responses])
    prompt_values = torch.tensor(group_success_rates([r.success for r in responses], groups), dtype=torch.float64)
    values = _estimated_values(counts, len(responses), width,
                               prompt_values[:, None] if prior is None else prior.double().cpu(), prior_strength)
    sampled = ~torch.isnan(values)
    for row, response in enumerate(responses):
        if response.num_steps:
            values[row, response.num_steps - 1] = float(response.success)  # the response's own outcome
    zero_from = torch.tensor([estimates.pits.get(row, width) for row in range(len(responses))], dtype=torch.long)
    step_values = hold_fill(values, prompt_values, zero_from)
    num_steps = torch.tensor([r.num_steps for r in responses], dtype=torch.long)
    step_values = torch.where(torch.arange(width)[None, :] < num_steps[:, None], step_values, 0.0)
    return SampledValues(
        step_values=step_values.float(), prompt_values=prompt_values.float(), num_steps=num_steps, sampled=sampled,
        first_pits=[estimates.pits.get(row, -1) for row in range(len(responses))],
        prefixes_evaluated=len(estimates.counts), prefixes_skipped=estimates.prefixes_skipped,
        continuations=estimates.continuations, tokens=estimates.tokens, rounds=estimates.rounds,
        counts=counts, pooled_samples=sum(pooled.values()), pooled=pooled,
    )


def _estimated_values(counts: dict[tuple[int, int], PrefixCounts], rows: int, width: int, prior: torch.Tensor,
                      strength: float) -> torch.Tensor:
    """[rows, width] float64: the (shrunk) success rate of each counted step prefix, NaN elsewhere."""
    successes = torch.zeros(rows, width, dtype=torch.float64)
    samples = torch.zeros(rows, width, dtype=torch.float64)
    keys = [key for key in counts if key[1] >= 0]
    if keys:
        index = torch.tensor(keys, dtype=torch.long)
        successes[index[:, 0], index[:, 1]] = torch.tensor([float(counts[k].successes) for k in keys],
                                                           dtype=torch.float64)
        samples[index[:, 0], index[:, 1]] = torch.tensor([float(counts[k].continuations) for k in keys],
                                                         dtype=torch.float64)
    rates = shrink_success_rates(successes, samples, prior.expand(rows, width), strength)
    return torch.where(samples > 0, rates, torch.full_like(rates, float("nan")))
