"""Labels that pay (issue 57 item 2): at equal CPU time, many problems with few continuations per step prefix
against fewer problems with more, judged by the held-out step AUROC of the PAV each label set trains.

Two steps, each resumable by its outputs:

    # 1. what a problem costs at each n_mc: the recipe's labeller on the same problems, one torch thread
    python -m studies.word_problems_label_budget cost --work-dir runs/wp --problems 8 --n-mc 1,2,4 \\
        --out runs/wp_budget
    # 2. label sets of equal cost drawn from one n_mc = 4 labelling run, a PAV trained on each, judged on held-out
    python -m studies.word_problems_label_budget compare --work-dir runs/wp --labels runs/wp/labels \\
        --eval-labels runs/wp/heldout_labels --budget-problems 10 30 100 --n-mc 1,2,4 --out runs/wp_budget

``cost`` runs the labeller (``verl_prm.labeling.MonteCarloLabeler``, the settings of the recipe's label stage:
``n_cov`` rollouts, every step prefix, at most 6 steps) at each ``n_mc`` on the first ``--problems`` label
problems and records the process CPU seconds per problem (``resource.getrusage``: the time this process ran,
not the time other processes held the cores) and the sequences generated. ``compare`` fixes a budget, the CPU time
of ``--budget-problems`` problems at the largest ``n_mc``, and for each ``n_mc`` takes as many problems as that
budget pays for (``budget / cost(n_mc)``), their labels drawn from the ``n_mc = 4`` run's counts
(``verl_prm.labeling.subsample``: the law of fresh continuations), fits a PAV on them (format ``token_logprob``:
a logistic head on the policy's own token log-probs, the critic that ranks these steps; docs/real_model.md) and
reports the held-out AUROC against ``prefix_correct`` and the Monte-Carlo label with bootstrap intervals over
problems (``studies.word_problems_pav``), and each setting's AUROC minus the largest n_mc's, paired on the same
held-out steps and bootstrap resamples (``verl_prm.training.metrics.grouped_bootstrap_auroc_difference``).
The head is what ``verl-prm train --format token_logprob`` fits (``encode_rollouts``, ``fit_token_logprob_head``
with train's defaults, ``--l2`` its ``--head-l2``) and its held-out values what the checkpoint would score, but
the policy reads each rollout once: the features depend on the rollout, not on its labels, so every setting and
the held-out set share one extraction (``OUT/features.npz``, kept for reruns). Several budgets may be given.
Writes ``compare.json``, ``results.md`` and each setting's held-out scores (``OUT/heldout/*.jsonl``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

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


def cost_key(n_mc: int, prefix_rule: str = "every") -> str:
    """cost.json's key of a labelling setting: ``"4"`` (every step prefix), ``"first_pit:4"``."""
    return str(n_mc) if prefix_rule == "every" else f"{prefix_rule}:{n_mc}"


def measure_cost(args) -> dict:
    """CPU seconds per problem of the recipe's labeller at each n_mc (one torch thread, the same problems), every
    step prefix or (``--prefix-rule first_pit``) the first-pit search."""

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
        key = cost_key(n_mc, args.prefix_rule)
        if key in record and record[key]["problems"] == args.problems:
            print(f"[budget] cost {key}: measured before, {record[key]['cpu_seconds_per_problem']:.1f} s/problem")
            continue
        settings = LabelSettings(n_cov=config.n_cov, n_mc=n_mc, prefix_rule=args.prefix_rule,
                                 delimiter=STEP_DELIMITER, max_steps=MAX_STEPS, seed=0, source=policy)
        name = f"n{n_mc}" if args.prefix_rule == "every" else f"{args.prefix_rule}_n{n_mc}"
        store = ShardStore(out / f"cost_labels_{name}")
        store.check_config({"n_mc": n_mc, "prefix_rule": args.prefix_rule, "problems": args.problems,
                            "policy": policy})
        labeler = MonteCarloLabeler(engine, engine, scorer, settings)
        started, wall = cpu_seconds(), time.perf_counter()
        summary = run_labeling(items, lambda item: render_prompt(item, tokenizer=engine.tokenizer), labeler, store,
                               shard_size=args.problems, progress=False)
        if summary.get("skipped"):
            raise RuntimeError(f"{store.directory} held labels already: remove it to measure {key} again")
        used = cpu_seconds() - started
        record[key] = {"problems": args.problems, "cpu_seconds": round(used, 1),
                       "cpu_seconds_per_problem": round(used / args.problems, 2),
                       "wall_seconds": round(time.perf_counter() - wall, 1), "summary": summary}
        print(f"[budget] cost {key}: {used / args.problems:.1f} CPU s/problem", flush=True)
        path.write_text(json.dumps(record, indent=2))
    return record


