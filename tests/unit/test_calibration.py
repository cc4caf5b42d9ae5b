"""Post-hoc calibration of a learned PAV (verl_prm.training.calibration): PAV and Platt against hand-computed
cases and reference loops, ECE / reliability against loops, the checkpoint round trip through `verl-prm train`
and ProverCritic, every bad-input error; and the process-term diagnostics (verl_prm.diagnostics) against loops."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from verl_prm.diagnostics import (
    process_term_correlation,
    process_term_diagnostics,
    process_term_scale,
    zero_outcome_groups_with_signal,
)
from verl_prm.labeling.inputs import PromptItem
from verl_prm.labeling.monte_carlo import LabelSettings, MonteCarloLabeler
from verl_prm.labeling.scoring import OutcomeScorer
from verl_prm.labeling.closed_form_task import ScriptedStepGenerator, ScriptedStepTask, scripted_step_score
from verl_prm.labeling.store import ShardStore
from verl_prm.training.calibration import (
    MIN_CALIBRATION_LABELS,
    Calibration,
    CalibrationError,
    apply_isotonic,
    apply_platt,
    checkpoint_calibration,
    cross_fitted_values,
    fit_calibration,
    fit_isotonic,
    fit_platt,
    label_weights,
    pool_adjacent_violators,
    read_calibration,
    write_calibration,
)
from verl_prm.training.metrics import expected_calibration_error, reliability_bins
from verl_prm.training.config import TrainConfig
from verl_prm.training.trainer import train

# ------------------------------------------------------------------------------------------------ isotonic


def test_pool_adjacent_violators_by_hand():
    # y = 0, 0.6, 0.2, 1 at x = 0.1..0.4, weights 1, 2, 1, 1: 0.6 > 0.2 violates, so x = 0.2, 0.3 pool into
    # mean (2 * 0.6 + 0.2) / 3 = 1.4 / 3, centroid (2 * 0.2 + 0.3) / 3 = 0.7 / 3, weight 3.
    x, y, w = pool_adjacent_violators([0.3, 0.1, 0.4, 0.2], [0.2, 0.0, 1.0, 0.6], [1, 1, 1, 2])
    assert np.allclose(x, [0.1, 0.7 / 3, 0.4]) and np.allclose(y, [0.0, 1.4 / 3, 1.0]) and np.allclose(w, [1, 3, 1])
    # equal values pool first; equal adjacent means pool too (the block means strictly increase)
    x, y, w = pool_adjacent_violators([0.5, 0.5, 0.7, 0.9], [0.0, 1.0, 0.5, 0.8], [1, 1, 2, 1])
    assert np.allclose(x, [(0.5 + 0.5 + 1.4) / 4, 0.9]) and np.allclose(y, [0.5, 0.8]) and np.allclose(w, [4, 1])


def _isotonic_min_max(y, w):
    """Weighted isotonic regression of points in x order by the min-max formula (Barlow, Bartholomew, Bremner
    & Brunk 1972, "Statistical inference under order restrictions", Thm 1.4):
    f_i = max_{j <= i} min_{k >= i} Av(j..k), Av = weighted mean of y_j..y_k."""
    n = len(y)
    av = lambda j, k: sum(w[t] * y[t] for t in range(j, k + 1)) / sum(w[t] for t in range(j, k + 1))
    return np.array([max(min(av(j, k) for k in range(i, n)) for j in range(i + 1)) for i in range(n)])


def test_pool_adjacent_violators_equals_the_min_max_formula():
    rng = np.random.default_rng(0)
    for trial in range(20):
        n = int(rng.integers(2, 12))
        x = np.sort(rng.choice(100, n, replace=False) / 100.0)
        y, w = rng.random(n).round(2), rng.integers(1, 5, n).astype(float)
        bx, by, bw = pool_adjacent_violators(x, y, w)
        # each point's fitted value is the mean of the block holding it; blocks are consecutive runs of points
        sizes, fitted, start = [], [], 0
        for weight in bw:
            end = start
            while not np.isclose(w[start:end].sum(), weight):
                end += 1
            sizes.append(end - start)
            start = end
        fitted = np.repeat(by, sizes)
        assert np.allclose(fitted, _isotonic_min_max(y, w), atol=1e-12), trial
        assert np.all(np.diff(by) > 0) and np.allclose(bw.sum(), w.sum())


def test_isotonic_map_interpolates_between_centroids_and_clamps():
    x, y = [0.1, 0.3, 0.7], [0.0, 0.5, 0.9]
    assert np.allclose(apply_isotonic([0.0, 0.1, 0.2, 0.5, 0.7, 1.0], x, y), [0.0, 0.0, 0.25, 0.7, 0.9, 0.9])
    values = np.linspace(0.05, 0.95, 40)
    fitted = fit_isotonic(values, (values > 0.5).astype(float), np.ones(40))
    assert fitted["y"][0] == 0.0 and fitted["y"][-1] == 1.0 and len(fitted["x"]) == 2


# ------------------------------------------------------------------------------------------------ Platt


def _logit(v):
    return math.log(v / (1 - v))


def test_platt_recovers_the_map_that_generated_soft_labels():
    # soft labels q_i = sigmoid(2.5 logit(v_i) - 0.7) exactly: the cross-entropy's minimiser is (2.5, -0.7)
    values = np.linspace(0.02, 0.98, 60)
    labels = np.array([1 / (1 + math.exp(-(2.5 * _logit(v) - 0.7))) for v in values])
    fitted = fit_platt(values, labels, np.arange(1, 61, dtype=float))
    assert fitted["slope"] == pytest.approx(2.5, abs=1e-8) and fitted["intercept"] == pytest.approx(-0.7, abs=1e-8)
    assert np.allclose(apply_platt(values, **fitted), labels, atol=1e-8)


def test_platt_is_the_minimum_of_a_brute_force_grid():
    rng = np.random.default_rng(3)
    values = rng.uniform(0.05, 0.95, 80)
    labels = (rng.random(80) < values**0.5).astype(float)  # hard labels, not of the Platt form
    weights = rng.integers(1, 9, 80).astype(float)

    def loss(a, b):
        total = 0.0
        for v, q, w in zip(values, labels, weights):
            s = 1 / (1 + math.exp(-(a * _logit(v) + b)))
            total -= w * (q * math.log(s) + (1 - q) * math.log(1 - s))
        return total

    fitted = fit_platt(values, labels, weights)
    grid = [(a, b) for a in np.linspace(0.05, 3.0, 60) for b in np.linspace(-2.0, 2.0, 61)]
    best = min(grid, key=lambda ab: loss(*ab))
    assert loss(fitted["slope"], fitted["intercept"]) <= loss(*best) + 1e-9
    assert abs(fitted["slope"] - best[0]) < 0.06 and abs(fitted["intercept"] - best[1]) < 0.07
    for da, db in ((1e-4, 0), (-1e-4, 0), (0, 1e-4), (0, -1e-4)):  # a local minimum in every direction
        assert loss(fitted["slope"] + da, fitted["intercept"] + db) >= loss(fitted["slope"], fitted["intercept"])


def test_platt_refuses_labels_a_threshold_separates_even_with_a_soft_label_on_it():
    # Albert & Anderson (1984): labels 0 below a value and 1 above it, with a soft label at it, have no finite
    # maximum-likelihood fit (the cross-entropy keeps falling as the slope grows)
    values = np.linspace(0.1, 0.9, 41)
    labels = np.where(values < 0.5, 0.0, 1.0)
    labels[20] = 0.3  # values[20] = 0.5
    with pytest.raises(CalibrationError, match="separated by the value"):
        fit_platt(values, labels, np.ones(41))
    labels[19] = 1.0  # one label on the other side: a finite slope fits
    fitted = fit_platt(values, labels, np.ones(41))
    assert 0 < fitted["slope"] < 1e3


def test_label_weights_count_unsampled_labels_as_the_best_sampled():
    assert label_weights([16, 0, 4, 0]).tolist() == [16, 16, 4, 16]
    assert label_weights([0, 0]).tolist() == [1, 1]


# ------------------------------------------------------------------------------------------------ ECE, reliability


def test_ece_and_reliability_bins_equal_a_loop():
    rng = np.random.default_rng(1)
    p, q = rng.random(200), rng.random(200)
    p[:3] = [0.0, 1.0, 0.1]  # the edges: 1.0 goes to the last bin, 0.1 to bin 1 of 10
    data = reliability_bins(p, q, 10)
    ece = 0.0
    for b in range(10):
        members = [i for i in range(200) if min(int(math.floor(p[i] * 10)), 9) == b]
        assert data["count"][b] == len(members)
        if members:
            assert data["mean_value"][b] == pytest.approx(np.mean(p[members]))
            assert data["mean_label"][b] == pytest.approx(np.mean(q[members]))
            ece += len(members) / 200 * abs(np.mean(p[members]) - np.mean(q[members]))
        else:
            assert math.isnan(data["mean_value"][b])
    assert expected_calibration_error(p, q, 10) == pytest.approx(ece)


# ------------------------------------------------------------------------------------------------ bad input


def _write(tmp_path: Path, **fields) -> Path:
    data = {"format": "verl-prm calibration", "version": 1, "method": "platt",
            "parameters": {"slope": 2.0, "intercept": 0.1}, "num_labels": 100, "weights_digest": "ab" * 32}
    data.update(fields)
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("fields, message", [
    (dict(parameters={"slope": -1.0, "intercept": 0.0}), "platt slope -1.0 <= 0 is not an increasing map"),
    (dict(parameters={"slope": float("nan"), "intercept": 0.0}), "platt slope and intercept must be finite"),
    (dict(method="isotonic", parameters={"x": [0.1, 0.5, 0.4], "y": [0.0, 0.5, 0.6]}),
     r"not monotone at breakpoint 2 \(x 0.5 -> 0.4 must increase"),
    (dict(method="isotonic", parameters={"x": [0.1, 0.5], "y": [0.6, 0.5]}), "y 0.6 -> 0.5 must not decrease"),
    (dict(method="isotonic", parameters={"x": [0.1, float("inf")], "y": [0.0, 1.0]}), "hold NaN or inf"),
    (dict(method="isotonic", parameters={"x": [0.1], "y": [0.0]}), "length >= 2"),
    (dict(method="temperature"), "unknown calibration method 'temperature'"),
    (dict(version=7), "is not a verl-prm calibration"),
])
def test_a_bad_calibration_file_is_a_one_line_error_naming_it(tmp_path, fields, message):
    path = _write(tmp_path, **fields)
    with pytest.raises(CalibrationError, match=message) as caught:
        read_calibration(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)
    assert "calibration='none'" in str(caught.value)


@pytest.mark.parametrize("fields, message", [
    # flat maps: every critic value would map to about one value, every process term to 0 (a fit refuses them)
    (dict(parameters={"slope": 1e-12, "intercept": 0.0}), r"the platt map is flat: it maps every critic value"),
    (dict(parameters={"slope": 1.0, "intercept": 60.0}), r"the platt map is flat"),  # saturated at 1
    (dict(method="isotonic", parameters={"x": [0.1, 0.9], "y": [0.4, 0.4]}), r"the isotonic map is flat"),
    (dict(method="isotonic", parameters={"x": [2.0, 3.0], "y": [0.2, 0.9]}), r"the isotonic map is flat"),  # x > 1
    (dict(parameters={"slope": 2e6, "intercept": 0.0}), r"platt slope 2e\+06 is above 1e\+06"),
    # wrongly typed fields
    (dict(num_labels="abc"), r"num_labels \(.*\) must be an integer >= 32, got 'abc'"),
    (dict(num_labels=None), r"num_labels \(.*\) must be an integer >= 32, got None"),
    (dict(num_labels=1e400), r"num_labels \(.*\) must be an integer >= 32, got inf"),
    (dict(num_labels=True), r"num_labels \(.*\) must be an integer >= 32, got True"),
    (dict(num_labels=4), r"num_labels \(.*\) must be an integer >= 32, got 4"),
    (dict(metrics=[1, 2]), r"metrics must be an object of numbers and strings, got \[1, 2\]"),
    (dict(metrics="xy"), r"metrics must be an object of numbers and strings, got 'xy'"),
    (dict(metrics={"ece": [0.1]}), r"metrics must be an object of numbers and strings"),
    (dict(weights_digest=12), r"weights_digest must be a sha256 digest \(64 hex digits\), got 12"),
    (dict(parameters={"slope": 2.0}), r"platt parameters must be \{'slope', 'intercept'\}"),
])
def test_a_flat_or_mistyped_calibration_file_is_refused_naming_it_and_the_field(tmp_path, fields, message):
    path = _write(tmp_path, **fields)
    with pytest.raises(CalibrationError, match=message) as caught:
        read_calibration(path)
    assert str(path) in str(caught.value) and "calibration='none'" in str(caught.value)


_VALID = ('"format": "verl-prm calibration", "version": 1, "num_labels": 100, "weights_digest": "' + "ab" * 32 + '"')


@pytest.mark.parametrize("text, message", [
    ('{"method": "platt", "parameters": {"slope": 1' + "0" * 400 + ', "intercept": 0.1}, ' + _VALID + "}",
     "platt slope and intercept must be finite numbers"),  # an integer too large for a float
    ('{"method": "isotonic", "parameters": {"x": [0.1, 1' + "0" * 400 + '], "y": [0.1, 0.9]}, ' + _VALID + "}",
     "isotonic x and y must be lists of finite numbers"),
    ('{"method": "platt", "parameters": {"slope": 1.0, "intercept": 0.1}, ' + _VALID + ', "metrics": {"n": 1'
     + "0" * 400 + "}}", "metrics must be an object of numbers and strings"),
    ("[1, 2]", "is not a verl-prm calibration"),
    ('{"format": "verl-prm calibration", "version": 1, "method": "platt"}', "lacks parameters, num_labels"),
    ("\xff\xfe", "is not JSON"),
])
def test_a_malformed_calibration_file_is_a_calibration_error_naming_it(tmp_path, text, message):
    path = tmp_path / "calibration.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(CalibrationError, match=message) as caught:
        read_calibration(path)
    assert str(path) in str(caught.value) and "calibration='none'" in str(caught.value)


def _checkpoint(directory: Path, weights: bytes = b"weights") -> Path:
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(weights)
    return directory


@pytest.mark.parametrize("kind, message", [
    ("dangling_link", r"is a symbolic link to .*moved.json, which does not exist"),
    ("link_loop", r"cannot be read \(.*symbolic links"),
    ("directory", r"is a directory, not a calibration file"),
    ("unreadable", r"cannot be read \(Permission denied\)"),
])
def test_auto_refuses_a_calibration_file_it_cannot_read(tmp_path, monkeypatch, kind, message):
    """Under calibration="auto" only a checkpoint without anything named calibration.json is uncalibrated; a
    broken one is an error naming it, never a silent uncalibrated load."""
    from verl_prm.checkpoints import weights_digest

    checkpoint = _checkpoint(tmp_path / "checkpoint")
    target = checkpoint / "calibration.json"
    if kind == "dangling_link":
        target.symlink_to(tmp_path / "moved.json")
    elif kind == "link_loop":
        target.symlink_to(checkpoint / "other.json")
        (checkpoint / "other.json").symlink_to(target)
    elif kind == "directory":
        target.mkdir()
        _write(target, weights_digest=weights_digest(checkpoint))  # even one holding a valid file
    else:  # root reads a chmod 000 file, so the refusal of the operating system is simulated
        _write(checkpoint, weights_digest=weights_digest(checkpoint))
        original = Path.read_bytes
        denied = PermissionError(13, "Permission denied", str(target))
        monkeypatch.setattr(Path, "read_bytes", lambda self: (_ for _ in ()).throw(denied) if self == target
                            else original(self))
    with pytest.raises(CalibrationError, match=message) as caught:
        checkpoint_calibration(checkpoint, "auto")
    assert str(target) in str(caught.value) and "calibration='none'" in str(caught.value)
    assert checkpoint_calibration(checkpoint, "none") is None
    monkeypatch.undo()
    if target.is_dir():
        (target / "calibration.json").unlink()
        target.rmdir()
    else:
        target.unlink()
    assert checkpoint_calibration(checkpoint, "auto") is None  # genuinely absent: uncalibrated


def test_weights_digest_covers_every_byte_of_a_large_weights_file(tmp_path):
    """A weights file over 256 MiB (sparse: only one byte is ever written) edited in its middle, its size kept,
    has hashlib's sha256 of its bytes as digest, so the calibration of the original weights is refused for it."""
    import hashlib
    import time

    from verl_prm.checkpoints import file_digest, weights_digest

    checkpoint = _checkpoint(tmp_path / "checkpoint", b"")
    weights = checkpoint / "model.safetensors"
    megabyte = bytes(10**6)
    with open(weights, "r+b") as handle:
        handle.truncate(300 * len(megabyte))
    _write(checkpoint, weights_digest=weights_digest(checkpoint))
    with open(weights, "r+b") as handle:
        handle.seek(150 * len(megabyte))
        handle.write(b"\x01")
    start = time.perf_counter()
    digest = file_digest(weights)
    print(f"\nfile_digest of a 300 MB file: {time.perf_counter() - start:.2f} s")
    reference = hashlib.sha256()
    for block in [megabyte] * 150 + [b"\x01" + megabyte[1:]] + [megabyte] * 149:
        reference.update(block)
    assert weights.stat().st_size == 300 * 10**6 and digest == reference.hexdigest()
    with pytest.raises(CalibrationError, match="was fitted for other weights"):
        read_calibration(checkpoint, checkpoint)


