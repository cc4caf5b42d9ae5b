"""Step values by Monte-Carlo sampling: which step prefixes to sample, the estimate, and the token budget.

A critic that samples has no model of its own: for a response y = a_1..a_H to a prompt x it asks the policy
that wrote the batch for ``n`` continuations c_1..c_n of the prefix x + y[:end_h] and estimates

    v_h = #{j <= n : R(y[:end_h] + c_j) succeeds} / n,

an unbiased estimate of Q^pi(s_h, a_h) with standard error sqrt(v_h (1 - v_h) / n). Two values need no
sampling: the value after the **last** step is the response's own outcome (the response ended there, by EOS or
at the length limit), and the **prompt value** is the success rate of the prompt's group of responses in the
batch (GRPO's n responses of one prompt are n Monte-Carlo samples of V^pi(x)).

Which prefixes are sampled (``PREFIX_RULES``):

* ``every``: every step but the last (cost n (H - 1) continuations per response);
* ``fixed``: ``k`` steps per response, evenly spaced over the steps but the last (``fixed_prefix_steps``);
* ``first_pit``: the PAV paper's search in a **failed** response (outcome 0) for the first step after which the
  value is 0 (zero successes out of n), assuming a value stays 0 after such a pit: bisection on [0, H - 1) with
  the last step as the known zero, about log2(H) prefixes (``verl_prm.labeling.monte_carlo.first_pit_search_step``).
  Steps at and after the pit get 0. Successful responses are not searched.

A step that is not sampled (not chosen by the rule, or refused by the token budget) **holds** the value of the
nearest estimated step before it (the prompt value if there is none), except that steps at or after a known zero
of ``first_pit`` are 0 (``fill_unsampled``).

The token budget bounds the tokens one call of ``sampled_step_values`` may generate. A prefix is admitted only if
its worst case, n times its continuation limit (``PrefixRequest.reserved_tokens``), fits in what is left (the
first prefix that does not fit ends the round's admission), and the tokens actually generated are charged after
each round, so the generated total never exceeds the budget.
Under ``every``/``fixed`` the prefixes are admitted by step index first (all first steps, then all second
steps, ...), so that what the budget refuses are the late steps, whose values the hold rule takes from the
steps before them.

The sampling itself is injected (``sample(requests) -> [PrefixCounts]``): the verl glue generates through the
run's rollout replicas and scores with the run's reward function; the tests use a scripted policy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from verl_prm.labeling.monte_carlo import first_pit_search_step

__all__ = [
    "PREFIX_RULES",
    "PrefixCounts",
    "PrefixRequest",
    "ResponseSteps",
    "SampledValues",
    "fill_unsampled",
    "fixed_prefix_steps",
    "group_success_rates",
    "sampled_step_values",
]

PREFIX_RULES = ("every", "fixed", "first_pit")


@dataclass(frozen=True)
class ResponseSteps:
    """One response as the sampler sees it.

    ``continuation_limits[h]``: the most tokens a continuation of the prefix ending after step h may have (the
    policy's response length minus the prefix's tokens), one entry per step; ``success``: the response's own
    outcome; ``group``: its prompt group (responses of one prompt share it); ``sample``: False for a row whose
    prefixes are not to be sampled (a padding row of the batch: its values are the hold rule's).
    """

    continuation_limits: Sequence[int]
    success: bool
    group: int
    sample: bool = True

    @property
    def num_steps(self) -> int:
        return len(self.continuation_limits)


@dataclass(frozen=True)
class PrefixRequest:
    """Sample ``n`` continuations of response ``row`` after step ``step``, each of at most ``max_tokens`` tokens."""

    row: int
    step: int
    n: int
    max_tokens: int

    @property
    def reserved_tokens(self) -> int:
        """The most tokens this request can generate: n * max_tokens."""
        return self.n * self.max_tokens


@dataclass(frozen=True)
class PrefixCounts:
    """What sampling one prefix gave: successes among its continuations and the tokens they have."""

    successes: int
    continuations: int
    tokens: int


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


def fixed_prefix_steps(num_steps: int, count: int) -> list[int]:
    """``count`` steps evenly spaced over the steps but the last, h_j = floor((j + 1) (H - 1) / (count + 1)) - 1
    for j < count; all of 0..H - 2 when H - 1 <= count. The spacing is at least one step when H - 1 > count, so the
    steps are distinct."""
    candidates = num_steps - 1
    if candidates <= count:
        return list(range(max(candidates, 0)))
    return [((j + 1) * candidates) // (count + 1) for j in range(count)]


def group_success_rates(successes: Sequence[bool], groups: Sequence[int]) -> list[float]:
    """The prompt value of each response: the success rate of its group, V(x) = mean_{i in group(x)} R_i."""
    totals: dict[int, list[int]] = {}
    for success, group in zip(successes, groups):
        total = totals.setdefault(group, [0, 0])
        total[0] += int(bool(success))
        total[1] += 1
    return [totals[group][0] / totals[group][1] for group in groups]


def fill_unsampled(values: Sequence[float | None], prompt_value: float, zero_from: int | None = None) -> list[float]:
    """Values of all H steps from the estimated ones (``None`` where not estimated): steps at or after
    ``zero_from`` are 0; any other missing step holds the nearest estimated value before it, v_h = v_{h'} with
    h' = max{h' < h : estimated}, or the prompt value when no step before it is estimated."""
    filled, last = [], float(prompt_value)
    for h, value in enumerate(values):
        if zero_from is not None and h >= zero_from:
            filled.append(0.0)
            continue
        if value is not None:
            last = float(value)
        filled.append(last)
    return filled


def _admit(requests: list[PrefixRequest], remaining: int | None) -> tuple[list[PrefixRequest], list[PrefixRequest]]:
    """Split ``requests`` (in priority order) at the first one whose reserved tokens no longer fit ``remaining``:
    it and all after it are refused, so a refused prefix never has a lower priority than an admitted one."""
    if remaining is None:
        return requests, []
    for position, request in enumerate(requests):
        if request.reserved_tokens > remaining:
            return requests[:position], requests[position:]
        remaining -= request.reserved_tokens
    return requests, []


def sampled_step_values(
    responses: Sequence[ResponseSteps],
    sample: Callable[[list[PrefixRequest]], list[PrefixCounts]],
    *,
    rule: str,
    n: int,
    prefixes_per_response: int = 4,
    token_budget: int | None = None,
    width: int | None = None,
) -> SampledValues:
    """Monte-Carlo step values of ``responses`` under a prefix ``rule`` (module docstring).

    ``sample`` is called once per round with the admitted requests (one round for ``every``/``fixed``, one per
    bisection round for ``first_pit``) and returns one ``PrefixCounts`` per request. ``token_budget`` (None:
    unbounded) bounds the tokens generated over all rounds. ``width``: S of the [B, S] values (default: the most
    steps of a response, at least 1).
    """
    if rule not in PREFIX_RULES:
        raise ValueError(f"prefix rule must be one of {PREFIX_RULES}, got {rule!r}")
    if n < 1:
        raise ValueError(f"n (continuations per prefix) must be >= 1, got {n}")
    if token_budget is not None and token_budget < 1:
        raise ValueError(f"token_budget must be >= 1 or None, got {token_budget}")
    if rule == "fixed" and prefixes_per_response < 1:
        raise ValueError(f"prefixes_per_response must be >= 1, got {prefixes_per_response}")

    estimates: list[list[float | None]] = [[None] * r.num_steps for r in responses]
    for row, response in enumerate(responses):
        if response.num_steps:
            estimates[row][-1] = 1.0 if response.success else 0.0  # the response's own outcome
    result = SampledValues(step_values=torch.empty(0), prompt_values=torch.empty(0), num_steps=torch.empty(0),
                           sampled=torch.empty(0), first_pits=[-1] * len(responses))
    remaining = token_budget

    def run_round(requests: list[PrefixRequest]) -> tuple[list[tuple[PrefixRequest, PrefixCounts]], list[PrefixRequest]]:
        nonlocal remaining
        admitted, refused = _admit(requests, remaining)
        result.prefixes_skipped += len(refused)
        if not admitted:
            return [], refused
        counts = sample(admitted)
        if len(counts) != len(admitted):
            raise RuntimeError(f"the sampler returned {len(counts)} results for {len(admitted)} prefixes")
        result.rounds += 1
        for request, count in zip(admitted, counts):
            if count.continuations != request.n or not 0 <= count.successes <= request.n:
                raise RuntimeError(
                    f"the sampler returned {count.successes} successes of {count.continuations} continuations for "
                    f"response {request.row} step {request.step}, but n={request.n} were asked for"
                )
            if count.tokens > request.reserved_tokens:
                raise RuntimeError(
                    f"the sampler generated {count.tokens} tokens for response {request.row} step {request.step}, "
                    f"over its limit n * max_tokens = {request.reserved_tokens}"
                )
            estimates[request.row][request.step] = count.successes / request.n
            result.counts[(request.row, request.step)] = count
            result.prefixes_evaluated += 1
            result.continuations += count.continuations
            result.tokens += count.tokens
        if remaining is not None:
            remaining = token_budget - result.tokens
        return list(zip(admitted, counts)), refused

    def request(row: int, step: int) -> PrefixRequest:
        return PrefixRequest(row=row, step=step, n=n, max_tokens=int(responses[row].continuation_limits[step]))

    zero_from: list[int | None] = [None] * len(responses)
    if rule in ("every", "fixed"):
        wanted = []
        for row, response in enumerate(responses):
            if not response.sample:
                continue
            steps = range(response.num_steps - 1) if rule == "every" else fixed_prefix_steps(
                response.num_steps, prefixes_per_response)
            wanted.extend(request(row, step) for step in steps)
        wanted.sort(key=lambda r: (r.step, r.row))
        run_round(wanted)
    else:
        searches = {row: (0, r.num_steps - 1) for row, r in enumerate(responses)
                    if r.sample and r.num_steps and not r.success}
        while True:
            active = {row: span for row, span in searches.items() if span[0] < span[1]}
            if not active:
                break
            answered, refused = run_round([request(row, sum(span) // 2) for row, span in sorted(active.items())])
            for skipped in refused:  # the budget ends this search: the known zero stays at its upper end
                searches[skipped.row] = (searches[skipped.row][1], searches[skipped.row][1])
            for asked, count in answered:
                searches[asked.row] = first_pit_search_step(*searches[asked.row], count.successes == 0)
        for row, (_, pit) in searches.items():
            zero_from[row] = pit
            result.first_pits[row] = pit

    prompt_values = group_success_rates([r.success for r in responses], [r.group for r in responses])
    longest = max([0] + [r.num_steps for r in responses])
    if width is None:
        width = max(1, longest)
    elif width < longest:
        raise ValueError(f"width {width} is below the longest response's {longest} steps")
    step_values = torch.zeros(len(responses), width)
    sampled = torch.zeros(len(responses), width, dtype=torch.bool)
    for row, response in enumerate(responses):
        values = fill_unsampled(estimates[row], prompt_values[row], zero_from[row])
        step_values[row, : response.num_steps] = torch.tensor(values, dtype=torch.float32)
        for step in range(response.num_steps):
            sampled[row, step] = (row, step) in result.counts
    result.step_values = step_values
    result.prompt_values = torch.tensor(prompt_values, dtype=torch.float32)
    result.num_steps = torch.tensor([r.num_steps for r in responses], dtype=torch.long)
    result.sampled = sampled
    return result
