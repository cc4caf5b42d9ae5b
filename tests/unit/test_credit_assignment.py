"""PURE's min-form and PRIME's leave-one-out credit assignment (``pav_pure``, ``pav_prime``) against the peers'
formulas, written as plain loops over samples, steps and tokens.

PURE (CJReinforce/PURE, openrlhf/utils/utils.py ``turn_process_reward_logits_to_reward`` and
openrlhf/trainer/ppo_utils/experience_maker.py): step rewards weighted by a softmax of ``-r / T`` over the
response's steps, minus the leave-one-out mean step reward of the prompt's other responses (``reward_baseline
= step``), placed at the step-end tokens, the verifiable reward's RLOO at the last token, returns = reverse
cumulative sum, 0 advantage on step-separator tokens. PRIME (PRIME-RL/PRIME ``compute_rloo_returns``): per reward
source, ``r * n/(n-1) - sum_g mean_j / (n-1)`` at the reward positions, undiscounted returns summed over the
sources, whitened over the response tokens.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from verl_prm import advantages as adv
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


def pure_reference(b, alpha, temperature, baseline, zero_separators, keep=None):
    batch, length = b["step_ids"].shape
    ids = b["step_ids"].tolist()
    mask = b["mask"].tolist()
    uids = b["uids"]
    keep = keep or [True] * batch
    rewards = [pure_min_form_loop(row, temperature) for row in b["scores"]]
    # reward_baseline = "step": the others' (sum of weighted rewards / number of steps), averaged
    per_step = [sum(r) / len(r) if r else None for r in rewards]
    out_rloo = rloo_loop(b["outcome"].tolist(), uids)
    result = []
    for i in range(batch):
        base = 0.0
        if baseline:
            others = [per_step[j] for j in range(batch)
                      if uids[j] == uids[i] and j != i and per_step[j] is not None and keep[j]]
            base = sum(others) / len(others) if others else 0.0
        token_rewards = [0.0] * length
        separators = set()
        for h, r in enumerate(rewards[i]):
            end = step_ends_loop(ids[i], h)
            token_rewards[end] += alpha * (r - base) if keep[i] else 0.0
            if h < len(rewards[i]) - 1:
                separators.add(end)
        last = max(t for t in range(length) if mask[i][t])
        token_rewards[last] += out_rloo[i]  # the verifiable reward's RLOO at the last token (PURE: EOS)
        returns, running = [0.0] * length, 0.0
        for t in reversed(range(length)):  # returns = reward.fliplr().cumsum(dim=1).fliplr()
            running += token_rewards[t]
            returns[t] = running
        row = [returns[t] * mask[i][t] for t in range(length)]
        if zero_separators:  # returns.masked_fill_(process_reward_mask, 0) for the separator tokens
            row = [0.0 if t in separators else x for t, x in enumerate(row)]
        result.append(row)
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
@pytest.mark.parametrize("baseline", [True, False])
@pytest.mark.parametrize("zero_separators", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_min_form_advantage_equals_pures_formula(temperature, baseline, zero_separators, seed):
    b = random_batch(seed)
    out = adv.leave_one_out_outcome(b["outcome"], b["groups"], b["num_groups"])
    ours = adv.min_form_advantage(out, b["step_scores"], b["step_ids"], b["num_steps"], b["mask"], 2.5,
                                  groups=b["groups"], num_groups=b["num_groups"], temperature=temperature,
                                  baseline=baseline, zero_separators=zero_separators)
    expected = pure_reference(b, 2.5, temperature, baseline, zero_separators)
    torch.testing.assert_close(ours, expected, atol=1e-10, rtol=1e-10)


def test_min_form_advantage_with_dropped_and_stepless_responses():
    b = random_batch(3, allow_empty=True)
    keep = [i % 3 != 0 for i in range(len(b["uids"]))]
    out = adv.leave_one_out_outcome(b["outcome"], b["groups"], b["num_groups"])
    ours = adv.min_form_advantage(out, b["step_scores"], b["step_ids"], b["num_steps"], b["mask"], 1.0,
                                  groups=b["groups"], num_groups=b["num_groups"], keep=torch.tensor(keep))
    torch.testing.assert_close(ours, pure_reference(b, 1.0, 0.1, True, True, keep=keep), atol=1e-10, rtol=1e-10)
    for i, kept in enumerate(keep):  # a dropped response gets the outcome term alone (0 on its separators)
        if not kept:
            row = ours[i][b["mask"][i] > 0]
            assert set(row.tolist()) <= {0.0, float(out[i])}


# ----------------------------------------------------------------------------------------------------------
# PRIME
# ----------------------------------------------------------------------------------------------------------


def prime_reference(b, alpha, whiten, n):
    """compute_rloo_returns with two reward sources: the process scores at the step ends (rm_scores, reward
    mask = step-end tokens) and the outcome at the last valid token (gt_scores); gamma = 1."""
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


@pytest.mark.parametrize("whiten", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_leave_one_out_process_advantage_equals_primes_formula(whiten, seed):
    b = random_batch(seed, groups=3, n=4)
    out = adv.leave_one_out_outcome(b["outcome"], b["groups"], b["num_groups"])
    ours = adv.leave_one_out_process_advantage(out, b["step_scores"], b["step_ids"], b["num_steps"], b["mask"], 1.7,
                                               groups=b["groups"], num_groups=b["num_groups"], whiten=whiten)
    torch.testing.assert_close(ours, prime_reference(b, 1.7, whiten, n=4), atol=1e-9, rtol=1e-9)


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
    return dict(token_level_rewards=rewards, response_mask=b["mask"], index=b["uids"], step_ids=b["step_ids"],
                step_values=step_values, prompt_values=prompt_values, num_steps=b["num_steps"])


def config(name, **pav):
    return {"adv_estimator": name, "pav": pav}


@pytest.mark.parametrize("name, off", [("pav_pure", {"zero_separator_advantage": False}),
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


@pytest.mark.parametrize("value, message", [
    (-0.1, "min_form_temperature must be a finite number >= 0"),
    (float("nan"), "min_form_temperature must be a finite number >= 0"),
    (float("inf"), "min_form_temperature must be a finite number >= 0"),
    ("0.1", "min_form_temperature must be a number"),
])
def test_bad_temperature_names_the_key(value, message):
    with pytest.raises(ValueError, match=f"algorithm.pav.{message}"):
        read_pav_config({"pav": {"min_form_temperature": value}})


@pytest.mark.parametrize("key", ["min_form_baseline", "zero_separator_advantage", "whiten_returns"])
def test_bad_switch_names_the_key(key):
    with pytest.raises(ValueError, match=f"algorithm.pav.{key} must be true or false"):
        PavConfig(**{key: "yes"})


def test_every_estimator_is_registered_in_verl():
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn
    from omegaconf import OmegaConf
    from pathlib import Path

    import verl_prm.config as config_package
    import verl  # noqa: F401  (loads the plugin, which registers every entry of ESTIMATORS)

    assert set(ESTIMATORS) == {"pav_grpo", "pav_rloo", "pav_reinforce", "prm_aggregate", "pav_pure", "pav_prime"}
    for name, estimator in ESTIMATORS.items():
        assert get_adv_estimator_fn(name) is estimator
    yaml = OmegaConf.load(Path(config_package.__file__).parent / "verl_prm" / "pav.yaml")
    assert read_pav_config(yaml.algorithm) == PavConfig()  # the yaml's defaults are PavConfig's
    assert set(yaml.algorithm.pav) == {f for f in PavConfig.__dataclass_fields__}