def test_fit_refuses_too_few_labels_constant_values_and_wrong_rankings():
    few = np.linspace(0.1, 0.9, MIN_CALIBRATION_LABELS - 1)
    with pytest.raises(CalibrationError, match="31 held-out labels, fewer than the minimum 32"):
        fit_calibration("platt", few, few, np.ones_like(few), "")
    values = np.linspace(0.1, 0.9, 40)
    with pytest.raises(CalibrationError, match="all held-out values are equal"):
        fit_platt(np.full(40, 0.3), values, np.ones(40))
    with pytest.raises(CalibrationError, match="fitted slope .* <= 0"):
        fit_platt(values, 1 - values, np.ones(40))
    with pytest.raises(CalibrationError, match="one pooled block"):
        fit_isotonic(values, 1 - values, np.ones(40))
    with pytest.raises(CalibrationError, match="separated by the value"):
        fit_platt(values, (values > 0.5).astype(float), np.ones(40))
    with pytest.raises(CalibrationError, match="held-out labels hold NaN"):
        fit_platt(values, np.where(values > 0.5, np.nan, 0.2), np.ones(40))


# ------------------------------------------------------------------------------------------------ round trip


def _label_rows(task, prompts, n_cov, n_mc):
    items = [PromptItem(i, task.prompt(i), str(task.num_steps), "scripted") for i in prompts]
    labeler = MonteCarloLabeler(ScriptedStepGenerator(0.75), ScriptedStepGenerator(0.7),
                                OutcomeScorer(scripted_step_score), LabelSettings(n_cov=n_cov, n_mc=n_mc, seed=0))
    return labeler.label(items, [item.prompt for item in items])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, bpe_small):
    """A tiny PAV trained (30 steps) on MC labels of the scripted task, as in tests/unit/test_training.py."""
    root = tmp_path_factory.mktemp("calibration")
    bpe_small.save_pretrained(root / "tokenizer")
    config = dict(model_type="qwen2", vocab_size=len(bpe_small), hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    (root / "config.json").write_text(json.dumps(config))
    task = ScriptedStepTask(num_steps=4)
    ShardStore(root / "labels").write_shard(_label_rows(task, range(48), n_cov=4, n_mc=8))
    args = ["--labels", str(root / "labels"), "--output-dir", str(root / "run"), "--init-config",
            str(root / "config.json"), "--tokenizer", str(root / "tokenizer"), "--eval-fraction", "0.25",
            "--batch-size", "16", "--max-steps", "30", "--lr", "4e-3", "--warmup-steps", "4", "--max-length", "256",
            "--no-progress"]
    from verl_prm.training.cli import main

    assert main(args) == 0
    return root, args, task


def test_train_fits_stores_and_reports_the_calibration(trained):
    root, _, _ = trained
    checkpoint = root / "run" / "checkpoint-0000030"
    stored = json.loads((checkpoint / "calibration.json").read_text())
    metrics = json.loads((root / "run" / "eval_metrics.json").read_text())
    print(f"\nheld-out ECE raw {metrics['eval/ece']:.4f} -> platt {metrics['eval/calibrated_ece']:.4f} (cross-fitted "
          f"{metrics['eval/calibrated_ece_cross_fitted']:.4f}); MSE {metrics['eval/mse']:.4f} -> "
          f"{metrics['eval/calibrated_mse']:.4f} ({metrics['eval/calibrated_mse_cross_fitted']:.4f})")
    assert stored["method"] == "platt" and stored["parameters"]["slope"] > 0
    assert stored["num_labels"] == metrics["eval/calibration_labels"] >= MIN_CALIBRATION_LABELS
    from verl_prm.checkpoints import weights_digest

    assert stored["weights_digest"] == weights_digest(checkpoint)
    assert stored["metrics"]["ece"] == metrics["eval/ece"]
    # Platt minimises the weighted cross-entropy on these labels, so it cannot raise their (unweighted) MSE much
    assert metrics["eval/calibrated_mse"] <= metrics["eval/mse"] + 0.005
    assert (root / "run" / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_critic_applies_the_calibration_in_every_entry_point(trained):
    from verl_prm.critic import ProverCritic
    from verl_prm.steps import encode_with_step_ends, step_char_spans

    root, _, task = trained
    checkpoint = str(root / "run" / "checkpoint-0000030")
    calibrated = ProverCritic.from_pretrained(checkpoint, device="cpu")
    raw = ProverCritic.from_pretrained(checkpoint, device="cpu", calibration="none")
    assert calibrated.calibration is not None and raw.calibration is None
    assert "platt calibration (slope" in repr(calibrated) and "uncalibrated" in raw.describe()
    seeds = ScriptedStepGenerator(0.75).generate([task.prompt(i) for i in range(500, 504)], 2, list(range(4)))
    prompts = [task.prompt(500 + i) for i, samples in enumerate(seeds) for _ in samples]
    responses = [sample.text for samples in seeds for sample in samples]
    got, base = calibrated.score_texts(prompts, responses), raw.score_texts(prompts, responses)
    mapped = calibrated.calibration
    assert torch.allclose(got.prompt_values, torch.from_numpy(mapped(base.prompt_values.numpy())).float(), atol=1e-6)
    for b in range(len(responses)):
        h = int(base.num_steps[b])
        want = torch.from_numpy(mapped(base.step_values[b, :h].numpy())).float()
        assert torch.allclose(got.step_values[b, :h], want, atol=1e-6)
        assert torch.all(got.step_values[b, h:] == 0)
    encoded = [encode_with_step_ends(calibrated.tokenizer, p, r, step_char_spans(r, "\n\n"))
               for p, r in zip(prompts, responses)]
    sequences = calibrated.score_sequences([list(e.input_ids) for e in encoded], [e.prompt_end for e in encoded],
                                           [list(e.step_ends) for e in encoded])
    assert torch.allclose(sequences.step_values, got.step_values, atol=1e-6)
    best = ProverCritic.from_pretrained(checkpoint, device="cpu", best_of_k=3).score_texts(prompts, responses)
    assert torch.allclose(best.prompt_values, 1 - (1 - got.prompt_values) ** 3, atol=1e-6)  # calibrate, then BoK


def test_a_calibration_of_other_weights_is_refused(trained, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from verl_prm.critic import ProverCritic

    root, _, _ = trained
    copy = tmp_path / "changed"
    shutil.copytree(root / "run" / "checkpoint-0000030", copy)
    weights = load_file(copy / "model.safetensors")
    weights["score.weight"] = weights["score.weight"] + 0.01
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CalibrationError, match=f"{copy / 'calibration.json'} was fitted for other weights .*refit"):
        ProverCritic.from_pretrained(str(copy), device="cpu")
    assert ProverCritic.from_pretrained(str(copy), device="cpu", calibration="none").calibration is None
    with pytest.raises(CalibrationError, match="no calibration file"):
        ProverCritic.from_pretrained(str(copy), device="cpu", calibration=str(tmp_path / "missing.json"))
    # an explicit file fitted for the original weights loads for those
    original = ProverCritic.from_pretrained(str(root / "run" / "checkpoint-0000030"), device="cpu",
                                            calibration=str(root / "run" / "checkpoint-0000030" / "calibration.json"))
    assert original.calibration.method == "platt"


def test_rerunning_a_finished_run_refits_isotonic_or_removes_the_calibration(trained):
    from verl_prm.training.cli import main

    root, args, _ = trained
    checkpoint = root / "run" / "checkpoint-0000030"
    before = (checkpoint / "model.safetensors").read_bytes()
    assert main(args + ["--calibration", "isotonic"]) == 0
    stored = read_calibration(checkpoint, checkpoint)
    assert stored.method == "isotonic" and np.all(np.diff(stored.parameters["x"]) > 0)
    assert (checkpoint / "model.safetensors").read_bytes() == before  # a refit changes no weight
    assert main(args + ["--calibration", "none"]) == 0
    assert not (checkpoint / "calibration.json").exists()
    assert main(args) == 0  # back to the default platt for the other tests of this module
    assert read_calibration(checkpoint, checkpoint).method == "platt"


def test_cross_fitted_values_are_out_of_fold_fits():
    rng = np.random.default_rng(5)
    values, groups = rng.uniform(0.05, 0.95, 300), np.repeat(np.arange(60), 5)
    labels = np.clip(values + rng.normal(0, 0.1, 300), 0, 1)
    weights = np.ones(300)
    cross = cross_fitted_values("platt", values, labels, weights, groups, folds=3)
    part = groups % 3
    for k in range(3):
        rest = part != k
        want = fit_calibration("platt", values[rest], labels[rest], weights[rest], "")(values[part == k])
        assert np.allclose(cross[part == k], want)


def test_too_few_held_out_labels_or_none_held_out_are_refused_at_start(trained):
    root, _, _ = trained
    settings = dict(labels=[str(root / "labels")], output_dir=str(root / "few"), init_config=str(root / "config.json"),
                    tokenizer=str(root / "tokenizer"), max_steps=1, progress=False)
    with pytest.raises(ValueError, match="--eval-fraction 0 holds none out: .*or --calibration none"):
        TrainConfig(**settings, eval_fraction=0.0)
    with pytest.raises(ValueError, match=r"--calibration platt needs at least 32 held-out labels to fit; .* leaves "
                                         r"\d+: hold out more prompts"):
        train(TrainConfig(**settings, eval_fraction=0.02))
    with pytest.raises(ValueError, match=re.escape("calibration (--calibration) must be one of ('platt', 'isotonic', 'none'), got 'beta'")):
        TrainConfig(**settings, calibration="beta")
    one_class = [dict(row, q=[1.0] * len(row["q"]), n_success=[0] * len(row["q"]), n_mc=[0] * len(row["q"]),
                      first_pit=-1, outcome=1.0, prompt_value=math.nan, prompt_n_mc=0, prompt_n_success=0)
                 for row in _label_rows(ScriptedStepTask(num_steps=4), range(200, 210), n_cov=4, n_mc=2)]
    ShardStore(root / "one_class").write_shard(one_class)
    with pytest.raises(ValueError, match=r"all 160 held-out labels are 1.0, so there is no value-to-label relation"):
        train(TrainConfig(**settings, eval_labels=[str(root / "one_class")]))


def test_write_then_read_round_trips(tmp_path):
    calibration = Calibration("isotonic", {"x": [0.1, 0.5], "y": [0.2, 0.9]}, 40, "cd" * 32, {"ece": 0.1})
    read = read_calibration(write_calibration(calibration, tmp_path))
    assert read.to_json() == calibration.to_json() and np.allclose(read([0.3]), [0.55])


# ------------------------------------------------------------------------------------------------ diagnostics


def test_process_term_diagnostics_equal_loops():
    rng = np.random.default_rng(2)
    batch, slots = 12, 5
    num_steps = torch.tensor(rng.integers(0, slots + 1, batch))
    learned = torch.tensor(rng.normal(0, 0.1, (batch, slots)))
    exact = torch.tensor(rng.normal(0, 0.5, (batch, slots)))
    learned[1, :] = 0.0  # a response without any process signal
    slipped = torch.tensor(rng.random((batch, slots)) < 0.3)
    outcomes = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 6, 6])  # group 5: no response
    learned[6:8, :] = 0.0  # group 3 (mixed outcomes) silent
    learned[0, :] = 0.0  # group 0 (all 1) gets its signal only from response 1, also silent -> no signal
    threshold = 0.05

    real = [(i, h) for i in range(batch) for h in range(int(num_steps[i]))]
    a = np.array([float(learned[i, h]) for i, h in real])
    e = np.array([float(exact[i, h]) for i, h in real])
    want_r = np.sum((a - a.mean()) * (e - e.mean())) / math.sqrt(np.sum((a - a.mean()) ** 2) * np.sum((e - e.mean()) ** 2))
    assert process_term_correlation(learned, exact, num_steps) == pytest.approx(want_r, abs=1e-12)
    right = [abs(float(learned[i, h])) for i, h in real if not slipped[i, h]]
    slip = [abs(float(learned[i, h])) for i, h in real if slipped[i, h]]
    assert process_term_scale(learned, num_steps, slipped) == pytest.approx((np.mean(right), np.mean(slip)))

    members = {}
    for i, g in enumerate(groups.tolist()):
        members.setdefault(g, []).append(i)
    flat = [g for g, rows in members.items() if len({float(outcomes[i]) for i in rows}) == 1]
    signal = [g for g in flat if any(abs(float(learned[i, h])) > threshold
                                     for i in members[g] for h in range(int(num_steps[i])))]
    share_flat, share_signal = zero_outcome_groups_with_signal(learned, num_steps, outcomes, groups, 7, threshold)
    assert share_flat == pytest.approx(len(flat) / len(members))
    assert share_signal == pytest.approx(len(signal) / len(flat))
    metrics = process_term_diagnostics(learned, num_steps, slipped, outcomes, groups, 7, threshold, exact=exact)
    assert metrics["pav/process_corr"] == pytest.approx(want_r) and metrics["pav/zero_outcome_groups"] == share_flat
    assert set(metrics) == {"pav/process_corr", "pav/abs_adv_right", "pav/abs_adv_slipped", "pav/exact_abs_adv_right",
                            "pav/exact_abs_adv_slipped", "pav/zero_outcome_groups",
                            "pav/zero_outcome_groups_with_signal"}
    assert math.isnan(process_term_correlation(torch.zeros(2, 3), exact[:2, :3], torch.tensor([3, 3])))
    with pytest.raises(ValueError, match="slipped has shape"):
        process_term_scale(learned, num_steps, slipped[:, :2])
