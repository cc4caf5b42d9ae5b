"""PAV training (verl_prm.training): metrics, loss, schedule, sampling, encoding, and a tiny critic trained on
Monte-Carlo labels of a scripted task whose exact values are known; resume; the label -> train -> score CLI."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from verl_prm.labeling.format import read_labels
from verl_prm.labeling.inputs import PromptItem
from verl_prm.labeling.monte_carlo import LabelSettings, MonteCarloLabeler
from verl_prm.labeling.scoring import OutcomeScorer
from verl_prm.labeling.closed_form_task import ScriptedStepGenerator, ScriptedStepTask, scripted_step_score
from verl_prm.labeling.store import ShardStore
from verl_prm.steps import encode_with_step_ends, step_char_spans
from verl_prm.training.data import (
    EncodedRollout,
    class_balanced_weights,
    collate,
    encode_labels,
    prompt_value_carriers,
    sample_batch_indices,
    split_by_prompt,
)
from verl_prm.training.losses import gather_step_logits, soft_label_bce, warmup_cosine_factor
from verl_prm.training.metrics import auroc, calibration_slope, expected_calibration_error, mse, value_metrics
from verl_prm.training.config import TrainConfig
from verl_prm.training.resume import latest_checkpoint
from verl_prm.training.trainer import train

P_PROVER, P_POLICY, NUM_STEPS = 0.7, 0.75, 4



# ------------------------------------------------------------------------------------------------ metrics


def test_auroc_hand_computed_with_ties():
    # positives score 0.35, 0.8, 0.4; negatives 0.1, 0.4. Pairs won: (0.35>0.1), (0.8>0.1), (0.8>0.4),
    # (0.4>0.1) = 4, the tie (0.4, 0.4) counts 1/2, (0.35<0.4) = 0: AUROC = 4.5 / 6.
    assert auroc([0.1, 0.4, 0.35, 0.8, 0.4], [0, 0, 1, 1, 1]) == pytest.approx(0.75)
    assert auroc([0.5, 0.5, 0.5], [1, 0, 1]) == pytest.approx(0.5)
    assert auroc([0.2, 0.9], [0, 1]) == 1.0 and auroc([0.9, 0.2], [0, 1]) == 0.0
    assert math.isnan(auroc([0.1, 0.2], [1, 1]))
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 40) / 4.0  # many ties
    labels = rng.random(40) < 0.4
    pairs = [(p, n) for p, n in itertools.product(scores[labels], scores[~labels])]
    brute = np.mean([1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs])
    assert auroc(scores, labels) == pytest.approx(brute, abs=1e-12)


def test_ece_and_mse_hand_computed():
    # 2 bins: {0.1, 0.2} vs targets {0, 1}: |0.15 - 0.5| = 0.35, weight 1/2; {0.9, 0.6} vs {1, 0.5}: means
    # 0.75 and 0.75 -> 0.175. 4 bins: the upper bin splits into {0.6} vs 0.5 and {0.9} vs 1, 0.1 x 1/4 each.
    assert expected_calibration_error([0.1, 0.2, 0.9, 0.6], [0, 1, 1, 0.5], num_bins=2) == pytest.approx(0.175)
    assert expected_calibration_error([0.1, 0.2, 0.9, 0.6], [0, 1, 1, 0.5], num_bins=4) == pytest.approx(0.225)
    assert expected_calibration_error([1.0, 1.0], [1.0, 1.0], num_bins=10) == 0.0
    assert mse([0.0, 1.0], [0.5, 0.5]) == 0.25
    metrics = value_metrics([0.2, 0.8], [0.0, 1.0])
    assert metrics["auroc"] == 1.0 and metrics["mse_constant"] == 0.25


def test_calibration_slope_is_the_weighted_least_squares_slope():
    rng = np.random.default_rng(2)
    p, w = rng.random(30), rng.random(30) + 0.1
    q = 0.2 + 3.0 * p  # labels rising 3x as fast as the predictions: slope 3 exactly
    assert calibration_slope(p, q, w) == pytest.approx(3.0, abs=1e-12)
    noisy = q + rng.normal(0, 0.1, 30)
    # the normal equations of min_{a, b} sum w (q - a - b p)^2 by a direct solve
    design = np.stack([np.ones(30), p], 1) * np.sqrt(w)[:, None]
    slope = np.linalg.lstsq(design, noisy * np.sqrt(w), rcond=None)[0][1]
    assert calibration_slope(p, noisy, w) == pytest.approx(slope, abs=1e-10)
    assert math.isnan(calibration_slope([0.4, 0.4], [0.0, 1.0])) and math.isnan(calibration_slope([], []))
    with pytest.raises(ValueError, match="2 predictions, 3 targets"):
        calibration_slope([0.1, 0.2], [0.0, 1.0, 1.0])


# ------------------------------------------------------------------------------------------------ loss, schedule


def test_soft_label_bce_matches_a_loop_and_is_minimised_at_q():
    logits = torch.tensor([[0.3, -1.2, 2.0], [0.5, 0.0, 9.0]])
    targets = torch.tensor([[0.25, 0.0, 1.0], [0.6, 0.5, 0.5]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    expected, count = 0.0, 0
    for b in range(2):
        for s in range(3):
            if mask[b, s]:
                p, q = 1 / (1 + math.exp(-logits[b, s].item())), targets[b, s].item()
                expected -= q * math.log(p) + (1 - q) * math.log(1 - p)
                count += 1
    assert soft_label_bce(logits, targets, mask).item() == pytest.approx(expected / count, rel=1e-6)
    z = torch.logit(torch.tensor([0.3, 0.85])).requires_grad_()
    soft_label_bce(z[None], torch.tensor([[0.3, 0.85]]), torch.ones(1, 2, dtype=torch.bool)).backward()
    assert torch.allclose(z.grad, torch.zeros(2), atol=1e-6)
    token_logits = torch.arange(12.0).view(2, 6, 1)
    assert gather_step_logits(token_logits, torch.tensor([[5, 0], [2, 2]])).tolist() == [[5.0, 0.0], [8.0, 8.0]]


def test_warmup_cosine_factor():
    assert [warmup_cosine_factor(t, 4, 20) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert warmup_cosine_factor(4, 4, 20) == 1.0
    assert warmup_cosine_factor(12, 4, 20) == pytest.approx(0.5)  # half way through the decay
    assert warmup_cosine_factor(20, 4, 20, min_ratio=0.1) == pytest.approx(0.1)
    assert warmup_cosine_factor(19, 4, 20, min_ratio=0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 15 / 16)))


# ------------------------------------------------------------------------------------------------ sampling, data


def _expected_positive_share(examples, weights):
    positive = sum(w * sum(t >= 0.5 for t in e.targets) for e, w in zip(examples, weights))
    total = sum(w * len(e.targets) for e, w in zip(examples, weights))
    return positive / total


def test_class_balanced_weights_balance_the_step_classes():
    # 1 rollout of 5 positive steps, 6 rollouts of 1-3 negative steps: 5 vs 12 steps before balancing
    examples = [EncodedRollout([1], [0] * 5, [0.9] * 5)] + [
        EncodedRollout([1], [0] * n, [0.1] * n) for n in (1, 2, 3, 1, 2, 3)
    ]
    uniform = np.full(len(examples), 1 / len(examples))
    assert _expected_positive_share(examples, uniform) == pytest.approx(5 / 17)
    weights = class_balanced_weights(examples)
    assert weights.sum() == pytest.approx(1.0)
    assert _expected_positive_share(examples, weights) == pytest.approx(0.5)  # exact for one-class rollouts
    mixed = examples + [EncodedRollout([1], [0, 0], [0.2, 0.7])]
    assert abs(_expected_positive_share(mixed, class_balanced_weights(mixed)) - 0.5) < 0.05
    draws = sample_batch_indices(weights, 20000, step=3, seed=1)
    assert np.array_equal(draws, sample_batch_indices(weights, 20000, step=3, seed=1))
    assert not np.array_equal(draws[:50], sample_batch_indices(weights, 50, step=4, seed=1))
    assert np.bincount(draws, minlength=7)[0] / 20000 == pytest.approx(weights[0], abs=0.01)


def _label_rows(task: ScriptedStepTask, prompts: range, n_cov: int, n_mc: int, seed: int = 0) -> list[dict]:
    items = [PromptItem(i, task.prompt(i), str(task.num_steps), "scripted") for i in prompts]
    labeler = MonteCarloLabeler(ScriptedStepGenerator(P_POLICY), ScriptedStepGenerator(P_PROVER),
                                OutcomeScorer(scripted_step_score), LabelSettings(n_cov=n_cov, n_mc=n_mc, seed=seed))
    return labeler.label(items, [item.prompt for item in items])


def test_encode_labels_positions_targets_and_truncation(bpe_small):
    task = ScriptedStepTask(num_steps=3)
    frame = pd.DataFrame(_label_rows(task, range(3), n_cov=2, n_mc=4))
    frame.at[0, "q"] = [math.nan] + list(frame.at[0, "q"][1:])  # an unlabelled step is skipped
    examples, stats = encode_labels(frame, bpe_small)
    assert len(examples) == 6 and stats.unlabelled_steps == 1 and stats.steps == 18
    carriers = (frame["rollout_index"] == 0).tolist()  # a prompt's value is labelled on its first rollout only
    assert (stats.prompt_values, stats.repeated_prompt_values) == (3, 3)
    for e, row, carries in zip(examples, frame.itertuples(), carriers):
        encoded = encode_with_step_ends(bpe_small, row.prompt, row.response, list(zip(row.step_starts, row.step_ends)))
        labelled = [end for end, q in zip(encoded.step_ends, row.q) if not math.isnan(q)]
        assert e.input_ids == list(encoded.input_ids)
        assert e.positions == [encoded.prompt_end] * carries + labelled
        assert e.targets == [row.prompt_value] * carries + [q for q in row.q if not math.isnan(q)]
    limit = examples[1].positions[1] + 1  # keeps two steps of rollout 1 (no prompt value), cuts its last step
    short, stats = encode_labels(frame, bpe_small, max_length=limit, use_prompt_value=False)
    assert stats.truncated_rollouts == sum(len(e.input_ids) > limit for e in examples) >= 1
    assert "not trained on" in stats.notes[0] and stats.prompt_values == 0
    dropped = 0
    for cut, full, carries in zip(short, examples, carriers):
        steps = full.positions[carries:]  # no prompt value here
        assert cut.input_ids == full.input_ids[:limit]
        assert cut.positions == [p for p in steps if p < limit]
        dropped += sum(p >= limit for p in steps)
    assert stats.steps_beyond_max_length == dropped >= 1
    bok, _ = encode_labels(frame.iloc[1:2], bpe_small, best_of_k=2, use_prompt_value=False)
    q, s, n = (np.asarray(frame.at[1, c], dtype=float) for c in ("q", "n_success", "n_mc"))
    expected = np.where(n > 0, 1 - (n - s) * (n - s - 1) / np.maximum(n * (n - 1), 1), 1 - (1 - q) ** 2)
    assert bok[0].targets == pytest.approx(expected.tolist())
    batch = collate(examples[:2], pad_token_id=bpe_small.pad_token_id)
    assert batch["input_ids"].shape[0] == 2 and batch["step_mask"].sum().item() == sum(len(e.positions) for e in examples[:2])


def _four_rollouts_of_one_prompt() -> pd.DataFrame:
    """A label shard's rows of one prompt labelled with 4 rollouts: each row repeats the prompt's value."""
    frame = pd.DataFrame(_label_rows(ScriptedStepTask(num_steps=3), range(1), n_cov=4, n_mc=4, seed=2))
    assert len(frame) == 4 and frame["prompt_value"].nunique() == 1 and frame["prompt_n_mc"].iloc[0] == 4
    return frame


def _labels_once(frame: pd.DataFrame, tokenizer) -> tuple[list[int], list[int], list[float]]:
    """(row, token position, label) of every label of ``frame`` (rows of one prompt), the prompt value counted
    once: the position of the prompt's last token (its first row's), then each row's labelled step ends."""
    labels = []
    for b, row in enumerate(frame.itertuples()):
        encoded = encode_with_step_ends(tokenizer, row.prompt, row.response, list(zip(row.step_starts, row.step_ends)))
        if b == 0:
            labels.append((b, encoded.prompt_end, row.prompt_value))
        labels += [(b, end, q) for end, q in zip(encoded.step_ends, row.q) if not math.isnan(q)]
    return labels


