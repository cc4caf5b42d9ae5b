"""The recipe's statistics: seed-mean curves, level crossings, the area under the accuracy curve, the bootstrap
over seeds, sample efficiency, the results table and the machine it states."""

from __future__ import annotations

import json
import random

import pytest




# ------------------------------------------------------------------------------------------- statistics


def test_interpolation_and_the_first_crossing_are_exact_on_piecewise_linear_curves():
    from verl_prm.apps.arithmetic.stats import first_crossing, interpolate

    xs, ys = [0, 10, 20], [0.2, 0.4, 0.6]
    assert interpolate(xs, ys, 15) == pytest.approx(0.5) and interpolate(xs, ys, 10) == 0.4
    assert first_crossing(xs, ys, 0.5) == pytest.approx(15.0)  # 10 + (0.5 - 0.4) / (0.6 - 0.4) * 10
    assert first_crossing(xs, ys, 0.4) == 10.0 and first_crossing(xs, ys, 0.1) == 0.0
    assert first_crossing(xs, ys, 0.61) is None
    # not monotone: the first segment that reaches the level, not the first point above it
    bumpy_x, bumpy_y = [0, 10, 20, 30], [0.2, 0.5, 0.3, 0.7]
    assert first_crossing(bumpy_x, bumpy_y, 0.4) == pytest.approx(10 * 0.2 / 0.3)
    assert first_crossing(bumpy_x, bumpy_y, 0.6) == pytest.approx(20 + 10 * 0.3 / 0.4)
    with pytest.raises(ValueError, match=r"x = 31 is outside the curve's range \[0, 30\]"):
        interpolate(bumpy_x, bumpy_y, 31)
    with pytest.raises(ValueError, match="x must increase strictly"):
        first_crossing([0, 10, 10], [0.1, 0.2, 0.3], 0.2)
    # random curves: the curve is at the level at the crossing, and below it on a fine grid before it
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 8)
        xs = sorted(rng.sample(range(0, 100), n))
        ys = [rng.random() for _ in range(n)]
        level = rng.uniform(0, 1.1)
        crossing = first_crossing(xs, ys, level)
        grid = [xs[0] + (xs[-1] - xs[0]) * k / 2000 for k in range(2001)]
        if crossing is None:
            assert max(ys) < level
            continue
        if crossing > xs[0]:
            assert interpolate(xs, ys, crossing) == pytest.approx(level, abs=1e-12)
        assert all(interpolate(xs, ys, x) < level for x in grid if x < crossing - 1e-9)


def test_normalised_auc_is_the_trapezoid_over_the_budget():
    from verl_prm.apps.arithmetic.stats import interpolate, normalised_auc

    # by hand: 10 * (0.2 + 0.4) / 2 + 20 * (0.4 + 0.1) / 2 = 3 + 5 = 8 over 30 steps
    assert normalised_auc([0, 10, 30], [0.2, 0.4, 0.1], 30) == pytest.approx(8 / 30)
    assert normalised_auc([0, 30], [0.5, 0.5], 30) == pytest.approx(0.5)
    # a midpoint sum of the interpolated curve converges to it
    xs, ys = [0, 5, 10, 20, 30], [0.19, 0.17, 0.25, 0.2, 0.31]
    midpoints = [(k + 0.5) * 30 / 30000 for k in range(30000)]
    assert normalised_auc(xs, ys, 30) == pytest.approx(sum(interpolate(xs, ys, x) for x in midpoints) / 30000, abs=1e-9)
    with pytest.raises(ValueError, match=r"the curve spans \[0, 25\], the budget is \[0, 30\]"):
        normalised_auc([0, 25], [0.1, 0.2], 30)


