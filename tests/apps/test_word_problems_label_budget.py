"""The label-budget study's arithmetic (studies.word_problems_label_budget): equal CPU time per setting."""

from __future__ import annotations

import argparse

import pytest

from studies.word_problems_label_budget import budget_sizes, n_mc_list


def test_each_n_mc_gets_the_problems_the_largest_n_mc_budget_pays_for():
    costs = {"1": {"cpu_seconds_per_problem": 3.5}, "2": {"cpu_seconds_per_problem": 5.7},
             "4": {"cpu_seconds_per_problem": 9.4}}
    # the budget: 100 problems at n_mc = 4, 940 CPU seconds; floor(940 / cost) problems each
    assert budget_sizes(costs, [1, 2, 4], 100) == {1: 268, 2: 164, 4: 100}
    assert budget_sizes(costs, [1, 2], 10) == {1: 16, 2: 10}


def test_n_mc_list_parses_sorted_distinct_positive_integers():
    assert n_mc_list("4,1,2,2") == [1, 2, 4]
    for bad in ("", "0,2", "a,2", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            n_mc_list(bad)