def test_a_prompt_value_repeated_on_four_rollouts_weighs_as_one_label(bpe_small):
    """4 rollouts of one prompt repeat V(prompt) in the shard; the training loss holds it once: the loss of a
    batch of the 4 rollouts is the mean binary cross-entropy over the prompt value and the steps' labels."""
    frame = _four_rollouts_of_one_prompt()
    examples, stats = encode_labels(frame, bpe_small)
    assert (stats.prompt_values, stats.repeated_prompt_values) == (1, 3)
    batch = collate(examples, pad_token_id=bpe_small.pad_token_id)
    logit = 0.4
    loss = soft_label_bce(gather_step_logits(torch.full(batch["input_ids"].shape, logit), batch["positions"]),
                          batch["targets"], batch["step_mask"]).item()

    def bce(y: float) -> float:
        p = 1.0 / (1.0 + math.exp(-logit))
        return -(y * math.log(p) + (1.0 - y) * math.log(1.0 - p))

    labels = [y for _, _, y in _labels_once(frame, bpe_small)]
    steps = labels[1:]
    assert loss == pytest.approx(np.mean([bce(y) for y in labels]), rel=1e-6)
    per_rollout = np.mean([bce(labels[0])] * 4 + [bce(y) for y in steps])  # V counted once per rollout
    assert abs(per_rollout - np.mean([bce(y) for y in labels])) > 1e-3  # the data tell the two apart


