"""PURE's min-form and PRIME's leave-one-out credit assignment (``pav_pure``, ``pav_prime``) against the peers'
formulas, written as plain loops over samples, steps and tokens.

PURE (github.com/CJReinforce/PURE at 41f9363: openrlhf/utils/utils.py ``turn_process_reward_logits_to_reward``,
openrlhf/trainer/ppo_utils/experience_maker.py ``process_experiences`` and ``make_experience_list``,
openrlhf/trainer/ppo_utils/replay_buffer.py ``normalize``): step rewards weighted by a softmax of ``-r / T`` over
the response's steps; ``reward_baseline=step``: minus the others' mean of ``sum(r) / num_steps``;
``reward_baseline=token``: minus ``(sum of the others' sum(r)) / (sum of their response lengths) *
num_tokens_per_step``; placed at the step-end tokens, the verifiable reward's RLOO added at the EOS index,
returns = ``reward.fliplr().cumsum(dim=1).fliplr()``, ``returns.masked_fill_(process_reward_mask, 0)`` (the
separators and the EOS), then (``disable_advantage_normalization`` off, the default) mean over the count of
non-zero tokens, ``rstd = (sum(action_mask * (adv - mean)^2) / count).clamp(min=1e-8).rsqrt()``, zero tokens
kept 0. PRIME (github.com/PRIME-RL/PRIME at 18ad596, training/verl/trainer/ppo/core_algos.py
``compute_rloo_returns``): per reward source, ``r * n/(n-1) - sum_g mean_j / (n-1)`` at the reward positions
(``rm_scores``: ``reward_mask = eos_mask``, the whole response; ``gt_scores``: the last valid token),
undiscounted returns summed over the sources, whitened over the response tokens.
"""

from __future__ import annotations

import math
import random
import re

import pytest
import torch

from verl_prm import advantages as adv
from verl_prm.choices import MIN_FORM_BASELINES, PRIME_REWARD_MASKS
from verl_prm.config import PavConfig, read_pav_config
from verl_prm.estimators import ESTIMATORS

# ----------------------------------------------------------------------------------------------------------
# Random batches: groups of n responses (contiguous, as PRIME's loop over start positions expects), steps of
# random lengths, a trailing EOS in no step, right padding.
# ----------------------------------------------------------------------------------------------------------


