"""The estimator math (the formulas of docs/concepts.md) against plain reference loops and verl's own estimators."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

import verl  # noqa: F401  (loads the plugin through the entry point)
from verl.trainer.ppo import core_algos
from verl_prm import advantages as adv
from verl_prm.advantages import fused as fused_lookup
from verl_prm.advantages import native as native_lookup
from verl_prm.choices import AGGREGATIONS
from verl_prm.config import PavConfig, read_pav_config
from verl_prm.estimators import ESTIMATORS, TREE_ESTIMATORS
from verl_prm.integrations.verl.advantage import StepInputs, estimator_step_inputs

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# ----------------------------------------------------------------------------------------------------------
# Reference implementations: plain loops over samples, steps and tokens, written from the formulas of the PAV paper (Setlur et al. 2024, Eq. 5) as docs/concepts.md states them.
# ----------------------------------------------------------------------------------------------------------


def ref_best_of_k(q: float, k: int) -> float:
    return 1.0 - (1.0 - q) ** k


def ref_outcomes(rewards, index, kind: str, norm_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    scores = [float(sum(row)) for row in rewards]
    groups: dict = {}
    for i, label in enumerate(index):
        groups.setdefault(label, []).append(i)
    out = []
    for i, score in enumerate(scores):
        members = [scores[j] for j in groups[index[i]]]
        n = len(members)
        if kind == "grpo":
            if n == 1:
                mean, std = 0.0, 1.0
            else:
                mean = sum(members) / n
                std = math.sqrt(sum((m - mean) ** 2 for m in members) / (n - 1))
            out.append((score - mean) / (std + eps) if norm_by_std else score - mean)
        elif kind == "rloo":
            out.append(score if n == 1 else score - (sum(members) - score) / (n - 1))
        elif kind == "reinforce":
            out.append(score - sum(scores) / len(scores))
        else:
            raise AssertionError(kind)
    return out


def ref_step_scores(values, prompt_values, num_steps, k=1, use_values=False, clip=None, normalize=False,
                    keep=None, eps=1e-6) -> list[list[float]]:
    scores = []
    for i, h_count in enumerate(num_steps):
        row = []
        previous = ref_best_of_k(prompt_values[i], k)
        for h in range(h_count):
            v = ref_best_of_k(values[i][h], k)
            p = v if use_values else v - previous
            previous = v
            if clip is not None:
                p = max(-clip, min(clip, p))
            if keep is not None and not keep[i]:
                p = 0.0
            row.append(p)
        scores.append(row)
    if normalize:
        pool = [p for i, row in enumerate(scores) for p in row if keep is None or keep[i]]
        divisor = 1.0
        if len(pool) > 1:
            mean = sum(pool) / len(pool)
            std = math.sqrt(sum((p - mean) ** 2 for p in pool) / (len(pool) - 1))
            if std >= adv.MIN_NORMALIZE_STD:
                divisor = std + eps
        scores = [[p / divisor for p in row] for row in scores]
    return scores


def ref_pav(batch, kind: str, alpha: float, norm_by_std=True, **score_options) -> list[list[float]]:
    out = ref_outcomes(batch["rewards"], batch["index"], kind, norm_by_std)
    scores = ref_step_scores(batch["values"], batch["prompt_values"], batch["num_steps"], **score_options)
    result = []
    for i, row in enumerate(batch["step_ids"]):
        adv_row = []
        for t, h in enumerate(row):
            mask = batch["mask"][i][t]
            process = scores[i][h] if h >= 0 else 0.0
            adv_row.append((out[i] + alpha * process) * mask)
        result.append(adv_row)
    return result


def ref_aggregate(scores: list[float], how: str) -> float:
    if not scores:
        return 0.0
    if how == "min":
        return min(scores)
    if how == "max":
        return max(scores)
    if how == "sum":
        return sum(scores)
    if how == "mean":
        return sum(scores) / len(scores)
    if how == "product":
        return math.prod(scores)
    if how == "last":
        return scores[-1]
    raise AssertionError(how)


# ----------------------------------------------------------------------------------------------------------
# Ragged batches: empty responses, groups of one, B = 1, tokens in no step, garbage beyond num_steps.
# ----------------------------------------------------------------------------------------------------------


@st.composite
def ragged_batches(draw, max_batch=6, max_length=9):
    batch_size = draw(st.integers(1, max_batch))
    length = draw(st.integers(1, max_length))
    num_labels = draw(st.integers(1, batch_size))
    index = [f"uid{draw(st.integers(0, num_labels - 1))}" for _ in range(batch_size)]
    mask, step_ids, num_steps, rewards = [], [], [], []
    for _ in range(batch_size):
        valid = draw(st.integers(0, length))
        row_mask = [1] * valid + [0] * (length - valid)
        # steps: consecutive runs of tokens; some tokens (e.g. EOS) in no step
        row_ids, step = [], -1
        for t in range(valid):
            choice = draw(st.sampled_from(["same", "new", "none"])) if step >= 0 else draw(
                st.sampled_from(["new", "none"]))
            if choice == "new":
                step += 1
            row_ids.append(step if choice != "none" else -1)
        row_ids += [-1] * (length - valid)
        outcome = float(draw(st.integers(0, 1)))
        row_rewards = [0.0] * length
        if valid:
            row_rewards[valid - 1] = outcome
            if draw(st.booleans()):  # a KL-like dense term, on a 0.1 grid: outcomes 1e-3 apart make a group std
                # of ~6e-4, and GRPO's division by it turns float32 rounding of the inputs into errors > 1e-5
                row_rewards[0] += draw(st.integers(-5, 5)) / 10
        mask.append(row_mask)
        step_ids.append(row_ids)
        num_steps.append(step + 1)
        rewards.append(row_rewards)
    max_steps = max(num_steps) + draw(st.integers(0, 2))
    # values on a grid of 1/1024, exact in float32, as are their differences: equal progress values stay bit-equal
    # (a 1e-3 grid gave 0.154 - 0.328 != 0.0 - 0.174 in float32, and GRPO's std of two "equal" rewards, 4e-11,
    # amplified float rounding into the comparison), and near-ties (1 - 1e-8 vs 1) cannot occur
    probability = st.integers(0, 1024).map(lambda x: x / 1024)
    values = [[draw(probability) for _ in range(max_steps)] for _ in range(batch_size)]
    for i in range(batch_size):  # entries at h >= H are ignored: fill them with NaN to prove it
        for h in range(num_steps[i], max_steps):
            values[i][h] = float("nan")
    prompt_values = [draw(probability) for _ in range(batch_size)]
    truncated = [draw(st.booleans()) for _ in range(batch_size)]
    return dict(index=index, mask=mask, step_ids=step_ids, num_steps=num_steps, rewards=rewards, values=values,
                prompt_values=prompt_values, truncated=truncated)


def to_tensors(batch, device="cpu"):
    return dict(
        token_level_rewards=torch.tensor(batch["rewards"], dtype=torch.float32, device=device),
        response_mask=torch.tensor(batch["mask"], dtype=torch.float32, device=device),
        index=np.array(batch["index"], dtype=object),
        step_ids=torch.tensor(batch["step_ids"], dtype=torch.int64, device=device),
        step_values=torch.tensor(batch["values"], dtype=torch.float32, device=device).reshape(
            len(batch["values"]), -1),
        prompt_values=torch.tensor(batch["prompt_values"], dtype=torch.float32, device=device),
        num_steps=torch.tensor(batch["num_steps"], dtype=torch.int64, device=device),
        # the leaves below each step's node, which only the tree estimators read (one leaf: a chain)
        leaf_counts=torch.ones(len(batch["values"]), len(batch["values"][0]), dtype=torch.int64, device=device),
        response_values=torch.zeros(len(batch["values"]), device=device),
        response_leaf_counts=torch.ones(len(batch["values"]), dtype=torch.int64, device=device),
    )


def algo_config(estimator="pav_grpo", norm_by_std=True, **pav):
    return OmegaConf.create({"adv_estimator": estimator, "norm_adv_by_std_in_grpo": norm_by_std, "pav": pav})


def assert_close(actual: torch.Tensor, expected, atol=1e-5):
    expected = torch.tensor(expected, dtype=torch.float32).reshape(actual.shape)
    torch.testing.assert_close(actual.cpu().float(), expected, atol=atol, rtol=1e-5)


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KINDS = {"pav_grpo": "grpo", "pav_rloo": "rloo", "pav_reinforce": "reinforce"}


# ----------------------------------------------------------------------------------------------------------
# Pure functions
# ----------------------------------------------------------------------------------------------------------


def test_best_of_k_formula_and_validation():
    q = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0])
    torch.testing.assert_close(adv.best_of_k(q, 4), torch.tensor([ref_best_of_k(x, 4) for x in q.tolist()]))
    assert adv.best_of_k(q, 1) is q
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="integer >= 1"):
            adv.best_of_k(q, bad)


@SETTINGS
@given(ragged_batches())
def test_step_progress_matches_loop_and_telescopes(batch):
    t = to_tensors(batch)
    progress = adv.step_progress(t["step_values"], t["prompt_values"], t["num_steps"])
    expected = ref_step_scores(batch["values"], batch["prompt_values"], batch["num_steps"])
    for i, row in enumerate(expected):
        h_count = batch["num_steps"][i]
        assert_close(progress[i, :h_count], row)
        assert torch.all(progress[i, h_count:] == 0)
        if h_count:  # the sum telescopes to v_{H-1} - v_0
            total = batch["values"][i][h_count - 1] - batch["prompt_values"][i]
            assert abs(float(progress[i].sum()) - total) < 1e-5


@SETTINGS
@given(ragged_batches())
def test_step_scores_per_token_and_step_end_rewards_match_loops(batch):
    t = to_tensors(batch)
    scores = torch.nan_to_num(t["step_values"], nan=0.0)
    per_token = adv.step_scores_per_token(scores, t["step_ids"])
    at_ends = adv.step_end_rewards(scores, t["step_ids"])
    for i, row in enumerate(batch["step_ids"]):
        for j, h in enumerate(row):
            assert float(per_token[i, j]) == (float(scores[i, h]) if h >= 0 else 0.0)
            is_end = h >= 0 and h not in row[j + 1:]  # the step's last token (steps may be interrupted)
            assert float(at_ends[i, j]) == (float(scores[i, h]) if is_end else 0.0)


@pytest.mark.parametrize("how", AGGREGATIONS)
def test_aggregations_match_loop(how):
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(7, 5, generator=generator) * 2 - 0.5
    num_steps = torch.tensor([0, 1, 2, 5, 3, 4, 5])
    result = adv.aggregate_step_scores(scores, num_steps, how)
    expected = [ref_aggregate(scores[i, : num_steps[i]].tolist(), how) for i in range(7)]
    assert_close(result, expected)
    assert adv.aggregate_step_scores(torch.zeros(3, 0), torch.zeros(3, dtype=torch.long), how).tolist() == [0] * 3


def test_aggregate_rejects_unknown():
    with pytest.raises(ValueError, match="aggregation must be one of"):
        adv.aggregate_step_scores(torch.zeros(1, 1), torch.ones(1, dtype=torch.long), "median")


def test_group_ids_accepts_verl_uids_lists_and_tensors():
    groups, count = adv.group_ids(np.array(["b", "a", "b", "c"], dtype=object))
    assert count == 3 and groups.tolist() == [1, 0, 1, 2]
    # a tensor is grouped where it lies, without a host read: G = B slots (an upper bound of the groups)
    groups, count = adv.group_ids(torch.tensor([5, 5, 2, 9, 2]))
    assert count == 5 and groups.tolist() == [1, 1, 0, 2, 0]
    assert adv.group_ids(torch.tensor([7]))[0].tolist() == [0]
    with pytest.raises(TypeError, match="mutually comparable"):
        adv.group_ids(np.array(["a", 1], dtype=object))
    with pytest.raises(ValueError, match="index as a tensor must hold integer labels"):
        adv.group_ids(torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match="index is a tensor on meta but the batch is on cpu"):
        adv.group_ids(torch.zeros(2, dtype=torch.long, device="meta"), device="cpu")


@pytest.mark.parametrize("name", ["pav_grpo", "pav_rloo", "prm_aggregate", "pav_pure", "pav_prime"])
def test_estimators_take_group_ids_made_once_per_batch(name):
    labels = np.array(["b", "a", "b", "c", "a"], dtype=object)
    t5 = to_tensors(dict(index=list(labels), mask=[[1, 1, 1]] * 5, step_ids=[[0, 0, 1]] * 5, num_steps=[2] * 5,
                         rewards=[[0, 0, r] for r in (1, 0, 0, 1, 1)], values=[[0.5, 0.9], [0.2, 0.3]] * 2 + [[0.1, 1]],
                         prompt_values=[0.4] * 5))
    from_uids, _ = ESTIMATORS[name](**t5, config=algo_config(name))
    ids, _ = adv.group_ids(labels)
    from_ids, _ = ESTIMATORS[name](**dict(t5, index=ids), config=algo_config(name))
    torch.testing.assert_close(from_ids, from_uids)


# ----------------------------------------------------------------------------------------------------------
# Estimators against loops and against verl
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(KINDS))
@SETTINGS
@given(batch=ragged_batches(), alpha=st.sampled_from([0.0, 0.5, 3.0]), k=st.sampled_from([1, 4]),
       norm_by_std=st.booleans())
def test_pav_estimators_match_reference_loop(device, name, batch, alpha, k, norm_by_std):
    t = to_tensors(batch, device)
    advantages, returns = ESTIMATORS[name](**t, config=algo_config(name, norm_by_std, alpha=alpha, best_of_k=k))
    expected = ref_pav(batch, KINDS[name], alpha, norm_by_std, k=k)
    assert_close(advantages, expected)
    assert returns is advantages
    assert advantages.device.type == device


@pytest.mark.parametrize("name", list(KINDS))
@SETTINGS
@given(batch=ragged_batches(), clip=st.sampled_from([None, 0.05]), normalize=st.booleans(),
       drop_truncated=st.booleans(), use_values=st.booleans())
def test_safeguards_match_reference_loop(name, batch, clip, normalize, drop_truncated, use_values):
    t = to_tensors(batch)
    t["truncated"] = torch.tensor(batch["truncated"])
    config = algo_config(name, alpha=2.0, clip=clip, normalize=normalize, drop_truncated=drop_truncated,
                         process_term="value" if use_values else "progress")
    with pytest.warns(UserWarning, match="reward-hackable") if use_values else _no_warning():
        advantages, _ = ESTIMATORS[name](**t, config=config)
    keep = [not x for x in batch["truncated"]] if drop_truncated else None
    expected = ref_pav(batch, KINDS[name], 2.0, clip=clip, normalize=normalize, keep=keep, use_values=use_values)
    assert_close(advantages, expected, atol=1e-4)


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("how", AGGREGATIONS)
@pytest.mark.parametrize("process_term", ["progress", "value"])
@settings(max_examples=25, deadline=None)
@given(batch=ragged_batches(), with_outcome=st.booleans())
def test_prm_aggregate_matches_reference_loop(how, process_term, batch, with_outcome):
    import warnings

    t = to_tensors(batch)
    config = algo_config("prm_aggregate", aggregation=how, process_term=process_term, aggregate_weight=0.7,
                         aggregate_with_outcome=with_outcome)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        advantages, _ = ESTIMATORS["prm_aggregate"](**t, config=config)
    scores = ref_step_scores(batch["values"], batch["prompt_values"], batch["num_steps"],
                             use_values=process_term == "value")
    rewards = []
    for i, row in enumerate(scores):
        reward = 0.7 * ref_aggregate(row, how) + (sum(batch["rewards"][i]) if with_outcome else 0.0)
        rewards.append([reward])  # one "token" carrying the trajectory reward
    out = ref_outcomes(rewards, batch["index"], "grpo")
    expected = [[out[i] * m for m in batch["mask"][i]] for i in range(len(out))]
    # GRPO divides by the group's std: the float32 rounding of the rewards (~1e-7 of their size) grows by 1/std
    # (hypothesis finds groups whose rewards differ by 1e-3)
    centered = ref_outcomes(rewards, batch["index"], "grpo", norm_by_std=False)
    stds = [abs(c / o) for c, o in zip(centered, out) if abs(o) > 1e-9 and abs(c) > 0]
    size = max(abs(r[0]) for r in rewards)
    assert_close(advantages, expected, atol=1e-4 + (2e-7 * size / min(stds) if stds else 0.0))


@pytest.mark.parametrize("norm_by_std", [True, False])
@SETTINGS
@given(batch=ragged_batches())
def test_pav_grpo_with_alpha_zero_equals_verl_grpo(norm_by_std, batch):
    t = to_tensors(batch)
    ours, _ = ESTIMATORS["pav_grpo"](**t, config=algo_config(norm_by_std=norm_by_std, alpha=0.0))
    for verl_name in ("grpo", "grpo_vectorized"):
        theirs, _ = core_algos.get_adv_estimator_fn(verl_name)(
            token_level_rewards=t["token_level_rewards"].clone(), response_mask=t["response_mask"],
            index=t["index"], norm_adv_by_std_in_grpo=norm_by_std)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@SETTINGS
@given(batch=ragged_batches())
def test_pav_rloo_with_alpha_zero_equals_verl_rloo(batch):
    t = to_tensors(batch)
    ours, _ = ESTIMATORS["pav_rloo"](**t, config=algo_config("pav_rloo", alpha=0.0))
    theirs, _ = core_algos.get_adv_estimator_fn("rloo")(
        token_level_rewards=t["token_level_rewards"].clone(), response_mask=t["response_mask"], index=t["index"],
        config=algo_config("rloo"))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(ESTIMATORS))
@SETTINGS
@given(batch=ragged_batches(), extra=st.integers(1, 4))
def test_right_padding_changes_nothing_and_masked_tokens_get_zero(name, batch, extra):
    t = to_tensors(batch)
    config = algo_config(name, alpha=1.5)
    base, _ = ESTIMATORS[name](**t, config=config)
    assert torch.all(base[t["response_mask"] == 0] == 0)
    padded = dict(t)
    for key, value in (("token_level_rewards", 0.0), ("response_mask", 0.0), ("step_ids", -1)):
        padded[key] = torch.nn.functional.pad(t[key], (0, extra), value=value)
    # more step columns of garbage too
    padded["step_values"] = torch.nn.functional.pad(t["step_values"], (0, extra), value=0.123)
    padded["leaf_counts"] = torch.nn.functional.pad(t["leaf_counts"], (0, extra), value=7)
    wide, _ = ESTIMATORS[name](**padded, config=config)
    torch.testing.assert_close(wide[:, : base.shape[1]], base)
    assert torch.all(wide[:, base.shape[1]:] == 0)


# ----------------------------------------------------------------------------------------------------------
# The fused (torch.compile) per-token lookup
# ----------------------------------------------------------------------------------------------------------


def random_lookup_inputs(batch, length, steps, seed=0, ids_dtype=torch.int64, mask_dtype=torch.float32,
                         device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    num_steps = torch.randint(0, steps + 1, (batch,), generator=generator)
    step_ids = torch.randint(-1, steps, (batch, length), generator=generator)
    step_ids = torch.where(step_ids < num_steps[:, None], step_ids, torch.full_like(step_ids, -1))
    mask = torch.rand(batch, length, generator=generator) > 0.3
    return dict(
        outcome_advantage=torch.randn(batch, generator=generator).to(device),
        step_scores=torch.randn(batch, steps, generator=generator).to(device),
        step_ids=step_ids.to(ids_dtype).to(device),
        response_mask=mask.to(mask_dtype).to(device),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "shape, ids_dtype, mask_dtype",
    [((3, 5, 2), torch.int64, torch.float32), ((37, 129, 9), torch.int32, torch.bool),
     ((64, 1000, 33), torch.int64, torch.int64)],
)
def test_fused_lookup_equals_eager_and_the_loop(device, shape, ids_dtype, mask_dtype):
    inputs = random_lookup_inputs(*shape, ids_dtype=ids_dtype, mask_dtype=mask_dtype, device=device)
    originals = {k: v.clone() for k, v in inputs.items()}
    fused = adv.process_advantage(**inputs, alpha=0.7, compile="always")
    eager = adv.process_advantage(**inputs, alpha=0.7, compile="never")
    for key, value in originals.items():  # the inputs are left as they were (int32 ids once were not)
        assert torch.equal(inputs[key], value), key
    assert fused.dtype == eager.dtype == torch.float32
    assert torch.equal(fused, eager)
    out, scores, ids, mask = (inputs[k].cpu() for k in ("outcome_advantage", "step_scores", "step_ids",
                                                        "response_mask"))
    for i in (0, shape[0] - 1):
        for t in range(shape[1]):
            step = int(ids[i, t])
            expected = (out[i] + (0.7 * scores[i, step] if step >= 0 else 0.0)) * float(mask[i, t])
            assert abs(float(fused[i, t]) - float(expected)) < 1e-6


def test_auto_fuses_only_large_batches(monkeypatch):
    calls = []
    real = fused_lookup._fused_masked_lookup

    def spy(table, step_ids, response_mask, checked, *, fall_back):
        calls.append((step_ids.numel(), fall_back))
        return real(table, step_ids, response_mask, checked, fall_back=fall_back)

    monkeypatch.setattr(fused_lookup, "_fused_masked_lookup", spy)
    small = random_lookup_inputs(16, 64, 4)
    adv.process_advantage(**small, alpha=1.0)
    assert calls == []
    large = random_lookup_inputs(1024, adv.FUSED_MIN_TOKENS // 1024, 8, seed=1)
    fused = adv.process_advantage(**large, alpha=1.0)
    assert calls == [(adv.FUSED_MIN_TOKENS, True)]
    assert torch.equal(fused, adv.process_advantage(**large, alpha=1.0, compile="never"))
    with pytest.raises(ValueError, match="compile must be one of"):
        adv.process_advantage(**small, alpha=1.0, compile="yes")


def test_failed_compilation_warns_once_then_stays_eager(monkeypatch, caplog):
    def broken_compile(fn, **options):
        def call(*args):  # what inductor raises (an InductorError) when it finds no C++ compiler
            raise torch._dynamo.exc.TorchDynamoException("InvalidCxxCompiler: No working C++ compiler found")
        return call

    monkeypatch.setattr(fused_lookup, "_compiled_lookups", {})
    monkeypatch.setattr(fused_lookup, "_compile_failed", None)
    monkeypatch.setattr(torch, "compile", broken_compile)
    large = random_lookup_inputs(1024, adv.FUSED_MIN_TOKENS // 1024, 8, seed=2)
    # a float64 table: the C kernel takes float32 only, so the CPU's fused lookup is torch.compile's
    large["outcome_advantage"] = large["outcome_advantage"].double()
    eager = adv.process_advantage(**large, alpha=1.0, compile="never")
    # an input error is the input's own error, and does not switch compilation off
    bad = dict(large, response_mask=large["response_mask"][:, :-1])
    with pytest.raises(RuntimeError, match="size of tensor"):
        adv.process_advantage(**bad, alpha=1.0)
    assert fused_lookup._compile_failed is None
    with caplog.at_level("WARNING", logger="verl_prm.advantages"):
        assert torch.equal(adv.process_advantage(**large, alpha=1.0), eager)
        assert torch.equal(adv.process_advantage(**large, alpha=1.0), eager)
    warnings = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(warnings) == 1 and "InvalidCxxCompiler" in warnings[0] and "compile=never" in warnings[0]
    # asked for explicitly, the fused kernel's failure is an error
    monkeypatch.setattr(fused_lookup, "_compiled_lookups", {})
    with pytest.raises(RuntimeError, match="InvalidCxxCompiler"):
        adv.process_advantage(**large, alpha=1.0, compile="always")


def test_failed_c_kernel_build_warns_once_then_stays_eager(monkeypatch, caplog, tmp_path):
    """No working C compiler: compile=auto warns once (naming the fix) and runs eager; compile=always raises."""
    monkeypatch.setattr(fused_lookup, "_compile_failed", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("VERL_PRM_CACHE", str(tmp_path / "cache"))
    large = random_lookup_inputs(1024, adv.FUSED_MIN_TOKENS // 1024, 8, seed=4)
    eager = adv.process_advantage(**large, alpha=1.0, compile="never")
    with pytest.raises(native_lookup.NativeLookupError, match="no-such-cc"):
        adv.process_advantage(**large, alpha=1.0, compile="always")
    with caplog.at_level("WARNING", logger="verl_prm.advantages"):
        assert torch.equal(adv.process_advantage(**large, alpha=1.0), eager)
        assert torch.equal(adv.process_advantage(**large, alpha=1.0), eager)
    warnings = [r.getMessage() for r in caplog.records if "C kernel" in r.getMessage()]
    assert len(warnings) == 1 and "no-such-cc" in warnings[0] and "compile=never" in warnings[0]
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.so"))


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.int64, torch.int32, torch.bool])
@pytest.mark.parametrize("steps", [1, 15, 31, 32, 50, 63, 64, 100])
def test_c_kernel_equals_the_loop_for_every_table_width_and_dtype(steps, ids_dtype, mask_dtype):
    """The C kernel's table paths (one, two and four registers, the gather past 64 columns), its vector loop and
    scalar head and tail (a length that is no multiple of 16, rows that start off a cache line), out-of-range ids
    (clamped into their own row, int64 ids far outside int32 saturated, never wrapped) and the flags, against a
    Python loop over ``adv = (out_i + alpha * A[i, step]) * mask`` and the contract."""
    if not native_lookup.native_lookup_supported(torch.zeros(1, 2), torch.zeros(1, 1, dtype=ids_dtype),
                                                 torch.zeros(1, 1, dtype=mask_dtype)):
        pytest.skip("not a C-kernel input")
    generator = torch.Generator().manual_seed(steps)
    batch, length = 9, 77
    table = torch.randn(batch, steps + 1, generator=generator)
    num_steps = torch.randint(0, steps + 1, (batch,), generator=generator)
    ids = torch.randint(-3, steps + 3, (batch, length), generator=generator)
    huge = 2**40 if ids_dtype == torch.int64 else 2**31 - 1
    ids[1, 20], ids[2, 21], ids[3, 75] = huge, -huge, steps  # past the end, before the start, one past the last
    mask = (torch.rand(batch, length, generator=generator) > 0.2).to(mask_dtype)
    step_values = torch.rand(batch, steps, generator=generator)
    prompt_values = torch.rand(batch, generator=generator)
    outcome = torch.randn(batch, generator=generator)
    out, bad = native_lookup.native_lookup(table, ids.to(ids_dtype), mask, num_steps,
                                           (step_values, prompt_values, outcome))
    for i in range(batch):
        for t in range(length):
            column = min(max(int(ids[i, t]), -1), steps - 1) + 1
            assert float(out[i, t]) == float(table[i, column]) * float(mask[i, t]), (i, t)
        ids_bad = any(int(x) < -1 or int(x) >= int(num_steps[i]) for x in ids[i])
        assert bool(bad[i]) == ids_bad, i
    # the small tensors' checks (bad_input_rows), on rows whose ids are all -1
    ids = torch.full((batch, length), -1)
    num_steps = torch.full((batch,), steps)
    step_values[1, steps - 1], prompt_values[2], outcome[3], num_steps[4] = float("nan"), 1.5, float("inf"), steps + 1
    num_steps[5], step_values[5, steps - 1] = steps - 1, float("nan")  # past row 5's last real step: no flag
    _, bad = native_lookup.native_lookup(table, ids.to(ids_dtype), mask, num_steps,
                                         (step_values, prompt_values, outcome))
    assert bad.tolist() == [i in (1, 2, 3, 4) for i in range(batch)]


def test_c_kernel_splits_rows_over_threads_with_the_same_result():
    inputs = random_lookup_inputs(600, 700, 20, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = adv.process_advantage(**inputs, alpha=0.3, compile="always")
        torch.set_num_threads(4)
        four = adv.process_advantage(**inputs, alpha=0.3, compile="always")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, four)
    assert torch.equal(one, adv.process_advantage(**inputs, alpha=0.3, compile="never"))


@pytest.mark.parametrize("compile", ["never", "always"])
def test_out_of_range_step_ids_are_clamped_within_their_own_row(compile):
    """With check_inputs off nothing validates step ids: an id past the last column (or below -1) must read its
    own row (the last step, or "no step"), never the neighbouring response's entry at the same flat offset."""
    inputs = random_lookup_inputs(6, 40, 4, seed=3)
    bad = inputs["step_ids"].clone()
    bad[2, 11], bad[2, 12], bad[3, 0], bad[5, 39] = 4, 9, -7, 100  # row 5 is the last: past the flat table
    clamped = bad.clamp(-1, 3)
    expected = adv.process_advantage(**dict(inputs, step_ids=clamped), alpha=1.0, compile="never")
    actual = adv.process_advantage(**dict(inputs, step_ids=bad), alpha=1.0, compile=compile)
    assert torch.equal(actual, expected)
    # the value read at [2, 11] is row 2's last step, not row 3's "no step" entry
    table = inputs["outcome_advantage"][:, None] + torch.nn.functional.pad(inputs["step_scores"], (1, 0))
    assert actual[2, 11] == table[2, 4] * inputs["response_mask"][2, 11]
    assert torch.equal(adv.step_scores_per_token(inputs["step_scores"], bad),
                       adv.step_scores_per_token(inputs["step_scores"], clamped))


