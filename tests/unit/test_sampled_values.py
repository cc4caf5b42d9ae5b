"""Monte-Carlo step values (verl_prm.critic.sampled over verl_prm.monte_carlo) on the scripted task of
verl_prm.labeling.closed_form_task.

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

from verl_prm.critic.sampled import hold_fill, sampled_step_values, shrink_labels, shrink_success_rates
from verl_prm.labeling.generators import derive_seed
from verl_prm.labeling.closed_form_task import (
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

    def __init__(self, rows, salt=None):
        self.rows = rows
        self.salt = () if salt is None else (salt,)  # a salt draws other continuations (fresh seeds)
        self.generator = ScriptedStepGenerator(P_CORRECT, DELIMITER)
        self.calls = []

    def __call__(self, requests: list[PrefixRequest]) -> list[PrefixCounts]:
        self.calls.append(list(requests))
        counts = []
        for request in requests:
            group, steps = self.rows[request.row]
            prefix = _prefix(steps, request.step)
            [samples] = self.generator.generate([TASK.prompt(group) + prefix], request.n_mc,
                                                [derive_seed("test", *self.salt, request.row, request.step)])
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



# ------------------------------------------------------------------------------- free samples of the group

def _shared_prefix_rows(seed: int, groups: int, per_group: int) -> list[tuple[int, list[str]]]:
    """Responses of the scripted policy whose step h is always ``x=h`` or ``y=h``: a step's text is its
    correctness alone, so responses of a group often share their first steps (a step is a "token" here)."""
    rng = random.Random(seed)
    return [(group, [("x" if rng.random() < P_CORRECT else "y") + f"={h}" for h in range(H)])
            for group in range(groups) for _ in range(per_group)]


def _pooled_loop(rows, n: int, sampled_keys) -> dict[tuple[int, int], tuple[int, int]]:
    """The reference: for each sampled prefix (b, h), n continuations (seeded as the sampler is) plus every other
    response of b's group whose steps begin with b's first h + 1 steps and go on past them (its outcome is a sample
    of the prefix's value: it was written by the same policy from that prefix)."""
    generator = ScriptedStepGenerator(P_CORRECT, DELIMITER)
    outcomes = [scripted_step_score("scripted", DELIMITER.join(steps), H) for _, steps in rows]
    pooled = {}
    for b, h in sampled_keys:
        group, steps = rows[b]
        prefix = _prefix(steps, h)
        [samples] = generator.generate([TASK.prompt(group) + prefix], n, [derive_seed("test", b, h)])
        wins = sum(scripted_step_score("scripted", prefix + s.text, H) for s in samples)
        count = n
        for other, (other_group, other_steps) in enumerate(rows):
            if other != b and other_group == group and other_steps[: h + 1] == steps[: h + 1] and len(other_steps) > h + 1:
                wins += outcomes[other]
                count += 1
        pooled[(b, h)] = (int(wins), count)
    return pooled


@pytest.mark.parametrize("prefix_rule", ["every", "first_pit"])
def test_pooled_group_samples_equal_a_loop_over_the_group(prefix_rule):
    rows = _shared_prefix_rows(seed=11, groups=3, per_group=6)
    n = 4
    tokens = [steps for _, steps in rows]
    result = _values(rows, ScriptedSampler(rows), prefix_rule=prefix_rule, n_mc=n, tokens=tokens,
                     step_ends=[list(range(H))] * len(rows))
    reference = _pooled_loop(rows, n, result.counts)
    assert {key: (c.successes, c.continuations) for key, c in result.counts.items()} == reference
    assert result.pooled_samples == sum(count - n for _, count in reference.values()) > 0
    assert result.continuations == n * len(result.counts)  # generated ones only
    plain = _values(rows, ScriptedSampler(rows), prefix_rule=prefix_rule, n_mc=n)
    for (b, h), (wins, count) in reference.items():
        if prefix_rule == "every" or h < result.first_pits[b] or result.first_pits[b] < 0:
            assert result.step_values[b, h].item() == pytest.approx(wins / count, abs=1e-6)
    assert plain.first_pits == result.first_pits  # the search reads the continuations only
    # the last step is the outcome, the prompt value the group's rate, with or without pooling
    assert result.step_values[:, H - 1].tolist() == plain.step_values[:, H - 1].tolist()
    assert result.prompt_values.tolist() == plain.prompt_values.tolist()


def test_a_padding_row_is_no_free_sample():
    rows = [(0, ["x=0", "x=1", "y=2", "x=3", "x=4", "x=5"]), (0, ["x=0", "x=1", "x=2", "x=3", "x=4", "x=5"])]
    inputs = _inputs(rows)
    inputs[1] = ResponseSteps(num_steps=H, success=True, sample=False, continuation_limits=[H - h - 1 for h in range(H)])
    steps = [steps for _, steps in rows]
    ends = [list(range(H))] * 2
    padded = sampled_step_values(inputs, [0, 0], ScriptedSampler(rows), prefix_rule="every", n_mc=2,
                                 tokens=[steps[0], None], step_ends=ends)
    assert padded.pooled_samples == 0
    real = sampled_step_values(_inputs(rows), [0, 0], ScriptedSampler(rows), prefix_rule="every", n_mc=2,
                               tokens=steps, step_ends=ends)
    # both real: each is a free sample of the other's first two prefixes (they part at step 2)
    assert real.pooled == {(0, 0): 1, (0, 1): 1, (0, 2): 0, (0, 3): 0, (0, 4): 0,
                           (1, 0): 1, (1, 1): 1, (1, 2): 0, (1, 3): 0, (1, 4): 0}


def test_pooled_values_are_unbiased_on_the_scripted_policy():
    """E[(k + k') / (n + n')] = Q: given the group's prefixes, every pooled outcome is a Bernoulli(Q) sample. One
    owner response whose first three steps are correct, seven others of the policy, one continuation of the
    owner's prefix after step 2 (prefix_rule fixed): the mean of its pooled estimate over 600 groups is within 4
    standard errors of Q = p^(H - 3) (closed form, verl_prm.labeling.closed_form_task)."""
    owner = ["x=0", "x=1", "x=2", "y=3", "x=4", "x=5"]
    step = fixed_prefix_steps(H - 1, 1)[0]
    assert step == 2
    estimates, pooled = [], 0
    for seed in range(600):
        rows = [(0, owner)] + _shared_prefix_rows(seed=1000 + seed, groups=1, per_group=7)
        result = _values(rows, ScriptedSampler(rows, salt=seed), prefix_rule="fixed", prefixes_per_response=1, n_mc=1,
                         tokens=[steps for _, steps in rows], step_ends=[list(range(H))] * len(rows))
        count = result.counts[(0, step)]
        estimates.append(count.successes / count.continuations)
        pooled += count.continuations - 1
    exact = exact_prefix_value(_prefix(owner, step), H, P_CORRECT, DELIMITER)
    assert exact == pytest.approx(P_CORRECT ** (H - 3))
    mean = sum(estimates) / len(estimates)
    spread = math.sqrt(sum((e - mean) ** 2 for e in estimates) / (len(estimates) - 1) / len(estimates))
    assert abs(mean - exact) <= 4 * spread and pooled > 600  # more than one free sample per group on average


# ------------------------------------------------------------------------------------ shrinkage toward a prior

def _beta_posterior_mean(successes: int, samples: int, prior_mean: float, strength: float) -> float:
    """Beta-binomial conjugacy: a Beta(a, b) prior and k successes of n give the posterior Beta(a + k, b + n - k),
    of mean (a + k) / (a + b + n); the prior of mean m and strength s is a = s m, b = s (1 - m)."""
    a, b = strength * prior_mean, strength * (1 - prior_mean)
    return (a + successes) / (a + b + samples)


def test_shrink_success_rates_equals_the_beta_posterior_mean_loop():
    rng = random.Random(4)
    samples = [rng.randrange(1, 20) for _ in range(200)]
    successes = [rng.randrange(n + 1) for n in samples]
    prior = [rng.random() for _ in samples]
    for strength in (0.0, 0.5, 2.0, 7.0):
        got = shrink_success_rates(torch.tensor(successes), torch.tensor(samples), torch.tensor(prior, dtype=torch.float64),
                                   strength)
        assert got.tolist() == pytest.approx([_beta_posterior_mean(k, n, m, strength)
                                              for k, n, m in zip(successes, samples, prior)], abs=1e-12)
    assert shrink_success_rates(torch.tensor([3]), torch.tensor([4]), torch.tensor([0.1]), 0).tolist() == [0.75]
    for bad in (-1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="prior_strength must be a finite number >= 0, got"):
            shrink_success_rates(torch.tensor([1]), torch.tensor([2]), torch.tensor([0.5]), bad)


def test_sampled_values_are_shrunk_toward_the_group_rate_or_the_given_prior():
    rows = _responses(seed=5, groups=2, per_group=3)
    n, strength = 3, 2.0
    plain = _values(rows, ScriptedSampler(rows), prefix_rule="every", n_mc=n)
    shrunk = _values(rows, ScriptedSampler(rows), prefix_rule="every", n_mc=n, prior_strength=strength)
    prior = torch.rand(len(rows), H, generator=torch.Generator().manual_seed(0))
    given = _values(rows, ScriptedSampler(rows), prefix_rule="every", n_mc=n, prior=prior, prior_strength=strength)
    for (b, h), count in plain.counts.items():
        group_rate = plain.prompt_values[b].item()
        assert shrunk.step_values[b, h].item() == pytest.approx(
            _beta_posterior_mean(count.successes, n, group_rate, strength), abs=1e-6)
        assert given.step_values[b, h].item() == pytest.approx(
            _beta_posterior_mean(count.successes, n, prior[b, h].item(), strength), abs=1e-6)
    # the outcome of the last step and the prompt values are not shrunk; the counts stay the samples
    for result in (shrunk, given):
        assert result.step_values[:, H - 1].tolist() == plain.step_values[:, H - 1].tolist()
        assert result.prompt_values.tolist() == plain.prompt_values.tolist()
        assert result.counts == plain.counts
    with pytest.raises(ValueError, match=r"prior has shape \(6, 2\), expected \(6, 6\)"):
        _values(rows, ScriptedSampler(rows), prefix_rule="every", n_mc=n, prior=prior[:, :2], prior_strength=1.0)


def test_shrunk_labels_add_the_prior_as_pseudo_samples():
    """A label y of t samples shrunk with strength s: the Beta posterior mean of its t y successes, with t + s
    trials; unmasked labels are unchanged (a loop over the entries)."""
    rng = random.Random(8)
    trials = [float(rng.randrange(1, 9)) for _ in range(60)]
    rates = [rng.randrange(int(t) + 1) / t for t in trials]
    prior = [rng.random() for _ in trials]
    mask = [rng.random() < 0.6 for _ in trials]
    got_rates, got_trials = shrink_labels(torch.tensor(rates, dtype=torch.float64), torch.tensor(trials),
                                          torch.tensor(prior, dtype=torch.float64),
                                          torch.tensor(mask), 3.0)
    assert got_rates.tolist() == pytest.approx([_beta_posterior_mean(round(y * t), t, m, 3.0) if keep else y
                                                for y, t, m, keep in zip(rates, trials, prior, mask)], abs=1e-12)
    assert got_trials.tolist() == [t + 3.0 if keep else t for t, keep in zip(trials, mask)]