def budget_sizes(costs: dict, n_mcs: Sequence[int], budget_problems: int) -> dict[int, int]:
    """Problems each n_mc gets for the CPU time of ``budget_problems`` problems at the largest n_mc."""
    largest = max(n_mcs)
    budget = budget_problems * costs[str(largest)]["cpu_seconds_per_problem"]
    # floor(budget / cost), with a margin for the float product (100 * 9.4 / 9.4 is 99.999...)
    return {m: budget_problems if m == largest else int(budget / costs[str(m)]["cpu_seconds_per_problem"] + 1e-9)
            for m in n_mcs}


def paired_differences(rows: dict[str, list[dict]], reference: str, *, resamples: int, seed: int,
                       level: float) -> dict[str, dict]:
    """Each setting's held-out AUROC minus the ``reference`` setting's, paired on the same steps and the same
    bootstrap resamples of the problems (``grouped_bootstrap_auroc_difference``), against ``prefix_correct`` and
    against the Monte-Carlo label (``q > 0.5``, the steps that carry one).

    Args:
        rows: per setting, the held-out rows its critic scored (problem, step, score, prefix_correct, mc_label),
            the same steps in the same order for every setting.
    Raises:
        ValueError: rows that are not the same steps (naming the setting and the first row that differs).
    """
    from verl_prm.training.metrics import grouped_bootstrap_auroc_difference

    base = rows[reference]
    steps = [(r["problem"], r["step"], r["prefix_correct"], r["mc_label"]) for r in base]
    problems = np.asarray([r["problem"] for r in base])
    correct = np.asarray([r["prefix_correct"] for r in base], dtype=bool)
    labelled = np.asarray([r["mc_label"] is not None for r in base], dtype=bool)
    mc_positive = np.asarray([r["mc_label"] is not None and r["mc_label"] > heldout.MC_POSITIVE for r in base])
    ref_scores = np.asarray([r["score"] for r in base], dtype=np.float64)
    out = {}
    for name, other in rows.items():
        if name == reference:
            continue
        mismatch = next((i for i, (a, b) in enumerate(zip(other, steps))
                         if (a["problem"], a["step"], a["prefix_correct"], a["mc_label"]) != b), None)
        if len(other) != len(steps) or mismatch is not None:
            raise ValueError(f"{name}: its held-out rows are not {reference}'s ({len(other)} against {len(steps)} "
                             f"rows, first difference at row {mismatch}): judge both on the same --eval-labels")
        scores = np.asarray([r["score"] for r in other], dtype=np.float64)
        result = {}
        for label, mask, positive in (("prefix_correct", np.ones_like(correct), correct),
                                      ("mc_label", labelled, mc_positive)):
            d = grouped_bootstrap_auroc_difference(scores[mask], ref_scores[mask], positive[mask], problems[mask],
                                                   resamples=resamples, seed=seed, level=level)
            result[label] = {"difference": d.auroc, "low": d.low, "high": d.high, "skipped_resamples": d.skipped}
        out[name] = result
    return out


def report(results: dict) -> str:
    """results.md: per budget and seed (the draw of the subsampled labels and of the bootstrap), each setting's
    problems, labelled steps and held-out AUROCs, and its paired difference from the largest n_mc's (every step
    prefix)."""
    lines = [("| budget (problems at the largest n_mc) | seed | labels | problems | labelled steps | AUROC vs "
              "prefix_correct | paired difference from the largest n_mc | AUROC vs the Monte-Carlo label | paired "
              "difference |"),
             "|---|---|---|---|---|---|---|---|---|"]

    def cell(r):
        return f"{r['auroc']:.3f} [{r['low']:.3f}, {r['high']:.3f}]"

    def difference(d):
        return f"{d['difference']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]" if d else ""

    for budget in sorted(results["budgets"], key=lambda b: (b["budget_problems"], b["seed"])):
        for name, key in budget["settings"].items():
            r, paired = results["settings"][key], budget["paired"].get(name, {})
            labels = f"n_mc {r['n_mc']}" + (", first pit" if r["prefix_rule"] == "first_pit" else "")
            lines.append(f"| {budget['budget_problems']} | {budget['seed']} | {labels} | {r['problems']} | "
                         f"{r['labelled_steps']:,} | "
                         f"{cell(r['prefix_correct'])} | {difference(paired.get('prefix_correct'))} | "
                         f"{cell(r['mc_label'])} | {difference(paired.get('mc_label'))} |")
    return "\n".join(lines) + "\n"