class _TokenValues(torch.nn.Module):
    """A stand-in critic whose logit at a token is (token id mod 11 - 5) / 3: every position's value is known."""

    def forward(self, input_ids, attention_mask):
        return type("Output", (), {"logits": ((input_ids % 11).float() - 5.0)[..., None] / 3.0})()


def test_held_out_metrics_count_a_repeated_prompt_value_once(bpe_small):
    """The held-out evaluation of the trainer (``evaluate_examples`` then ``value_metrics``) over 4 rollouts of one
    prompt counts V(prompt) once: its MSE is the mean over the prompt value and the steps' labels."""
    from verl_prm.training.evaluation import evaluate_examples

    frame = _four_rollouts_of_one_prompt()
    examples, _ = encode_labels(frame, bpe_small)
    predictions, targets = evaluate_examples(_TokenValues(), examples, batch_size=3,
                                             pad_token_id=bpe_small.pad_token_id, device="cpu")
    metrics = value_metrics(predictions, targets)
    labels = _labels_once(frame, bpe_small)
    ids = [list(e.input_ids) for e in examples]
    value = [1.0 / (1.0 + math.exp(-((ids[b][t] % 11) - 5.0) / 3.0)) for b, t, _ in labels]
    assert metrics["num_steps"] == len(labels) == 1 + sum(len(q) for q in frame["q"])
    assert metrics["mse"] == pytest.approx(np.mean([(v - y) ** 2 for v, (_, _, y) in zip(value, labels)]), rel=1e-6)


def test_the_same_prompt_value_is_one_shard_one_prompt_index_one_prompt_text():
    rows = pd.DataFrame({"prompt_index": [0, 0, 0, 1, 1, 0], "rollout_index": [0, 1, 2, 0, 1, 3],
                         "prompt": ["a", "a", "b", "a", "a", "a"], "prompt_value": [0.5, 0.5, 0.25, 1.0, 1.0, 0.5],
                         "prompt_n_success": [2, 2, 1, 4, 4, 2], "prompt_n_mc": [4, 4, 4, 4, 4, 4]})
    # (0, "a") twice, then (0, "b"), (1, "a") and (0, "a") again, non-adjacent: three prompt values
    assert prompt_value_carriers(rows).tolist() == [True, False, True, True, False, False]
    two_shards = rows.assign(shard=["s1", "s1", "s1", "s1", "s1", "s2"], shard_row=[0, 1, 2, 3, 4, 0])
    assert prompt_value_carriers(two_shards).tolist() == [True, False, True, True, False, True]
    nan = rows.assign(prompt_value=math.nan, prompt_n_success=0, prompt_n_mc=0)  # not computed: the same on each row
    assert prompt_value_carriers(nan).tolist() == [True, False, True, True, False, False]
    edited = two_shards.copy()
    edited.loc[1, ["prompt_value", "prompt_n_success"]] = [0.75, 3]
    with pytest.raises(ValueError, match=r"label shard s1 row 1 \(prompt_index=0, rollout_index=1\) has the prompt "
                                         r"of label shard s1 row 0 .* but another prompt value .*0\.75.* vs .*0\.5"):
        prompt_value_carriers(edited)
    assert prompt_value_carriers(rows.iloc[:0]).tolist() == []


def test_split_by_prompt_keeps_rollouts_of_a_prompt_together():
    frame = pd.DataFrame({"prompt": [f"p{i // 4}" for i in range(400)], "x": range(400)})
    train_part, eval_part = split_by_prompt(frame, 0.25, seed=3)
    assert not set(train_part["prompt"]) & set(eval_part["prompt"])
    assert len(train_part) + len(eval_part) == 400 and 10 <= eval_part["prompt"].nunique() <= 40
    again = split_by_prompt(frame.sample(frac=1.0, random_state=0), 0.25, seed=3)[1]
    assert set(again["prompt"]) == set(eval_part["prompt"])