@pytest.mark.parametrize("name", ["pav_grpo", "pav_rloo", "prm_aggregate"])
def test_index_of_the_wrong_length_names_the_argument(name):
    t = small_batch()
    for labels in (["a", "a", "b"], ["a"]):
        with pytest.raises(ValueError, match=r"index \(verl's uid.*one entry per response, shape \(2,\), got "
                                             rf"shape \({len(labels)},\)"):
            ESTIMATORS[name](**dict(t, index=np.array(labels, dtype=object)), config=algo_config(name))


def test_truncated_of_the_wrong_length_names_the_argument():
    t = small_batch()
    for name in ESTIMATORS:
        with pytest.raises(ValueError, match=r"truncated \(keep.*shape \(2,\), got shape \(3,\)"):
            ESTIMATORS[name](**t, truncated=torch.tensor([False, True, False]),
                                 config=algo_config(name, drop_truncated=True))


def test_estimators_read_the_compile_knob(monkeypatch):
    modes = []
    real = adv.process_advantage_and_bad_rows
    monkeypatch.setattr(adv, "process_advantage_and_bad_rows", lambda *a, compile, **k: modes.append(compile) or real(
        *a, compile=compile, **k))
    t = small_batch()
    fused, _ = ESTIMATORS["pav_grpo"](**t, config=algo_config(compile="always"))
    eager, _ = ESTIMATORS["pav_grpo"](**t, config=algo_config(compile="never"))
    ESTIMATORS["pav_rloo"](**t, config=algo_config())
    assert modes == ["always", "never", "auto"]
    assert torch.equal(fused, eager)


