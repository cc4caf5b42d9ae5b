"""The recipe's learned critics: exact label rows, the SFT solutions as label rows, and the checking backbone
(critic_init: the policy signal, result targets)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from verl_prm.apps.arithmetic.score import DATA_SOURCE
from verl_prm.apps.arithmetic.task import (
    Problem,
    solution_lines,
)



def test_exact_label_rows_hold_the_exact_provers_values_and_pass_the_label_checks(tmp_path):
    import pandas as pd

    from verl_prm.labeling.format import read_labels
    from verl_prm.labeling.store import ShardStore
    from studies.arithmetic_critic import exact_label_rows
    from verl_prm.apps.arithmetic.model import build_tokenizer, render
    from verl_prm.apps.arithmetic.prover import prefix_value

    problem = Problem(3, (("+", 2), ("*", 3)), 7)  # 3+2=5, 5*3=1
    prompt = render(build_tokenizer(), problem.prompt_text)
    rows = []
    for i, response in enumerate(["3+2=5 *3\n5*3=1\nanswer 1", "3+2=6 *3\n6*3=4\nanswer 4"]):
        ends = [5, 14, len(response)] if i == 0 else [5, 14, len(response)]
        rows.append({"prompt_index": 0, "rollout_index": i, "data_source": DATA_SOURCE, "prompt": prompt,
                     "ground_truth": "1", "response": response, "step_starts": [0, 5, 14], "step_ends": ends,
                     "q": [0.5, 0.5, 0.0], "n_success": [1, 1, 0], "n_mc": [2, 2, 2], "first_pit": -1,
                     "prompt_value": 0.5, "prompt_n_success": 1, "prompt_n_mc": 2, "outcome": float(i == 0),
                     "score": float(i == 0), "finished": True, "strategy": "every", "source": "test"})
    exact = exact_label_rows(pd.DataFrame(rows), step_accuracy=0.8)
    assert exact[0]["q"] == [0.8, 1.0, 1.0] and exact[0]["prompt_value"] == pytest.approx(0.64)
    assert exact[1]["q"] == [0.0, 0.0, 0.0] and exact[1]["first_pit"] == 0
    assert exact[0]["q"][0] == prefix_value(problem, rows[0]["response"][:5], 0.8)
    ShardStore(tmp_path).write_shard(exact)  # the writer validates the rows
    assert read_labels(tmp_path)["q"].map(list).tolist() == [[0.8, 1.0, 1.0], [0.0, 0.0, 0.0]]


def test_sft_solutions_become_exact_label_rows_with_one_step_per_result(tmp_path):
    from studies.arithmetic_critic import sft_label_rows
    from verl_prm.apps.arithmetic.model import build_tokenizer

    problem = Problem(3, (("+", 2), ("*", 3)), 7)  # 3+2=5, 5*3=1
    right, slipped = "\n".join(solution_lines(problem)), "\n".join(solution_lines(problem, 1, 2))
    (tmp_path / "sft.jsonl").write_text("".join(
        json.dumps({"prompt": problem.prompt_text, "response": r, "slip_step": s}) + "\n"
        for r, s in ((right, -1), (slipped, 1))))
    rows = sft_label_rows(tmp_path, build_tokenizer(), step_accuracy=0.5)
    assert [r["response"][a:b] for r in rows[:1] for a, b in zip(r["step_starts"], r["step_ends"])] == [
        "3+2=5", " *3\n5*3=1", "\nanswer 1"]
    assert rows[0]["q"] == [0.5, 1.0, 1.0] and rows[0]["prompt_value"] == 0.25
    assert rows[1]["q"] == [0.5, 0.0, 0.0] and rows[1]["first_pit"] == 1 and rows[1]["outcome"] == 0.0


def test_running_min_is_the_least_likely_step_so_far():
    from studies.arithmetic_critic import running_min

    assert running_min([-0.1, -2.0, -0.5, -3.0]) == [-0.1, -2.0, -2.0, -3.0]
    assert running_min([]) == []


def test_policy_signal_reads_the_log_probability_of_each_written_result(monkeypatch):
    """An oracle policy that puts its mass on the reference solution's next character: the running minimum of its
    log-probabilities of the written results separates right prefixes from wrong ones perfectly, and a probe of
    a hidden state that carries the first step's truth finds it."""
    from types import SimpleNamespace

    import verl_prm.apps.arithmetic.rollout as rollout
    from studies.arithmetic_critic import policy_signal
    from verl_prm.apps.arithmetic.model import build_tokenizer, render

    tokenizer = build_tokenizer()
    problem = Problem(3, (("+", 2), ("*", 3)), 7)  # 3+2=5, 5*3=1
    prompt = render(tokenizer, problem.prompt_text)
    right = "\n".join(solution_lines(problem))
    texts = [right, "\n".join(solution_lines(problem, 0, 6)), "\n".join(solution_lines(problem, 1, 2))] * 4
    monkeypatch.setattr(rollout, "sample", lambda *a, **k: SimpleNamespace(texts=texts, prompt_index=[0] * len(texts)))
    reference = tokenizer(prompt + right, add_special_tokens=False)["input_ids"]

    class Oracle:
        def __call__(self, input_ids, output_hidden_states=False):
            ids = input_ids[0].tolist()
            logits = torch.zeros(len(ids), tokenizer.vocab_size + 2)
            for t in range(len(ids) - 1):
                logits[t, reference[t + 1]] = 8.0
            # hidden state: 1 where the written token is the reference's (the first result's token included)
            hidden = torch.tensor([[float(i == r)] + [0.0] * 3 for i, r in zip(ids, reference)]).unsqueeze(0)
            return SimpleNamespace(logits=logits.unsqueeze(0), hidden_states=(hidden,))

    signal = policy_signal(Oracle(), tokenizer, [prompt], [problem], samples=1, max_new_tokens=32, seed=0)
    assert signal["policy_logprob_steps"] == 2 * len(texts)
    assert signal["policy_logprob_step_auroc"] == 1.0
    assert signal["policy_logprob_first_step_auroc"] == 1.0 and signal["probe_first_step_auroc"] == 1.0
    assert signal["first_steps"] == len(texts)