def sampled_n_mc(labels) -> set[int]:
    """The continuation counts of the labels' sampled steps (n_mc > 0; exact terminal steps have 0)."""
    return {int(n) for counts in labels["n_mc"] for n in counts if n > 0}


class PolicyFeatures:
    """The ``token_logprob`` critic's step features of label rows under the policy, each rollout read once: they
    depend on the rollout's tokens and step ends, not on its labels, so every label set of the comparison and the
    held-out set share one extraction (``verl_prm.training.token_logprob.extract_step_features``, what ``verl-prm
    train`` runs), kept in ``path`` (npz) across runs."""

    def __init__(self, policy: Path, path: Path, device: str | None) -> None:
        from verl_prm.critic.loading import load_critic_tokenizer, resolve_dtype

        self.policy, self.path = policy, path
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(None, self.device)
        self.tokenizer = load_critic_tokenizer(str(policy))
        self.critic = None
        self.cache: dict[str, np.ndarray] = {}
        # what the features depend on besides the rollout: the policy's weights and the extraction's dtype
        weights = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(policy).glob("*.safetensors"))
        self.identity = json.dumps({"policy": str(Path(policy).resolve()), "weights": weights,
                                    "dtype": str(self.dtype)})
        if path.is_file():
            with np.load(path, allow_pickle=False) as stored:
                made = str(stored["identity"]) if "identity" in stored.files else "not recorded"
                if made != self.identity:
                    raise SystemExit(f"{path} holds features of another policy or dtype ({made}; now "
                                     f"{self.identity}): remove it, or use another --out")
                bounds = stored["offsets"]
                self.cache = {key: stored["features"][a:b] for key, a, b in zip(stored["keys"].tolist(), bounds[:-1],
                                                                             bounds[1:])}

    @staticmethod
    def key(input_ids, step_ends) -> str:
        return hashlib.sha1(np.asarray([*input_ids, -1, *step_ends], dtype=np.int64).tobytes()).hexdigest()

    def of(self, rollouts) -> list[np.ndarray]:
        """[H_i, F] features of each rollout (``RolloutSteps``), extracting those not read before."""
        from verl_prm.training.token_logprob import extract_step_features

        keys = [self.key(r.input_ids, r.step_ends) for r in rollouts]
        missing = {k: r for k, r in zip(keys, rollouts) if k not in self.cache}
        if missing:
            extracted = extract_step_features(self._critic(), list(missing.values()))
            self.cache.update(zip(missing, extracted))
            self._save()
        return [self.cache[k] for k in keys]

    def _critic(self):
        from verl_prm.critic import ProverCritic
        from verl_prm.critic.loading import default_attn_implementation
        from verl_prm.critic.token_logprob_format import TokenLogprobFormat

        if self.critic is None:  # as verl-prm train --format token_logprob builds it
            adapter = TokenLogprobFormat.load_lm(str(self.policy), self.tokenizer, dtype=self.dtype, device=self.device,
                                                 attn_implementation=default_attn_implementation(self.device,
                                                                                                 self.dtype))
            self.critic = ProverCritic(adapter.to(self.device), self.tokenizer, device=self.device)
        return self.critic

    def _save(self) -> None:
        keys = list(self.cache)
        features = [self.cache[k] for k in keys]
        offsets = np.concatenate([[0], np.cumsum([len(f) for f in features])]).astype(np.int64)
        staging = self.path.with_name(self.path.name + ".tmp.npz")
        np.savez(staging, keys=np.asarray(keys), offsets=offsets, features=np.concatenate(features),
                 identity=np.asarray(self.identity))
        staging.replace(self.path)


def held_out_rollouts(frame, tokenizer) -> list:
    """The held-out label rows as ``RolloutSteps`` encoded as ``studies.word_problems_pav.critic_values`` encodes
    them (every row, every step; the labels are not read)."""
    from verl_prm.steps import encode_with_step_ends
    from verl_prm.training.token_logprob import RolloutSteps

    out = []
    for row in frame.itertuples(index=False):
        encoded = encode_with_step_ends(tokenizer, row.prompt, row.response, list(zip(row.step_starts, row.step_ends)),
                                        sample=heldout.row_name(row))
        ends = [int(e) for e in encoded.step_ends]
        out.append(RolloutSteps([int(t) for t in encoded.input_ids], int(encoded.prompt_end), ends,
                                np.zeros(len(ends)), np.zeros(len(ends), dtype=np.int64), row.prompt))
    return out