# ----------------------------------------------------------------------------------------------------------
# Errors and configuration
# ----------------------------------------------------------------------------------------------------------


def small_batch():
    return to_tensors(dict(
        index=["a", "a"], mask=[[1, 1, 1], [1, 1, 0]], step_ids=[[0, 0, 1], [0, -1, -1]], num_steps=[2, 1],
        rewards=[[0, 0, 1], [0, 0, 0]], values=[[0.5, 0.9], [0.2, 0.0]], prompt_values=[0.4, 0.4]))


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_estimator_without_step_tensors_says_what_must_supply_them(name):
    t = small_batch()
    with pytest.raises(ValueError, match="needs the step tensors.*estimator_step_inputs"):
        core_algos.get_adv_estimator_fn(name)(token_level_rewards=t["token_level_rewards"],
                                              response_mask=t["response_mask"], index=t["index"],
                                              config=algo_config(name))


def test_verl_compute_advantage_alone_gives_the_same_clear_error():
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    t = small_batch()
    data = DataProto.from_dict(tensors={k: t[k] for k in ("token_level_rewards", "response_mask")},
                               non_tensors={"uid": t["index"]})
    with pytest.raises(ValueError, match="needs the step tensors"):
        compute_advantage(data, adv_estimator="pav_grpo", config=algo_config())