def test_bootstrap_is_seeded_resamples_within_each_group_and_matches_the_exact_bootstrap():
    import itertools

    import numpy as np

    from verl_prm.apps.arithmetic.stats import bootstrap, bootstrap_se

    groups = {"a": [0.0, 1.0, 3.0], "b": [2.0, 2.5, 5.0]}

    def difference(sample):
        assert len(sample["a"]) == 3 and set(sample["a"]) <= set(groups["a"]) and set(sample["b"]) <= set(groups["b"])
        return [np.mean(sample["b"]) - np.mean(sample["a"]), np.mean(sample["a"])]

    draws = bootstrap(difference, groups, resamples=2000, seed=7)
    assert draws.shape == (2000, 2)
    assert np.array_equal(draws, bootstrap(difference, groups, resamples=2000, seed=7))
    assert not np.array_equal(draws, bootstrap(difference, groups, resamples=2000, seed=8))
    # the ideal bootstrap: every one of the 3^3 x 3^3 equally likely resamples (a loop)
    exact = [np.mean(b) - np.mean(a) for a in itertools.product(groups["a"], repeat=3)
             for b in itertools.product(groups["b"], repeat=3)]
    assert bootstrap_se(draws[:, 0])[0] == pytest.approx(np.std(exact), rel=0.05)
    # the mean of n values: the bootstrap variance is the population variance over n
    population = np.var(groups["a"])  # ((0 - 4/3)^2 + (1 - 4/3)^2 + (3 - 4/3)^2) / 3 = 14/9
    assert population == pytest.approx(14 / 9)
    assert bootstrap_se(draws[:, 1])[0] == pytest.approx(np.sqrt(population / 3), rel=0.05)
    se, undefined = bootstrap_se([1.0, 2.0, float("nan"), float("inf")])
    assert se == pytest.approx(np.sqrt(0.5)) and undefined == 0.5
    with pytest.raises(ValueError, match="resamples must be an integer >= 2, got 1"):
        bootstrap(difference, groups, resamples=1, seed=0)


def test_mean_curve_needs_the_same_evaluations_in_every_seed():
    from verl_prm.apps.arithmetic.stats import mean_curve

    curve = [(0, 0, 0.2), (10, 160, 0.4), (20, 320, 0.6)]
    mean, se = mean_curve([curve, [(0, 0, 0.4), (10, 160, 0.6), (20, 320, 0.8)]])
    assert [m[:2] for m in mean] == [(0, 0), (10, 160), (20, 320)]
    assert [m[2] for m in mean] == pytest.approx([0.3, 0.5, 0.7]) and se == pytest.approx([0.1, 0.1, 0.1])
    with pytest.raises(ValueError, match=r"curve 1 is evaluated at steps \[0, 10\], curve 0 at \[0, 10, 20\]"):
        mean_curve([curve, curve[:2]])


def _rl_run(values, step=10):  # 16 sampled responses per step
    return {"curve": [(step * i, 16 * step * i, v) for i, v in enumerate(values)],
            "training": [{"step": 1, "zero_signal_groups": 0.5}], "final": {"accuracy": values[-1]}}


def test_sample_efficiency_is_the_steps_to_grpos_accuracy_at_two_thirds_of_its_budget():
    import itertools

    import numpy as np

    from verl_prm.apps.arithmetic.evaluate import efficiency_statistics, summarise_arms

    runs = {"grpo": {0: _rl_run([0.2, 0.3, 0.4, 0.5]), 1: _rl_run([0.2, 0.3, 0.4, 0.5])},
            "pav_exact": {0: _rl_run([0.2, 0.5, 0.5, 0.6]), 1: _rl_run([0.2, 0.5, 0.5, 0.6])}}
    arms = summarise_arms(runs, budget=30, resamples=200)
    grpo, pav = arms["grpo"], arms["pav_exact"]
    # L: GRPO at step 20 (2/3 of 30) = 0.4, which GRPO reaches at 20 and PAV at 0 + (0.4 - 0.2) / 0.3 * 10
    assert pav["level"] == pytest.approx(0.4) and pav["level_step"] == pytest.approx(20)
    assert grpo["steps_to_level"] == pytest.approx(20) and grpo["efficiency"] == pytest.approx(1.0)
    assert pav["reference_steps_to_level"] == pytest.approx(20)
    assert pav["steps_to_level"] == pytest.approx(20 / 3) and pav["samples_to_level"] == pytest.approx(16 * 20 / 3)
    assert pav["efficiency"] == pytest.approx(3.0)
    # areas by hand: (10 (0.2 + 0.3) + 10 (0.3 + 0.4) + 10 (0.4 + 0.5)) / 2 / 30, and the same for PAV
    assert grpo["auc"] == pytest.approx(10.5 / 30) and pav["auc"] == pytest.approx(14 / 30)
    assert pav["auc_gain"] == pytest.approx(3.5 / 30) and pav["auc_by_seed"] == pytest.approx([14 / 30] * 2)
    # identical seeds: no spread in any resample
    assert pav["efficiency_se"] == pytest.approx(0, abs=1e-12) and pav["auc_se"] == pytest.approx(0, abs=1e-12)
    assert pav["efficiency_undefined_share"] == 0
    assert pav["final_accuracy"] == 0.6 and pav["final_accuracy_se"] == 0.0

    # seeds that differ: the bootstrap's error against the exact bootstrap over the 2^2 x 2^2 resamples
    runs = {"grpo": {0: _rl_run([0.2, 0.3, 0.4, 0.5]), 1: _rl_run([0.2, 0.2, 0.3, 0.6])},
            "pav_exact": {0: _rl_run([0.2, 0.5, 0.5, 0.6]), 1: _rl_run([0.2, 0.3, 0.6, 0.5])}}
    curves = {arm: [seeds[s]["curve"] for s in sorted(seeds)] for arm, seeds in runs.items()}
    exact = [efficiency_statistics(ref, arm, budget=30, level_fraction=2 / 3)
             for ref in itertools.product(curves["grpo"], repeat=2)
             for arm in itertools.product(curves["pav_exact"], repeat=2)]
    arms = summarise_arms(runs, budget=30, resamples=2000, seed=3)
    for name in ("level", "steps_to_level", "efficiency", "auc", "auc_gain"):
        assert arms["pav_exact"][f"{name}_se"] == pytest.approx(np.std([e[name] for e in exact]), rel=0.06), name
    assert arms == summarise_arms(runs, budget=30, resamples=2000, seed=3)  # seeded: the same again

    # an arm that never reaches L; a run that stopped early
    runs["grpo"] = {0: _rl_run([0.2, 0.3, 0.4, 0.5]), 1: _rl_run([0.2, 0.3, 0.4, 0.5])}
    runs["pav_exact"] = {0: _rl_run([0.2, 0.25, 0.3, 0.35]), 1: _rl_run([0.2, 0.25, 0.3, 0.35])}
    never = summarise_arms(runs, budget=30, resamples=50)["pav_exact"]
    assert never["steps_to_level"] is None and np.isnan(never["efficiency"])
    assert never["steps_to_level_undefined_share"] == 1.0
    runs["pav_exact"][1] = _rl_run([0.2, 0.25, 0.3])
    with pytest.raises(ValueError, match=r"pav_exact seed 1 spans steps \[0, 10, 20\]; the statistics need steps 0 to"):
        summarise_arms(runs, budget=30, resamples=50)


