"""``python -m studies.shrinkage``: bias and variance of the sampled source's process term against the exact one, for
the number of continuations n and the prior strength s of ``verl_prm.critic.prior_strength``.

The scripted task of ``verl_prm.labeling.closed_form_task`` (H steps, each written correctly with probability p, a wrong
step never repaired) has exact values: Q = p^(H - h) after h correct steps, 0 after a wrong one, V = p^H for the
prompt. Each repetition draws a batch of ``--groups`` prompts x ``--group-size`` responses from the policy and
estimates every step's value as the sampled source does (``verl_prm.critic.sampled.sampled_step_values``,
``prefix_rule=every``, n continuations per prefix by the same policy, the group's free samples pooled unless
``--no-pool``, the rates shrunk toward the group's success rate with strength s; the same continuations for every
s). The process term is what the estimators compute from the values, ``PavConfig(best_of_k=K).process_scores``
(Best-of-K, then progress v_h - v_{h-1}), and the reference is the same function of the exact values.

The error e = estimate - exact of a step's process term is grouped by the step's class (its index h and whether
the response went wrong before h, at h, or not yet), within which the exact term is one number. Printed per (n, s):
|bias| (the classes' |mean e|, weighted by their steps), variance (the classes' variance of e, weighted), RMSE over
all steps, mean |A| on right steps (a correct step after correct ones; exact: the last column's header), and the
samples per sampled value (n + the pooled ones).
"""

from __future__ import annotations

import argparse
import math
import time
from collections import defaultdict

NS, STRENGTHS = (1, 2, 4, 8), (0.0, 1.0, 2.0, 4.0)


def _batch(rep: int, groups: int, size: int, p: float, steps: int):
    """(group, steps) of ``groups`` x ``size`` responses of the scripted policy, seeded by ``rep``."""
    from verl_prm.labeling.generators import derive_seed
    from verl_prm.labeling.closed_form_task import ScriptedStepGenerator, ScriptedStepTask

    task, generator = ScriptedStepTask(num_steps=steps), ScriptedStepGenerator(p)
    rows = []
    for group in range(groups):
        [samples] = generator.generate([task.prompt(group)], size, [derive_seed("shrinkage", rep, group)])
        rows.extend((group, sample.text.split(task.delimiter)) for sample in samples)
    return rows


class _Sampler:
    """``sample(requests)`` over the scripted policy, memoised so that every prior strength sees the same
    continuations of a (repetition, n)."""

    def __init__(self, rows, rep: int, p: float, steps: int) -> None:
        from verl_prm.labeling.closed_form_task import ScriptedStepGenerator, ScriptedStepTask

        self.rows, self.rep, self.task = rows, rep, ScriptedStepTask(num_steps=steps)
        self.generator, self.memo = ScriptedStepGenerator(p), {}

    def __call__(self, requests):
        from verl_prm.labeling.generators import derive_seed
        from verl_prm.labeling.closed_form_task import scripted_step_score
        from verl_prm.monte_carlo import PrefixCounts

        counts = []
        for request in requests:
            key = (request.row, request.step, request.n_mc)
            if key not in self.memo:
                group, steps = self.rows[request.row]
                prefix = self.task.delimiter.join(steps[: request.step + 1])
                [samples] = self.generator.generate([self.task.prompt(group) + prefix], request.n_mc,
                                                    [derive_seed("shrinkage", self.rep, "mc", request.row, request.step)])
                wins = sum(scripted_step_score("scripted", prefix + s.text, self.task.num_steps) == 1.0 for s in samples)
                self.memo[key] = PrefixCounts(int(wins), len(samples), sum(s.num_tokens for s in samples))
            counts.append(self.memo[key])
        return counts


def _exact(rows, p: float, steps: int):
    """Exact step values [B, H] and prompt values [B] (closed form), the step classes and the right steps."""
    import torch

    from verl_prm.labeling.closed_form_task import exact_prefix_value

    values = torch.tensor([[exact_prefix_value("\n\n".join(s[: h + 1]), steps, p) for h in range(steps)]
                           for _, s in rows], dtype=torch.float64)
    classes, right = [], []
    for _, s in rows:
        wrong = next((h for h, step in enumerate(s) if not step.startswith("x")), steps)
        classes.append([(h, "before" if wrong < h else "at" if wrong == h else "not yet") for h in range(steps)])
        right.append([h < wrong for h in range(steps)])
    return values, torch.full((len(rows),), p ** steps, dtype=torch.float64), classes, torch.tensor(right)