def test_verl_compute_advantage_inside_estimator_step_inputs_equals_direct_call():
    """The trainer hook's path: verl's own compute_advantage (no step tensors passed) inside the context."""
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    t = small_batch()
    config = algo_config(alpha=2.0, best_of_k=2)
    tensors = {k: t[k] for k in ("token_level_rewards", "response_mask")}
    inputs = StepInputs(t["step_ids"], t["step_values"], t["prompt_values"], t["num_steps"],
                        torch.zeros(2, dtype=torch.bool), leaf_counts=t["leaf_counts"])
    with estimator_step_inputs(inputs):
        data = compute_advantage(DataProto.from_dict(tensors=tensors, non_tensors={"uid": t["index"]}),
                                 adv_estimator="pav_grpo", config=config)
    direct, _ = core_algos.get_adv_estimator_fn("pav_grpo")(**t, config=config)
    torch.testing.assert_close(data.batch["advantages"], direct)
    torch.testing.assert_close(data.batch["returns"], direct)
    # a verl estimator gets verl's arguments only
    config_grpo = algo_config("grpo_vectorized")
    with estimator_step_inputs(inputs):
        data = compute_advantage(DataProto.from_dict(tensors=tensors, non_tensors={"uid": t["index"]}),
                                 adv_estimator="grpo_vectorized", config=config_grpo)
    expected, _ = core_algos.compute_grpo_vectorized_outcome_advantage(
        t["token_level_rewards"], t["response_mask"], t["index"])
    torch.testing.assert_close(data.batch["advantages"], expected)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(step_ids=torch.tensor([[0, 0, 2], [0, -1, -1]])), "sample 0: token 2 has step_id 2 but the response "
                                                               "has num_steps=2"),
        (dict(step_ids=torch.tensor([[0, 0, 1], [0, -2, -1]])), "sample 1: token 1 has step_id -2"),
        (dict(num_steps=torch.tensor([2, 3])), "sample 1: num_steps=3 is outside"),
        (dict(step_values=torch.tensor([[0.5, 0.9], [1.7, 0.0]])), r"sample 1: step_values\[1, 0\] = 1.7"),
        (dict(step_values=torch.tensor([[0.5, float("nan")], [0.2, 0.0]])), r"sample 0: step_values\[0, 1\]"),
        (dict(prompt_values=torch.tensor([0.4, -0.1])), r"sample 1: prompt_values\[1\]"),
        (dict(step_ids=torch.zeros(2, 2, dtype=torch.long)), "step_ids must have the shape of response_mask"),
        (dict(prompt_values=torch.zeros(3)), r"prompt_values must be \[B=2\]"),
    ],
)
@pytest.mark.parametrize("compile_mode", ["always", "never"])
def test_bad_step_inputs_name_the_sample(change, message, compile_mode):
    """Both lookup paths: the fused kernel flags the bad rows of the small tensors too."""
    t = small_batch()
    t.update(change)
    with pytest.raises(ValueError, match=message):
        ESTIMATORS["pav_grpo"](**t, config=algo_config(compile=compile_mode))