def test_results_table_states_the_machine_the_level_and_too_few_seeds(tmp_path):
    from verl_prm.apps.arithmetic.evaluate import summarise_arms, write_table

    runs = {"grpo": {0: _rl_run([0.2, 0.3, 0.4, 0.5]), 1: _rl_run([0.2, 0.3, 0.4, 0.5])},
            "pav_exact": {0: _rl_run([0.2, 0.5, 0.5, 0.6]), 1: _rl_run([0.2, 0.5, 0.5, 0.6])}}
    environment = {"cpu": "AMD EPYC", "machine": "x86_64", "logical_cpus": 2, "cpus_available": 2,
                   "cpu_flags": ["avx512f", "avx2"], "torch_cpu_capability": "AVX512", "torch_threads": 1, "gpus": [],
                   "python": "3.11.7", "packages": {"torch": "2.13.0+cpu", "verl": "0.9.1"}}
    results = {"arms": summarise_arms(runs, budget=30, resamples=50), "runs": runs, "environment": environment,
               "settings": {"rl": {"eval_samples": 4}},
               "prover": {"group_size": 8, "success": 0.2, "zero_signal_groups": 0.17, "all_fail_groups": 0.17,
                          "step_accuracy": 0.66},
               "policies": {"base": {"accuracy": 0.18, "samples_per_problem": 4}},
               "critic": {"label_auroc": 0.6, "step_auroc": 0.9, "steps_scored": 10, "wrong_step_share": 0.5,
                          "mean_value_drop_at_first_wrong_step": 0.1}, "search": {}}
    text = write_table(results, tmp_path / "results.md", tmp_path / "results.json")
    assert text.startswith("Machine: AMD EPYC (x86_64), 2 logical CPUs (2 available), flags avx512f avx2, torch "
                           "kernels AVX512, 1 torch threads; GPUs: none;")
    assert "L = 0.400, GRPO's seed-mean held-out accuracy at step 20 (0.667 of its 30 steps)" in text
    assert "4 samples per test prompt per evaluation" in text and "50 resamples, seed 0" in text
    row = next(line for line in text.splitlines() if line.startswith("| PAV-GRPO, exact prover"))
    assert row.split(" | ")[4:8] == ["0.467 ± 0.000", "6.7 ± 0.0", "107 ± 0", "3.00 ± 0.00x"], row
    grpo_row = next(line for line in text.splitlines() if line.startswith("| GRPO"))
    assert grpo_row.split(" | ")[4:8] == ["0.350 ± 0.000", "20.0 ± 0.0", "320 ± 0", "1x (the reference)"], grpo_row
    assert "**Fewer than 3 seeds** (grpo: 2, pav_exact: 2)" in text
    assert json.loads((tmp_path / "results.json").read_text())["arms"]["pav_exact"]["efficiency"] == pytest.approx(3.0)