def test_result_targets_mark_each_written_result_with_the_result_of_its_operation():
    from verl_prm.apps.arithmetic.critic_init import result_targets
    from verl_prm.apps.arithmetic.model import build_tokenizer, render

    tokenizer = build_tokenizer()
    problem = Problem(3, (("+", 2), ("*", 3)), 7)  # 3+2=5, 5*3=1
    prompt = render(tokenizer, problem.prompt_text)
    slipped = "\n".join(solution_lines(problem, 0, 6))  # 3+2=6 *3 / 6*3=4 / answer 4
    targets = result_targets(tokenizer, prompt, slipped, 7)
    assert slipped.splitlines()[:2] == ["3+2=6 *3", "6*3=4"]
    # the last token of each written result (one token per character), the operation's result from the written
    # operand (6*3 = 18 = 4 mod 7: the second line is right given the first), and whether the written one slipped
    assert [tokenizer.decode([targets.input_ids[t]]) for t in targets.positions] == ["6", "4"]
    assert targets.positions == [len(prompt) + 4, len(prompt) + 13]
    assert targets.targets == [5, 4] and targets.slipped == [True, False]
    assert targets.prefix_right == [False, False]  # once a result slipped, no later prefix is right
    right = result_targets(tokenizer, prompt, "\n".join(solution_lines(problem)), 7)
    assert right.slipped == [False, False] and right.prefix_right == [True, True]
    # a line that computes right from a miscopied operand: no slip, but the prefix is wrong from there on
    miscopied = result_targets(tokenizer, prompt, "3+2=5 *3\n4*3=5\nanswer 5", 7)
    assert miscopied.slipped == [False, False] and miscopied.prefix_right == [True, False]


class _Interrupt(Exception):
    pass


def _tiny_policy(path):
    """(tokenizer, path) of an untrained one-layer policy saved at ``path``."""
    from verl_prm.apps.arithmetic.model import ModelConfig, build_model, build_tokenizer, save_policy

    tokenizer = build_tokenizer()
    return tokenizer, save_policy(build_model(tokenizer, ModelConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=64)), tokenizer, path)