@pytest.mark.parametrize("compile_mode", ["always", "never"])
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_the_large_inputs_are_checked_after_the_math(name, compile_mode):
    """The check reads the [B, T] inputs through the outcome sums and the fused lookup's id flags (no pass of its
    own): every bad entry is still an error naming the sample and the token, for every estimator and both
    lookup paths. Reference: the contract in the docstring of ``check_step_inputs``, checked element by element."""
    config = algo_config(compile=compile_mode)
    cases = [
        (dict(step_ids=torch.tensor([[0, 0, 1], [0, -1, 1]])), "sample 1: token 2 has step_id 1 but the response "
                                                              "has num_steps=1"),
        (dict(step_ids=torch.tensor([[0, 0, 5], [0, -1, -1]])), "sample 0: token 2 has step_id 5"),
        (dict(token_level_rewards=torch.tensor([[0.0, 0.0, 1.0], [0.0, float("nan"), 0.0]])),
         r"sample 1: token_level_rewards\[1, 1\] = nan is not finite"),
        (dict(token_level_rewards=torch.tensor([[float("-inf"), 0.0, 1.0], [0.0, 0.0, 0.0]])),
         r"sample 0: token_level_rewards\[0, 0\] = -inf is not finite"),
        (dict(token_level_rewards=torch.tensor([[0.0, 0.0, 1.0], [3e38, 3e38, 0.0]])),
         r"sample 1: the sum of token_level_rewards\[1\] overflows"),
    ]
    for change, message in cases:
        t = dict(small_batch(), **change)
        with pytest.raises(ValueError, match=message):
            ESTIMATORS[name](**t, config=config)


