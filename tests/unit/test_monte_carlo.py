"""The one Monte-Carlo core (verl_prm.monte_carlo): the labeler and the sampled step values are the same estimate.

Reference: the PAV paper (Setlur et al. 2024) defines the value of a step prefix as the expected outcome of the
prover's completions of it, Q^mu(s_h, a_h) = E_{c ~ mu(. | x, y[:end_h])} R(y[:end_h] + c), and labels steps with
its Monte-Carlo estimate, the fraction of n_mc sampled completions that succeed. ``_plain_monte_carlo`` writes that
definition out as a loop over rollouts and steps, with the continuations seeded as the labeler seeds them.
"""

from __future__ import annotations

import pytest

from verl_prm.critic.sampled import sampled_step_values
from verl_prm.labeling.generators import derive_seed
from verl_prm.labeling.inputs import PromptItem
from verl_prm.labeling.monte_carlo import LabelSettings, MonteCarloLabeler
from verl_prm.labeling.scoring import OutcomeScorer
from verl_prm.labeling.closed_form_task import ScriptedStepGenerator, ScriptedStepTask, scripted_step_score
from verl_prm.monte_carlo import (
    PrefixCounts,
    PrefixRequest,
    ResponseSteps,
    estimate_prefixes,
    requested_steps,
    shared_prefix_outcomes,
)

H, P_POLICY, P_PROVER, N_MC, SEED = 4, 0.7, 0.85, 16, 3
TASK = ScriptedStepTask(num_steps=H)


def _continuations(row: dict, step: int) -> list[str]:
    """The n_mc prover continuations of ``row``'s prefix after ``step``, seeded as the labeler seeds them."""
    prefix = row["response"][: row["step_ends"][step]]
    seed = derive_seed(SEED, "mc", row["prompt_index"], row["rollout_index"], step)
    [samples] = ScriptedStepGenerator(P_PROVER).generate([row["prompt"] + prefix], N_MC, [seed])
    return [prefix + sample.text for sample in samples]


def _plain_monte_carlo(rows: list[dict]) -> list[list[float]]:
    """q[b][h] = #{successful continuations of prefix h} / n_mc for every step but the last (the paper's estimate)."""
    values = []
    for row in rows:
        values.append([sum(scripted_step_score("scripted", text, H) for text in _continuations(row, h)) / N_MC
                       for h in range(len(row["step_ends"]) - 1)])
    return values


def _label(prefix_rule: str) -> list[dict]:
    items = [PromptItem(i, TASK.prompt(i), str(H), "scripted") for i in range(6)]
    settings = LabelSettings(n_cov=4, n_mc=N_MC, prefix_rule=prefix_rule, prefixes_per_response=2,
                             success_labels="outcome", prompt_value=False, seed=SEED)
    labeler = MonteCarloLabeler(ScriptedStepGenerator(P_POLICY), ScriptedStepGenerator(P_PROVER),
                                OutcomeScorer(scripted_step_score), settings)
    return labeler.label(items, [item.prompt for item in items])


def _sampled(rows: list[dict], prefix_rule: str):
    """The sampled source (the RL path) on the labeler's rollouts, its sampler continuing with the same prover."""

    def sample(requests: list[PrefixRequest]) -> list[PrefixCounts]:
        counts = []
        for request in requests:
            texts = _continuations(rows[request.row], request.step)
            counts.append(PrefixCounts(successes=int(sum(scripted_step_score("scripted", t, H) for t in texts)),
                                       continuations=len(texts), tokens=0))
        return counts

    responses = [ResponseSteps(num_steps=len(row["step_ends"]), success=row["outcome"] == 1.0) for row in rows]
    return sampled_step_values(responses, [row["prompt_index"] for row in rows], sample, prefix_rule=prefix_rule,
                               n_mc=N_MC, prefixes_per_response=2)