def test_an_interrupted_critic_init_resumes_to_the_uninterrupted_result(tmp_path, assert_umask_modes):
    from safetensors.torch import load_file

    from verl_prm.apps.arithmetic.critic_init import CriticInitConfig, train_critic_init
    tokenizer, policy = _tiny_policy(tmp_path / "p")
    problem = Problem(3, (("+", 2), ("*", 3)), 7)
    prompts = [problem.prompt_text] * 8
    responses = ["\n".join(solution_lines(problem, 0, 6)), "\n".join(solution_lines(problem))] * 4
    config = CriticInitConfig(steps=4, batch_size=2, eval_fraction=0.5, eval_every=1, check_weight=1.0)
    whole = train_critic_init(policy, tmp_path / "whole", prompts, responses, 7, config, progress=False)

    def stop_at_step_2(record):
        if record["step"] == 2:
            raise _Interrupt

    with pytest.raises(_Interrupt):
        train_critic_init(policy, tmp_path / "resumed", prompts, responses, 7, config, progress=False,
                          log=stop_at_step_2)
    assert (tmp_path / "resumed" / "critic_init_state.pt").exists()
    steps = []
    resumed = train_critic_init(policy, tmp_path / "resumed", prompts, responses, 7, config, progress=False,
                                log=lambda record: steps.append(record["step"]))
    assert steps == [3, 4]  # only the steps after the saved state were trained again
    assert resumed["curve"] == whole["curve"]
    for name in ("model.safetensors", "critic_init_heads.safetensors"):
        want, got = load_file(tmp_path / "whole" / name), load_file(tmp_path / "resumed" / name)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert not (tmp_path / "resumed" / "critic_init_state.pt").exists()
    assert_umask_modes(tmp_path / "p")  # the policy (save_policy)
    assert_umask_modes(tmp_path / "resumed")
    # a state left by other settings is refused, naming the file
    with pytest.raises(_Interrupt):
        train_critic_init(policy, tmp_path / "other", prompts, responses, 7, config, progress=False,
                          log=stop_at_step_2)
    with pytest.raises(ValueError, match=r"critic_init_state.pt holds a critic_init training state made with other settings \(check_weight: 1.0 -> 0.5\)"):
        train_critic_init(policy, tmp_path / "other", prompts, responses, 7,
                          CriticInitConfig(steps=4, batch_size=2, eval_fraction=0.5, eval_every=1, check_weight=0.5),
                          progress=False)


def test_critic_init_needs_a_slipped_result_and_saves_a_causal_lm(tmp_path):
    from verl_prm.apps.arithmetic.critic_init import CriticInitConfig, train_critic_init
    tokenizer, policy = _tiny_policy(tmp_path / "p")
    problem = Problem(3, (("+", 2), ("*", 3)), 7)
    right = "\n".join(solution_lines(problem))
    with pytest.raises(ValueError, match="no solution with a slipped result"):
        train_critic_init(policy, tmp_path / "out", [problem.prompt_text] * 4, [right] * 4, 7,
                          CriticInitConfig(steps=1, eval_fraction=0.25), progress=False)
    slipped = "\n".join(solution_lines(problem, 0, 6))
    result = train_critic_init(policy, tmp_path / "out", [problem.prompt_text] * 8, [slipped, right] * 4, 7,
                               CriticInitConfig(steps=2, batch_size=2, eval_fraction=0.5, eval_every=1), progress=False)
    assert [r["step"] for r in result["curve"]] == [1, 2] and result["train_solutions"] == result["eval_solutions"] == 2
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=False)
    assert type(saved).__name__ == "Qwen2ForCausalLM" and (tmp_path / "out" / "tokenizer.json").exists()
    from safetensors.torch import load_file

    heads = load_file(tmp_path / "out" / "critic_init_heads.safetensors")  # result head over 7 residues, check head
    assert heads["heads.0.weight"].shape == (7, 16) and heads["heads.1.weight"].shape == (1, 16)
    # with the check target the solutions without a slip are used too, and the check's held-out AUROC is measured
    checked = train_critic_init(policy, tmp_path / "check", [problem.prompt_text] * 8, [slipped, right] * 4, 7,
                                CriticInitConfig(steps=1, batch_size=2, eval_fraction=0.5, check_weight=1.0),
                                progress=False)
    assert checked["train_solutions"] == checked["eval_solutions"] == 4 and 0 <= checked["eval/check_auroc"] <= 1
    # the check head read as a value head: its logits are the check head's on the init's backbone
    from transformers import AutoModelForTokenClassification

    from studies.arithmetic_critic import check_head_checkpoint

    converted = AutoModelForTokenClassification.from_pretrained(
        check_head_checkpoint(tmp_path / "check", tmp_path / "check_head"), trust_remote_code=False).eval()
    init = AutoModelForCausalLM.from_pretrained(tmp_path / "check", trust_remote_code=False).eval()
    heads = load_file(tmp_path / "check" / "critic_init_heads.safetensors")
    ids = torch.tensor([tokenizer(problem.prompt_text + slipped)["input_ids"]])
    with torch.no_grad():
        hidden = init.get_decoder()(input_ids=ids).last_hidden_state
        want = hidden @ heads["heads.1.weight"].T + heads["heads.1.bias"]
        assert torch.allclose(converted(input_ids=ids).logits, want, atol=1e-5)
    with pytest.raises(FileNotFoundError, match="no heads saved"):
        check_head_checkpoint(policy, tmp_path / "nothing")
    with pytest.raises(ValueError, match="check_weight"):
        CriticInitConfig(check_weight=float("inf"))
    with pytest.raises(ValueError, match="eval_fraction"):
        CriticInitConfig(eval_fraction=1.0)
    with pytest.raises(ValueError, match="lr"):
        CriticInitConfig(lr=float("nan"))


