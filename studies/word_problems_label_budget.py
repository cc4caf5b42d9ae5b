"""Labels that pay (issue 57 item 2): at equal CPU time, many problems with few continuations per step prefix
against fewer problems with more, judged by the held-out step AUROC of the PAV each label set trains.

Two steps, each resumable by its outputs:

    # 1. what a problem costs at each n_mc: the recipe's labeller on the same problems, one torch thread
    python -m studies.word_problems_label_budget cost --work-dir runs/wp --problems 8 --n-mc 1,2,4 \\
        --out runs/wp_budget
    # 2. label sets of equal cost drawn from one n_mc = 4 labelling run, a PAV trained on each, judged on held-out
    python -m studies.word_problems_label_budget compare --work-dir runs/wp --labels runs/wp/labels \\
        --eval-labels runs/wp/heldout_labels --budget-problems 200 --n-mc 1,2,4 --out runs/wp_budget

``cost`` runs the labeller (``verl_prm.labeling.MonteCarloLabeler``, the settings of the recipe's label stage:
``n_cov`` rollouts, every step prefix, at most 6 steps) at each ``n_mc`` on the first ``--problems`` label
problems and records the process CPU seconds per problem (``resource.getrusage``: the time this process ran,
not the time other processes held the cores) and the sequences generated. ``compare`` fixes a budget, the CPU time
of ``--budget-problems`` problems at the largest ``n_mc``, and for each ``n_mc`` takes as many problems as that
budget pays for (``budget / cost(n_mc)``), their labels drawn from the ``n_mc = 4`` run's counts
(``verl_prm.labeling.subsample``: the law of fresh continuations), trains a PAV on them (format ``token_logprob``:
a logistic head on the policy's own token log-probs, the critic that ranks these steps; docs/real_model.md) and
reports the held-out AUROC against ``prefix_correct`` and the
Monte-Carlo label with bootstrap intervals over problems (``studies.word_problems_pav``).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Sequence

import pyarrow.parquet as pq

from studies import word_problems_pav as heldout
from verl_prm.cli_types import finite_float

SCORE_FUNCTION = "pkg://verl_prm.apps.word_problems.score:compute_score"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def at_least(low: int):
    """An argparse ``type``: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    return parse


def n_mc_list(text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--n-mc takes integers separated by commas, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"--n-mc values must be >= 1, got {text!r}")
    return values


def measure_cost(args) -> dict:
    """CPU seconds per problem of the recipe's labeller at each n_mc (one torch thread, the same problems)."""
    import torch

    from verl_prm.apps.word_problems.pipeline import MAX_STEPS, RecipeConfig, generator
    from verl_prm.apps.word_problems.task import STEP_DELIMITER
    from verl_prm.labeling.inputs import read_prompts, render_prompt
    from verl_prm.labeling.monte_carlo import LabelSettings, MonteCarloLabeler
    from verl_prm.labeling.runner import run_labeling
    from verl_prm.labeling.scoring import OutcomeScorer, load_reward_function
    from verl_prm.labeling.store import ShardStore

    torch.set_num_threads(1)
    out = Path(args.out)
    path = out / "cost.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    config = RecipeConfig()
    policy = str(Path(args.work_dir) / "policy")
    engine = generator(config, policy)
    items = read_prompts(str(Path(args.work_dir) / "data" / "label.parquet"), limit=args.problems)
    scorer = OutcomeScorer(load_reward_function(SCORE_FUNCTION))
    for n_mc in args.n_mc:
        key = str(n_mc)
        if key in record and record[key]["problems"] == args.problems:
            print(f"[budget] cost n_mc={n_mc}: measured before, {record[key]['cpu_seconds_per_problem']:.1f} s/problem")
            continue
        settings = LabelSettings(n_cov=config.n_cov, n_mc=n_mc, prefix_rule="every", delimiter=STEP_DELIMITER,
                                 max_steps=MAX_STEPS, seed=0, source=policy)
        store = ShardStore(out / f"cost_labels_n{n_mc}")
        store.check_config({"n_mc": n_mc, "problems": args.problems, "policy": policy})
        labeler = MonteCarloLabeler(engine, engine, scorer, settings)
        started, wall = cpu_seconds(), time.perf_counter()
        summary = run_labeling(items, lambda item: render_prompt(item, tokenizer=engine.tokenizer), labeler, store,
                               shard_size=args.problems, progress=False)
        if summary.get("skipped"):
            raise RuntimeError(f"{store.directory} held labels already: remove it to measure n_mc={n_mc} again")
        used = cpu_seconds() - started
        record[key] = {"problems": args.problems, "cpu_seconds": round(used, 1),
                       "cpu_seconds_per_problem": round(used / args.problems, 2),
                       "wall_seconds": round(time.perf_counter() - wall, 1), "summary": summary}
        print(f"[budget] cost n_mc={n_mc}: {used / args.problems:.1f} CPU s/problem", flush=True)
        path.write_text(json.dumps(record, indent=2))
    return record