def _measure(args) -> dict:
    """errors[(n, s)] = [(class, e, is right step, estimate)], samples[(n, s)] = samples per value."""
    import torch

    from verl_prm.config import PavConfig
    from verl_prm.critic.sampled import sampled_step_values
    from verl_prm.labeling.closed_form_task import scripted_step_score
    from verl_prm.monte_carlo import ResponseSteps

    pav = PavConfig(best_of_k=args.best_of_k)
    errors, samples, exact_right = defaultdict(list), defaultdict(list), []
    for rep in range(args.repeats):
        rows = _batch(rep, args.groups, args.group_size, args.p, args.steps)
        exact_values, exact_prompt, classes, right = _exact(rows, args.p, args.steps)
        num_steps = torch.full((len(rows),), args.steps)
        exact = pav.process_scores(exact_values, exact_prompt, num_steps)
        exact_right.extend(exact[right].abs().tolist())
        inputs = [ResponseSteps(num_steps=args.steps, success=scripted_step_score(
            "scripted", "\n\n".join(s), args.steps) == 1.0) for _, s in rows]
        tokens = None if args.no_pool else [s for _, s in rows]
        for n in NS:
            sampler = _Sampler(rows, rep, args.p, args.steps)
            for strength in STRENGTHS:
                values = sampled_step_values(inputs, [g for g, _ in rows], sampler, prefix_rule="every", n_mc=n,
                                             tokens=tokens, step_ends=[list(range(args.steps))] * len(rows),
                                             prior_strength=strength)
                scores = pav.process_scores(values.step_values.double(), values.prompt_values.double(), num_steps)
                for b in range(len(rows)):
                    for h in range(args.steps):
                        errors[(n, strength)].append((classes[b][h], float(scores[b, h] - exact[b, h]),
                                                      bool(right[b, h]), float(scores[b, h])))
                samples[(n, strength)].extend(c.continuations for c in values.counts.values())
    return {"errors": errors, "samples": samples, "exact_right": sum(exact_right) / len(exact_right)}


def _row(errors, samples) -> tuple[float, float, float, float, float]:
    by_class = defaultdict(list)
    for key, error, _, _ in errors:
        by_class[key].append(error)
    total = len(errors)
    means = {key: sum(e) / len(e) for key, e in by_class.items()}
    bias = sum(len(e) * abs(means[key]) for key, e in by_class.items()) / total
    variance = sum(sum((x - means[key]) ** 2 for x in e) for key, e in by_class.items()) / total
    rmse = math.sqrt(sum(error ** 2 for _, error, _, _ in errors) / total)
    right = [abs(score) for _, _, is_right, score in errors if is_right]
    return bias, variance, rmse, sum(right) / len(right), sum(samples) / len(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.shrinkage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=100, help="batches drawn per (n, s)")
    parser.add_argument("--groups", type=int, default=16, help="prompts per batch (the arithmetic recipe's 16)")
    parser.add_argument("--group-size", type=int, default=8, help="responses per prompt (the recipe's 8)")
    parser.add_argument("--steps", type=int, default=6, help="steps H of a response")
    parser.add_argument("--p", type=float, default=0.7, help="probability that the policy writes a step correctly")
    parser.add_argument("--best-of-k", type=int, default=4, help="K of algorithm.pav.best_of_k (the recipe's 4)")
    parser.add_argument("--no-pool", action="store_true", help="do not pool the group's free samples")
    args = parser.parse_args(argv)
    if min(args.repeats, args.groups, args.group_size, args.steps, args.best_of_k) < 1 or not 0 < args.p < 1:
        parser.error("--repeats, --groups, --group-size, --steps and --best-of-k must be >= 1, --p in (0, 1)")
    start = time.perf_counter()
    measured = _measure(args)
    print(f"scripted policy p={args.p}, H={args.steps}, {args.groups} x {args.group_size} responses a batch, "
          f"{args.repeats} batches, Best-of-{args.best_of_k}, pooling {'off' if args.no_pool else 'on'} "
          f"({time.perf_counter() - start:.0f} s)")
    print(f"| n | s | abs bias | variance | RMSE | mean abs A, right steps (exact {measured['exact_right']:.3f}) "
          "| samples per value |")
    print("|---|---|---|---|---|---|---|")
    for n in NS:
        for strength in STRENGTHS:
            bias, variance, rmse, right, per_value = _row(measured["errors"][(n, strength)],
                                                          measured["samples"][(n, strength)])
            print(f"| {n} | {strength:g} | {bias:.4f} | {variance:.4f} | {rmse:.4f} | {right:.3f} | {per_value:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
