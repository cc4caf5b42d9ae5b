"""First-error evaluation in the ProcessBench format (verl_prm.evaluation.processbench): the metric against
hand-computed values and a reference loop, the threshold sweep, the PRM800K label derivation, and the CLI with
stored scores and with a tiny random critic."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForTokenClassification

from verl_prm.evaluation.cli import main
from verl_prm.evaluation.processbench import (
    FirstErrorSample,
    first_error_f1,
    holdout_split,
    predicted_first_error,
    read_first_error_samples,
    step_scores_of,
    sweep_thresholds,
)


# Five samples, threshold 0.5 (hand-computed):
#   s0: first score < 0.5 at h=1, label 1  -> right (erroneous)
#   s1: none below (the 0.0 is padding)  -> -1, label -1 -> right (correct)
#   s2: h=0, label 1                      -> wrong (erroneous)
#   s3: h=2, label -1                     -> wrong (correct)
#   s4: h=2, label 2                      -> right (erroneous)
# acc_err = 2/3, acc_cor = 1/2, F1 = 2 * (2/3) * (1/2) / (2/3 + 1/2) = 4/7.
HAND_SCORES = [[0.9, 0.2, 0.8], [0.9, 0.9], [0.1, 0.5, 0.5], [0.7, 0.6, 0.4], [0.6, 0.6, 0.3]]
HAND_LABELS = [1, -1, 1, -1, 2]


def _padded(rows):
    width = max(len(r) for r in rows)
    table = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
    return table, torch.tensor([len(r) for r in rows])


def test_f1_matches_the_hand_computed_case():
    scores, num_steps = _padded(HAND_SCORES)
    predicted = predicted_first_error(scores, num_steps, 0.5)
    assert predicted.tolist() == [1, -1, 0, 2, 2]
    metrics = first_error_f1(predicted, torch.tensor(HAND_LABELS))
    assert metrics["accuracy_erroneous"] == pytest.approx(2 / 3)
    assert metrics["accuracy_correct"] == pytest.approx(1 / 2)
    assert metrics["f1"] == pytest.approx(4 / 7)
    assert (metrics["num_erroneous"], metrics["num_correct"]) == (3, 2)
    # both accuracies 0 -> F1 0; an empty class -> NaN
    assert first_error_f1(torch.tensor([0, 0]), torch.tensor([1, -1]))["f1"] == 0.0
    assert math.isnan(first_error_f1(torch.tensor([1]), torch.tensor([1]))["f1"])


def test_prediction_equals_reference_loop_for_many_thresholds():
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(40, 7, generator=generator, dtype=torch.float64)
    num_steps = torch.randint(0, 8, (40,), generator=generator)
    thresholds = torch.linspace(0, 1, 11, dtype=torch.float64)
    batched = predicted_first_error(scores, num_steps, thresholds)
    for k, t in enumerate(thresholds.tolist()):
        for i in range(40):
            expected = next((h for h in range(int(num_steps[i])) if float(scores[i, h]) < t), -1)
            assert int(batched[k, i]) == expected


def test_sweep_picks_the_best_threshold_and_split_is_a_partition():
    scores, num_steps = _padded(HAND_SCORES)
    grid = torch.tensor([0.05, 0.35, 0.5, 0.65, 0.95], dtype=torch.float64)
    best, table = sweep_thresholds(scores, num_steps, torch.tensor(HAND_LABELS), grid)
    f1s = [m["f1"] for m in table]
    assert best == float(grid[f1s.index(max(f1s))])
    # 0.35: predictions [1, -1, 0, -1, 2] -> acc_err 2/3, acc_cor 1 -> F1 0.8 (the best of the grid)
    assert best == 0.35 and max(f1s) == pytest.approx(0.8)
    tune, held = holdout_split(10, 0.3, seed=1)
    assert len(tune) == 3 and sorted(tune.tolist() + held.tolist()) == list(range(10))
    # stratified: both parts hold both classes, each class split by the fraction
    strata = torch.tensor([True, True, False, False, False, False, True, False, False, False])
    tune, held = holdout_split(10, 0.5, seed=2, strata=strata)
    assert sorted(tune.tolist() + held.tolist()) == list(range(10))
    assert int(strata[tune].sum()) in (1, 2) and int(strata[held].sum()) in (1, 2)
    assert int((~strata[tune]).sum()) + int((~strata[held]).sum()) == 7 and int((~strata[tune]).sum()) in (3, 4)


def test_progress_scores_use_the_prompt_value():
    prompt = torch.tensor([0.5], dtype=torch.float64)
    values = torch.tensor([[0.6, 0.2, 0.9]], dtype=torch.float64)
    progress = step_scores_of(prompt, values, torch.tensor([3]), "progress")
    assert torch.allclose(progress, torch.tensor([[0.1, -0.4, 0.7]], dtype=torch.float64))
    # BoK with K = 2 before the difference: 1 - 0.5^2 = 0.75, 1 - 0.4^2 = 0.84
    bok = step_scores_of(prompt, values, torch.tensor([3]), "progress", 2)
    assert float(bok[0, 0]) == pytest.approx(0.84 - 0.75)


def test_prm800k_first_error_labels(repo_data):
    samples = read_first_error_samples(repo_data / "prm800k_samples.jsonl")
    assert [s.label for s in samples] == [1, 6, -1, -1, 7, -1]
    assert [len(s.steps) for s in samples] == [2, 7, 5, 7, 8, 12]
    # row 0: all five completions of step 1 were rated -1 (a human rewrote it): the first is the error
    assert samples[0].steps[1] == "The first equation is 3p + e = 124, and the second equation is 5p + e = 182."
    # row 1: the neutral (0) step 1 is acceptable; the pre-generated step 6 rated -1 is the first error
    assert samples[1].meta["finish_reason"] == "found_error"
    with pytest.raises(ValueError, match="label 5 is not -1 or a step index"):
        FirstErrorSample("x", "p", ["a"], 5)


def test_cli_with_stored_scores_at_a_fixed_threshold(tmp_path, capsys):
    rows = tmp_path / "bench.jsonl"
    with open(rows, "w") as f:
        for i, (scores, label) in enumerate(zip(HAND_SCORES, HAND_LABELS)):
            f.write(json.dumps(dict(id=f"s{i}", problem="p", steps=[f"step {h}" for h in range(len(scores))],
                                    label=label, prm_scores=scores)) + "\n")
    out = tmp_path / "pred.jsonl"
    assert main(["--input", str(rows), "--scores-field", "prm_scores", "--threshold", "0.5", "--output", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["f1"] == pytest.approx(4 / 7) and report["tuned"] is False
    assert [json.loads(line)["predicted"] for line in out.read_text().splitlines()] == [1, -1, 0, 2, 2]


def test_cli_with_a_tiny_critic_on_prm800k_rows(tmp_path, bpe_small, repo_data, capsys):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(bpe_small), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=False, num_labels=1)
    Qwen2ForTokenClassification(config).eval().save_pretrained(tmp_path / "critic")
    bpe_small.save_pretrained(tmp_path / "critic")
    out = tmp_path / "pred.jsonl"
    for score in ("values", "progress"):
        assert main(["--input", str(repo_data / "prm800k_samples.jsonl"), "--critic", str(tmp_path / "critic"),
                     "--device", "cpu", "--score", score, "--tune-fraction", "0.5", "--output", str(out)]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["tuned"] and report["tune_samples"] + report["eval_samples"] == 6 and report["eval_samples"] >= 2
        assert 0.0 <= report["tune_f1"] <= 1.0
        predictions = [json.loads(line) for line in out.read_text().splitlines()]
        assert [len(p["scores"]) for p in predictions] == [2, 7, 5, 7, 8, 12]  # one value per labelled step
        if score == "values":
            assert all(0.0 <= v <= 1.0 for p in predictions for v in p["scores"])
