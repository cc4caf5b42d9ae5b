"""studies.arithmetic_significance: Welch's t-test written without SciPy, against closed forms of Student's t and
R's ``t.test``, and its table of the exported recipe runs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from studies.arithmetic_significance import significance_table, student_t_two_sided, welch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("t", [0.0, 0.3, 1.0, 2.5, 12.706, 40.0])
def test_student_t_matches_its_closed_forms_for_one_and_two_degrees_of_freedom(t):
    # df = 1 is the Cauchy distribution: P(|T| >= t) = 1 - 2 atan(t) / pi; df = 2: 1 - t / sqrt(2 + t^2)
    assert student_t_two_sided(t, 1) == pytest.approx(1 - 2 * math.atan(t) / math.pi, rel=1e-10, abs=1e-14)
    assert student_t_two_sided(-t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-10, abs=1e-14)


@pytest.mark.parametrize("t, df", [(2.776, 4), (2.228, 10), (2.042, 30), (1.960, 1e6)])
def test_student_t_gives_five_percent_at_the_tables_critical_values(t, df):
    # two-sided 5% critical values of Student's t tables (3 decimals, hence the tolerance)
    assert student_t_two_sided(t, df) == pytest.approx(0.05, abs=2e-4)


def test_welch_agrees_with_r_t_test():
    # R: t.test(c(11,9,10,11,10,12,9,11,12,9), c(11,13,10,13,12,9,11,12,12,11))
    #    Welch Two Sample t-test: t = -1.8325, df = 17.9, p-value = 0.08356
    t, df, p = welch([11, 9, 10, 11, 10, 12, 9, 11, 12, 9], [11, 13, 10, 13, 12, 9, 11, 12, 12, 11])
    assert t == pytest.approx(-1.8325, abs=1e-4) and df == pytest.approx(17.9, abs=0.05)
    assert p == pytest.approx(0.08356, abs=1e-5)


def test_welch_refuses_what_it_cannot_test():
    with pytest.raises(ValueError, match="at least 2 values per group, got 1 and 3"):
        welch([0.2], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="both groups are constant"):
        welch([0.2, 0.2], [0.3, 0.3])
    with pytest.raises(ValueError, match="t must be finite"):
        student_t_two_sided(float("nan"), 3)


def test_the_docs_p_values_come_from_the_exported_runs():
    from studies.arithmetic_curves import read_runs

    table = significance_table(read_runs([ROOT / "docs" / "arithmetic" / "runs_avx2.json"]))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()[2:]}
    # the README's "Measured" rows: accuracy at step 30, area, Welch p (step 30 / area)
    assert "| 0.327 ± 0.015 | 0.255 ± 0.005 | 0.04 | 0.02 |" in rows["pav_exact"]
    assert "| 0.278 ± 0.008 | 0.229 ± 0.006 | 0.62 | 0.35 |" in rows["pav_learned_refined"]
    assert "| 0.264 ± 0.003 | 0.231 ± 0.000 | 0.61 | 0.02 |" in rows["pav_learned_refresh"]
    assert "| 0.252 ± 0.010 | 0.221 ± 0.005 | 0.27 | 0.90 |" in rows["pav_mc"]
    assert rows["grpo"].endswith("| 0.271 ± 0.011 | 0.221 ± 0.002 |  |  |")
    with pytest.raises(ValueError, match="no 'reinforce' runs to compare against"):
        significance_table({"grpo": {}}, reference="reinforce")


def test_small_p_values_keep_their_size():
    from studies.arithmetic_significance import format_p

    assert [format_p(p) for p in (0.6213, 0.0412, 0.00745, 0.0004)] == ["0.62", "0.04", "0.007", "< 0.001"]
