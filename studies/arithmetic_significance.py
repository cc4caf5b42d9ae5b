"""Welch's t-test of every arm of the recipe's RL runs against GRPO, over seeds: on the held-out accuracy at the
last step and on the area under the held-out curve (``stats.normalised_auc``: the curve's mean accuracy over the
budget).

The per-seed numbers come from exported runs (``docs/arithmetic/runs_avx2.json``) or work directories, read by
``studies.arithmetic_curves.read_runs`` (one machine kind per table). The test is the two-sided Welch test (no
assumption of equal variances; Welch-Satterthwaite degrees of freedom), written here so that the docs' p-values
need no SciPy; it agrees with R's ``t.test`` (tests/apps/test_arithmetic_significance.py).

    python -m studies.arithmetic_significance docs/arithmetic/runs_avx2.json
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Sequence

__all__ = ["format_mean_se", "main", "significance_table", "student_t_two_sided", "welch"]


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularised incomplete beta function (modified Lentz; Numerical Recipes,
    3rd ed., section 6.4, ``betacf``)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            return h
    raise ArithmeticError(f"the incomplete beta continued fraction did not converge (a={a}, b={b}, x={x})")


def _regularised_beta(a: float, b: float, x: float) -> float:
    """``I_x(a, b)``, by the continued fraction on the side where it converges fast (``x < (a+1)/(a+b+2)``)."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, 1.0 - x) / b


def student_t_two_sided(t: float, df: float) -> float:
    """``P(|T| >= |t|)`` for Student's t with ``df`` degrees of freedom: ``I_{df/(df+t^2)}(df/2, 1/2)``."""
    if not (math.isfinite(t) and math.isfinite(df) and df > 0):
        raise ValueError(f"t must be finite and df > 0, got t={t!r}, df={df!r}")
    return _regularised_beta(df / 2.0, 0.5, df / (df + t * t))


def welch(first: Sequence[float], second: Sequence[float]) -> tuple[float, float, float]:
    """(t, degrees of freedom, two-sided p) of Welch's test of equal means: ``t = (m1 - m2) / sqrt(v1/n1 + v2/n2)``
    with sample variances (ddof 1), ``df = (v1/n1 + v2/n2)^2 / ((v1/n1)^2/(n1-1) + (v2/n2)^2/(n2-1))``."""
    if len(first) < 2 or len(second) < 2:
        raise ValueError(f"Welch's test needs at least 2 values per group, got {len(first)} and {len(second)}")
    moments = []
    for values in (first, second):
        n = len(values)
        mean = sum(values) / n
        moments.append((n, mean, sum((v - mean) ** 2 for v in values) / (n - 1)))
    (n1, m1, v1), (n2, m2, v2) = moments
    s1, s2 = v1 / n1, v2 / n2
    if s1 + s2 == 0:
        raise ValueError("both groups are constant: Welch's t is undefined")
    t = (m1 - m2) / math.sqrt(s1 + s2)
    df = (s1 + s2) ** 2 / (s1 ** 2 / (n1 - 1) + s2 ** 2 / (n2 - 1))
    return t, df, student_t_two_sided(t, df)


def format_p(p: float) -> str:
    """Two decimals, three below 0.01 (a p of 0.004 is not "0.00"), "< 0.001" below that."""
    return "< 0.001" if p < 0.001 else f"{p:.3f}" if p < 0.01 else f"{p:.2f}"


def format_mean_se(values: Sequence[float]) -> str:
    """The mean ± its standard error over the values, to 3 decimals (the mean alone for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return f"{mean:.3f}"
    return f"{mean:.3f} ± {math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n):.3f}"


def significance_table(runs: dict[str, dict[int, dict]], reference: str = "grpo") -> str:
    """A markdown table: per arm, its seeds, the seed mean ± standard error of the accuracy at the last step and of
    the area, and Welch's p against ``reference`` for both (blank with fewer than 2 seeds)."""
    from verl_prm.apps.arithmetic.stats import normalised_auc

    if reference not in runs:
        raise ValueError(f"no {reference!r} runs to compare against (arms: {sorted(runs)})")

    def measures(records: dict[int, dict]) -> tuple[list[float], list[float]]:
        finals, areas = [], []
        for record in records.values():
            curve = record["outputs"]["curve"]
            xs, ys = [float(row[0]) for row in curve], [float(row[2]) for row in curve]
            finals.append(ys[-1])
            areas.append(normalised_auc(xs, ys, xs[-1]))
        return finals, areas

    base = measures(runs[reference])
    lines = [f"| arm | seeds | accuracy at the last step | area / steps | Welch p vs {reference}: last step | area |",
             "|---|---|---:|---:|---:|---:|"]
    for arm, records in runs.items():
        finals, areas = measures(records)
        p_final = p_area = ""
        if arm != reference and len(finals) > 1:
            p_final, p_area = (format_p(welch(mine, theirs)[2]) for mine, theirs in zip((finals, areas), base))
        lines.append(f"| {arm} | {', '.join(map(str, sorted(records)))} | {format_mean_se(finals)} | "
                     f"{format_mean_se(areas)} | {p_final} | {p_area} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from studies.arithmetic_curves import read_runs

    parser = argparse.ArgumentParser(prog="python -m studies.arithmetic_significance",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+",
                        help="exported runs files (docs/arithmetic/runs_avx2.json) or work directories")
    parser.add_argument("--reference", default="grpo", help="the arm every other arm is compared with")
    args = parser.parse_args(argv)
    print(significance_table(read_runs(args.runs), args.reference))
    return 0


if __name__ == "__main__":
    sys.exit(main())