# ------------------------------------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def critic_setup(tmp_path_factory, bpe_small):
    """MC labels of the scripted task (64 prompts x 4 rollouts, n_mc = 16), the tokenizer, a tiny config."""
    root = tmp_path_factory.mktemp("pav")
    bpe_small.save_pretrained(root / "tokenizer")
    config = dict(model_type="qwen2", vocab_size=len(bpe_small), hidden_size=48, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    (root / "config.json").write_text(json.dumps(config))
    task = ScriptedStepTask(num_steps=NUM_STEPS)
    rows = _label_rows(task, range(64), n_cov=4, n_mc=16)
    ShardStore(root / "labels").write_shard(rows)
    return root, task, rows


def _config(root: Path, output: str, **overrides) -> TrainConfig:
    settings = dict(labels=[str(root / "labels")], output_dir=str(root / output), init_config=str(root / "config.json"),
                    tokenizer=str(root / "tokenizer"), eval_fraction=0.2, batch_size=16, max_steps=80, lr=4e-3,
                    warmup_steps=8, max_length=256, progress=False, log_every=20)
    settings.update(overrides)
    return TrainConfig(**settings)


def test_trained_critic_beats_a_constant_on_exact_values(critic_setup):
    """Trained on Monte-Carlo labels (n_mc = 16), the critic's values on unseen prompts approach the exact Q."""
    from verl_prm.critic import ProverCritic

    root, task, rows = critic_setup
    config = _config(root, "run")
    summary = train(config)
    assert summary["eval_rollouts"] > 0 and summary["metrics"]["eval/num_steps"] > 0
    _, held_out = split_by_prompt(read_labels(root / "labels"), config.held_out_fraction, config.seed)
    # each held-out prompt's value counts once, not once per rollout (4 here)
    assert summary["metrics"]["eval/num_steps"] == held_out["prompt"].nunique() + sum(map(len, held_out["q"]))
    critic = ProverCritic.from_pretrained(summary["checkpoint"], format="value_head", device="cpu")
    seeds = ScriptedStepGenerator(P_POLICY).generate([task.prompt(i) for i in range(1000, 1030)], 4, list(range(30)))
    prompts = [task.prompt(1000 + i) for i, samples in enumerate(seeds) for _ in samples]
    responses = [sample.text for samples in seeds for sample in samples]
    scores = critic.score_texts(prompts, responses, delimiter="\n\n")
    predicted, exact = [], []
    for b, response in enumerate(responses):
        ends = [end for _, end in step_char_spans(response, "\n\n")]
        predicted += scores.step_values[b, : len(ends)].tolist() + [float(scores.prompt_values[b])]
        exact += task.exact_values(response, ends, P_PROVER) + [P_PROVER**NUM_STEPS]
    predicted, exact = np.array(predicted), np.array(exact)
    constant = np.mean([q for row in rows for q in row["q"]])  # the best constant fitted on the training labels
    critic_mse, constant_mse = mse(predicted, exact), mse(np.full_like(exact, constant), exact)
    held_out = summary["metrics"]
    print(f"\nPAV on the scripted task: MSE vs exact Q {critic_mse:.4f} (constant {constant_mse:.4f}); held-out MC "
          f"labels: MSE {held_out['eval/mse']:.4f} AUROC {held_out['eval/auroc']:.3f} ECE {held_out['eval/ece']:.3f}")
    assert critic_mse < 0.4 * constant_mse
    assert auroc(predicted, exact >= 0.5) > 0.85 and held_out["eval/auroc"] > 0.8
    assert held_out["eval/mse"] < held_out["eval/mse_constant"]


class Crash(RuntimeError):
    """Raised by ``crash_at_three``: the run stops as a crash would, after step 3's record."""


def crash_at_three(step, record):
    if step == 3:
        raise Crash


def test_interrupted_training_resumes_to_the_same_weights(critic_setup):
    root, _, _ = critic_setup
    settings = dict(max_steps=6, save_every=2, keep_checkpoints=5, log_every=1, eval_every=3, warmup_steps=2)
    reference = train(_config(root, "straight", **settings))

    with pytest.raises(Crash):
        train(_config(root, "crashed", **settings), on_step=crash_at_three)
    assert latest_checkpoint(root / "crashed").name == "checkpoint-0000002"
    with pytest.raises(ValueError, match="lr: 0.004 -> 0.001"):
        train(_config(root, "crashed", **dict(settings, lr=1e-3)))
    resumed = train(_config(root, "crashed", **settings))
    assert resumed["start_step"] == 2
    want = load_file(Path(reference["checkpoint"]) / "model.safetensors")
    got = load_file(Path(resumed["checkpoint"]) / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    want_state = torch.load(Path(reference["checkpoint"]) / "training_state.pt", weights_only=False)
    got_state = torch.load(Path(resumed["checkpoint"]) / "training_state.pt", weights_only=False)
    for a, b in zip(want_state["optimizer"]["state"].values(), got_state["optimizer"]["state"].values()):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]) and torch.equal(a["step"], b["step"])
    log = [json.loads(line) for line in (root / "crashed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3, 4, 5, 6]  # no step lost or logged twice
    assert [r["step"] for r in log if "eval/mse" in r] == [3, 6]
    assert resumed["metrics"] == reference["metrics"]


def test_runs_with_other_mixed_precisions_train_in_one_process(critic_setup):
    """accelerate's process-wide AcceleratorState refuses a second Accelerator with another mixed precision; two
    train() calls in one process (a study training critic variants) with "no" and then "bf16" both run."""
    root, _, _ = critic_setup
    first = train(_config(root, "precision_no", max_steps=1, warmup_steps=1, mixed_precision="no"))
    second = train(_config(root, "precision_bf16", max_steps=1, warmup_steps=1, mixed_precision="bf16"))
    assert first["checkpoint"] and second["checkpoint"]


def test_freeze_backbone_trains_only_the_value_head(critic_setup):
    """--freeze-backbone: every backbone tensor keeps the --init weights bit for bit; the head moves."""
    root, _, _ = critic_setup
    base = train(_config(root, "freeze_init", max_steps=2, warmup_steps=1))
    frozen = train(_config(root, "freeze_run", init=base["checkpoint"], init_config=None, tokenizer=None, max_steps=30,
                           warmup_steps=2, freeze_backbone=True))
    before = load_file(Path(base["checkpoint"]) / "model.safetensors")
    after = load_file(Path(frozen["checkpoint"]) / "model.safetensors")
    assert before.keys() == after.keys()
    head = [k for k in before if k.startswith("score.")]
    assert head and all(torch.equal(before[k], after[k]) for k in before if k not in head)
    assert all(not torch.equal(before[k], after[k]) for k in head)
    with pytest.raises(ValueError, match="freeze_backbone: True -> False"):
        train(_config(root, "freeze_run", init=base["checkpoint"], init_config=None, tokenizer=None, max_steps=40,
                      warmup_steps=2))


def _head_loss_and_gradient(checkpoint: Path, root: Path, seed: int = 0):
    """The training loss that --freeze-backbone minimises, computed here from the checkpoint's model rollout by
    rollout (soft_label_bce per labelled step, each rollout weighted by its class-balanced sampling weight, the
    training split of split_by_prompt), and its gradient with respect to the value head's parameters."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    model = AutoModelForTokenClassification.from_pretrained(checkpoint, trust_remote_code=False).double()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=False)
    train_frame, _ = split_by_prompt(read_labels([str(root / "labels")]), 0.2, seed)
    examples, _ = encode_labels(train_frame, tokenizer, max_length=256)
    weights = class_balanced_weights(examples)
    total, count = 0.0, 0.0
    for example, weight in zip(examples, weights):
        logits = model(input_ids=torch.tensor([example.input_ids])).logits[0, :, 0]
        for position, target in zip(example.positions, example.targets):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits[position], torch.tensor(float(target),
                                                                        dtype=torch.float64))
            total = total + weight * loss
            count += weight
    loss = total / count
    gradient = torch.autograd.grad(loss, [model.score.weight, model.score.bias])
    return float(loss.detach()), max(float(g.abs().max()) for g in gradient)


def test_head_fit_newton_sets_the_head_at_the_optimum_of_the_frozen_features(critic_setup):
    """--head-fit newton: the backbone is untouched, the head's gradient of the (independently computed) training
    loss vanishes, its loss is below what Adam's sampled steps reach on the same features, a rerun does not
    refit, and it is refused without --freeze-backbone or with AdamW's weight decay."""
    root, _, _ = critic_setup
    base = train(_config(root, "newton_init", max_steps=40, warmup_steps=4))
    frozen = dict(init=base["checkpoint"], init_config=None, tokenizer=None, freeze_backbone=True)
    adam = train(_config(root, "newton_adam", max_steps=60, warmup_steps=2, **frozen))
    fitted = train(_config(root, "newton_run", max_steps=200, head_fit="newton", **frozen))
    before = load_file(Path(base["checkpoint"]) / "model.safetensors")
    after = load_file(Path(fitted["checkpoint"]) / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before if not k.startswith("score."))
    log = [json.loads(line) for line in (root / "newton_run" / "metrics.jsonl").read_text().splitlines()]
    fit_record = next(r for r in log if r.get("head_fit") == "newton")
    assert fit_record["head_fit_converged"] and fit_record["step"] == 200
    newton_loss, newton_gradient = _head_loss_and_gradient(Path(fitted["checkpoint"]), root)
    adam_loss, adam_gradient = _head_loss_and_gradient(Path(adam["checkpoint"]), root)
    assert newton_gradient < 1e-3 < adam_gradient
    assert newton_loss < adam_loss
    assert newton_loss == pytest.approx(fit_record["loss"], rel=1e-4)  # float32 features vs the float64 model here
    assert "eval/mse" in fitted["metrics"]
    rerun = train(_config(root, "newton_run", max_steps=200, head_fit="newton", **frozen))
    assert rerun["start_step"] == 200 and rerun["metrics"] == fitted["metrics"]
    assert sum(r.get("head_fit") == "newton" for r in
               map(json.loads, (root / "newton_run" / "metrics.jsonl").read_text().splitlines())) == 1
    with pytest.raises(ValueError, match=re.escape("head_fit newton (--head-fit newton) fits the value head on frozen "
                                                   "features: it needs --freeze-backbone")):
        _config(root, "refused", head_fit="newton", init=base["checkpoint"], init_config=None, tokenizer=None)
    with pytest.raises(ValueError, match=re.escape("weight_decay (--weight-decay 0.01) is AdamW's")):
        _config(root, "refused", head_fit="newton", weight_decay=0.01, **frozen)
    with pytest.raises(ValueError, match=re.escape("head_fit (--head-fit) must be one of ('adam', 'newton'), got 'lbfgs'")):
        _config(root, "refused", head_fit="lbfgs", **frozen)


def test_label_train_score_cli_end_to_end(tmp_path, bpe_small):
    """`verl-prm label` (tiny causal LM) -> `verl-prm train --init` that LM -> ProverCritic scores."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_prm.critic import ProverCritic
    from verl_prm.labeling.cli import main as label_main
    from verl_prm.training.cli import main as train_main

    config = Qwen2Config(vocab_size=len(bpe_small), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=bpe_small.eos_token_id, pad_token_id=bpe_small.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "lm")
    bpe_small.save_pretrained(tmp_path / "lm")
    prompts = [{"prompt": [{"role": "user", "content": f"Count to {i}."}], "data_source": "toy",
                "reward_model": {"ground_truth": str(i)}} for i in range(6)]
    pd.DataFrame(prompts).to_parquet(tmp_path / "prompts.parquet")
    (tmp_path / "reward.py").write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return float(solution_str.count(' ') % 2 == 1)\n")
    assert label_main(["--input", str(tmp_path / "prompts.parquet"), "--output-dir", str(tmp_path / "labels"),
                 "--policy", str(tmp_path / "lm"), "--n-cov", "2", "--n-mc", "2", "--max-new-tokens", "10",
                 "--delimiter", " ", "--max-steps", "3", "--reward-fn", f"{tmp_path / 'reward.py'}:score",
                 "--device", "cpu", "--no-progress"]) == 0
    labels = read_labels(tmp_path / "labels")
    assert len(labels) == 12 and labels["step_ends"].map(len).max() <= 3
    assert train_main(["--labels", str(tmp_path / "labels"), "--output-dir", str(tmp_path / "pav"), "--init",
                 str(tmp_path / "lm"), "--max-steps", "3", "--batch-size", "4", "--warmup-steps", "1",
                 "--eval-fraction", "0.3", "--lr", "1e-3", "--no-progress",
                 "--calibration", "none"]) == 0  # 12 rollouts hold out too few labels to fit a calibration
    checkpoint = latest_checkpoint(tmp_path / "pav")
    assert checkpoint.name == "checkpoint-0000003" and (checkpoint / "model.safetensors").is_file()
    critic = ProverCritic.from_pretrained(str(checkpoint), format="value_head", device="cpu")
    row = labels.iloc[0]
    scores = critic.score_texts([row["prompt"]], [row["response"]], delimiter=" ", max_steps=3)
    assert int(scores.num_steps[0]) == len(row["step_ends"])
    assert torch.all((scores.step_values[0, : len(row["step_ends"])] > 0) & (scores.step_values[0, : len(row["step_ends"])] < 1))
    # the checkpoint's backbone came from the causal LM (--init), the value head is new
    lm = load_file(tmp_path / "lm" / "model.safetensors")
    pav = load_file(checkpoint / "model.safetensors")
    assert "score.weight" in pav and pav["score.weight"].shape[0] == 1
    assert lm["model.embed_tokens.weight"].shape == pav["model.embed_tokens.weight"].shape


# ------------------------------------------------------------------------------------------------ safe resumes


def test_keep_checkpoints_zero_is_refused_and_rotation_keeps_the_final_model(critic_setup, tmp_path):
    from verl_prm.training.cli import main

    root, _, _ = critic_setup
    message = "keep_checkpoints (--keep-checkpoints) must be an integer >= 1, got 0: the newest checkpoint is the model"
    with pytest.raises(ValueError, match=re.escape(message)):
        _config(root, "keep0", keep_checkpoints=0)
    with pytest.raises(ValueError, match=re.escape(message)):
        main(["--labels", str(root / "labels"), "--output-dir", str(tmp_path / "pav"), "--init-config",
              str(root / "config.json"), "--tokenizer", str(root / "tokenizer"), "--keep-checkpoints", "0"])
    assert not (tmp_path / "pav").exists()
    summary = train(_config(root, "keep1", max_steps=3, save_every=1, keep_checkpoints=1, warmup_steps=1))
    kept = sorted(p.name for p in (root / "keep1").glob("checkpoint-*"))
    assert kept == ["checkpoint-0000003"] and summary["checkpoint"] == str(root / "keep1" / "checkpoint-0000003")
    assert (root / "keep1" / "checkpoint-0000003" / "model.safetensors").is_file()


_STALLING_TRAINER = """
import json, sys, time
import torch
from verl_prm.training.config import TrainConfig
from verl_prm.training.trainer import train

torch.set_num_threads(1)

def stall(step, record):
    if step == 2:
        print("step 2", flush=True)
        time.sleep(120)

train(TrainConfig(**json.loads(sys.argv[1])), on_step=stall)
"""


def test_second_train_writer_is_refused_and_a_killed_trainer_resumes(critic_setup):
    """A real `train` process, killed with SIGKILL after its step-2 checkpoint while it held the directory: while
    it lives a second train() is refused naming its pid; after the kill the rerun resumes at step 2 and ends with
    the weights of an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    from dataclasses import asdict

    from verl_prm.locking import DirectoryLockedError

    root, _, _ = critic_setup
    settings = dict(max_steps=4, save_every=2, keep_checkpoints=5, log_every=1, warmup_steps=1)
    reference = train(_config(root, "uninterrupted", **settings))
    config = _config(root, "killed", **settings)
    child = subprocess.Popen([sys.executable, "-c", _STALLING_TRAINER, json.dumps(asdict(config))],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert any(line.strip() == "step 2" for line in child.stdout)  # after the trainer's own log lines
        with pytest.raises(DirectoryLockedError, match=re.escape(f"{root / 'killed'} is being written by another "
                                                                 f"process: pid {child.pid} on host ")):
            train(config)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
    resumed = train(config)
    assert resumed["start_step"] == 2
    want = load_file(Path(reference["checkpoint"]) / "model.safetensors")
    got = load_file(Path(resumed["checkpoint"]) / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_torn_last_metrics_line_is_skipped_and_a_torn_middle_line_is_an_error(critic_setup, capsys):
    from verl_prm.training.resume import read_log

    root, _, _ = critic_setup
    settings = dict(max_steps=4, save_every=2, keep_checkpoints=5, log_every=1, warmup_steps=1)

    with pytest.raises(Crash):
        train(_config(root, "torn", **settings), on_step=crash_at_three)
    log_path = root / "torn" / "metrics.jsonl"
    with open(log_path, "a") as f:
        f.write('{"step": 4, "lo')  # the process died while appending a line
    capsys.readouterr()
    assert train(_config(root, "torn", **settings))["start_step"] == 2
    assert f"{log_path} line 4 is torn (cut off while it was written" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in log_path.read_text().splitlines()] == [1, 2, 3, 4, 4]  # loss + eval
    lines = log_path.read_text().splitlines()
    log_path.write_text("\n".join([lines[0], lines[1][:7]] + lines[2:]) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{log_path} line 2 is not a JSON record") + ".*not the last line"):
        read_log(log_path)
    with pytest.raises(ValueError, match=re.escape(f"{log_path} line 2 is not a JSON record")):
        train(_config(root, "torn", **settings))


def test_rerunning_a_finished_run_logs_no_second_eval_line(critic_setup):
    root, _, _ = critic_setup
    first = train(_config(root, "finished", max_steps=2, warmup_steps=1, log_every=1))
    log = (root / "finished" / "metrics.jsonl").read_text()
    again = train(_config(root, "finished", max_steps=2, warmup_steps=1, log_every=1))
    assert again["start_step"] == 2 and again["metrics"] == first["metrics"]
    assert (root / "finished" / "metrics.jsonl").read_text() == log
    assert sum("eval/mse" in line for line in log.splitlines()) == 1


def test_nan_auroc_says_why_and_held_out_labels_must_not_be_training_labels(critic_setup, capsys):
    root, _, rows = critic_setup
    one_class = [dict(row, q=[1.0] * len(row["q"]), n_success=[0] * len(row["q"]), n_mc=[0] * len(row["q"]),
                      first_pit=-1, outcome=1.0, prompt_value=math.nan, prompt_n_mc=0, prompt_n_success=0)
                 for row in _label_rows(ScriptedStepTask(num_steps=NUM_STEPS), range(100, 102), n_cov=4, n_mc=2)]
    ShardStore(root / "one_class").write_shard(one_class)
    capsys.readouterr()
    summary = train(_config(root, "nan_auroc", max_steps=2, warmup_steps=1, eval_fraction=None,
                           eval_labels=[str(root / "one_class")], calibration="none"))  # one class: nothing to fit
    metrics = summary["metrics"]
    steps = sum(len(row["q"]) for row in one_class)
    why = (f"AUROC is NaN: all {steps} held-out step labels are at or above 0.5 (one class); it needs both classes. "
           "Hold out more prompts (--eval-fraction) or pass --eval-labels with mixed outcomes")
    assert math.isnan(metrics["eval/auroc"]) and metrics["eval/auroc_note"] == why
    assert f"verl-prm train: step 2: {why}" in capsys.readouterr().out
    logged = json.loads((root / "nan_auroc" / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["eval/auroc_note"] == why
    assert json.loads((root / "nan_auroc" / "eval_metrics.json").read_text())["eval/auroc_note"] == why
    shard = root / "labels" / "shard-00000.parquet"
    with pytest.raises(ValueError, match=re.escape(f"--eval-labels and --labels share {len(rows)} rollouts (e.g. "
                                                   f"{shard} row 0 is {shard} row 0, prompt_index=0, rollout_index=0)")):
        train(_config(root, "leak", eval_fraction=None, eval_labels=[str(shard)]))


def test_train_refuses_labels_that_break_the_format(critic_setup, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_prm.labeling.format import LABEL_SCHEMA

    root, _, rows = critic_setup
    bad = [dict(row) for row in rows[:4]]
    bad[2]["q"] = bad[2]["q"][:-1]  # fewer values than steps
    pq.write_table(pa.Table.from_pylist(bad, schema=LABEL_SCHEMA), tmp_path / "shard-00000.parquet")
    with pytest.raises(ValueError, match=re.escape(f"label shard {tmp_path / 'shard-00000.parquet'} row 2 (prompt_index="
                                                   f"{bad[2]['prompt_index']}, rollout_index={bad[2]['rollout_index']}): "
                                                   f"q has {NUM_STEPS - 1} entries but there are {NUM_STEPS} steps")):
        train(_config(root, "bad_labels", labels=[str(tmp_path)]))


# ------------------------------------------------------------------------------------------------ hostile inputs


def _copy_labels(root: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(root / "labels", tmp_path / "labels")
    return tmp_path / "labels"


def test_a_nan_init_weight_stops_at_step_1_and_writes_no_checkpoint(critic_setup, tmp_path):
    from safetensors.torch import save_file
    import shutil

    from verl_prm.training.optimisation import NonFiniteLossError

    root, _, _ = critic_setup
    base = train(_config(root, "nan_base", max_steps=1, warmup_steps=1))
    init = tmp_path / "nan_init"
    shutil.copytree(base["checkpoint"], init)
    weights = load_file(init / "model.safetensors")
    weights["model.norm.weight"][0] = math.nan  # one NaN weight
    save_file(weights, init / "model.safetensors", metadata={"format": "pt"})
    output = tmp_path / "nan_run"
    with pytest.raises(NonFiniteLossError, match=re.escape("step 1: loss nan is not finite; training stopped before "
                                                           "this step changed the weights and no checkpoint was "
                                                           "written. Check the --init weights for NaN/inf")):
        train(_config(root, "unused", output_dir=str(output), init=str(init), init_config=None, tokenizer=None,
                      max_steps=2, warmup_steps=1))
    assert not list(output.glob("checkpoint-*")) and latest_checkpoint(output) is None


def test_a_nan_loss_keeps_the_last_good_checkpoint(critic_setup, tmp_path, monkeypatch):
    import verl_prm.training.optimisation as optimisation

    root, _, _ = critic_setup
    calls = []

    def nan_at_step_3(*args):
        calls.append(1)
        loss = trainer_loss(*args)
        return loss * math.nan if len(calls) == 3 else loss

    trainer_loss = optimisation.soft_label_bce
    monkeypatch.setattr(optimisation, "soft_label_bce", nan_at_step_3)
    output = tmp_path / "run"
    good = output / "checkpoint-0000002"
    with pytest.raises(optimisation.NonFiniteLossError, match=re.escape(f"step 3: loss nan is not finite; training stopped "
                                                                   f"before this step changed the weights and the last "
                                                                   f"good checkpoint, {good}, is kept")):
        train(_config(root, "unused", output_dir=str(output), max_steps=4, save_every=1, warmup_steps=1))
    assert latest_checkpoint(output) == good and not (output / "checkpoint-0000003").exists()
    assert all(torch.isfinite(tensor).all() for tensor in load_file(good / "model.safetensors").values())


def test_resume_refuses_changed_inputs_and_settings(critic_setup, tmp_path):
    import shutil

    root, _, rows = critic_setup
    labels = _copy_labels(root, tmp_path)
    init_config = tmp_path / "config.json"
    shutil.copy(root / "config.json", init_config)
    settings = dict(labels=[str(labels)], init_config=str(init_config), output_dir=str(tmp_path / "run"), max_steps=3,
                    save_every=1, warmup_steps=1)

    def crash_at_one(step, record):
        if step == 1:
            raise RuntimeError("crash")

    with pytest.raises(RuntimeError, match="crash"):
        train(_config(root, "unused", **settings), on_step=crash_at_one)
    checkpoint = tmp_path / "run" / "checkpoint-0000001"
    with pytest.raises(ValueError, match=re.escape(f"{checkpoint} holds a checkpoint made with other settings (grad_clip: "
                                                   "1.0 -> 0.5): resume with the same settings, or start over with "
                                                   "--no-resume or a new --output-dir")):
        train(_config(root, "unused", **settings, grad_clip=0.5))
    ShardStore(labels).write_shard(_label_rows(ScriptedStepTask(num_steps=NUM_STEPS), range(200, 201), n_cov=2, n_mc=2))
    with pytest.raises(ValueError, match=re.escape(f"cannot resume from {checkpoint}: inputs changed since it was "
                                                   f"written (--labels: added {labels / 'shard-00001.parquet'}); "
                                                   "restore them, or start over with --no-resume")):
        train(_config(root, "unused", **settings))
    (labels / "shard-00001.parquet").unlink()
    config = json.loads(init_config.read_text())
    init_config.write_text(json.dumps(dict(config, rope_theta=5000.0)))
    with pytest.raises(ValueError, match=re.escape("inputs changed since it was written (--init-config: changed "
                                                   "config.json)")):
        train(_config(root, "unused", **settings))
    init_config.write_text(json.dumps(config))
    assert train(_config(root, "unused", **settings))["start_step"] == 1


def test_no_resume_sets_the_earlier_run_aside(critic_setup, tmp_path):
    root, _, _ = critic_setup
    output = tmp_path / "run"
    train(_config(root, "unused", output_dir=str(output), max_steps=4, save_every=2, keep_checkpoints=5, log_every=1,
                  warmup_steps=1))
    summary = train(_config(root, "unused", output_dir=str(output), max_steps=2, warmup_steps=1, log_every=1,
                            resume=False, seed=1))
    assert latest_checkpoint(output) == output / "checkpoint-0000002" == Path(summary["checkpoint"])
    assert sorted(p.name for p in output.glob("checkpoint-*")) == ["checkpoint-0000002"]
    state = torch.load(output / "checkpoint-0000002" / "training_state.pt", weights_only=False)
    assert state["config"]["seed"] == 1  # this run's, not the earlier run's checkpoint-0000002
    (earlier,) = output.glob("earlier-run-*")
    assert sorted(p.name for p in earlier.iterdir()) == ["checkpoint-0000002", "checkpoint-0000004",
                                                          "eval_metrics.json", "metrics.jsonl"]
    assert [json.loads(line)["step"] for line in (output / "metrics.jsonl").read_text().splitlines()] == [1, 2, 2]


def test_held_out_labels_copied_from_the_training_shards_are_refused(critic_setup, tmp_path):
    root, _, rows = critic_setup
    copy = _copy_labels(root, tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"--eval-labels and --labels share {len(rows)} rollouts (e.g. "
                                                   f"{copy / 'shard-00000.parquet'} row 0 is "
                                                   f"{root / 'labels' / 'shard-00000.parquet'} row 0")):
        train(_config(root, "copied", eval_fraction=None, eval_labels=[str(copy)]))


@pytest.mark.parametrize("overrides, message", [
    (dict(eval_batch_size=0), "eval_batch_size (--eval-batch-size) must be an integer >= 1, got 0"),
    (dict(warmup_steps=-5), "warmup_steps (--warmup-steps) must be an integer >= 0, got -5"),
    (dict(log_every=0), "log_every (--log-every) must be an integer >= 1, got 0"),
    (dict(lr=math.nan), "lr (--lr) must be > 0 (a finite number), got nan"),
    (dict(freeze_backbone=True), "freeze_backbone (--freeze-backbone) with init_config (--init-config) trains a "
                                 "value head on a random backbone"),
    (dict(eval_labels=["held_out/"]), "eval_fraction (--eval-fraction) splits --labels when there are no "
                                      "eval_labels; with --eval-labels nothing is split: drop one of the two"),
])
def test_settings_a_user_likely_mistyped_are_refused_at_start(critic_setup, overrides, message):
    root, _, _ = critic_setup
    with pytest.raises(ValueError, match=re.escape(message)):
        _config(root, "refused", **overrides)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_at_start(critic_setup, tmp_path, bpe_small):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    root, _, _ = critic_setup
    small = len(bpe_small) - 40
    Qwen2ForCausalLM(Qwen2Config(vocab_size=small, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "lm")
    bpe_small.save_pretrained(tmp_path / "lm")
    with pytest.raises(ValueError, match=re.escape(f"the tokenizer of --init (no --tokenizer given) {tmp_path / 'lm'} "
                                                   f"has {len(bpe_small)} tokens but the model has {small} embeddings")):
        train(_config(root, "unused", output_dir=str(tmp_path / "run"), init=str(tmp_path / "lm"), init_config=None,
                      tokenizer=None))


def test_a_truncated_newest_checkpoint_falls_back_to_the_older_intact_one(critic_setup, tmp_path, capsys):
    from verl_prm.training.resume import checkpoint_problem

    root, _, _ = critic_setup
    output = tmp_path / "run"
    settings = dict(output_dir=str(output), max_steps=4, save_every=2, keep_checkpoints=5, warmup_steps=1)
    train(_config(root, "unused", **settings))
    weights = output / "checkpoint-0000004" / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as handle:
        handle.truncate(size - 1000)  # a copy or save cut short
    problem = (f"model.safetensors is cut short: its header describes {size} bytes, the file has {size - 1000}")
    assert checkpoint_problem(output / "checkpoint-0000004") == problem
    with pytest.warns(UserWarning, match=re.escape(f"skipping damaged checkpoint(s) {output / 'checkpoint-0000004'} "
                                                   f"({problem}); using the older intact {output / 'checkpoint-0000002'}")):
        assert latest_checkpoint(output) == output / "checkpoint-0000002"
    capsys.readouterr()
    assert train(_config(root, "unused", **settings))["start_step"] == 2
    assert "skipping damaged checkpoint(s)" in capsys.readouterr().out
    assert checkpoint_problem(output / "checkpoint-0000004") is None  # rewritten by the resumed run
    (output / "checkpoint-0000004" / "tokenizer_config.json").unlink()
    assert checkpoint_problem(output / "checkpoint-0000004") == ("it has no tokenizer files: tokenizer_config.json "
                                                                 "missing")
    (output / "checkpoint-0000002" / "training_state.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=re.escape(f"{output} holds only damaged checkpoints (checkpoint-0000002, "
                                                   "checkpoint-0000004; see the notes above): rerun with --no-resume")):
        train(_config(root, "unused", **settings))


def test_a_tokenizer_path_that_is_a_file_or_has_no_tokenizer_is_refused(critic_setup, tmp_path):
    from verl_prm.checkpoints import CheckpointError

    root, _, _ = critic_setup
    file = root / "tokenizer" / "tokenizer.json"
    with pytest.raises(CheckpointError, match=re.escape(
            f"--tokenizer '{file}' is a file, not a tokenizer directory: pass the directory that holds "
            "tokenizer_config.json and tokenizer.json (e.g. the model's directory)")):
        train(_config(root, "unused", output_dir=str(tmp_path / "run"), tokenizer=str(file)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=re.escape(
            f"--tokenizer '{tmp_path / 'empty'}' has no tokenizer files: tokenizer_config.json and a vocabulary "
            "(tokenizer.json or vocab.json")):
        train(_config(root, "unused", output_dir=str(tmp_path / "run"), tokenizer=str(tmp_path / "empty")))


def test_an_empty_prompt_names_the_shard_and_row(critic_setup, tmp_path):
    root, _, rows = critic_setup
    bad = [dict(row) for row in rows[:3]]
    bad[1]["prompt"] = ""
    ShardStore(tmp_path / "labels").write_shard(bad)
    shard = tmp_path / "labels" / "shard-00000.parquet"
    with pytest.raises(ValueError, match=re.escape(f"label shard {shard} row 1 (prompt_index={bad[1]['prompt_index']}, "
                                                   f"rollout_index={bad[1]['rollout_index']}): the prompt is empty")):
        train(_config(root, "unused", output_dir=str(tmp_path / "run"), labels=[str(tmp_path / "labels")],
                      eval_fraction=0.0, calibration="none"))
