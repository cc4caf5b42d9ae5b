"""verl's ``main_ppo`` with the word-problem recipe's policy (SmolLM2-135M-Instruct after the recipe's SFT) on the
CPU loop: what one RL step costs, and short GRPO / ``pav_tree`` runs (``verl-prm recipe word-problems`` makes the
policy and the data; docs/real_model.md reports the runs).

    python -m studies.word_problems_rl --work-dir runs/wp --out runs/wp_rl --arm grpo --seed 0 --steps 20

Each run: 4 problems a step from the recipe's label pool (the first ``label_problems`` are skipped: the PAV's
labels), 4 responses each of at most 96 tokens, one step per line (``verl_prm.steps.delimiter='\\n'``), the
recipe's outcome reward; held-out accuracy on the first ``--val-problems`` test problems (temperature 1, one
sample) before training and every ``--test-freq`` steps. ``pav_tree`` samples each group as a tree (2 roots, one
branch point per root, 2 continuations; ``verl_prm.tree``) and adds the tree's node values through ``pav_grpo``.
A run resumes from its last checkpoint (``trainer.resume_mode=auto``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import pandas as pd

from verl_prm.apps.cpu_loop import LoopSize, main_ppo_args, read_metrics, start_main_ppo
from verl_prm.apps.word_problems import score
from verl_prm.choices import PRECISIONS
from verl_prm.cli_types import finite_float

ARMS = {
    "grpo": ["algorithm.adv_estimator=grpo"],
    "pav_tree": ["algorithm.adv_estimator=pav_grpo", "verl_prm.critic.path=null", "verl_prm.critic.source=tree"],
}
SIZE = LoopSize(prompts_per_step=4, responses_per_prompt=4, max_prompt_length=160, max_response_length=96)


def write_data(work_dir: Path, out: Path, skip: int, val_problems: int) -> tuple[Path, Path]:
    """The RL problems (the label pool after its first ``skip``) and the held-out problems, as verl parquet."""
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    train, val = data / "train.parquet", data / "val.parquet"
    pd.read_parquet(work_dir / "data" / "label.parquet").iloc[skip:].to_parquet(train)
    pd.read_parquet(work_dir / "data" / "test.parquet").iloc[:val_problems].to_parquet(val)
    return train, val


def command(work_dir: Path, out: Path, arm: str, seed: int, steps: int, lr: float, test_freq: int,
            val_problems: int, skip: int, precision: str = "auto", log_probs: bool = False) -> tuple[list[str], Path]:
    train, val = write_data(work_dir, out, skip, val_problems)
    run_dir = out / f"{arm}_seed{seed}"
    hook = [] if arm == "grpo" else ["verl_prm.steps.delimiter='\\n'", "verl_prm.steps.max_tokens=null"]
    # grpo: verl's own GRPO, no verl-prm config group and no trainer hook
    overrides = [
        *ARMS[arm], *hook,
        f"reward.custom_reward_function.path={score.__file__}",
        f"data.train_files={train}", f"data.val_files={val}", f"data.val_batch_size={val_problems}",
        f"data.seed={seed}", f"actor_rollout_ref.rollout.seed={seed}",
        f"actor_rollout_ref.model.path={work_dir / 'policy'}",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        "trainer.project_name=verl_prm_word_problems",
        # the rollout's log-probs beside the actor's: verl logs their gap (training/rollout_probs_diff_*)
        *(["actor_rollout_ref.rollout.calculate_log_probs=True"] if log_probs else []),
        f"trainer.default_local_dir={run_dir / 'checkpoints'}", "trainer.max_actor_ckpt_to_keep=1",
    ]
    args = main_ppo_args(out, "grpo", steps=steps, size=SIZE, run_name=f"{arm}_seed{seed}", test_freq=test_freq,
                         save_freq=test_freq, val_before_train=test_freq > 0, resume=True, plugin=arm != "grpo",
                         extra=overrides, precision=precision)
    return [sys.executable, "-m", "verl.trainer.main_ppo", *args], run_dir


def summary(metrics: list[dict]) -> dict:
    """Per logged step: the step's seconds, its generation seconds, the mean reward and response length; the
    held-out accuracy where evaluated."""
    rows = {}
    for record in metrics:
        data = record["data"]
        row = rows.setdefault(record["step"], {})
        for name, key in (("step_s", "timing_s/step"), ("gen_s", "timing_s/gen"), ("reward", "critic/score/mean"),
                          ("response_length", "response_length/mean"),
                          ("val", "val-core/word_problems/acc/mean@1"),
                          ("old_log_prob_s", "timing_s/old_log_prob"), ("update_actor_s", "timing_s/update_actor"),
                          ("update_weights_s", "timing_s/update_weights"), ("adv_s", "timing_s/adv"),
                          ("reward_s", "timing_s/reward"),
                          ("probs_diff_mean", "training/rollout_probs_diff_mean"),
                          ("probs_diff_max", "training/rollout_probs_diff_max")):
            if key in data:
                row[name] = data[key]
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.word_problems_rl", description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", type=Path, required=True, help="the word-problem recipe's work dir")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arm", choices=sorted(ARMS), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=finite_float(0.0, low_open=True), default=2e-6)
    parser.add_argument("--test-freq", type=int, default=10, help="-1: no held-out evaluation")
    parser.add_argument("--val-problems", type=int, default=64)
    parser.add_argument("--skip", type=int, default=48, help="label-pool problems the RL data leaves out")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto",
                        help="the rollout's and the actor's compute precision (verl_prm.precision)")
    parser.add_argument("--log-probs", action="store_true",
                        help="the rollout returns log-probs: verl logs their gap to the actor's")
    args = parser.parse_args(argv)
    cmd, run_dir = command(args.work_dir, args.out, args.arm, args.seed, args.steps, args.lr, args.test_freq,
                           args.val_problems, args.skip, args.precision, args.log_probs)
    run = start_main_ppo(cmd, run_dir / "metrics.jsonl", run_dir / "main_ppo.log", append_log=True)
    try:
        returncode = run.wait()
    finally:
        run.stop()
    result = {"returncode": returncode, "seconds": time.perf_counter() - run.started,
              "peak_rss_gib": run.peak_bytes / 2**30, "steps": summary(read_metrics(run_dir / "metrics.jsonl"))}
    (run_dir / "summary.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return returncode


if __name__ == "__main__":
    sys.exit(main())
