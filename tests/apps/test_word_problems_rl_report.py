"""studies.word_problems_rl_report: the word-problem RL runs' table from verl's file-logger records."""

from __future__ import annotations

import json
import math

import pytest

from studies.word_problems_rl_report import main, read_runs, run_measures, table

VAL = "val-core/word_problems/acc/mean@1"


def _write_run(root, name, records):
    run = root / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in records))


def _step(reward, length=50.0, seconds=60.0, **extra):
    return {"critic/score/mean": reward, "response_length/mean": length, "timing_s/step": seconds, **extra}


def test_a_runs_numbers_are_its_halves_its_last_records_and_its_tree_tokens(tmp_path):
    records = [(0, {VAL: 0.5}), (1, _step(0.25)), (2, _step(0.5)), (3, _step(1.0, seconds=90.0)),
               (2, _step(0.75)),  # step 2 logged again by a resumed run: this record counts
               (3, {VAL: 0.625}),
               (4, _step(0.0, length=40.0, **{"pav/tree_generated_tokens": 500.0}))]
    _write_run(tmp_path, "pav_tree_seed1", records)
    (tmp_path / "data").mkdir()  # the study's parquet folder is not a run
    runs = read_runs(tmp_path)
    assert list(runs) == ["pav_tree"] and list(runs["pav_tree"]) == [1]
    m = run_measures(runs["pav_tree"][1], VAL)
    # steps 1-4 trained; first half = steps 1, 2 (rewards 0.25, 0.75), second half = steps 3, 4 (1.0, 0.0)
    assert m["steps"] == 4 and m["reward_first"] == 0.5 and m["reward_second"] == 0.5
    assert m["curve"] == [(0, 0.5), (3, 0.625)]
    assert m["step_s"] == (60 + 60 + 90 + 60) / 4
    # 16 responses a step (4 problems x 4); the tree's step 4 generated 500 of its 640 trained tokens
    assert m["trained"] == (50 * 16 * 3 + 40 * 16) / 4 and m["generated"] == (50 * 16 * 3 + 500) / 4


def test_the_arm_rows_give_seed_means_and_welchs_p_against_grpo(tmp_path):
    finals = {("grpo", 0): 0.5, ("grpo", 1): 0.5625, ("pav_tree", 0): 0.625, ("pav_tree", 1): 0.71875}
    for (arm, seed), final in finals.items():
        _write_run(tmp_path, f"{arm}_seed{seed}", [(0, {VAL: 0.5}), (1, _step(0.5)), (2, _step(final)),
                                                   (2, {VAL: final})])
    text = table(read_runs(tmp_path), problems=64)
    # per run: the standard error over 64 problems of 0.625 is sqrt(0.625 * 0.375 / 64) = 0.0605
    assert "| pav_tree | 0 | 0: 0.500 ± 0.062, 2: 0.625 ± 0.061 | 0.500 / 0.625 | 60.0 | 800 (800) |" in text
    # Welch by hand: means 0.53125 and 0.671875, sample variances 2 * 0.03125^2 and 2 * 0.046875^2, each / 2 seeds
    s1, s2 = 2 * 0.03125 ** 2 / 2, 2 * 0.046875 ** 2 / 2
    t = (0.671875 - 0.53125) / math.sqrt(s1 + s2)
    df = (s1 + s2) ** 2 / (s1 ** 2 + s2 ** 2)
    assert round(t, 3) == 2.496 and round(df, 2) == 1.74
    # two-sided p: 1 - the integral of Student's t density over [-t, t] (Simpson's rule, 20,000 intervals)
    def density(x):
        return (math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
                * (1 + x * x / df) ** (-(df + 1) / 2))
    n, h = 20000, 2 * t / 20000
    inside = h / 3 * sum((1 if i in (0, n) else 4 if i % 2 else 2) * density(-t + i * h) for i in range(n + 1))
    p_value = 1 - inside
    assert 0.1 < p_value < 0.15
    row = [line for line in text.splitlines() if line.startswith("| pav_tree | 0, 1 |")][0]
    assert "0.500 ± 0.000 -> 0.672 ± 0.047" in row and row.endswith(f"| {p_value:.2f} / {p_value:.2f} |")


def test_a_run_without_records_is_named(tmp_path, capsys):
    (tmp_path / "grpo_seed0").mkdir()
    with pytest.raises(ValueError, match="grpo_seed0: no metrics.jsonl records"):
        read_runs(tmp_path)
    with pytest.raises(SystemExit):
        main(["--runs", str(tmp_path), "--problems", "0"])
    assert "--problems must be >= 1" in capsys.readouterr().err