def test_the_fused_lookup_flags_bad_rows_as_a_loop_does():
    """Every check of ``check_step_inputs`` (its docstring's contract), per response, against a loop over the
    elements, for the fused and the eager lookup: ids outside [-1, H - 1], H outside [0, S], a real step's value or
    the prompt's outside [0, 1] or NaN (padding columns are not read), a non-finite outcome."""
    batch, steps = 64, 9
    inputs = random_lookup_inputs(batch, 1000, steps, seed=3)
    generator = torch.Generator().manual_seed(4)
    num_steps = torch.randint(-1, steps + 2, (batch,), generator=generator)
    values = torch.rand(batch, steps, generator=generator)
    spoiled = torch.rand(batch, steps, generator=generator) < 0.02
    values = torch.where(spoiled, torch.tensor([float("nan"), 1.5, -0.1])[torch.arange(batch * steps).view(
        batch, steps) % 3], values)
    prompts = torch.rand(batch, generator=generator)
    prompts[[5, 6]] = torch.tensor([float("nan"), 1.01])
    outcome = torch.randn(batch, generator=generator)
    outcome[[7, 8]] = torch.tensor([float("inf"), float("nan")])
    expected = []
    for i in range(batch):
        h = int(num_steps[i])
        expected.append(
            not 0 <= h <= steps
            or any(not -1 <= int(x) < h for x in inputs["step_ids"][i])
            or any(not 0 <= float(values[i, j]) <= 1 for j in range(min(max(h, 0), steps)))
            or not 0 <= float(prompts[i]) <= 1
            or not math.isfinite(float(outcome[i]))
        )
    assert 0 < sum(expected) < batch
    for mode in ("always", "never"):
        out, bad = adv.process_advantage_and_bad_rows(**inputs, alpha=0.7, compile=mode,
                                                      checked=(values, prompts, num_steps, outcome))
        assert torch.equal(out, adv.process_advantage(**inputs, alpha=0.7, compile="never"))
        assert bad.tolist() == expected, mode
        assert adv.process_advantage_and_bad_rows(**inputs, alpha=0.7, compile=mode)[1] is None