def compare(args) -> dict:
    from dataclasses import fields

    from verl_prm.labeling.format import read_labels
    from verl_prm.labeling.subsample import subsample_labels
    from verl_prm.training import TrainConfig
    from verl_prm.training.token_logprob import encode_rollouts, fit_token_logprob_head

    torch.set_num_threads(1)
    out = Path(args.out)
    costs = json.loads((out / "cost.json").read_text())
    largest = max(args.n_mc)
    needed = [cost_key(m) for m in args.n_mc] + ([cost_key(largest, "first_pit")] if args.first_pit_labels else [])
    missing = [key for key in needed if key not in costs]
    if missing:
        raise SystemExit(f"no cost measured for {missing} in {out / 'cost.json'}: run `cost` with those --n-mc "
                         "(and --prefix-rule first_pit for first_pit:N) first")
    labels = read_labels(args.labels)
    labels_n_mc = min(sampled_n_mc(labels), default=0)
    if labels_n_mc < largest or set(labels["strategy"]) != {"every"}:
        raise SystemExit(f"{args.labels} hold labels of {sorted(set(labels['strategy']))} with {labels_n_mc} "
                         f"continuations at least: the labels of n_mc={largest} and fewer are drawn from labels of "
                         f"every step prefix with at least as many; label with --prefix-rule every --n-mc {largest}")
    sources = {"every": labels}
    if args.first_pit_labels:
        pit = read_labels(args.first_pit_labels)
        if set(pit["strategy"]) != {"first_pit"} or sampled_n_mc(pit) - {largest}:
            raise SystemExit(f"--first-pit-labels {args.first_pit_labels}: labels of {sorted(set(pit['strategy']))} "
                             f"with n_mc {sorted(sampled_n_mc(pit))}; the setting needs the first-pit search at "
                             f"n_mc={largest} (verl-prm label --prefix-rule first_pit --n-mc {largest})")
        every_prompts = labels.groupby("prompt_index")["prompt"].first()
        pit_prompts = pit.groupby("prompt_index")["prompt"].first()
        shared = every_prompts.index.intersection(pit_prompts.index)
        differing = [i for i in shared if every_prompts[i] != pit_prompts[i]]
        if differing or len(shared) < min(len(every_prompts), len(pit_prompts)):
            raise SystemExit(f"--first-pit-labels {args.first_pit_labels}: prompt_index "
                             f"{differing[0] if differing else sorted(set(pit_prompts.index) - set(shared))[0]} is "
                             f"not the problem of that index in {args.labels}: label the same --input (the label "
                             "problems, first to last) with --prefix-rule first_pit")
        sources["first_pit"] = pit
    budgets = {}
    for budget in sorted(set(args.budget_problems)):
        cpu = budget * costs[cost_key(largest)]["cpu_seconds_per_problem"]
        sizes = {str(m): ("every", m, problems) for m, problems in budget_sizes(costs, args.n_mc, budget).items()}
        if args.first_pit_labels:
            sizes["first_pit"] = ("first_pit", largest,
                                  int(cpu / costs[cost_key(largest, "first_pit")]["cpu_seconds_per_problem"] + 1e-9))
        budgets[budget] = sizes
    for budget, sizes in budgets.items():  # every budget checked before any feature is extracted
        for name, (rule, m, problems) in sizes.items():
            held = sources[rule]["prompt_index"].nunique()
            if problems > held:
                source = args.labels if rule == "every" else args.first_pit_labels
                raise SystemExit(f"--budget-problems {budget} needs {problems} labelled problems for {name} but "
                                 f"{source} holds {held}: lower it or label more")
    judged = heldout.held_out_steps(argparse.Namespace(work_dir=Path(args.work_dir), labels=args.labels,
                                                       eval_labels=args.eval_labels))
    features = PolicyFeatures(Path(args.work_dir) / "policy", out / "features.npz", args.device)
    held_features = features.of(held_out_rollouts(judged.rows, features.tokenizer))
    # verl-prm train's defaults for what the comparison does not set
    train = {f.name: f.default for f in fields(TrainConfig)}
    results_path = out / "compare.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    results.setdefault("settings", {})
    # another seed's budgets are kept (a rerun with --seed S draws other n_mc < max subsamples beside them)
    results["budgets"] = [b for b in results.get("budgets", []) if b["seed"] != args.seed]
    for budget, sizes in budgets.items():
        keys, rows = {}, {}
        for name, (rule, m, problems) in sizes.items():
            key = keys[name] = f"{rule},n_mc={m},problems={problems},l2={args.l2:g},seed={args.seed}"
            source = sources[rule]
            chosen = set(sorted(source["prompt_index"].unique())[:problems])
            frame = source[source["prompt_index"].isin(chosen)].reset_index(drop=True)
            if rule == "every" and m < labels_n_mc:
                frame = subsample_labels(frame, m, seed=args.seed)
            rollouts = encode_rollouts(frame, features.tokenizer, max_length=train["max_length"],
                                       best_of_k=train["best_of_k"], use_prompt_value=train["use_prompt_value"],
                                       note=print)
            head = fit_token_logprob_head(features.of(rollouts), rollouts, result_regex=None, l2=args.l2,
                                          max_iterations=train["max_steps"], balance=train["balance"])
            values = np.concatenate([head.values(f) for f in held_features])
            if len(values) != len(judged.steps):  # both follow the labels' spans
                raise RuntimeError(f"{key}: {len(values)} step values for {len(judged.steps)} held-out steps")
            prompt_values = np.full(int(judged.carriers.sum()), head.prompt_value)
            metrics = heldout.critic_metrics(judged.steps, values, judged.prompts, prompt_values, args)
            labelled = np.concatenate([r.q for r in rollouts])
            results["settings"][key] = {"prefix_rule": rule, "n_mc": m, "problems": problems,
                                        "labelled_steps": int(np.isfinite(labelled).sum()),
                                        "budget_cpu_seconds": round(problems * costs[cost_key(m, rule)]
                                                                    ["cpu_seconds_per_problem"], 1),
                                        "calibration_slope": head.fit["calibration_slope"], **metrics}
            rows[name] = [{"problem": r.problem, "step": int(r.step), "score": float(v),
                           "prefix_correct": bool(r.prefix_correct), "mc_label": heldout.json_safe(r.mc_label)}
                          for r, v in zip(judged.steps.itertuples(index=False), values)]
            tag = (f"n{m}" if rule == "every" else f"{rule}_n{m}") + f"_p{problems}_l2-{args.l2:g}_s{args.seed}"
            (out / "heldout").mkdir(exist_ok=True)
            (out / "heldout" / f"{tag}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[name]))
            print(f"[budget] {key}: {json.dumps(heldout.json_safe(metrics))}", flush=True)
        paired = paired_differences(rows, str(largest), resamples=args.resamples, seed=args.seed, level=args.level)
        results["budgets"].append({"budget_problems": budget, "seed": args.seed, "settings": keys,
                                   "paired": {name: paired.get(name, {}) for name in sizes}})
        results_path.write_text(json.dumps(heldout.json_safe(results), indent=2))
    (out / "results.md").write_text(report(heldout.json_safe(results)))
    print(report(heldout.json_safe(results)), end="")
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies.word_problems_label_budget", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    cost = sub.add_parser("cost", help="CPU seconds per labelled problem at each n_mc")
    cost.add_argument("--work-dir", required=True)
    cost.add_argument("--problems", type=at_least(1), default=8)
    cost.add_argument("--n-mc", type=n_mc_list, default=[1, 2, 4])
    cost.add_argument("--prefix-rule", choices=("every", "first_pit"), default="every",
                      help="the labeller's prefixes: every step prefix, or the first-pit search of each failed rollout")
    cost.add_argument("--out", required=True)
    comp = sub.add_parser("compare", help="PAVs trained on label sets of equal CPU cost, judged on held-out problems")
    comp.add_argument("--work-dir", required=True)
    comp.add_argument("--labels", nargs="+", required=True)
    comp.add_argument("--eval-labels", nargs="+", required=True)
    comp.add_argument("--budget-problems", type=at_least(1), nargs="+", required=True,
                      help="one or more budgets, each the CPU time of this many problems at the largest n_mc")
    comp.add_argument("--n-mc", type=n_mc_list, default=[1, 2, 4])
    comp.add_argument("--first-pit-labels", nargs="+", default=None,
                      help="labels of the first-pit search at the largest n_mc (verl-prm label --prefix-rule "
                      "first_pit) on the same label problems: a further setting at the same budget")
    comp.add_argument("--l2", type=finite_float(0.0), default=0.0,
                      help="the head's ridge penalty (verl-prm train --head-l2; 0, its default, suits 4 features)")
    comp.add_argument("--seed", type=at_least(0), default=0)
    comp.add_argument("--resamples", type=at_least(1), default=2000)
    comp.add_argument("--level", type=finite_float(0.0, 1.0, low_open=True, high_open=True), default=0.95)
    comp.add_argument("--device", default="cpu")
    comp.add_argument("--out", required=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from verl_prm.locking import DirectoryLock

    args = parser().parse_args(argv)
    with DirectoryLock(args.out, f"studies.word_problems_label_budget {args.command}"):  # one writer of OUT
        (measure_cost if args.command == "cost" else compare)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