def _ols_slope(x, y):
    """The least-squares slope cov(x, y) / var(x), written out."""
    mx, my = sum(x) / len(x), sum(y) / len(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)


def test_size_statistics_compare_values_and_process_terms_with_the_exact_provers():
    """value_size.size_statistics on two rows worked by hand: the process term is A_h = BoK(v_h) - BoK(v_{h-1})
    (the PAV paper's Eq. 5 with the Best-of-K prover, BoK(v) = 1 - (1 - v)^K); a first pit is the first step whose
    exact value is 0 after a positive one."""
    import numpy as np

    from studies.arithmetic_value_size import size_statistics

    exact = [np.array([0.5, 0.25, 0.0, 0.0]), np.array([1.0, 1.0])]
    values = [np.array([0.4, 0.3, 0.1, 0.1]), np.array([0.8, 0.8])]
    stats = size_statistics(values, exact, best_of_k=1)
    # row 1: A = [-0.1, -0.2, 0], exact A = [-0.25, -0.25, 0]; the pit is step 2 (index 1); row 2: A = [0]
    assert stats["mse"] == pytest.approx((0.01 + 0.0025 + 0.01 + 0.01 + 0.04 + 0.04) / 6)
    assert stats["drop_at_first_pit"] == pytest.approx(0.3 - 0.1)
    assert stats["abs_adv_slipped"] == pytest.approx(0.2) and stats["first_pits"] == 1
    assert stats["abs_adv_right"] == pytest.approx((0.1 + 0.0) / 2)  # the steps whose exact value stays > 0
    assert stats["slope"] == pytest.approx(_ols_slope([0.5, 0.25, 0, 0, 1, 1], [0.4, 0.3, 0.1, 0.1, 0.8, 0.8]))
    assert stats["process_slope"] == pytest.approx(_ols_slope([-0.25, -0.25, 0, 0], [-0.1, -0.2, 0, 0]))
    assert stats["process_corr"] == pytest.approx(float(np.corrcoef([-0.1, -0.2, 0, 0], [-0.25, -0.25, 0, 0])[0, 1]))
    # Best-of-2 changes the process term, not the statistics of the values themselves
    bok = lambda v: 1 - (1 - v) ** 2  # noqa: E731
    k2 = size_statistics(values, exact, best_of_k=2)
    assert k2["abs_adv_slipped"] == pytest.approx(abs(bok(0.1) - bok(0.3)))
    assert k2["mse"] == stats["mse"]
    # the exact values against themselves: the right size
    same = size_statistics(exact, exact, best_of_k=4)
    assert (same["mse"], same["slope"], same["process_slope"], same["process_corr"]) == pytest.approx((0, 1, 1, 1))


@pytest.mark.parametrize("values,exact,message", [
    ([[0.1, 0.2]], [[0.1, 0.2, 0.3]], "row 0 has values of shape (2,) and exact (3,)"),
    ([[0.1, float("nan")]], [[0.1, 0.2]], "row 0 has a non-finite value"),
    ([[0.1, 0.2]], [], "1 rows of values but 0 of exact values"),
])
def test_size_statistics_refuse_rows_that_do_not_match(values, exact, message):
    from studies.arithmetic_value_size import size_statistics

    with pytest.raises(ValueError, match=re.escape(message)):
        size_statistics(values, exact, best_of_k=1)


def test_a_converged_logistic_head_recovers_the_probabilities_it_was_fitted_to():
    """value_size.fitted_head_predictor: soft targets that are sigmoid(2 x0 - x1 + 0.5) exactly are the maximum of
    the binary cross-entropy, so a converged fit reproduces them; non-finite targets are skipped, targets outside
    [0, 1] refused."""
    import numpy as np

    from studies.arithmetic_value_size import fitted_head_predictor

    rng = np.random.default_rng(0)
    rows = [rng.normal(size=(5, 3)) for _ in range(60)]
    targets = [1 / (1 + np.exp(-(2 * r[:, 0] - r[:, 1] + 0.5))) for r in rows]
    targets[0] = targets[0].copy()
    targets[0][2] = np.nan
    predict = fitted_head_predictor(rows, targets)
    truth = [1 / (1 + np.exp(-(2 * r[:, 0] - r[:, 1] + 0.5))) for r in rows]
    for got, want in zip(predict(rows), truth):
        np.testing.assert_allclose(got, want, atol=1e-4)
    with pytest.raises(ValueError, match=r"targets must be in \[0, 1\]"):
        fitted_head_predictor(rows, [t * 2 for t in truth])
    with pytest.raises(ValueError, match="no finite target"):
        fitted_head_predictor(rows[:1], [np.full(5, np.nan)])
