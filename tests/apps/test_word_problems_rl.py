"""studies.word_problems_rl: the main_ppo command of a word-problem RL run (no run: the command is checked)."""

from __future__ import annotations

import pandas as pd

from studies.word_problems_rl import command


def _work_dir(tmp_path):
    rows = [{"data_source": "word_problems", "prompt": [{"role": "user", "content": f"q{i}"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i}}
            for i in range(10)]
    (tmp_path / "wp" / "data").mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(tmp_path / "wp" / "data" / "label.parquet")
    pd.DataFrame(rows).to_parquet(tmp_path / "wp" / "data" / "test.parquet")
    return tmp_path / "wp"


def test_grpo_is_verls_own_and_pav_tree_runs_the_hook_with_line_steps(tmp_path):
    work = _work_dir(tmp_path)
    grpo, run_dir = command(work, tmp_path / "rl", "grpo", 3, steps=20, lr=2e-6, test_freq=10, val_problems=4, skip=6)
    overrides = grpo[3:]
    keys = [a.lstrip("+").split("=", 1)[0] for a in overrides]
    assert len(keys) == len(set(keys)), "a key given twice"
    assert not [a for a in overrides if a.lstrip("+").startswith("verl_prm")]
    assert "algorithm.adv_estimator=grpo" in overrides and "data.seed=3" in overrides
    assert f"actor_rollout_ref.model.path={work / 'policy'}" in overrides and run_dir.name == "grpo_seed3"
    train = pd.read_parquet(tmp_path / "rl" / "data" / "train.parquet")
    val = pd.read_parquet(tmp_path / "rl" / "data" / "val.parquet")
    assert [r["index"] for r in train.extra_info] == [6, 7, 8, 9]  # the PAV's label problems are left out
    assert len(val) == 4
    tree = command(work, tmp_path / "rl", "pav_tree", 0, steps=20, lr=2e-6, test_freq=10, val_problems=4, skip=6)[0]
    assert {"+verl_prm=pav", "verl_prm.critic.source=tree", "algorithm.adv_estimator=pav_grpo",
            "verl_prm.steps.delimiter='\\n'", "verl_prm.steps.max_tokens=null"} <= set(tree)


def test_a_learning_rate_that_is_not_a_positive_finite_number_is_refused(tmp_path, capsys):
    import pytest

    from studies.word_problems_rl import main

    with pytest.raises(SystemExit):
        main(["--work-dir", str(tmp_path), "--out", str(tmp_path / "rl"), "--arm", "grpo", "--lr", "nan"])
    assert "argument --lr" in capsys.readouterr().err