def test_cpu_info_reads_the_model_the_cpus_and_the_avx_flags():
    from verl_prm.apps.arithmetic.machine import cpu_info
    from verl_prm.apps.arithmetic.pipeline import environment

    text = ("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2 avx512f avx512bw\n\n"
            "processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2 avx512f avx512bw\n")
    assert cpu_info(text) == {"cpu": "AMD EPYC 7B13", "logical_cpus": 2, "cpu_flags": ["avx512f", "avx2"]}
    assert cpu_info("processor : 0\nflags : fpu sse\n") == {"cpu": None, "logical_cpus": 1, "cpu_flags": []}
    env = environment()
    assert env["logical_cpus"] >= env["cpus_available"] >= 1 and isinstance(env["gpus"], list)


def test_every_scale_evaluates_with_4_samples_and_a_changed_statistic_is_detected_on_resume(tmp_path):
    from dataclasses import replace

    from verl_prm.apps.arithmetic.pipeline import SCALES, stages_of

    for name, scale in SCALES.items():
        assert scale.eval_samples >= 4 and scale.rl.eval_samples >= 4, name
    assert SCALES["cpu"].rl_seeds == (0, 1, 2) and SCALES["cpu"].bootstrap_resamples == 2000
    with pytest.raises(ValueError, match=r"rl.eval_samples must be >= 4 samples per test prompt, got 1"):
        replace(SCALES["cpu"], rl=replace(SCALES["cpu"].rl, eval_samples=1))
    with pytest.raises(ValueError, match=r"eval_samples must be >= 4 samples per test prompt, got 2"):
        replace(SCALES["cpu"], eval_samples=2)
    with pytest.raises(ValueError, match=r"level_fraction must be in \(0, 1\] \(a finite number\), got nan"):
        replace(SCALES["cpu"], level_fraction=float("nan"))
    with pytest.raises(ValueError, match="bootstrap_resamples must be an integer >= 2, got 1"):
        replace(SCALES["cpu"], bootstrap_resamples=1)
    scale = replace(SCALES["micro"], rl_arms=("grpo",))
    stages = stages_of(scale, tmp_path)
    for stage in (stages["evaluate"], stages["rl"].parts[0]):
        stage.path.mkdir(parents=True)
        stage.finish({}, 1.0, env={})
    other = stages_of(replace(scale, level_fraction=0.5), tmp_path)
    with pytest.raises(ValueError, match=r"other settings \(statistics\[0\]: 0.6666666666666666 -> 0.5\)"):
        other["evaluate"].done()
    more = stages_of(replace(scale, rl=replace(scale.rl, eval_samples=8)), tmp_path)
    with pytest.raises(ValueError, match=r"other settings \(rl.eval_samples: 4 -> 8\)"):
        more["rl"].parts[0].done()


def test_process_summary_averages_each_seeds_steps_then_the_seeds_and_prices_the_steps_to_level():
    """evaluate.process_summary: per seed the mean over its logged steps (a metric a step did not log is skipped,
    one no step logged is nan), then the mean over seeds; tokens per step = responses + continuations; the steps to
    L times the per-step cost are the tokens and seconds to L (summarise_arms), shown by process_table."""
    from verl_prm.apps.arithmetic.evaluate import process_summary, process_table, summarise_arms

    nan = float("nan")
    seed0 = [{"zero_signal_groups": 0.5, "process_corr": 0.5, "mc_tokens": 300.0, "response_tokens": 100.0, "step_seconds": 2.0},
             {"zero_signal_groups": 0.5, "process_corr": 0.7, "mc_tokens": 500.0, "response_tokens": 100.0, "step_seconds": 4.0}]
    seed1 = [{"zero_signal_groups": 0.5, "process_corr": 0.9, "mc_tokens": 400.0, "response_tokens": 300.0, "step_seconds": 3.0},
             {"zero_signal_groups": 0.5, "process_corr": nan, "mc_tokens": 400.0, "response_tokens": 300.0, "step_seconds": 3.0}]
    summary = process_summary([seed0, seed1])
    assert summary["process_corr"] == pytest.approx((0.6 + 0.9) / 2)
    assert summary["tokens_per_step"] == pytest.approx((100 + 300) / 2 + (400 + 400) / 2)
    assert summary["seconds_per_step"] == pytest.approx(3.0)
    assert summary["abs_adv_slipped"] is None  # never logged (an arm without a reference)
    runs = {"grpo": {s: _rl_run([0.2, 0.3, 0.4, 0.5]) for s in (0, 1)},
            "pav_mc": {0: {**_rl_run([0.2, 0.5, 0.5, 0.6]), "training": seed0},
                       1: {**_rl_run([0.2, 0.5, 0.5, 0.6]), "training": seed1}}}
    arms = summarise_arms(runs, budget=30, resamples=20)
    mc = arms["pav_mc"]
    assert mc["tokens_to_level"] == pytest.approx(mc["steps_to_level"] * 600.0)
    assert mc["seconds_to_level"] == pytest.approx(mc["steps_to_level"] * 3.0)
    row = next(line for line in process_table(arms) if line.startswith("| PAV-GRPO, Monte-Carlo"))
    assert row.split(" | ")[1] == "0.750" and "600 (400)" in row, row