def test_drop_truncated_without_truncated_tensor_is_an_error():
    with pytest.raises(ValueError, match="needs the `truncated` tensor"):
        ESTIMATORS["pav_grpo"](**small_batch(), config=algo_config(drop_truncated=True))


def test_grpo_family_needs_index():
    t = small_batch()
    t.pop("index")
    with pytest.raises(ValueError, match="needs `index`"):
        ESTIMATORS["pav_grpo"](**t, config=algo_config())
    ESTIMATORS["pav_reinforce"](**t, config=algo_config())  # batch baseline: no groups needed


@pytest.mark.parametrize(
    "pav, message",
    [
        ({"alpah": 1.0}, "Known keys: alpha"),
        ({"alpha": -1.0}, re.escape("alpha must be in [0, 1e+06]")),
        ({"best_of_k": 0}, "best_of_k must be an integer >= 1"),
        ({"best_of_k": 2.5}, "best_of_k"),
        ({"process_term": "q"}, "process_term must be one of"),
        ({"clip": 0.0}, "clip must be > 0"),
        ({"aggregation": "median"}, "aggregation must be one of"),
        ({"compile": "yes"}, "compile must be one of"),
        # every float knob is finite, and the error names the key
        ({"alpha": float("nan")}, r"algorithm.pav.alpha must be in \[0, 1e\+06\] \(a finite number\), got nan"),
        ({"alpha": float("inf")}, r"algorithm.pav.alpha must be in \[0, 1e\+06\] \(a finite number\), got inf"),
        ({"clip": float("nan")}, r"algorithm.pav.clip must be > 0 \(a finite number\), got nan"),
        ({"clip": float("inf")}, r"algorithm.pav.clip must be > 0 \(a finite number\), got inf"),
        ({"epsilon": float("nan")}, r"algorithm.pav.epsilon must be > 0 \(a finite number\), got nan"),
        ({"epsilon": 0.0}, r"algorithm.pav.epsilon must be > 0"),
        ({"aggregate_weight": float("nan")}, r"algorithm.pav.aggregate_weight must be in \[-1e\+06, 1e\+06\] \(a finite number\), got nan"),
        ({"aggregate_weight": float("-inf")}, r"algorithm.pav.aggregate_weight must be in \[-1e\+06, 1e\+06\] \(a finite number\), got -inf"),
        ({"best_of_k": float("nan")}, r"algorithm.pav.best_of_k must be an integer >= 1, got nan"),
        ({"best_of_k": float("inf")}, r"algorithm.pav.best_of_k must be an integer >= 1, got inf"),
        ({"min_form_temperature": float("nan")},
         r"algorithm.pav.min_form_temperature must be 0 \(the hard minimum\) or a finite number >= 1e-30"),
    ],
)
def test_config_validation(pav, message):
    with pytest.raises((ValueError, TypeError), match=message):
        read_pav_config(OmegaConf.create({"pav": pav}))


def test_config_defaults_and_sources():
    assert read_pav_config(None) == PavConfig()
    assert read_pav_config({"pav": {"alpha": 0.5}}).alpha == 0.5
    assert read_pav_config(OmegaConf.create({"pav": {"best_of_k": 4}})).best_of_k == 4


# ----------------------------------------------------------------------------------------------------------
# Plugin loading through verl's entry point
# ----------------------------------------------------------------------------------------------------------


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300, cwd="/")


