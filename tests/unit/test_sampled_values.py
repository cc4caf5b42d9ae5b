"""Monte-Carlo step values (verl_prm.critic.sampled over verl_prm.monte_carlo) on the scripted task of
verl_prm.labeling.scripted.

The scripted policy writes each remaining step correctly with probability p and never repairs a wrong step, so
after h correct steps Q = p^(H - h) and after a wrong step Q = 0 (closed form in its module docstring). The
references here are a direct Monte-Carlo loop written out below (n continuations per step prefix, successes / n,
with the same seeds) and that closed form.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from verl_prm.critic.sampled import hold_fill, sampled_step_values
from verl_prm.labeling.generators import derive_seed
from verl_prm.labeling.scripted import (
    ScriptedStepGenerator,
    ScriptedStepTask,
    exact_prefix_value,
    scripted_step_score,
)
from verl_prm.monte_carlo import PrefixCounts, PrefixRequest, ResponseSteps, fixed_prefix_steps

H, P_CORRECT, DELIMITER = 6, 0.8, "\n\n"
TASK = ScriptedStepTask(num_steps=H, delimiter=DELIMITER)


def _responses(seed: int, groups: int, per_group: int) -> list[tuple[int, list[str]]]:
    """(prompt index, steps) of responses written by the scripted policy itself."""
    rng = random.Random(seed)
    rows = []
    for group in range(groups):
        for _ in range(per_group):
            rows.append((group, [("x" if rng.random() < P_CORRECT else "y") + f"={rng.randrange(10)}" for _ in range(H)]))
    return rows


def _prefix(steps: list[str], h: int) -> str:
    return DELIMITER.join(steps[: h + 1])


class ScriptedSampler:
    """``sample`` over the scripted policy: continuations of prompt + response prefix, scored by the task."""

    def __init__(self, rows):
        self.rows = rows
        self.generator = ScriptedStepGenerator(P_CORRECT, DELIMITER)
        self.calls = []

    def __call__(self, requests: list[PrefixRequest]) -> list[PrefixCounts]:
        self.calls.append(list(requests))
        counts = []
        for request in requests:
            group, steps = self.rows[request.row]
            prefix = _prefix(steps, request.step)
            [samples] = self.generator.generate([TASK.prompt(group) + prefix], request.n_mc,
                                                [derive_seed("test", request.row, request.step)])
            successes = sum(scripted_step_score("scripted", prefix + s.text, H, {"delimiter": DELIMITER}) == 1.0
                            for s in samples)
            counts.append(PrefixCounts(successes=successes, continuations=len(samples),
                                       tokens=sum(s.num_tokens for s in samples)))
        return counts


def _inputs(rows) -> list[ResponseSteps]:
    # a scripted continuation after step h has exactly H - h - 1 "tokens" (steps)
    return [ResponseSteps(num_steps=H, success=scripted_step_score("scripted", DELIMITER.join(steps), H) == 1.0,
                          continuation_limits=[H - h - 1 for h in range(H)])
            for _, steps in rows]


def _values(rows, sampler, **options):
    return sampled_step_values(_inputs(rows), [group for group, _ in rows], sampler, **options)


def _direct_monte_carlo(rows, n: int) -> tuple[list[list[float]], list[float]]:
    """The reference: every non-terminal step prefix gets n continuations (seeded as the sampler is), v = k / n;
    the last step is the response's outcome; the prompt value is the group's success rate."""
    generator = ScriptedStepGenerator(P_CORRECT, DELIMITER)
    values = []
    for row, (group, steps) in enumerate(rows):
        row_values = []
        for h in range(H - 1):
            prefix = _prefix(steps, h)
            [samples] = generator.generate([TASK.prompt(group) + prefix], n, [derive_seed("test", row, h)])
            wins = sum(scripted_step_score("scripted", prefix + s.text, H) for s in samples)
            row_values.append(wins / n)
        row_values.append(scripted_step_score("scripted", DELIMITER.join(steps), H))
        values.append(row_values)
    outcomes = [v[-1] for v in values]
    prompt_values = []
    for group, _ in rows:
        members = [o for (g, _), o in zip(rows, outcomes) if g == group]
        prompt_values.append(sum(members) / len(members))
    return values, prompt_values


def test_every_step_equals_a_direct_monte_carlo_loop_and_the_closed_form():
    rows = _responses(seed=3, groups=3, per_group=4)
    n = 64
    sampler = ScriptedSampler(rows)
    result = _values(rows, sampler, prefix_rule="every", n_mc=n)
    reference, prompt_reference = _direct_monte_carlo(rows, n)
    torch.testing.assert_close(result.step_values, torch.tensor(reference), rtol=0, atol=1e-6)
    assert result.prompt_values.tolist() == pytest.approx(prompt_reference, abs=1e-6)
    assert result.num_steps.tolist() == [H] * len(rows)
    assert result.prefixes_evaluated == len(rows) * (H - 1) and result.prefixes_skipped == 0
    assert result.continuations == len(rows) * (H - 1) * n
    assert result.rounds == 1 and len(sampler.calls) == 1
    # the Monte-Carlo estimate is within 4.5 standard errors of the closed form Q of every prefix
    for row, (_, steps) in enumerate(rows):
        for h in range(H - 1):
            exact = exact_prefix_value(_prefix(steps, h), H, P_CORRECT, DELIMITER)
            assert abs(result.step_values[row, h].item() - exact) <= 4.5 * math.sqrt(exact * (1 - exact) / n) + 1e-9


def _with_pit(pit: int, group: int) -> tuple[int, list[str]]:
    return group, ["x=1"] * pit + ["y=2"] + ["x=3"] * (H - pit - 1)


@pytest.mark.parametrize("pit", range(H))
def test_first_pit_finds_the_first_wrong_step_with_log_prefixes(pit):
    # H=6, p=0.8: before the pit Q >= 0.8^5 = 0.33; 0 successes of 48 has probability 0.67^48 < 1e-8
    rows = [_with_pit(pit, group=0), (0, ["x=1"] * H)]
    n = 48
    sampler = ScriptedSampler(rows)
    result = _values(rows, sampler, prefix_rule="first_pit", n_mc=n)
    assert result.first_pits == [pit, -1]
    assert result.step_values[0, pit:].tolist() == [0.0] * (H - pit)
    # bisection on [0, H - 1): at most ceil(log2(H - 1)) + 1 prefixes, and the successful response is not searched
    assert result.prefixes_evaluated <= math.ceil(math.log2(H - 1)) + 1
    assert all(request.row == 0 for call in sampler.calls for request in call)
    # every sampled step equals its direct estimate (same seeds); steps before the pit are positive
    reference, prompt_reference = _direct_monte_carlo(rows, n)
    for (row, step) in result.counts:
        assert result.step_values[row, step].item() == pytest.approx(reference[row][step])
    assert all(v > 0 for v in result.step_values[0, :pit].tolist())
    assert result.prompt_values.tolist() == pytest.approx(prompt_reference)
    # the successful response: prompt value held to the last step, which is its outcome 1
    assert result.step_values[1].tolist() == pytest.approx([prompt_reference[1]] * (H - 1) + [1.0])


def test_token_budget_is_never_exceeded_and_skipped_prefixes_hold_the_last_value():
    rows = _responses(seed=5, groups=2, per_group=3)
    n = 8
    full = _values(rows, ScriptedSampler(rows), prefix_rule="every", n_mc=n)
    # reserved per prefix h: n * (H - h - 1); a budget that fits steps 0 and 1 of every response but not step 2
    budget = sum(n * (H - 1) + n * (H - 2) for _ in rows) + n * (H - 3) - 1
    sampler = ScriptedSampler(rows)
    result = _values(rows, sampler, prefix_rule="every", n_mc=n, token_budget=budget)
    assert result.tokens <= budget
    admitted = [(r.row, r.step) for r in sampler.calls[0]]
    assert sorted({step for _, step in admitted}) == [0, 1] and len(admitted) == 2 * len(rows)
    # step 2's prefixes cost n * 3 each: the refused ones (tokens are charged after the round) are counted
    assert result.prefixes_skipped == len(rows) * (H - 1) - len(admitted)
    for row in range(len(rows)):
        assert result.step_values[row, :2].tolist() == full.step_values[row, :2].tolist()
        # steps 2..H-2 hold step 1's value; the last step is the outcome
        assert result.step_values[row, 2 : H - 1].tolist() == [full.step_values[row, 1].item()] * (H - 3)
        assert result.step_values[row, H - 1].item() == full.step_values[row, H - 1].item()


def test_first_pit_cut_by_the_budget_keeps_the_known_zero():
    rows = [_with_pit(1, group=0)]
    # the first midpoint (step 2 of [0, 5)) reserves n * 3 tokens; a budget below it samples nothing
    result = _values(rows, ScriptedSampler(rows), prefix_rule="first_pit", n_mc=4, token_budget=11)
    assert result.prefixes_evaluated == 0 and result.prefixes_skipped == 1 and result.tokens == 0
    assert result.first_pits == [H - 1]
    assert result.step_values[0].tolist() == [0.0] * H  # prompt value 0 (the group's only response failed)


def test_fixed_steps_are_evenly_spaced_and_distinct():
    assert fixed_prefix_steps(5, 10) == [0, 1, 2, 3, 4]
    assert fixed_prefix_steps(10, 4) == [2, 4, 6, 8]
    assert fixed_prefix_steps(0, 3) == []
    for candidates in range(1, 39):
        for count in range(1, 8):
            chosen = fixed_prefix_steps(candidates, count)
            assert len(set(chosen)) == len(chosen) == min(count, candidates)
            assert all(0 <= h < candidates for h in chosen)


def _hold_loop(values, prompt_value, zero_from):
    """The hold rule written out: 0 from zero_from on, else the nearest estimate at or before h, else v_0."""
    filled, last = [], prompt_value
    for h, value in enumerate(values):
        last = value if value is not None else last
        filled.append(0.0 if h >= zero_from else last)
    return filled


def test_hold_fill_equals_the_rule_written_as_a_loop():
    nan = float("nan")
    estimates = torch.tensor([[nan, 0.5, nan, nan, 1.0], [0.75, nan, nan, 0.0, nan]])
    got = hold_fill(estimates, torch.tensor([0.25, 0.5]), torch.tensor([5, 2]))
    assert got.tolist() == [[0.25, 0.5, 0.5, 0.5, 1.0], [0.75, 0.75, 0.0, 0.0, 0.0]]
    rng = random.Random(0)
    rows = [[rng.choice([None, rng.random()]) for _ in range(7)] for _ in range(50)]
    prompt, zero = [rng.random() for _ in rows], [rng.randrange(9) for _ in rows]
    tensor = torch.tensor([[nan if v is None else v for v in row] for row in rows], dtype=torch.float64)
    got = hold_fill(tensor, torch.tensor(prompt, dtype=torch.float64), torch.tensor(zero))
    assert got.tolist() == [_hold_loop(row, p, z) for row, p, z in zip(rows, prompt, zero)]


def test_bad_arguments_name_the_knob():
    rows = [(0, ["x=1"] * H)]
    with pytest.raises(ValueError, match="n_mc \\(continuations per step prefix\\) must be an integer >= 1, got 0"):
        _values(rows, ScriptedSampler(rows), prefix_rule="every", n_mc=0)
    with pytest.raises(ValueError, match="token_budget must be >= 1 or None, got 0"):
        _values(rows, ScriptedSampler(rows), prefix_rule="every", n_mc=2, token_budget=0)
    with pytest.raises(ValueError, match="prefix_rule must be one of"):
        _values(rows, ScriptedSampler(rows), prefix_rule="all", n_mc=2)


def test_a_sampler_over_its_limits_is_an_error():
    rows = [(0, ["x=1"] * H)]

    def greedy(requests):
        return [PrefixCounts(successes=r.n_mc, continuations=r.n_mc, tokens=r.reserved_tokens + 1) for r in requests]

    with pytest.raises(RuntimeError, match="over its limit n_mc \\* max_tokens"):
        _values(rows, greedy, prefix_rule="every", n_mc=2)