def budget_sizes(costs: dict, n_mcs: Sequence[int], budget_problems: int) -> dict[int, int]:
    """Problems each n_mc gets for the CPU time of ``budget_problems`` problems at the largest n_mc."""
    largest = max(n_mcs)
    budget = budget_problems * costs[str(largest)]["cpu_seconds_per_problem"]
    # floor(budget / cost), with a margin for the float product (100 * 9.4 / 9.4 is 99.999...)
    return {m: budget_problems if m == largest else int(budget / costs[str(m)]["cpu_seconds_per_problem"] + 1e-9)
            for m in n_mcs}


def compare(args) -> dict:
    import numpy as np
    import torch

    from verl_prm.labeling.format import read_labels, rows_to_table
    from verl_prm.labeling.subsample import subsample_labels
    from verl_prm.training import TrainConfig, train

    torch.set_num_threads(1)
    out = Path(args.out)
    costs = json.loads((out / "cost.json").read_text())
    missing = [m for m in args.n_mc if str(m) not in costs]
    if missing:
        raise SystemExit(f"no cost measured for n_mc {missing}: run `cost` with --n-mc including them first")
    sizes = budget_sizes(costs, args.n_mc, args.budget_problems)
    labels = read_labels(args.labels)
    prompts = sorted(labels["prompt_index"].unique())
    largest = max(sizes.values())
    if largest > len(prompts):
        raise SystemExit(f"the budget needs {largest} labelled problems for n_mc={min(args.n_mc)} but {args.labels} "
                         f"holds {len(prompts)}: lower --budget-problems or label more")
    results_path = out / "compare.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for m, problems in sizes.items():
        key = f"n_mc={m},problems={problems},seed={args.seed}"
        if key in results:
            print(f"[budget] {key}: done before")
            continue
        chosen = set(prompts[:problems])
        frame = labels[labels["prompt_index"].isin(chosen)].reset_index(drop=True)
        frame = subsample_labels(frame, m, seed=args.seed) if m < 4 else frame
        shard_dir = out / f"labels_n{m}_p{problems}_s{args.seed}"
        shard_dir.mkdir(parents=True, exist_ok=True)
        pq.write_table(rows_to_table(frame.drop(columns=[c for c in frame.columns if c.startswith("_")])
                                     .to_dict("records")), shard_dir / "shard-00000.parquet")
        critic_dir = out / f"pav_n{m}_p{problems}_s{args.seed}"
        if not (critic_dir / "config.json").is_file():
            train(TrainConfig(labels=[str(shard_dir)], output_dir=str(critic_dir),
                              init=str(Path(args.work_dir) / "policy"), format="token_logprob", eval_fraction=0.0,
                              head_l2=args.l2, cpu=True, progress=False, calibration="none", seed=args.seed))
        judged = heldout.run(argparse.Namespace(
            critic=[f"pav={critic_dir}"], export_critic=None, work_dir=Path(args.work_dir), labels=[shard_dir],
            eval_labels=args.eval_labels, out=out / f"heldout_n{m}_p{problems}_s{args.seed}", export_heldout=None,
            export_train_problems=None, resamples=args.resamples, seed=args.seed, level=args.level,
            device=args.device))
        metrics = {name: judged["critics"]["pav"][name] for name in ("prefix_correct", "mc_label", "prompt_value")}
        results[key] = {"n_mc": m, "problems": problems, "labelled_steps": int(np.sum(frame["q"].map(len))),
                        "budget_cpu_seconds": round(problems * costs[str(m)]["cpu_seconds_per_problem"], 1),
                        **metrics}
        results_path.write_text(json.dumps(heldout.json_safe(results), indent=2))
        print(f"[budget] {key}: {json.dumps(heldout.json_safe(metrics))}", flush=True)
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies.word_problems_label_budget", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    cost = sub.add_parser("cost", help="CPU seconds per labelled problem at each n_mc")
    cost.add_argument("--work-dir", required=True)
    cost.add_argument("--problems", type=at_least(1), default=8)
    cost.add_argument("--n-mc", type=n_mc_list, default=[1, 2, 4])
    cost.add_argument("--out", required=True)
    comp = sub.add_parser("compare", help="PAVs trained on label sets of equal CPU cost, judged on held-out problems")
    comp.add_argument("--work-dir", required=True)
    comp.add_argument("--labels", nargs="+", required=True)
    comp.add_argument("--eval-labels", nargs="+", required=True)
    comp.add_argument("--budget-problems", type=at_least(1), required=True)
    comp.add_argument("--n-mc", type=n_mc_list, default=[1, 2, 4])
    comp.add_argument("--l2", type=finite_float(0.0), default=1.0, help="the head's ridge penalty (--head-l2)")
    comp.add_argument("--seed", type=at_least(0), default=0)
    comp.add_argument("--resamples", type=at_least(1), default=2000)
    comp.add_argument("--level", type=finite_float(0.0, 1.0, low_open=True, high_open=True), default=0.95)
    comp.add_argument("--device", default="cpu")
    comp.add_argument("--out", required=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    (measure_cost if args.command == "cost" else compare)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
