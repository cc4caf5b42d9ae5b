"""studies.word_problems_rl_report: the word-problem RL runs' tables from verl's file-logger records and validation
dumps (synthetic run directories), and their export in the arithmetic recipe's runs format."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from studies.word_problems_rl_report import (
    cost_table, export_runs, final_table, main, read_runs, run_measures, run_table, step_table)

VAL = "val-core/word_problems/acc/mean@1"
ENVIRONMENT = {"cpu": "Test CPU", "machine": "x86_64", "logical_cpus": 2, "cpus_available": 2, "cpu_flags": ["avx2"],
               "gpus": []}


def _settings(arm, seed, steps, **changes):
    return {"arm": arm, "seed": seed, "steps": steps, "prompts_per_step": 4, "responses_per_prompt": 4,
            "val_problems": 64, "skip": 896, "lr": 2e-6, **changes}


def _write_run(root, arm, seed, records, steps=4, parts=(), starts=((100.0, 1.5),), **settings):
    run = root / f"{arm}_seed{seed}"
    run.mkdir(parents=True)
    (run / "settings.json").write_text(json.dumps(_settings(arm, seed, steps, **settings)))
    for number, part in enumerate(parts, 1):  # the records of earlier starts, kept by verl_rl.start_run
        (run / f"metrics-{number}.jsonl").write_text(
            "".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in part))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in records))
    (run / "starts.jsonl").write_text("".join(json.dumps(
        {"seconds": seconds, "returncode": 0, "load_1min_mean": load, "load_1min_max": load,
         "environment": ENVIRONMENT}) + "\n" for seconds, load in starts))
    return run


def _step(reward, length=50.0, seconds=60.0, **extra):
    return {"critic/score/mean": reward, "response_length/mean": length, "timing_s/step": seconds, **extra}


def _t_test_p(first, second):
    """Welch's two-sided p from its definition: t and the Welch-Satterthwaite df from the sample moments, then
    1 - the integral of Student's t density over [-|t|, |t|] (Simpson's rule, 20,000 intervals)."""
    def moments(values):
        mean = sum(values) / len(values)
        return mean, sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)

    (m1, s1), (m2, s2) = moments(first), moments(second)
    t = abs(m1 - m2) / math.sqrt(s1 + s2)
    df = (s1 + s2) ** 2 / (s1 ** 2 / (len(first) - 1) + s2 ** 2 / (len(second) - 1))

    def density(x):
        return (math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
                * (1 + x * x / df) ** (-(df + 1) / 2))

    n, h = 20000, 2 * t / 20000
    return 1 - h / 3 * sum((1 if i in (0, n) else 4 if i % 2 else 2) * density(-t + i * h) for i in range(n + 1))


def test_a_runs_numbers_are_its_halves_its_last_records_its_earlier_starts_and_its_tree_tokens(tmp_path):
    earlier = [(0, {VAL: 0.5}), (1, _step(0.25)), (2, _step(0.5))]
    records = [(2, _step(0.75)),  # step 2 logged again by the resumed start: this record counts
               (2, {VAL: 0.625}), (3, _step(1.0, seconds=90.0)),
               (4, _step(0.0, length=40.0, **{"pav/tree_generated_tokens": 500.0}))]
    _write_run(tmp_path, "pav_tree", 1, records, parts=[earlier], starts=((100.0, 1.5), (250.0, 3.25)))
    (tmp_path / "data").mkdir()  # not a run
    runs = read_runs(tmp_path)
    assert list(runs) == ["pav_tree"] and list(runs["pav_tree"]) == [1] and runs["pav_tree"][1]["finished"]
    m = run_measures(runs["pav_tree"][1])
    # steps 1-4 trained; first half = steps 1, 2 (rewards 0.25, 0.75), second half = steps 3, 4 (1.0, 0.0)
    assert m["steps"] == 4 and m["reward_first"] == 0.5 and m["reward_second"] == 0.5
    assert m["curve"] == [(0, 0.5), (2, 0.625)]
    assert m["step_s"] == (60 + 60 + 90 + 60) / 4 and m["seconds"] == 350.0 and m["load_max"] == 3.25
    # 16 responses a step (4 problems x 4); the tree's step 4 generated 500 of its 640 trained tokens
    assert m["trained"] == (50 * 16 * 3 + 40 * 16) / 4 and m["generated"] == (50 * 16 * 3 + 500) / 4


def test_the_step_table_gives_seed_means_and_welchs_p_against_grpo_at_every_evaluated_step(tmp_path):
    finals = {("grpo", 0): 0.5, ("grpo", 1): 0.5625, ("grpo", 2): 0.53125,
              ("pav_tree", 0): 0.625, ("pav_tree", 1): 0.71875, ("pav_tree", 2): 0.6875}
    for (arm, seed), final in finals.items():
        _write_run(tmp_path, arm, seed, [(0, {VAL: 0.5 - seed / 64}), (1, _step(0.5)), (2, _step(final)),
                                         (2, {VAL: final})], steps=2)
    lines = step_table(read_runs(tmp_path))
    assert lines[0] == "| step | grpo (3 seeds) | pav_tree (3 seeds) |"
    grpo, tree = [finals[("grpo", s)] for s in range(3)], [finals[("pav_tree", s)] for s in range(3)]
    p_final = _t_test_p(tree, grpo)
    assert 0.01 < p_final < 0.05  # two decimals (format_p: three only below 0.01)
    # step 0: the same three values in both arms, so Welch's t is 0 and p is 1
    assert lines[2] == "| 0 | 0.484 ± 0.009 | 0.484 ± 0.009 (p 1.00) |"
    assert lines[3] == f"| 2 | 0.531 ± 0.018 | 0.677 ± 0.028 (p {p_final:.2f}) |"


def test_accuracy_at_equal_generated_tokens_reads_each_curve_at_shares_of_the_common_budget(tmp_path):
    # GRPO generates 100 tokens a step (length 6.25 x 16 responses), the tree 80 (its own metric); evaluations
    # at steps 0, 2, 4: GRPO's curve is at costs 0, 200, 400, the tree's at 0, 160, 320
    curves = {("grpo", 0): (0.4, 0.5, 0.6), ("grpo", 1): (0.4, 0.45, 0.7),
              ("pav_tree", 0): (0.4, 0.6, 0.7), ("pav_tree", 1): (0.4, 0.55, 0.8)}
    for (arm, seed), (a0, a2, a4) in curves.items():
        extra = {"pav/tree_generated_tokens": 80.0} if arm == "pav_tree" else {}
        steps = [(s, _step(0.5, length=6.25, **extra)) for s in range(1, 5)]
        _write_run(tmp_path, arm, seed, [(0, {VAL: a0}), *steps[:2], (2, {VAL: a2}), *steps[2:], (4, {VAL: a4})])
    lines = cost_table(read_runs(tmp_path), "generated_tokens")
    # B = 320 (the tree's total), K = 2 evaluations after step 0: budgets 160 and 320; GRPO's curve there by the
    # segment formula a_i + (b - c_i) / (c_{i+1} - c_i) (a_{i+1} - a_i), the tree's exactly at its evaluations
    grpo = {160: [a0 + 160 / 200 * (a2 - a0) for a0, a2, _ in (curves["grpo", 0], curves["grpo", 1])],
            320: [a2 + 120 / 200 * (a4 - a2) for _, a2, a4 in (curves["grpo", 0], curves["grpo", 1])]}
    tree = {160: [0.6, 0.55], 320: [0.7, 0.8]}
    for row, budget, share in zip(lines[2:], (160, 320), ("0.50", "1.00")):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[:2] == ["pav_tree", f"{budget} ({share})"]
        g, t = grpo[budget], tree[budget]
        assert cells[2] == f"{np.mean(g):.3f} ± {np.std(g, ddof=1) / math.sqrt(2):.3f}"
        assert cells[3] == f"{np.mean(t):.3f} ± {np.std(t, ddof=1) / math.sqrt(2):.3f}"
        assert cells[4] == f"{_t_test_p(t, g):.2f}"
    assert len(lines) == 4


def _dump(run, step, accuracies):
    (run / "validation").mkdir(exist_ok=True)
    (run / "validation" / f"{step}.jsonl").write_text("".join(
        json.dumps({"input": f"problem {i:02d}", "output": "...", "gts": str(i), "score": a, "acc": a, "step": step})
        + "\n" for i, a in enumerate(accuracies)))


def test_the_final_accuracy_has_a_bootstrap_interval_over_problems_and_a_paired_difference(tmp_path):
    rng = np.random.default_rng(5)
    results = {(arm, seed): (rng.random(24) < (0.5 if arm == "grpo" else 0.6)).astype(float).tolist()
               for arm in ("grpo", "pav_tree") for seed in (0, 1)}
    for (arm, seed), accuracies in results.items():
        run = _write_run(tmp_path, arm, seed, [(0, {VAL: 0.5}), (1, _step(0.5)), (2, _step(0.5)),
                                               (2, {VAL: float(np.mean(accuracies))})], steps=2)
        _dump(run, 2, accuracies)
    lines = final_table(read_runs(tmp_path), resamples=300)

    def interval(values):
        # the bootstrap by hand: 300 resamples of the 24 problems, drawn as stats.bootstrap draws them (one
        # default_rng(0), integers(0, P, P) a resample); the percentiles by linear interpolation between the order
        # statistics at rank q (R - 1)
        generator, means = np.random.default_rng(0), []
        for _ in range(300):
            picks = generator.integers(0, len(values), len(values))
            means.append(sum(values[i] for i in picks) / len(values))
        means.sort()

        def percentile(q):
            rank = q * (len(means) - 1)
            low = math.floor(rank)
            return means[low] + (rank - low) * (means[min(low + 1, len(means) - 1)] - means[low])

        return sum(values) / len(values), percentile(0.025), percentile(0.975)

    per_problem = {arm: [(results[arm, 0][i] + results[arm, 1][i]) / 2 for i in range(24)]
                   for arm in ("grpo", "pav_tree")}
    g, t = interval(per_problem["grpo"]), interval(per_problem["pav_tree"])
    d = interval([b - a for a, b in zip(per_problem["grpo"], per_problem["pav_tree"])])
    assert lines[2] == f"| grpo | 2 | 24 | {g[0]:.3f} [{g[1]:.3f}, {g[2]:.3f}] |  |"
    assert lines[3] == (f"| pav_tree | 2 | 24 | {t[0]:.3f} [{t[1]:.3f}, {t[2]:.3f}] | "
                        f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}] (24 problems) |")
    (tmp_path / "pav_tree_seed1" / "validation" / "2.jsonl").unlink()
    assert "no validation/<step>.jsonl of every finished seed" in final_table(read_runs(tmp_path), resamples=10)[3]


def test_the_export_is_read_back_by_the_arithmetic_tools_and_leaves_unfinished_runs_out(tmp_path):
    from studies.arithmetic_curves import read_runs as read_exported
    from studies.arithmetic_significance import significance_table
    from verl_prm.apps.arithmetic.evaluate import cost_curve

    finals = {("grpo", 0): 0.5, ("grpo", 1): 0.5625, ("pav_learned", 0): 0.625, ("pav_learned", 1): 0.75}
    for (arm, seed), final in finals.items():
        _write_run(tmp_path / "rl", arm, seed, [(0, {VAL: 0.5}), (1, _step(0.5)), (2, _step(final, seconds=30.0)),
                                                (2, {VAL: final})], steps=2)
    _write_run(tmp_path / "rl", "pav_tree", 0, [(0, {VAL: 0.5}), (1, _step(0.5))], steps=2)  # stopped at step 1
    path, left_out = export_runs(read_runs(tmp_path / "rl"), tmp_path / "runs.json")
    assert left_out == ["pav_tree seed 0"]
    exported = read_exported([path])
    assert sorted(exported) == ["grpo", "pav_learned"] and sorted(exported["grpo"]) == [0, 1]
    record = exported["pav_learned"][1]
    # (step, sampled responses = step x 16, accuracy), as verl_rl.read_run writes it
    assert record["outputs"]["curve"] == [[0, 0, 0.5], [2, 32, 0.75]]
    assert record["seconds"] == 100.0 and record["environment"] == ENVIRONMENT
    seconds = cost_curve(record["outputs"]["curve"], record["outputs"]["training"], "step_seconds")
    assert seconds == [(0, 0.5), (90.0, 0.75)]
    row = [line for line in significance_table(exported).splitlines() if line.startswith("| pav_learned |")][0]
    assert f"| {_t_test_p([0.625, 0.75], [0.5, 0.5625]):.2f} |" in row


def test_main_prints_every_table_and_writes_the_plot_and_the_export(tmp_path, capsys):
    for arm in ("grpo", "pav_tree"):
        for seed in (0, 1):
            _write_run(tmp_path / "rl", arm, seed, [(0, {VAL: 0.5}), (1, _step(0.5)), (2, _step(0.5 + seed / 8)),
                                                    (2, {VAL: 0.5 + seed / 8 + (arm == "pav_tree") / 16})], steps=2)
    assert main(["--runs", str(tmp_path / "rl"), "--plot", str(tmp_path / "curves.png"),
                 "--export", str(tmp_path / "runs.json"), "--resamples", "20"]) == 0
    out = capsys.readouterr().out
    for heading in ("### Runs", "### Held-out accuracy by step", "### Training reward and costs",
                    "### Held-out accuracy at equal generated tokens",
                    "### Held-out accuracy at equal training seconds",
                    "### Final held-out accuracy"):
        assert heading in out
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert len(json.loads((tmp_path / "runs.json").read_text())["runs"]) == 4


def test_a_run_without_records_a_missing_directory_and_one_without_runs_are_named(tmp_path, capsys):
    with pytest.raises(ValueError, match="--runs .*/absent: no such directory"):
        read_runs(tmp_path, tmp_path / "absent")
    with pytest.raises(ValueError, match="no <arm>_seed<seed> run directory there"):
        read_runs(tmp_path)
    (tmp_path / "grpo_seed0").mkdir()
    with pytest.raises(ValueError, match="grpo_seed0: no metrics.jsonl records"):
        read_runs(tmp_path)
    with pytest.raises(SystemExit):
        main(["--runs", str(tmp_path), "--resamples", "1"])
    assert "--resamples must be >= 2" in capsys.readouterr().err


def test_runs_are_read_from_several_directories_and_one_arm_and_seed_twice_is_refused(tmp_path, capsys):
    step = [(0, {VAL: 0.25}), (1, _step(0.5)), (1, {VAL: 0.5})]
    _write_run(tmp_path / "out", "grpo", 0, step, steps=1, policy_sha256="ab" * 32, compute_dtype="bfloat16")
    _write_run(tmp_path / "archive", "grpo", 1, step, steps=1, precision="auto")  # ENVIRONMENT: avx2, no avx512f
    runs = read_runs(tmp_path / "out", tmp_path / "archive")
    assert sorted(runs["grpo"]) == [0, 1]
    rows = run_table(runs)
    assert "| policy | dtype |" in rows[0]
    # each run's start policy (- before it was recorded) and compute dtype (auto without AVX-512: float32)
    assert rows[2].endswith(f"| `{'ab' * 6}` | bfloat16 |") and rows[3].endswith("| - | float32 |")
    (tmp_path / "out" / "grpo_seed0" / "DONE.json").write_text('{"seconds": 1}')
    shutil.copytree(tmp_path / "out" / "grpo_seed0", tmp_path / "archive" / "grpo_seed0")  # archived: read once
    assert read_runs(tmp_path / "out", tmp_path / "archive")["grpo"][0]["run_dir"] == tmp_path / "out" / "grpo_seed0"
    _write_run(tmp_path / "other", "grpo", 1, step, steps=1)
    with pytest.raises(SystemExit):
        main(["--runs", str(tmp_path / "archive"), str(tmp_path / "other")])
    assert "hold the same arm and seed" in capsys.readouterr().err