def test_bare_import_verl_registers_every_estimator():
    result = run_python("""
        import verl
        from verl.trainer.ppo.core_algos import get_adv_estimator_fn
        for name in ("pav_grpo", "pav_rloo", "pav_reinforce", "prm_aggregate"):
            print(name, get_adv_estimator_fn(name).__module__)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["pav_grpo", "verl_prm.estimators", "pav_rloo", "verl_prm.estimators",
                                     "pav_reinforce", "verl_prm.estimators", "prm_aggregate", "verl_prm.estimators"]


def test_plugin_failure_is_loud():
    result = run_python("""
        import verl_prm
        verl_prm.SUPPORTED_VERL_VERSION = "0.0.1"   # as if another verl were installed
        import verl
        from verl.trainer.ppo.core_algos import get_adv_estimator_fn
        try:
            get_adv_estimator_fn("pav_grpo")()
        except Exception as error:
            print(type(error).__name__, error)
    """)
    assert result.returncode == 0, result.stderr
    assert "verl-prm failed to register with verl" in result.stderr
    assert "verl-prm supports verl 0.0.1" in result.stderr
    assert "PluginLoadError verl-prm failed to load" in result.stdout


def test_plugin_disabled_leaves_names_unknown():
    result = run_python("""
        import verl
        from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY
        print("pav_grpo" in ADV_ESTIMATOR_REGISTRY)
    """, VERL_USE_EXTERNAL_PLUGINS="none")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


# ----------------------------------------------------------------------------------------------------------
# CUDA: the same math, and no host-device synchronisation in the hot path
# ----------------------------------------------------------------------------------------------------------


class HostTraffic:
    """Records what would make an estimator wait for, or copy to or from, the device: scalar reads (``.item()``,
    ``bool``/``int``/``float`` of a tensor: ``aten._local_scalar_dense``), ``tolist``/``numpy``/``cpu``, copies
    between devices (``aten._to_copy``/``copy_`` whose source and result devices differ) and tensors made from
    host data (``aten.lift_fresh``: ``torch.tensor``/``as_tensor``/``from_numpy``, an upload on CUDA). CPU
    tensors go through the same dispatcher ops as CUDA ones, so the probe runs without a GPU."""

    READS = {"item", "tolist", "numpy", "cpu", "cuda", "pin_memory", "__bool__", "__int__", "__float__",
             "__index__"}

    def __init__(self):
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        self.events: list[str] = []
        probe = self

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name in HostTraffic.READS:
                    probe.events.append(name)
                return func(*args, **(kwargs or {}))

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                result = func(*args, **(kwargs or {}))
                name = func.overloadpacket.__name__
                if name == "_local_scalar_dense":
                    probe.events.append("scalar read")
                elif name == "lift_fresh":
                    probe.events.append("host data")
                elif name in ("_to_copy", "copy_") and isinstance(result, torch.Tensor):
                    source = args[1] if name == "copy_" else args[0]
                    if isinstance(source, torch.Tensor) and source.device != result.device:
                        probe.events.append("device copy")
                return result

        self.modes = (Functions(), Dispatch())

    def __enter__(self):
        for mode in self.modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self.modes):
            mode.__exit__(*exc)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_no_hidden_transfer_or_sync_in_any_estimator(name):
    """What an estimator may do on the host, per call: nothing with ``check_inputs=false`` and ``index`` as group
    ids on the batch's device; with verl's host uids, one tensor made from host data (``group_ids``: on CUDA the
    one upload, pinned and asynchronous); with ``check_inputs=true`` (the default), one ``tolist`` of the check
    flags after the math (the one synchronisation of ``check_step_inputs``). ``pav_reinforce`` and the tree
    estimators read no ``index``."""
    t = small_batch()
    uids = t["index"]
    ids, _ = adv.group_ids(uids)
    uses_groups = name not in ("pav_reinforce", *TREE_ESTIMATORS)
    expected = {
        (False, "ids"): [],
        (False, "uids"): ["host data"] if uses_groups else [],
        (True, "ids"): ["tolist"],
        (True, "uids"): (["host data"] if uses_groups else []) + ["tolist"],
    }
    for (check, kind), allowed in expected.items():
        inputs = dict(t, index=ids if kind == "ids" else uids)
        config = algo_config(name, check_inputs=check)
        reference, _ = ESTIMATORS[name](**inputs, config=config)
        with HostTraffic() as probe:
            advantages, _ = ESTIMATORS[name](**inputs, config=config)
        assert probe.events == allowed, (check, kind)
        torch.testing.assert_close(advantages, reference)


def test_the_probe_sees_what_it_forbids():
    x = torch.arange(4.0)
    with HostTraffic() as probe:
        bool(x.sum() > 0)
        x.max().item()
        x.tolist()
        torch.as_tensor(np.arange(3))
        x.to("meta")
    assert probe.events == ["__bool__", "scalar read", "item", "scalar read", "tolist", "host data", "device copy"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_no_host_device_sync_on_cuda(name):
    """With input checks off, an estimator issues no synchronising CUDA call: verl's numpy uids go host->device
    as one asynchronous copy from pinned memory; group ids already on the device need no copy at all."""
    t = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in small_batch().items()}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    ids, _ = adv.group_ids(t["index"], device="cuda")
    try:
        ESTIMATORS[name](**t, config=algo_config(name, check_inputs=False))
        ESTIMATORS[name](**dict(t, index=ids), config=algo_config(name, check_inputs=False))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_zero_signal_groups_against_a_loop():
    from verl_prm.advantages import group_ids, zero_signal_groups

    generator = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 2, (64,), generator=generator).float()
    labels = [f"u{int(i)}" for i in torch.randint(0, 20, (64,), generator=generator)]
    groups, count = group_ids(labels)
    got = zero_signal_groups(scores, groups, count)
    for g in range(count):
        members = [float(scores[i]) for i in range(64) if int(groups[i]) == g]
        assert bool(got[g]) == (max(members) == min(members)), g
    assert zero_signal_groups(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), 2).tolist() == [True, True]
    with pytest.raises(ValueError, match="one entry per response"):
        zero_signal_groups(scores, groups[:3], count)