def random_batch(seed: int, groups: int = 3, n: int = 4, max_steps: int = 4, allow_empty: bool = False):
    rng = random.Random(seed)
    rows, num_steps, scores, uids = [], [], [], []
    for g in range(groups):
        for _ in range(n):
            h_count = rng.randint(0 if allow_empty else 1, max_steps)
            ids = []
            for h in range(h_count):
                ids += [h] * rng.randint(1, 4)
            ids.append(-1)  # EOS: in no step
            rows.append(ids)
            num_steps.append(h_count)
            scores.append([rng.uniform(-0.6, 0.6) for _ in range(h_count)])
            uids.append(f"p{g}")
    length = max(len(r) for r in rows) + 2
    step_ids = torch.full((len(rows), length), -1, dtype=torch.long)
    mask = torch.zeros(len(rows), length)
    for i, ids in enumerate(rows):
        step_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    width = max(max_steps, 1)
    step_scores = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, row in enumerate(scores):
        step_scores[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
    outcome = torch.tensor([float(rng.random() < 0.5) for _ in rows], dtype=torch.float64)
    groups_t, num_groups = adv.group_ids(uids)
    return dict(step_ids=step_ids, mask=mask, num_steps=torch.tensor(num_steps), step_scores=step_scores,
                outcome=outcome, uids=uids, groups=groups_t, num_groups=num_groups, scores=scores)


def step_ends_loop(step_ids_row: list[int], h: int) -> int | None:
    ends = [t for t, s in enumerate(step_ids_row) if s == h]
    return ends[-1] if ends else None


def rloo_loop(values: list[float], uids: list[str]) -> list[float]:
    out = []
    for i, v in enumerate(values):
        others = [values[j] for j in range(len(values)) if uids[j] == uids[i] and j != i]
        out.append(v - sum(others) / len(others) if others else v)
    return out


# ----------------------------------------------------------------------------------------------------------
# PURE
# ----------------------------------------------------------------------------------------------------------


def pure_min_form_loop(scores: list[float], temperature: float) -> list[float]:
    """turn_process_reward_logits_to_reward's weighting: softmax(-r / T) * r over the real steps."""
    if not scores:
        return []
    if temperature == 0:
        low = min(scores)
        at_min = [s == low for s in scores]
        return [s / sum(at_min) if m else 0.0 for s, m in zip(scores, at_min)]
    exps = [math.exp(-s / temperature) for s in scores]
    return [e / sum(exps) * s for e, s in zip(exps, scores)]


def pure_normalize_loop(advantages, mask):
    """replay_buffer.normalize over the buffer's items, which ``append`` stored with their right padding removed
    (``remove_padding_in_sequences``: ``right_pad = (1 - act_mask).sum()``): zero-advantage tokens of the
    responses out of the count (``num_actions = action_mask.sum() - (adv == 0).sum()``), in the variance
    (``(adv - mean)^2 * action_mask``), kept 0."""
    items = [[x for x, m in zip(row, mask_row) if m] for row, mask_row in zip(advantages, mask)]  # unpadded
    count = sum(len(item) for item in items) - sum(x == 0 for item in items for x in item)
    if count == 0:
        return [[0.0] * len(row) for row in advantages]
    mean = sum(x for item in items for x in item) / count
    variance = sum((x - mean) ** 2 for item in items for x in item) / count
    rstd = 1.0 / math.sqrt(max(variance, 1e-8))
    return [[0.0 if x == 0 or not m else (x - mean) * rstd for x, m in zip(row, mask_row)]
            for row, mask_row in zip(advantages, mask)]


def pure_reference(b, alpha, temperature, baseline, zero_separators, keep=None, zero_eos=False, whiten=False):
    batch, length = b["step_ids"].shape
    ids = b["step_ids"].tolist()
    mask = b["mask"].tolist()
    uids = b["uids"]
    keep = keep or [True] * batch
    rewards = [pure_min_form_loop(row, temperature) for row in b["scores"]]
    # the responses that enter the others' baseline: with steps (PURE's all have one) and kept
    counted = [bool(rewards[j]) and keep[j] for j in range(batch)]
    out_rloo = rloo_loop(b["outcome"].tolist(), uids)
    lengths = [sum(row) for row in mask]  # response_length = action_mask.sum(-1)
    result = []
    for i in range(batch):
        others = [j for j in range(batch) if uids[j] == uids[i] and j != i and counted[j]]
        token_rewards = [0.0] * length
        separators = set()
        for h, r in enumerate(rewards[i]):
            end = step_ends_loop(ids[i], h)
            if baseline == "step":  # others' average_process_reward = outcome_rewards / num_steps, averaged
                base = sum(sum(rewards[j]) / len(rewards[j]) for j in others) / len(others) if others else 0.0
            elif baseline == "token":  # average_reward_per_token * num_tokens_per_step (tokens of step h here)
                others_tokens = sum(lengths[j] for j in others)
                per_token = sum(sum(rewards[j]) for j in others) / others_tokens if others_tokens else 0.0
                base = per_token * sum(1 for t in range(length) if ids[i][t] == h and mask[i][t])
            else:
                base = 0.0
            token_rewards[end] += alpha * (r - base) if keep[i] else 0.0
            if h < len(rewards[i]) - 1:
                separators.add(end)
        last = max(t for t in range(length) if mask[i][t])
        token_rewards[last] += out_rloo[i]  # the verifiable reward's RLOO at eos_indices
        if zero_eos:  # reward_mask[j, eos_indices[j]] = True, and masked_fill_(process_reward_mask, 0) below
            separators.add(last)
        returns, running = [0.0] * length, 0.0
        for t in reversed(range(length)):  # returns = reward.fliplr().cumsum(dim=1).fliplr()
            running += token_rewards[t]
            returns[t] = running
        row = [returns[t] * mask[i][t] for t in range(length)]
        if zero_separators or zero_eos:  # returns.masked_fill_(process_reward_mask, 0)
            zeroed = separators if zero_separators else {last}
            row = [0.0 if t in zeroed else x for t, x in enumerate(row)]
        result.append(row)
    if whiten:
        result = pure_normalize_loop(result, mask)
    return torch.tensor(result, dtype=torch.float64)


def test_softmin_weights_equal_the_softmax_loop_and_sum_to_one():
    b = random_batch(0, allow_empty=True)
    for temperature in (0.05, 0.1, 1.0, 0.0):
        weights = adv.softmin_weights(b["step_scores"], b["num_steps"], temperature)
        for i, row in enumerate(b["scores"]):
            expected = [w / s if s else 0.0 for w, s in zip(pure_min_form_loop(row, temperature), row)]
            if temperature == 0:
                low = min(row) if row else None
                expected = [1.0 / sum(x == low for x in row) if x == low else 0.0 for x in row]
            torch.testing.assert_close(weights[i, : len(row)], torch.tensor(expected, dtype=torch.float64))
            assert torch.all(weights[i, len(row):] == 0)
            assert (abs(float(weights[i].sum()) - 1.0) < 1e-12) if row else float(weights[i].sum()) == 0.0


def test_min_form_sum_is_the_minimum_at_zero_temperature_and_approaches_it():
    b = random_batch(1)
    hard = adv.min_form_step_rewards(b["step_scores"], b["num_steps"], 0.0).sum(dim=1)
    soft = adv.min_form_step_rewards(b["step_scores"], b["num_steps"], 1e-3).sum(dim=1)
    mean = adv.min_form_step_rewards(b["step_scores"], b["num_steps"], 1e6).sum(dim=1)
    for i, row in enumerate(b["scores"]):
        assert float(hard[i]) == min(row)
        assert abs(float(soft[i]) - min(row)) < 1e-3
        assert abs(float(mean[i]) - sum(row) / len(row)) < 1e-5  # T -> inf: the mean


def test_hard_min_splits_ties_equally():
    scores = torch.tensor([[0.2, -0.1, -0.1, 0.5]], dtype=torch.float64)
    weights = adv.softmin_weights(scores, torch.tensor([4]), 0.0)
    assert weights.tolist() == [[0.0, 0.5, 0.5, 0.0]]


@pytest.mark.parametrize("temperature", [0.1, 0.0])
@pytest.mark.parametrize("baseline", MIN_FORM_BASELINES)
@pytest.mark.parametrize("zero_separators, zero_eos", [(True, False), (False, False), (True, True), (False, True)])
@pytest.mark.parametrize("seed", [0, 1])
def test_min_form_advantage_equals_pures_formula(temperature, baseline, zero_separators, zero_eos, seed):
    b = random_batch(seed)
    out = adv.leave_one_out_outcome(b["outcome"], b["groups"], b["num_groups"])
    for whiten in (False, True):
        ours = adv.min_form_advantage(out, b["step_scores"], b["step_ids"], b["num_steps"], b["mask"], 2.5,
                                      groups=b["groups"], num_groups=b["num_groups"], temperature=temperature,
                                      baseline=baseline, zero_separators=zero_separators, zero_eos=zero_eos,
                                      whiten=whiten)
        expected = pure_reference(b, 2.5, temperature, baseline, zero_separators, zero_eos=zero_eos, whiten=whiten)
        torch.testing.assert_close(ours, expected, atol=1e-10, rtol=1e-10)


def test_pure_whiten_equals_pures_normalize_with_and_without_padding():
    """PURE's replay buffer strips each item's right padding before ``normalize`` (``remove_padding_in_sequences``
    in ``append``), so its count of non-zero tokens is over response tokens only, as ours: equal on a padded batch
    and on the same batch without padding."""
    b = random_batch(8)
    out = adv.leave_one_out_outcome(b["outcome"], b["groups"], b["num_groups"])
    full = torch.ones_like(b["mask"])
    for mask in (b["mask"], full):
        raw = adv.min_form_advantage(out, b["step_scores"], b["step_ids"], b["num_steps"], mask, 1.5,
                                     groups=b["groups"], num_groups=b["num_groups"], zero_eos=True, whiten=False)
        expected = pure_normalize_loop(raw.tolist(), mask.tolist())
        torch.testing.assert_close(adv.pure_whiten(raw, mask), torch.tensor(expected, dtype=torch.float64))
    assert b["mask"].sum() < full.sum()  # the batch is padded
    assert adv.pure_whiten(torch.zeros(2, 3, dtype=torch.float64), torch.ones(2, 3)).tolist() == [[0.0] * 3] * 2


def pure_num_tokens_per_step(step_ids_row: list[int], mask_row: list[float], num_steps: int) -> list[int]:
    """PURE's ``num_tokens_per_step`` (experience_maker.py ``make_experience``) on this token layout:
    ``score_ids`` = separator position + 1 for every step but the last, ``eos_indices + 1`` for the last (the
    response's last token); the step's count is ``score_ids[h] - score_ids[h - 1] - 1`` (``j - 1`` for h = 0):
    the separator, and for the last step the EOS, left out."""
    eos = max(t for t, m in enumerate(mask_row) if m)
    score_ids = [step_ends_loop(step_ids_row, h) + 1 for h in range(num_steps - 1)] + [eos + 1]
    return [score_ids[h] - (score_ids[h - 1] if h else 0) - 1 for h in range(num_steps)]


@pytest.mark.parametrize("eos_in_last_step", [False, True])
def test_the_token_baseline_counts_one_token_more_per_step_than_pure(eos_in_last_step):
    """The documented difference (docs/credit_assignment.md): ``n[i, h]`` counts every token of step h, PURE's
    ``num_tokens_per_step`` leaves out its last one (the separator; for the last step the EOS, which here is in no
    step unless ``eos_in_last_step``). Pinned against PURE's count, per step."""
    b = random_batch(12)
    step_ids = b["step_ids"].clone()
    if eos_in_last_step:
        for i in range(step_ids.shape[0]):
            eos = int(b["mask"][i].nonzero().max())
            step_ids[i, eos] = int(b["num_steps"][i]) - 1
    rewards = adv.min_form_step_rewards(b["step_scores"], b["num_steps"], 0.1)
    ours = adv.leave_one_out_token_baseline(rewards, step_ids, b["num_steps"], b["mask"], b["groups"],
                                            b["num_groups"])
    ids, mask, uids = step_ids.tolist(), b["mask"].tolist(), b["uids"]
    largest = 0.0
    for i in range(len(uids)):
        others = [j for j in range(len(uids)) if uids[j] == uids[i] and j != i]
        per_token = float(sum(rewards[j].sum() for j in others) / sum(sum(mask[j]) for j in others))
        pure_counts = pure_num_tokens_per_step(ids[i], mask[i], int(b["num_steps"][i]))
        for h, pure_count in enumerate(pure_counts):
            ours_count = sum(1 for t, s in enumerate(ids[i]) if s == h and mask[i][t])
            difference = 1 if (h < len(pure_counts) - 1 or eos_in_last_step) else 0
            assert ours_count - pure_count == difference
            assert abs(float(ours[i, h]) - per_token * (pure_count + difference)) < 1e-12
            largest = max(largest, abs(per_token) * difference)
    assert largest > 0


def test_the_eos_token_keeps_the_outcome_term_unless_zeroed():
    b = random_batch(9)
    out = adv.leave_one_out_outcome(b["outcome"], b["groups"], b["num_groups"])
    last = adv.response_end_positions(b["mask"])
    for zero_eos in (False, True):
        ours = adv.min_form_advantage(out, b["step_scores"], b["step_ids"], b["num_steps"], b["mask"], 1.0,
                                      groups=b["groups"], num_groups=b["num_groups"], zero_eos=zero_eos,
                                      whiten=False)
        at_eos = ours.gather(1, last[:, None]).squeeze(1)
        torch.testing.assert_close(at_eos, torch.zeros_like(out) if zero_eos else out)


def test_the_token_baseline_charges_longer_steps_more():
    # two responses of one prompt: the baseline of response 0's steps is response 1's reward per token (0.4 / 4
    # tokens) times each step's token count (1 and 3)
    scores = torch.tensor([[0.2, 0.2], [0.4, 0.0]], dtype=torch.float64)
    step_ids = torch.tensor([[0, 1, 1, 1], [0, 0, 0, -1]])
    mask = torch.ones(2, 4)
    groups, num_groups = adv.group_ids(["a", "a"])
    base = adv.leave_one_out_token_baseline(scores, step_ids, torch.tensor([2, 1]), mask, groups, num_groups)
    torch.testing.assert_close(base, torch.tensor([[0.1, 0.3], [0.4 / 4 * 3, 0.0]], dtype=torch.float64))


def test_min_form_advantage_with_dropped_and_stepless_responses():
    b = random_batch(3, allow_empty=True)
    keep = [i % 3 != 0 for i in range(len(b["uids"]))]
    out = adv.leave_one_out_outcome(b["outcome"], b["groups"], b["num_groups"])
    for baseline in ("token", "step"):
        ours = adv.min_form_advantage(out, b["step_scores"], b["step_ids"], b["num_steps"], b["mask"], 1.0,
                                      groups=b["groups"], num_groups=b["num_groups"], keep=torch.tensor(keep),
                                      baseline=baseline, whiten=False)
        torch.testing.assert_close(ours, pure_reference(b, 1.0, 0.1, baseline, True, keep=keep), atol=1e-10,
                                   rtol=1e-10)
        for i, kept in enumerate(keep):  # a dropped response gets the outcome term alone (0 on its separators)
            if not kept:
                row = ours[i][b["mask"][i] > 0]
                assert set(row.tolist()) <= {0.0, float(out[i])}


# ----------------------------------------------------------------------------------------------------------
# PRIME
# ----------------------------------------------------------------------------------------------------------


def prime_reference(b, alpha, whiten, n, reward_mask="step_end"):
    """compute_rloo_returns with two reward sources: the process scores at the step ends (rm_scores) and the
    outcome at the last valid token (gt_scores); gamma = 1. rm_scores' reward mask is PRIME's ``eos_mask`` (the
    whole response) with ``reward_mask="response"``, the step-end tokens with ``"step_end"`` (PRIME changed)."""
    batch, length = b["step_ids"].shape
    ids, mask = b["step_ids"].tolist(), b["mask"].tolist()
    sources = []
    process = [[0.0] * length for _ in range(batch)]
    process_mask = [[False] * length for _ in range(batch)]
    for i, row in enumerate(b["scores"]):
        for h, p in enumerate(row):
            end = step_ends_loop(ids[i], h)
            process[i][end] = alpha * p
            process_mask[i][end] = True
        if reward_mask == "response":  # reward_mask = eos_mask.bool()
            process_mask[i] = [bool(m) for m in mask[i]]
    outcome = [[0.0] * length for _ in range(batch)]
    outcome_mask = [[False] * length for _ in range(batch)]
    for i in range(batch):
        last = max(t for t in range(length) if mask[i][t])
        outcome[i][last] = float(b["outcome"][i])
        outcome_mask[i][last] = True
    for reward, reward_mask in ((process, process_mask), (outcome, outcome_mask)):
        reward = [row[:] for row in reward]
        for start in range(0, batch, n):
            means = []
            for pos in range(start, start + n):
                values = [reward[pos][t] for t in range(length) if reward_mask[pos][t]]
                means.append(sum(values) / len(values))
            baseline = sum(means) / (n - 1)
            for pos in range(start, start + n):
                for t in range(length):
                    if reward_mask[pos][t]:
                        reward[pos][t] = reward[pos][t] * n / (n - 1) - baseline
        discounted = [[0.0] * length for _ in range(batch)]
        for i in range(batch):
            running = 0.0
            for t in reversed(range(length)):
                running = reward[i][t] + 1.0 * running
                discounted[i][t] = running
        sources.append(discounted)
    returns = [[sources[0][i][t] + sources[1][i][t] for t in range(length)] for i in range(batch)]
    if whiten:  # verl_F.masked_whiten: mean and unbiased variance over the response tokens
        values = [returns[i][t] for i in range(batch) for t in range(length) if mask[i][t]]
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / len(values) * len(values) / (len(values) - 1)
        returns = [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in returns]
    return torch.tensor([[returns[i][t] * mask[i][t] for t in range(length)] for i in range(batch)],
                        dtype=torch.float64)


@pytest.mark.parametrize("reward_mask", PRIME_REWARD_MASKS)
@pytest.mark.parametrize("whiten", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_leave_one_out_process_advantage_equals_primes_formula(reward_mask, whiten, seed):
    b = random_batch(seed, groups=3, n=4)
    out = adv.leave_one_out_outcome(b["outcome"], b["groups"], b["num_groups"])
    ours = adv.leave_one_out_process_advantage(out, b["step_scores"], b["step_ids"], b["num_steps"], b["mask"], 1.7,
                                               groups=b["groups"], num_groups=b["num_groups"], whiten=whiten,
                                               reward_mask=reward_mask)
    torch.testing.assert_close(ours, prime_reference(b, 1.7, whiten, n=4, reward_mask=reward_mask), atol=1e-9,
                               rtol=1e-9)


def test_prime_masks_differ_with_multi_token_steps_and_agree_when_every_token_is_a_step():
    b = random_batch(4, groups=2, n=3)
    out = adv.leave_one_out_outcome(b["outcome"], b["groups"], b["num_groups"])

    def both(batch):
        return [adv.leave_one_out_process_advantage(out, batch["step_scores"], batch["step_ids"], batch["num_steps"],
                                                    batch["mask"], 1.0, groups=batch["groups"],
                                                    num_groups=batch["num_groups"], reward_mask=m)
                for m in PRIME_REWARD_MASKS]

    step_end, response = both(b)
    assert not torch.allclose(step_end, response)
    # every response token its own step (no EOS, no padding): the two masks are the same tokens
    lengths = b["num_steps"].tolist()
    width = max(lengths)
    one = dict(b, step_ids=torch.tensor([[h if h < k else -1 for h in range(width)] for k in lengths]),
               mask=torch.tensor([[1.0 if h < k else 0.0 for h in range(width)] for k in lengths]))
    step_end, response = both(one)
    torch.testing.assert_close(step_end, response)


def test_prime_step_rewards_fallbacks():
    # a group of one keeps its rewards; a stepless or dropped response neither gets a process term nor enters
    # the others' baseline
    scores = torch.tensor([[0.3, -0.2], [0.1, 0.0], [0.5, 0.4], [0.2, 0.0], [0.9, 0.0]], dtype=torch.float64)
    num_steps = torch.tensor([2, 1, 2, 0, 1])
    groups, num_groups = adv.group_ids(["a", "a", "a", "a", "b"])
    keep = torch.tensor([True, True, False, True, True])
    q = adv.leave_one_out_step_rewards(scores, num_steps, groups, num_groups, keep)
    means = {0: 0.05, 1: 0.1}  # counted in group a: responses 0 and 1 (n = 2)
    total = sum(means.values())
    expected = [[0.3 * 2 - total, -0.2 * 2 - total], [0.1 * 2 - total, 0.0], [0.0, 0.0], [0.0, 0.0], [0.9, 0.0]]
    torch.testing.assert_close(q, torch.tensor(expected, dtype=torch.float64))


# ----------------------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------------------


def test_step_rewards_go_to_the_true_last_token_of_interrupted_steps():
    step_ids = torch.tensor([[0, 0, -1, 0, 1, 1, -1], [0, -1, -1, -1, -1, -1, -1]])
    ends = adv.step_end_positions(step_ids, 3)
    assert ends.tolist() == [[3, 5, -1], [0, -1, -1]]
    rewards = adv.step_end_rewards(torch.tensor([[1.0, 2.0, 7.0], [3.0, 0.0, 0.0]]), step_ids)
    assert rewards.tolist() == [[0, 0, 0, 1.0, 0, 2.0, 0], [3.0, 0, 0, 0, 0, 0, 0]]
    assert adv.rewards_to_go(rewards).tolist() == [[3.0, 3.0, 3.0, 3.0, 2.0, 2.0, 0.0], [3.0] + [0.0] * 6]


def test_out_of_range_step_ids_are_clamped_within_their_own_row():
    """With check_inputs=false nothing validates step ids: like process_advantage, the step-end placement clamps
    them into [-1, S-1], so a bad id stays in its own row (never an out-of-bounds scatter)."""
    bad = torch.tensor([[0, 0, 7, 1], [0, -5, 1, 1]])
    clamped = bad.clamp(-1, 2)
    assert torch.equal(adv.step_end_positions(bad, 3), adv.step_end_positions(clamped, 3))
    assert adv.step_end_positions(bad, 3).tolist() == [[1, 3, 2], [0, 3, -1]]


def test_masked_whiten_equals_verls():
    from verl.utils.torch_functional import masked_whiten

    b = random_batch(4)
    values = torch.randn(b["mask"].shape, dtype=torch.float64)
    expected = masked_whiten(values, b["mask"].to(torch.float64)) * b["mask"]
    torch.testing.assert_close(adv.masked_whiten(values, b["mask"]), expected)


# ----------------------------------------------------------------------------------------------------------
# The estimators: registry, config, input checks
# ----------------------------------------------------------------------------------------------------------


def estimator_inputs(b, values_seed=0):
    """The estimator keyword arguments for batch ``b``: random prover values, outcome at the last token."""
    gen = torch.Generator().manual_seed(values_seed)
    step_values = torch.rand(b["step_scores"].shape, generator=gen)
    prompt_values = torch.rand(len(b["uids"]), generator=gen)
    rewards = torch.zeros(b["mask"].shape)
    last = (b["mask"].cumsum(1) == b["mask"].sum(1, keepdim=True)) & (b["mask"] > 0)
    rewards[last] = b["outcome"].float()
    # one leaf below every real step's node (the tree estimators read it; the others ignore it)
    leaf_counts = (torch.arange(step_values.shape[1])[None, :] < b["num_steps"][:, None]).long()
    return dict(token_level_rewards=rewards, response_mask=b["mask"], index=b["uids"], step_ids=b["step_ids"],
                step_values=step_values, prompt_values=prompt_values, num_steps=b["num_steps"],
                leaf_counts=leaf_counts, response_values=torch.zeros(len(b["uids"])),
                response_leaf_counts=torch.ones(len(b["uids"]), dtype=torch.long))


def config(name, **pav):
    return {"adv_estimator": name, "pav": pav}


@pytest.mark.parametrize("name, off", [("pav_pure", {"zero_separator_advantage": False, "min_form_whiten": False}),
                                       ("pav_prime", {"whiten_returns": False})])
def test_alpha_zero_is_verls_rloo(name, off):
    from verl.trainer.ppo.core_algos import compute_rloo_outcome_advantage

    t = estimator_inputs(random_batch(5))
    ours, returns = ESTIMATORS[name](**t, config=config(name, alpha=0.0, **off))
    theirs, _ = compute_rloo_outcome_advantage(t["token_level_rewards"], t["response_mask"], index=t["index"])
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    assert returns is ours


@pytest.mark.parametrize("name", ["pav_pure", "pav_prime"])
def test_estimators_equal_the_math_on_the_process_scores(name):
    b = random_batch(6)
    t = estimator_inputs(b, values_seed=1)
    truncated = torch.tensor([i % 4 == 1 for i in range(len(b["uids"]))])
    pav = dict(alpha=2.0, best_of_k=4, clip=0.3, drop_truncated=True, min_form_temperature=0.05)
    ours, _ = ESTIMATORS[name](**t, truncated=truncated, config=config(name, **pav))
    cfg = read_pav_config({"pav": pav})
    keep = ~truncated
    scores = adv.process_scores(t["step_values"], t["prompt_values"], t["num_steps"], best_of_k_k=4, clip=0.3,
                                keep=keep)
    out = adv.leave_one_out_outcome(t["token_level_rewards"].sum(1), b["groups"], b["num_groups"])
    common = dict(groups=b["groups"], num_groups=b["num_groups"], keep=keep)
    if name == "pav_pure":
        expected = adv.min_form_advantage(out, scores, b["step_ids"], b["num_steps"], b["mask"], 2.0,
                                          temperature=cfg.min_form_temperature, **common)
    else:
        expected = adv.leave_one_out_process_advantage(out, scores, b["step_ids"], b["num_steps"], b["mask"], 2.0,
                                                       **common)
    torch.testing.assert_close(ours, expected)
    assert not torch.equal(ours, ESTIMATORS[name](**t, truncated=truncated,
                                                      config=config(name, **{**pav, "alpha": 0.0}))[0])


@pytest.mark.parametrize("name", ["pav_pure", "pav_prime"])
def test_the_shared_input_checks_apply(name):
    t = estimator_inputs(random_batch(7))
    t["step_values"] = t["step_values"].clone()
    t["step_values"][2, 0] = 1.5
    with pytest.raises(ValueError, match=r"sample 2: step_values\[2, 0\] = 1.5 is not a probability"):
        ESTIMATORS[name](**t, config=config(name))
    t = estimator_inputs(random_batch(7))
    t.pop("index")
    with pytest.raises(ValueError, match=f"{name} needs `index`"):
        ESTIMATORS[name](**t, config=config(name))
    with pytest.raises(ValueError, match="needs the `truncated` tensor"):
        ESTIMATORS[name](**estimator_inputs(random_batch(7)), config=config(name, drop_truncated=True))


BOUND = re.escape("min_form_temperature must be 0 (the hard minimum) or a finite number >= 1e-30 (below it the "
                  "softmin logits -p/T overflow float32 and the weights become NaN), got ")


@pytest.mark.parametrize("value, message", [
    (-0.1, BOUND + "-0.1"),
    (1e-31, BOUND + "1e-31"),
    (float("nan"), BOUND + "nan"),
    (float("inf"), BOUND + "inf"),
    ("0.1", "min_form_temperature must be a number"),
])
def test_bad_temperature_names_the_key(value, message):
    with pytest.raises(ValueError, match=f"algorithm.pav.{message}"):
        read_pav_config({"pav": {"min_form_temperature": value}})


def test_the_bare_softmin_checks_its_temperature_too():
    with pytest.raises(ValueError, match="temperature must be 0 .* >= 1e-30"):
        adv.softmin_weights(torch.zeros(1, 2), torch.tensor([2]), 3e-39)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_smallest_temperature_keeps_the_weights_finite(dtype):
    # |p| <= 1000: the largest process score the estimators make (|progress| <= 1 over a std >= 1e-3)
    scores = torch.tensor([[1000.0, -1000.0, 0.5], [-0.25, 0.75, 0.0]], dtype=dtype)
    weights = adv.softmin_weights(scores, torch.tensor([3, 2]), adv.MIN_SOFTMIN_TEMPERATURE)
    assert weights.dtype == dtype and torch.isfinite(weights).all()
    assert weights.float().tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]  # the hard minimum, in the limit


@pytest.mark.parametrize("key", ["zero_separator_advantage", "zero_eos_advantage", "min_form_whiten",
                                 "whiten_returns"])
def test_bad_switch_names_the_key(key):
    with pytest.raises(ValueError, match=f"algorithm.pav.{key} must be true or false"):
        PavConfig(**{key: "yes"})


@pytest.mark.parametrize("key, value, choices", [("min_form_baseline", True, MIN_FORM_BASELINES),
                                                 ("prime_reward_mask", "eos", PRIME_REWARD_MASKS)])
def test_bad_choice_names_the_key_and_the_choices(key, value, choices):
    with pytest.raises(ValueError, match=re.escape(f"algorithm.pav.{key} must be one of {choices}, got {value!r}")):
        PavConfig(**{key: value})


@pytest.mark.parametrize("name", ["pav_pure", "pav_prime"])
def test_the_new_options_reach_the_math(name):
    b = random_batch(10)
    t = estimator_inputs(b, values_seed=2)
    options = ({"min_form_baseline": "step", "zero_eos_advantage": True, "min_form_whiten": False}
               if name == "pav_pure" else {"prime_reward_mask": "response", "whiten_returns": False})
    ours, _ = ESTIMATORS[name](**t, config=config(name, alpha=1.5, **options))
    scores = adv.process_scores(t["step_values"], t["prompt_values"], t["num_steps"])
    out = adv.leave_one_out_outcome(t["token_level_rewards"].sum(1).double(), b["groups"], b["num_groups"]).float()
    common = dict(groups=b["groups"], num_groups=b["num_groups"])
    if name == "pav_pure":
        expected = adv.min_form_advantage(out, scores, b["step_ids"], b["num_steps"], b["mask"], 1.5,
                                          baseline="step", zero_eos=True, whiten=False, **common)
    else:
        expected = adv.leave_one_out_process_advantage(out, scores, b["step_ids"], b["num_steps"], b["mask"], 1.5,
                                                       reward_mask="response", whiten=False, **common)
    torch.testing.assert_close(ours, expected)
    assert not torch.allclose(ours, ESTIMATORS[name](**t, config=config(name, alpha=1.5))[0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_token_level_rewards_name_the_sample(bad):
    t = estimator_inputs(random_batch(7))
    t["token_level_rewards"] = t["token_level_rewards"].clone()
    t["token_level_rewards"][3, 1] = bad
    for name in ESTIMATORS:
        with pytest.raises(ValueError, match=re.escape(f"sample 3: token_level_rewards[3, 1] = {bad} is not finite")):
            ESTIMATORS[name](**t, config=config(name))


def test_the_bare_functions_check_alpha():
    b = random_batch(0)
    out = adv.leave_one_out_outcome(b["outcome"], b["groups"], b["num_groups"])
    for function in (adv.min_form_advantage, adv.leave_one_out_process_advantage):
        with pytest.raises(ValueError, match="alpha must be a finite number, got nan"):
            function(out, b["step_scores"], b["step_ids"], b["num_steps"], b["mask"], float("nan"),
                     groups=b["groups"], num_groups=b["num_groups"])


def test_every_estimator_is_registered_in_verl():
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn
    from omegaconf import OmegaConf
    from pathlib import Path

    import verl_prm.config as config_package
    import verl  # noqa: F401  (loads the plugin, which registers every entry of ESTIMATORS)

    assert set(ESTIMATORS) == {"pav_grpo", "pav_rloo", "pav_reinforce", "prm_aggregate", "pav_pure", "pav_prime",
                               "tree_rl", "spo_tree"}
    from verl_prm.integrations.verl.advantage import VERL_ESTIMATORS

    for name, estimator in ESTIMATORS.items():
        # registered as advantage.verl_estimator(estimator): the trainer hook's step tensors reach it through verl
        assert get_adv_estimator_fn(name) is VERL_ESTIMATORS[name] and VERL_ESTIMATORS[name].__wrapped__ is estimator
    yaml = OmegaConf.load(Path(config_package.__file__).parent / "verl_prm" / "pav.yaml")
    assert read_pav_config(yaml.algorithm) == PavConfig()  # the yaml's defaults are PavConfig's
    assert set(yaml.algorithm.pav) == {f for f in PavConfig.__dataclass_fields__}