@pytest.mark.parametrize("prefix_rule", ["every", "fixed", "first_pit"])
def test_labels_and_sampled_values_are_one_estimate_equal_to_the_plain_loop(prefix_rule):
    rows = _label(prefix_rule)
    assert all(row["finished"] and len(row["step_ends"]) == H for row in rows)
    reference = _plain_monte_carlo(rows)
    sampled = _sampled(rows, prefix_rule)
    label_steps = {(b, h) for b, row in enumerate(rows) for h, n in enumerate(row["n_mc"]) if n > 0}
    assert set(sampled.counts) == label_steps and label_steps
    for b, h in label_steps:
        assert rows[b]["n_mc"][h] == N_MC and rows[b]["q"][h] == reference[b][h]
        assert sampled.step_values[b, h].item() == pytest.approx(reference[b][h], abs=1e-7)
    if prefix_rule == "every":
        assert label_steps == {(b, h) for b in range(len(rows)) for h in range(H - 1)}
    if prefix_rule == "fixed":  # floor((j + 1) 3 / 3) for j < 2: steps 1 and 2
        assert label_steps == {(b, h) for b in range(len(rows)) for h in (1, 2)}
    if prefix_rule == "first_pit":
        failed = [b for b, row in enumerate(rows) if row["outcome"] == 0.0]
        assert failed and sampled.first_pits == [rows[b]["first_pit"] if b in failed else -1 for b in range(len(rows))]
        for b in failed:  # the pit is the first zero of the full loop (zeros stay zero on this task: no repairs)
            zeros = [h for h in range(H - 1) if reference[b][h] == 0.0] + [H - 1]
            assert rows[b]["first_pit"] == zeros[0] and all(h in zeros for h in range(zeros[0], H))


def test_requested_steps_of_each_rule():
    ended, cut = ResponseSteps(num_steps=5, success=False), ResponseSteps(num_steps=5, success=False, last_known=False)
    won = ResponseSteps(num_steps=5, success=True)
    assert requested_steps(ended, "every", 2, "outcome") == ([0, 1, 2, 3], None)
    assert requested_steps(cut, "every", 2, "outcome") == ([0, 1, 2, 3, 4], None)
    assert requested_steps(ended, "fixed", 2, "outcome") == ([1, 2], None)
    assert requested_steps(ended, "first_pit", 2, "outcome") == ([], (0, 4))
    assert requested_steps(cut, "first_pit", 2, "outcome") == ([], (0, 5))
    assert requested_steps(won, "first_pit", 2, "outcome") == ([], None)
    assert requested_steps(won, "first_pit", 2, "every") == ([0, 1, 2, 3], None)
    assert requested_steps(ResponseSteps(num_steps=5, success=False, sample=False), "every", 2, "every") == ([], None)


def test_prompt_rows_are_continued_in_the_first_round():
    calls = []

    def sample(requests):
        calls.append([(r.row, r.step) for r in requests])
        return [PrefixCounts(successes=1, continuations=r.n_mc, tokens=0) for r in requests]

    responses = [ResponseSteps(num_steps=3, success=False), ResponseSteps(num_steps=2, success=True)]
    result = estimate_prefixes(responses, sample, prefix_rule="first_pit", n_mc=2, prompt_rows=[1])
    # one round: the prompt of row 1 and the midpoint 1 of row 0's search [0, 2), which is not a zero: pit 2
    assert calls == [[(1, -1), (0, 1)]]
    assert result.counts[(1, -1)].success_rate == 0.5 and result.pits == {0: 2}


@pytest.mark.parametrize("counts, message", [
    (PrefixCounts(successes=3, continuations=2, tokens=0), "3 successes of 2 continuations .* n_mc=2"),
    (PrefixCounts(successes=1, continuations=2, tokens=-1), "-1 tokens for response 0 step 0; a token count is >= 0"),
])
def test_a_sampler_reporting_impossible_counts_is_an_error(counts, message):
    with pytest.raises(RuntimeError, match=message):
        estimate_prefixes([ResponseSteps(num_steps=2, success=True)], lambda requests: [counts] * len(requests),
                          prefix_rule="every", n_mc=2)


def test_shared_prefix_outcomes_count_the_group_responses_that_continue_a_prefix():
    groups = ["a", "a", "a", "a", "b", "a"]
    responses = [[1, 2, 3], [1, 2, 4, 5], [1, 2], [1, 3, 3], [1, 2, 3], None]  # row 5: padding, no sample
    successes = [True, False, True, True, True, True]
    prefixes = [("a", [1, 2]), ("a", [1, 2]), ("a", [1]), ("b", [1, 2]), ("a", (1, 2, 4)), ("c", [1])]
    owners = [0, None, 3, None, 1, None]
    # [1, 2] in a: rows 0 and 1 go on past it (row 2 ends there, row 3 parts at the second token); row 0 owns it
    assert shared_prefix_outcomes(prefixes, owners, groups, responses, successes) == [
        (0, 1), (1, 2), (2, 3), (1, 1), (0, 0), (0, 0)]
    with pytest.raises(ValueError, match="2 owners for 6 prefixes"):
        shared_prefix_outcomes(prefixes, owners[:2], groups, responses, successes)