def test_refresh_summary_means_each_refresh_step_over_the_seeds_that_refreshed_there():
    """evaluate.refresh_summary: only the steps that logged pav/refresh/labels are refresh steps; each metric is
    the mean over the seeds that logged it at that step (an AUROC left out for one-class labels is skipped, not
    counted as 0); refresh_table prints a row per arm and refresh step, and nothing for arms that never refreshed."""
    from verl_prm.apps.arithmetic.evaluate import refresh_summary, refresh_table, summarise_arms

    nan = float("nan")

    def step(s, labels=nan, mse=nan, constant=nan, auroc=nan, seconds=nan):
        return {"step": s, "zero_signal_groups": 0.5, "refresh_labels": labels, "refresh_mse": mse,
                "refresh_mse_constant": constant, "refresh_auroc": auroc, "refresh_seconds": seconds}

    seed0 = [step(1), step(5, 600.0, 0.10, 0.20, 0.80, 90.0), step(6), step(10, 500.0, 0.05, 0.20, nan, 80.0)]
    seed1 = [step(1), step(5, 400.0, 0.30, 0.25, 0.60, 70.0), step(6)]
    rows = refresh_summary([seed0, seed1])
    assert [r["step"] for r in rows] == [5, 10] and [r["seeds"] for r in rows] == [2, 1]
    assert rows[0]["refresh_labels"] == pytest.approx(500.0)
    assert rows[0]["refresh_mse"] == pytest.approx(0.20) and rows[0]["refresh_auroc"] == pytest.approx(0.70)
    assert rows[1]["refresh_auroc"] is None and rows[1]["refresh_mse"] == pytest.approx(0.05)
    assert refresh_summary([[step(1), step(2)]]) == []

    runs = {"grpo": {s: {**_rl_run([0.2, 0.3, 0.4, 0.5]), "training": [step(1)]} for s in (0, 1)},
            "pav_learned_refresh": {0: {**_rl_run([0.2, 0.4, 0.5, 0.6]), "training": seed0},
                                    1: {**_rl_run([0.2, 0.4, 0.5, 0.6]), "training": seed1}}}
    table = refresh_table(summarise_arms(runs, budget=30, resamples=20))
    body = [line for line in table if line.startswith("| PAV-GRPO")]
    assert len(body) == 2, table  # GRPO never refreshed: no row
    assert body[0].split(" | ")[1:7] == ["5", "2", "500", "0.200", "0.225", "0.700"], body[0]
    assert body[1].split(" | ")[6] == "n/a", body[1]
    assert refresh_table(summarise_arms({"grpo": runs["grpo"]}, budget=30, resamples=20)) == []


def test_cost_curve_sums_each_evaluations_training_steps_and_names_a_missing_one():
    from verl_prm.apps.arithmetic.evaluate import cost_curve

    curve = [(0, 0, 0.1), (2, 16, 0.2), (3, 24, 0.4)]
    training = [{"step": 3, "generated_tokens": 5.0}, {"step": 1, "generated_tokens": 10.0},
                {"step": 2, "generated_tokens": 20.0}]
    # by hand: nothing before training, then 10 + 20, then 10 + 20 + 5
    assert cost_curve(curve, training, "generated_tokens") == [(0.0, 0.1), (30.0, 0.2), (35.0, 0.4)]
    with pytest.raises(ValueError, match=r"training steps \[2\] have no record of 'generated_tokens'"):
        cost_curve(curve, [training[0], training[1]], "generated_tokens")
